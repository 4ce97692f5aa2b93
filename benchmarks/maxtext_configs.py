"""`launch convert maxtext` on every model file MaxText ships: a table of outcomes and parameter counts.

Usage (the MaxText wheel is for this study only; nothing in equipax or its tests needs it):

    pip download maxtext==0.2.5 --no-deps -d /tmp/mt
    unzip -q /tmp/mt/maxtext-0.2.5-py3-none-any.whl -d /tmp/mt/x
    uv run python benchmarks/maxtext_configs.py /tmp/mt/x/maxtext/configs [--markdown]
    uv run python benchmarks/maxtext_configs.py /tmp/mt/x/maxtext/configs \
        --write-facts tests/fixtures/maxtext/facts.json

Each file of `configs/models/` is translated three ways, as MaxText users run it: alone
(`convert models/X.yml`), merged over base.yml (`convert base.yml models/X.yml`) and through
`model_name` (`convert base.yml model_name=X`). A row gives each outcome (the parameter count, or
exit 2 and what the stack lacks, or a crash) and the published size where `PUBLISHED` knows it.
docs/maxtext.md, "MaxText's own configs", records the summary.

`--write-facts` records what the translation relies on of that MaxText version, read from the
wheel (`base.yml`, the enums of `types.py` and `common_types.py`): the base.yml keys equipax
reads or writes, their defaults, and the values MaxText's loader accepts for the enumerated keys.
tests/launch/test_maxtext.py checks the translator against that file, without the wheel.
"""

import argparse
import collections
import json
import re
import sys
from pathlib import Path

# MaxText enums whose values are the domains of config keys (key -> enum class name).
ENUM_KEYS = {
    "decoder_block": "DecoderBlockType",
    "dataset_type": "DatasetType",
    "opt_type": "OptimizerType",
    "lr_schedule_type": "LearningRateScheduleType",
    "rope_type": "RopeType",
    "remat_policy": "RematPolicy",
    "profiler": "ProfilerType",
    "dtype": "DType",
    "quantization": "QuantizationType",
}

# Published parameter counts (model cards' safetensors totals), by MaxText model file name.
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-70b": 70_553_706_496,
    "llama3.3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "llama3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-0.6b": 596_049_920,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
}


def run(args: list[str]) -> tuple[str, int | None]:
    """One `launch convert maxtext` in this process: ('ok', params), ('exit 2: why', None) or ('crash: ...', None)."""
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["convert", "maxtext", *args, "--format", "json"])
    if result.exit_code == 0:
        return "ok", json.loads(result.stdout)["params"]
    if result.exit_code == 2:
        text = " ".join(result.output.split())
        why = text.split("does not have: ")[-1].split(". Translated")[0] if "does not have" in text else text
        return f"exit 2: {why[:110]}", None
    return f"crash (exit {result.exit_code}): {result.exception!r}"[:120], None


def _enum_values(source: str, name: str) -> list[str]:
    """The string values of `class NAME(...)` in a Python source (the class body's `X = "v"` lines)."""
    body = re.search(rf"^class {name}\b.*?:\n((?:[ \t]+.*\n|\n)+)", source, re.M)
    if body is None:
        raise SystemExit(f"no enum {name} in MaxText's sources")
    return sorted(set(re.findall(r'^\s+[A-Z_0-9]+ = "([^"]*)"', body.group(1), re.M)))


def write_facts(configs: Path, out: Path) -> None:
    import yaml

    from equipax.core.knobs import flatten
    from equipax.launch.experiments.registry import entries
    from equipax.launch.translators.maxtext.blocks import ARCHITECTURE_CHECKS
    from equipax.launch.translators.maxtext.rules import RULES
    from equipax.launch.translators.maxtext.translate import NOT_TRANSLATED, to_maxtext
    from equipax.launch.translators.maxtext.values import MAXTEXT_DEFAULTS

    base = yaml.safe_load((configs / "base.yml").read_text())
    source = (configs / "types.py").read_text() + (configs.parent / "common" / "common_types.py").read_text()
    ours = {k for r in RULES for k in r.maxtext} | set(ARCHITECTURE_CHECKS) | set(NOT_TRANSLATED)
    written: set[str] = set()
    for entry in entries():
        cfg = entry.fn()
        if entry.kind == "train" and cfg.kind == "lm" and "model.transformer.num_layers" in flatten(cfg):
            written |= set(to_maxtext(flatten(cfg)).knobs)
    facts = {
        "version": "0.2.5",
        "keys": sorted(k for k in ours | written if k in base),
        "not_keys": sorted(k for k in ours | written if k not in base),
        "defaults": {k: base[k] for k in MAXTEXT_DEFAULTS if k in base},
        "domains": {k: _enum_values(source, e) for k, e in ENUM_KEYS.items()},
    }
    out.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"wrote {out}: {len(facts['keys'])} keys, not in base.yml: {facts['not_keys']}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", type=Path, help="MaxText's configs directory (base.yml, models/)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--write-facts", type=Path, help="write the facts file (see the module docstring) and stop")
    ns = parser.parse_args()
    if ns.write_facts:
        write_facts(ns.configs, ns.write_facts)
        return
    base = ns.configs / "base.yml"
    rows = []
    for model in sorted((ns.configs / "models").glob("*.yml")):
        name = model.stem
        outcomes = [run([str(model)]), run([str(base), str(model)]), run([str(base), f"model_name={name}"])]
        rows.append((name, outcomes))
    counts: collections.Counter[str] = collections.Counter()
    sep = " | " if ns.markdown else "  "
    if ns.markdown:
        print("| model | alone | with base.yml | model_name | published | match |\n|---|---|---|---|---|---|")
    for name, outcomes in rows:
        params = {p for _, p in outcomes}
        published = PUBLISHED.get(name)
        kinds = [o.split(":")[0] for o, _ in outcomes]
        same = len(params) == 1
        match = "-" if published is None else ("yes" if same and published in params else "NO")
        key = "ok" if kinds == ["ok"] * 3 and same else ("exit 2" if kinds == ["exit 2"] * 3 else "mixed")
        counts[key] += 1
        counts[f"published {match}"] += published is not None
        cells = [f"{p / 1e9:.3f}B" if p else o for o, p in outcomes]
        pub = f"{published / 1e9:.3f}B" if published else "-"
        print(sep.join([name, *cells, pub, match]).strip())
    print(f"\n{len(rows)} model files: {dict(counts)}", file=sys.stderr)


if __name__ == "__main__":
    main()
