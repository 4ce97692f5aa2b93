"""`launch convert maxtext`: a MaxText config as equipax overrides (and `show --format maxtext`);
`launch convert hf-import` / `hf-export`: Hugging Face checkpoints in and out (docs/hf.md).

The MaxText table is `equipax.launch.translators.maxtext.rules.RULES` (docs/maxtext.md); the Hugging Face
conversions are `equipax.launch.translators.hf_checkpoints`.
"""

import json
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from equipax.core.knobs import ConfigError, flatten, parse_literal
from equipax.launch.commands.common import err, fail, path_option, resolve
from equipax.launch.experiments.registry import get_experiment
from equipax.launch.translators.maxtext.files import read_maxtext
from equipax.launch.translators.maxtext.translate import (
    Translation,
    apply_translation,
    settable,
    to_equipax,
    to_maxtext,
)
from equipax.launch.translators.maxtext.values import SCALE_RULES

__all__ = [
    "convert_app",
    "convert_maxtext",
    "DEFAULT_BASE",
    "hf_export",
    "hf_import",
    "print_maxtext",
    "translate_maxtext",
]

convert_app: typer.Typer = typer.Typer(
    help="Translate other frameworks' configs and checkpoints (MaxText configs, Hugging Face models).",
    no_args_is_help=True,
)

DEFAULT_BASE = "c4_1b"


def _literal(value: Any) -> str:
    """A knob value as `--set` parses it back: bare words stay bare (model.dtype=bfloat16)."""
    return value if isinstance(value, str) and parse_literal(value) == value else repr(value)


def translate_maxtext(
    config: Path, args: list[str], exp: str | None = None, scale_rule: str = "doubling"
) -> tuple[Translation, Any]:
    """`launch convert maxtext`'s work: the translation and the equipax config it gives (exit 2 on
    a user error: an unreadable file, an architecture equipax lacks, an invalid experiment)."""
    from equipax.launch.experiments.registry import get_experiment

    notes: list[str] = []
    try:
        t = to_equipax(read_maxtext(config, args, notes), scale_rule=scale_rule)
        t.notes[:0] = notes
        t.exp = exp or t.exp or DEFAULT_BASE
        resolve(t.exp, [])  # a clean error for an unknown --exp
        cfg = apply_translation(get_experiment(t.exp), t.knobs)
    except ConfigError as e:
        fail(str(e))
    return t, cfg


@convert_app.command("maxtext")
def convert_maxtext(
    config: Annotated[Path, typer.Argument(help="A MaxText config (YAML), e.g. maxtext/configs/base.yml.")],
    args: Annotated[
        list[str] | None,
        typer.Argument(
            help="A model file (MODEL.yml, e.g. configs/models/llama3-8b.yml), then MaxText overrides key=value "
            "as on MaxText's command line (model_name=llama3-8b reads models/llama3-8b.yml next to CONFIG)."
        ),
    ] = None,
    exp: Annotated[
        str | None,
        typer.Option(
            "--exp",
            "-e",
            help=f"The equipax experiment the translation applies to (default: one of the decoder block's family, "
            f"{DEFAULT_BASE} without a decoder_block).",
        ),
    ] = None,
    format: Annotated[str, typer.Option("--format", help="set (--set lines) or json.")] = "set",
    scale_rule: Annotated[
        str,
        typer.Option(
            "--scale-rule",
            help="global_parameter_scale: 'doubling' (MaxText 0.2.5: powers of two, doubled in rotation) or "
            "'linear' (every base size x scale: MaxText's first release, the Pax README).",
        ),
    ] = "doubling",
) -> None:
    """Print a MaxText config as equipax overrides, and each key that has no translation and why."""
    if format not in ("set", "json"):
        fail(f"--format must be 'set' or 'json'; got {format!r}.")
    if scale_rule not in SCALE_RULES:
        fail(f"--scale-rule must be one of {', '.join(SCALE_RULES)}; got {scale_rule!r}.")
    t, cfg = translate_maxtext(config, args or [], exp, scale_rule)
    knobs = settable(get_experiment(t.exp or DEFAULT_BASE), t.knobs)
    params = cfg.model.param_counts()["total"]
    if format == "json":
        out = {
            "exp": t.exp,
            "set": knobs,
            "params": params,
            "not_translated": t.skipped,
            "no_equipax_meaning": t.ignored,
            "notes": t.notes,
        }
        print(json.dumps(out, indent=2))
    else:
        print(f"# MaxText {config.name} as overrides of {t.exp} ({params:,} parameters): launch run --exp {t.exp}")
        for k, v in knobs.items():
            print(f"--set {shlex.quote(f'{k}={_literal(v)}')}")
    for note in t.notes:
        err.print(f"note: {note}", highlight=False, markup=False)
    for key, why in t.skipped.items():
        err.print(f"not translated: {key}: {why}", highlight=False, markup=False)
    if t.ignored:
        names = list(t.ignored)
        more = f" and {len(names) - 8} more (--format json lists them)" if len(names) > 8 else ""
        err.print(
            f"not translated: {len(names)} keys with no equipax meaning: {', '.join(names[:8])}{more}",
            highlight=False,
            markup=False,
        )


def print_maxtext(cfg: Any) -> None:
    """`launch show --format maxtext`: the experiment as MaxText 0.2.5 config keys (YAML)."""
    import yaml

    from equipax.launch.configs.experiment import is_lm

    if not is_lm(cfg) or "model.transformer.num_layers" not in flatten(cfg):
        fail(f"{cfg.name} is not a language model of the decoder stack; only those translate to MaxText.")
    try:
        t = to_maxtext(flatten(cfg))
    except ConfigError as e:
        fail(str(e))
        return
    print(f"# {cfg.name} as MaxText 0.2.5 keys: python3 -m maxtext.trainers.pre_train.train base.yml + these")
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


def _hf_directory(value: str) -> Path:
    """hf-import's directory: a local (or mounted) path; a gs:// or s3:// one is refused saying to
    copy it first (the weights are read as byte ranges of local files)."""
    from equipax.core.paths import local_only_problem

    if (problem := local_only_problem(value, "hf-import's directory")) is not None:
        raise typer.BadParameter(problem + ".")
    return path_option(value)


@convert_app.command("hf-import")
def hf_import(
    directory: Annotated[
        Path,
        typer.Argument(
            parser=_hf_directory,
            metavar="DIRECTORY",
            help="A local Hugging Face model directory (config.json + *.safetensors).",
        ),
    ],
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
