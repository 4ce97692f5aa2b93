"""Input-pipeline benchmark: tokens/s the data side delivers, next to what the train step consumes.

Cases (all on this host, one process, no device work):

- `default`: the default experiment's training input (`shakespeare_tiny`: SentencePiece
  tokens cut into windows), built exactly as `launch run` builds it.
- `c4_packed_jsonl` / `c4_packed_arrayrecord`: C4-format shards written from the Shakespeare
  plays (all of them, or the first `--plays`; `launch data prepare`'s code, one document per
  blank-line block) into a temporary directory, read by `DocumentLMInput` with packing: read,
  JSON-parse, tokenize, pack, batch.
  Measured with tokenization inline (`read_threads=0`) and on reader threads (`--threads`), as
  host 0 of 1, 2 and 4 simulated hosts (`--hosts`): the order is global, so each host reads its
  `batch / hosts` rows of every global batch; `build_s` includes the one pass that counts every
  document's tokens for the packing.

The train step's consumption rate comes from `benchmarks/results/train_step.json` (the
`default` preset), or `--step-tokens-per-s`. The pipeline keeps up when its rate is above it.

    uv run python benchmarks/input_pipeline.py --batches 200

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from equipax.core.knobs import apply_overrides
from equipax.data import BaseInput, DocumentLMInput, TextShards, find_shards, iter_text_documents, write_shards
from equipax.launch.experiments.registry import get_experiment
from equipax.launch.tasks.lm_data import build_lm_inputs, build_tokenizer

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "input_pipeline.json"
TRAIN_STEP_JSON = HERE / "results" / "train_step.json"


def time_input(inp: BaseInput, batches: int, warmup: int) -> dict[str, float]:
    """Seconds and tokens/s (weighted = real, non-padding tokens) over `batches` get_next calls."""
    for _ in range(warmup):
        inp.get_next()
    tokens = weighted = 0.0
    start = time.perf_counter()
    for _ in range(batches):
        batch = inp.get_next()
        tokens += batch["ids"].size
        weighted += float(batch["weights"].sum())
    seconds = time.perf_counter() - start
    return {
        "batches": batches,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "real_tokens_per_s": weighted / seconds,
        "batches_per_s": batches / seconds,
        "real_fraction": weighted / tokens,
    }


def step_rate(override: float | None) -> tuple[float | None, str]:
    if override is not None:
        return override, "--step-tokens-per-s"
    if TRAIN_STEP_JSON.exists():
        data = json.loads(TRAIN_STEP_JSON.read_text())
        default = data.get("presets", {}).get("default")
        if default:
            return float(default["tokens_per_s"]), f"{TRAIN_STEP_JSON.name} ({data.get('date', '?')})"
    return None, "unknown"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exp", default="shakespeare_tiny", help="Experiment whose input is timed.")
    parser.add_argument("--set", action="append", default=[], help="Knob overrides (KNOB=VALUE).")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument(
        "--plays",
        type=int,
        default=0,
        help="C4 cases: documents of the first N plays only (0: all 38 plays; a small N is a smoke test "
        "whose builds skip most of the token-count pass)",
    )
    parser.add_argument("--threads", default="0,1", help="reader threads to try for the C4 cases.")
    parser.add_argument("--hosts", default="1,2,4", help="simulated host counts for the C4 cases (host 0 is timed).")
    parser.add_argument("--step-tokens-per-s", type=float, default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    cfg, _ = apply_overrides(get_experiment(args.exp), args.set)
    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        t0 = time.perf_counter()
        tokenizer = build_tokenizer(cfg, tmp_dir, log=lambda m: None)
        tokenizer_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        inputs = build_lm_inputs(cfg, tokenizer)
        cases["default"] = {"build_s": time.perf_counter() - t0, **time_input(inputs.train, args.batches, args.warmup)}

        from equipax.data import list_plays, load_plays

        plays = load_plays()
        play_dir = tmp_dir / "plays"
        play_dir.mkdir()
        for name in list_plays()[: args.plays or None]:
            (play_dir / f"{name}.txt").write_text(plays[name])
        docs = list(iter_text_documents([play_dir], split="blank-line"))
        d = cfg.data
        for fmt in ("jsonl", "arrayrecord"):
            out = tmp_dir / fmt
            write_shards(docs, out, num_shards=args.shards, format=fmt)  # type: ignore[arg-type]
            for threads in (int(t) for t in args.threads.split(",")):
                for hosts in (int(h) for h in args.hosts.split(",")):
                    t0 = time.perf_counter()
                    shards = TextShards(find_shards(out, "c4-train.*"))
                    inp = DocumentLMInput(
                        shards,
                        tokenizer=tokenizer,
                        seq_len=d.seq_len,
                        batch_size=cfg.global_batch_size // hosts,
                        num_infeed_hosts=hosts,
                        seed=d.seed,
                        packing=True,
                        read_threads=threads,
                    )
                    name = f"c4_packed_{fmt}_threads{threads}" + (f"_host0of{hosts}" if hosts > 1 else "")
                    cases[name] = {
                        "hosts": hosts,
                        "build_s": time.perf_counter() - t0,
                        **time_input(inp, args.batches, args.warmup),
                    }

    rate, source = step_rate(args.step_tokens_per_s)
    for case in cases.values():
        case["x_train_step"] = None if rate is None else case["tokens_per_s"] / rate
    results = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "experiment": cfg.name,
        "seq_len": cfg.data.seq_len,
        "batch_size": cfg.global_batch_size,
        "tokenizer_vocab": tokenizer.vocab_size,
        "tokenizer_train_s": tokenizer_s,
        "c4_documents": len(docs),
        "train_step_tokens_per_s": rate,
        "train_step_source": source,
        "cases": cases,
        "settings": dataclasses.asdict(cfg.data)
        | {"batches": args.batches, "warmup": args.warmup, "plays": args.plays or len(list_plays())},
    }
    results = json.loads(json.dumps(results))  # tuples -> lists: what the file holds
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'case':40s} {'build s':>8s} {'tokens/s':>12s} {'real tok/s':>12s} {'x train step':>12s}")
    for name, c in cases.items():
        x = "-" if c["x_train_step"] is None else f"{c['x_train_step']:.1f}x"
        print(f"{name:40s} {c['build_s']:8.2f} {c['tokens_per_s']:12,.0f} {c['real_tokens_per_s']:12,.0f} {x:>12s}")
    if rate is not None:
        print(f"{'train step (' + source + ')':34s} {rate:12,.0f}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
