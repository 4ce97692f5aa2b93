"""`launch convert maxtext`: a MaxText config as equipax overrides (and `show --format maxtext`);
`launch convert hf-import` / `hf-export`: Hugging Face checkpoints in and out (docs/hf.md).

The MaxText table is `equipax.launch.translators.maxtext.RULES` (docs/maxtext.md); the Hugging Face
conversions are `equipax.launch.translators.hf_checkpoints`.
"""

import json
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from equipax.core.knobs import ConfigError, flatten, parse_literal
from equipax.launch.commands.common import err, fail, path_option, resolve
from equipax.launch.translators.maxtext import SCALE_RULES, to_equipax, to_maxtext

__all__ = ["convert_app", "convert_maxtext", "DEFAULT_BASE", "hf_export", "hf_import", "print_maxtext", "read_maxtext"]

convert_app: typer.Typer = typer.Typer(
    help="Translate other frameworks' configs and checkpoints (MaxText configs, Hugging Face models).",
    no_args_is_help=True,
)

DEFAULT_BASE = "c4_1b"


def read_maxtext(path: Path, overrides: list[str]) -> dict[str, Any]:
    """A MaxText YAML config with MaxText-style `key=value` overrides applied (values parsed as YAML)."""
    import yaml

    try:
        values = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        fail(f"Cannot read the MaxText config {path}: {e} (a MaxText config is a YAML text file).")
        raise AssertionError("unreachable") from None
    if not isinstance(values, dict):
        fail(f"{path} is not a MaxText config (a YAML mapping of key: value); found a {type(values).__name__}.")
    for text in overrides:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            fail(f"MaxText overrides are key=value (e.g. per_device_batch_size=16); got {text!r}.")
        values[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return {k: _number(v) for k, v in values.items()}


def _literal(value: Any) -> str:
    """A knob value as `--set` parses it back: bare words stay bare (model.dtype=bfloat16)."""
    return value if isinstance(value, str) and parse_literal(value) == value else repr(value)


def _number(value: Any) -> Any:
    """YAML 1.1 reads `1e-3` (no dot) as a string; MaxText means a number."""
    if isinstance(value, str):
        try:
            return float(value) if value.strip() else value
        except ValueError:
            return value
    return value


@convert_app.command("maxtext")
def convert_maxtext(
    config: Annotated[Path, typer.Argument(help="A MaxText config (YAML), e.g. MaxText/configs/base.yml.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="MaxText overrides key=value, as on MaxText's command line.")
    ] = None,
    exp: Annotated[
        str, typer.Option("--exp", "-e", help="The equipax experiment the overrides apply to.")
    ] = DEFAULT_BASE,
    format: Annotated[str, typer.Option("--format", help="set (--set lines) or json.")] = "set",
    scale_rule: Annotated[
        str,
        typer.Option(
            "--scale-rule",
            help="global_parameter_scale: 'linear' (every base size x scale, MaxText's "
            "first release, the Pax README) or 'doubling' (MaxText today).",
        ),
    ] = "linear",
) -> None:
    """Print a MaxText config as equipax overrides, and each key that has no translation and why."""
    if format not in ("set", "json"):
        fail(f"--format must be 'set' or 'json'; got {format!r}.")
    if scale_rule not in SCALE_RULES:
        fail(f"--scale-rule must be one of {', '.join(SCALE_RULES)}; got {scale_rule!r}.")
    t = to_equipax(read_maxtext(config, overrides or []), scale_rule=scale_rule)
    sets = [f"{k}={_literal(v)}" for k, v in t.knobs.items()]
    resolve(exp, sets)  # the result must be a valid experiment: a clean error (exit 2) if not
    if format == "json":
        print(json.dumps({"exp": exp, "set": t.knobs, "not_translated": t.skipped, "notes": t.notes}, indent=2))
    else:
        print(f"# MaxText {config.name} as overrides of {exp}: launch run --exp {exp} followed by")
        for s in sets:
            print(f"--set {shlex.quote(s)}")
    for note in t.notes:
        err.print(f"note: {note}", highlight=False)
    for key, why in t.skipped.items():
        err.print(f"not translated: {key}: {why}", highlight=False, markup=False)


def print_maxtext(cfg: Any) -> None:
    """`launch show --format maxtext`: the experiment as MaxText config keys (YAML)."""
    import yaml

    if cfg.kind != "lm" or "model.transformer.num_layers" not in flatten(cfg):
        fail(f"{cfg.name} is not a Pax-style language model; only those translate to MaxText.")
    try:
        t = to_maxtext(flatten(cfg))
    except ConfigError as e:
        fail(str(e))
        return
    print(f"# {cfg.name} as MaxText keys (python3 -m MaxText.train MaxText/configs/base.yml + these)")
    print(yaml.safe_dump(t.knobs, sort_keys=False, default_flow_style=None), end="")
    for knob, why in t.skipped.items():
        print(f"# not translated: {knob}: {why}")


def _size(text: str) -> int:
    """`5GB`, `500MB`, `64KB` or a number of bytes (save_pretrained's max_shard_size, powers of 1000)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, size in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * size)
    if t.isdigit():
        return int(t)
    fail(f"--shard-size takes a size such as 5GB, 500MB or 64KB (or a number of bytes); got {text!r}.")


@convert_app.command("hf-import")
def hf_import(
    directory: Annotated[Path, typer.Argument(help="A Hugging Face model directory (config.json + *.safetensors).")],
    out: Annotated[
        Path, typer.Option("--out", parser=path_option, help="The job directory to create (must not exist yet).")
    ],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="Override a knob of the imported job (data, learner, train, mesh...)."),
    ] = None,
    cpu_devices: Annotated[
        int | None,
        typer.Option("--cpu-devices", help="Simulate N devices (with a mesh.ici_mesh_shape that uses them)."),
    ] = None,
) -> None:
    """Import a Llama / Mistral / Qwen3 checkpoint as a job directory (config, tokenizer, step-0 checkpoint)."""
    from equipax.launch.cluster.devices import use_cpu_devices

    try:
        use_cpu_devices(cpu_devices)
    except ConfigError as e:
        fail(str(e))
    from equipax.launch.translators.hf_checkpoints import import_job

    cfg = import_job(directory, out, set_ or [], log=lambda m: err.print(m, highlight=False, markup=False))
    print(f"Imported {directory} as experiment {cfg.name} in {out}. Continue with: launch run --job-log-dir {out}")


@convert_app.command("hf-export")
def hf_export(
    job_log_dir: Annotated[
        Path, typer.Option("--job-log-dir", parser=path_option, help="The job directory to export.")
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", parser=path_option, help="The Hugging Face model directory to create (must not exist yet)."
        ),
    ],
    step: Annotated[int | None, typer.Option("--step", help="The checkpoint's step (default: the newest).")] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="float32, bfloat16 or float16: the tensors' dtype.")
    ] = "float32",
    shard_size: Annotated[
        str,
        typer.Option(
            "--shard-size", help="The most bytes of tensors per safetensors file (save_pretrained's max_shard_size)."
        ),
    ] = "5GB",
    cpu_devices: Annotated[
        int | None, typer.Option("--cpu-devices", help="Simulate N devices: restore onto the job's mesh.")
    ] = None,
    peft: Annotated[
        bool,
        typer.Option(
            "--peft", help="A LoRA job: write its adapters as a PEFT adapter (adapter_model.safetensors) instead."
        ),
    ] = False,
) -> None:
    """Export a job's checkpoint as a Hugging Face model directory (safetensors, config.json, tokenizer);
    a LoRA job's weights are merged (W + scale * A @ B), or with --peft its adapters alone."""
    from equipax.launch.cluster.devices import use_cpu_devices

    shard_bytes = _size(shard_size)
    try:
        use_cpu_devices(cpu_devices)
    except ConfigError as e:
        fail(str(e))
    from equipax.launch.translators.hf_checkpoints import export_job

    files = export_job(
        job_log_dir,
        step,
        out,
        dtype=dtype,
        shard_bytes=shard_bytes,
        peft=peft,
        log=lambda m: err.print(m, highlight=False, markup=False),
    )
    print(f"Wrote {out}: {', '.join(files)}")
