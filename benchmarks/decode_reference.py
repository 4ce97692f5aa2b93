"""`launch decode` tokens/s against a plain-JAX greedy KV-cache loop of the same model.

For each experiment, trains a job for two steps (the weights do not matter for speed; the shapes
do) unless `--job-root/<exp>` holds one, runs `launch decode` (greedy) on `--batches` batches of
`--batch` prompts for each batch size of `--cli-batch-sizes`, and runs the hand-written loop of
`benchmarks/decode_plain.py` (`make_greedy_decode`: no Equinox, no equipax; the job's parameters
converted to `baseline_lm.py`'s dict layout, computing in the model's dtype, scanned layers under
`lax.scan`) on the same prompts. The reference's tokens are compared with the CLI's (up to each
row's end-of-sequence): in float32 they are equal, so both decode the same model; in bfloat16 two
programs may round differently and part from each other after a near-tie (`token_agreement`).
Per batch, `launch decode` reports `seconds_per_token` (its decode loop's own time per step,
prefill included, compilation excluded); the reference's is its jitted call's wall time over
`--new-tokens`, after a warm-up call. Since a loaded host makes separate runs incomparable, the
same batches are also decoded in this process, interleaved batch by batch, by `decode_texts`
(the function `launch decode` calls, timed the same way) and the reference: `paired_ratio` is the
median over batches of equipax tokens/s / reference tokens/s (> 1: equipax is faster). The first
batch of each is a warm-up and is not counted; tokens/s = rows / seconds per step. `decode` itself
is timed too, as the reference is (prompts already on the device, a warm call right before the
timed one, no end-of-sequence stop): `decode_call_paired_ratio` leaves out what `decode_texts`
does around it (tokenizing, the copies to and from the host). `--profile DIR` traces one more
batch of each per batch size (`DIR/<exp>_b<batch>/{equipax,plain}`) and prints their per-op
device time per generated token (benchmarks/op_profile.py).

Every `launch` process runs before this process touches a device: a TPU chip is held by one
process at a time, so the training run and the CLI decodes of every experiment come first, then
this process decodes. They share JAX's persistent compilation cache (`--compile-cache`): the
programs `launch decode` compiled load here instead of compiling again.

    uv run python benchmarks/decode_reference.py                      # tiny GPT and tiny Llama, batch 1 and 8
    uv run python benchmarks/decode_reference.py --exps shakespeare_tiny --batch-sizes 1 --new-tokens 16
    python benchmarks/decode_reference.py --exps c4_1b_6l --new-tokens 128   # one TPU chip (run.sh's `decode`)

`--exps` takes registry names and the named jobs of `JOBS` (an experiment with knobs: `c4_1b_6l`).

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/decode_reference.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import launch_decode as launch_decode_script

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "decode_reference.json"
DEFAULT_EXPS = ("shakespeare_tiny", "shakespeare_llama_tiny")
# Named jobs: a registry experiment and the knobs its two training steps run with.
JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    # What run.sh's `decode` part decodes on one TPU chip: c4_1b (GPT: d 2560, 20 x 128 heads, MLP
    # 10240, vocab 32000, bfloat16 compute, scanned layers) at 6 layers, 553.8M parameters (the
    # `speed` part's c4_1b_6l), on one device. The job only carries the weights (their values do
    # not matter for speed), so it is made cheaply: two steps on synthetic tokens at 1 x 128 (the
    # train step's XLA:TPU compile grows with the tokens per step), the layers frozen (a learner
    # group without a learner: no Adam moments for them, so the checkpoint to write is 2.7 GiB,
    # not 6.2).
    "c4_1b_6l": (
        "c4_1b",
        (
            "model.transformer.num_layers=6",
            "mesh.ici_mesh_shape=(1,1,1)",
            "mesh.dcn_mesh_shape=(1,1,1)",
            "data.source=synthetic",
            "data.packing=False",
            "data.tokenizer=byte",
            "data.seq_len=128",
            "data.per_device_batch=1",
            "learner.groups=({'name': 'layers', 'regex': '^stack/'},)",
        ),
    )
}


def _prompts(batch: int, batches: int) -> list[str]:
    texts = launch_decode_script._PROMPTS
    return [texts[i % len(texts)] for i in range(batch * batches)]


def _launch(*args: str) -> subprocess.CompletedProcess:
    """`launch ARGS` to its end (launch_decode.py's); a failure's output is printed before it raises."""
    try:
        return launch_decode_script._launch(*args)
    except subprocess.CalledProcessError as e:
        tail = ((e.stdout or "") + (e.stderr or ""))[-4000:]
        print(f"launch {args[0]} failed (exit {e.returncode}):\n{tail}", file=sys.stderr, flush=True)
        raise


def launch_decode(job: Path, prompts: Sequence[str], *, batch: int, new_tokens: int) -> list[dict[str, Any]]:
    """`launch decode` (greedy) of `prompts` in batches of `batch`: its JSON records, in order."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(prompts) + "\n")
    try:
        done = _launch(
            "decode", "--job-log-dir", str(job), "--prompts", f.name, "--batch-size", str(batch),
            "--max-new-tokens", str(new_tokens), "--temperature", "0", "--output", "-",
        )  # fmt: skip
    finally:
        os.unlink(f.name)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run_cli(
    exp: str, *, job_root: Path, sets: Sequence[str], batch_sizes: Sequence[int], batches: int, new_tokens: int
) -> dict[str, Any]:
    """The `launch` processes of one experiment: its training run (unless its job exists) and
    `launch decode` at each batch size. Nothing here touches a device in this process."""
    experiment, knobs = JOBS.get(exp, (exp, ()))
    job = job_root / exp
    out: dict[str, Any] = {"job": str(job), "train_wall_s": None, "by_batch": {}}
    if not (job / "checkpoints").exists():
        t0 = time.perf_counter()
        overrides = [*launch_decode_script._TRAIN, *knobs, *sets]
        _launch("run", "--exp", experiment, "--job-log-dir", str(job), *[a for s in overrides for a in ("--set", s)])
        out["train_wall_s"] = time.perf_counter() - t0
        print(f"[{exp}] trained 2 steps in {out['train_wall_s']:.0f} s: {job}", flush=True)
    for batch in batch_sizes:
        t0 = time.perf_counter()
        records = launch_decode(job, _prompts(batch, batches), batch=batch, new_tokens=new_tokens)
        out["by_batch"][str(batch)] = {"records": records, "wall_s": time.perf_counter() - t0}
        rates = [batch / records[i]["seconds_per_token"] for i in range(0, len(records), batch)]
        print(
            f"[{exp}] launch decode, batch {batch}: tokens/s per batch "
            + ", ".join(f"{r:,.0f}" for r in rates)
            + f" (the process: {out['by_batch'][str(batch)]['wall_s']:.0f} s)",
            flush=True,
        )
    return out


def load_reference(job: Path) -> tuple[Any, Any, Any, Any]:
    """`(equipax model, baseline config, baseline params, tokenizer)` of the job's newest checkpoint."""
    from benchmarks.lm_step.baseline import baseline_for, baseline_params
    from benchmarks.lm_step.presets import Preset
    from equipax.core.optim import LearnerConfig
    from equipax.launch.configs.experiment import as_lm
    from equipax.launch.inference.trained_job import load_config, local_mesh, pick_step, restore_model
    from equipax.launch.program.program import build_program
    from equipax.launch.tasks.lm_data import build_tokenizer
    from equipax.models.decode import for_decoding

    cfg = load_config(job)
    lm = as_lm(cfg)
    cfg, mesh, _ = local_mesh(cfg)
    model, _ = restore_model(job, pick_step(job, None), build_program(cfg, mesh))
    # The reference decodes with its own attention: the training kernel, remat and learner do not apply.
    block = dataclasses.replace(lm.model.transformer, attention_impl="xla", remat="none")
    preset = Preset(
        name=cfg.name,
        description="",
        model=dataclasses.replace(lm.model, transformer=block),
        batch_size=1,
        seq_len=lm.data.seq_len,
        learner=LearnerConfig(),
    )
    tokenizer = build_tokenizer(lm, job, log=lambda m: None)
    # equipax decodes the model `launch decode` computes with: with model.quantization set, its
    # projections' int8 copy, made once at load as the CLI makes it (not in every timed call); the
    # reference reads the float weights in the compute dtype.
    return for_decoding(model), baseline_for(preset), baseline_params(model), tokenizer


def _agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token rows."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def benchmark_prefill(
    model: Any, bcfg: Any, params: Any, *, batch_sizes: Sequence[int], length: int, repeats: int = 5
) -> dict[str, Any]:
    """Prefill alone, both ways: `batch` prompts of `length` random tokens through the model in one
    pass, filling a cache of `length` slots; per batch size the median tokens/s of `repeats` calls
    of each (interleaved, after a warm-up call) and their ratio (> 1: equipax is faster)."""
    import equinox as eqx
    import jax
    import numpy as np

    from benchmarks import decode_plain
    from equipax.models.decode import init_cache, prefill

    ours = eqx.filter_jit(lambda m, ids, lens: prefill(m, ids, lens, init_cache(m, ids.shape[0], ids.shape[1]))[0])
    plain = decode_plain.make_prefill(bcfg)
    rng = np.random.default_rng(0)
    rows: dict[str, Any] = {}
    for batch in batch_sizes:
        ids = jax.numpy.asarray(rng.integers(0, model.cfg.vocab_size, (batch, length)), dtype=jax.numpy.int32)
        lens = jax.numpy.full((batch,), length, jax.numpy.int32)
        calls = {"equipax": (ours, model), "plain": (plain, params)}
        times: dict[str, list[float]] = {side: [] for side in calls}
        for fn, weights in calls.values():
            jax.block_until_ready(fn(weights, ids, lens))  # compile and warm
        for _ in range(repeats):
            for side, (fn, weights) in calls.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(weights, ids, lens))
                times[side].append(time.perf_counter() - t0)
        rate = {side: batch * length / statistics.median(ts) for side, ts in times.items()}
        rows[str(batch)] = {
            "equipax_tokens_per_s": rate["equipax"],
            "plain_tokens_per_s": rate["plain"],
            "ratio": rate["equipax"] / rate["plain"],
        }
        print(
            f"  prefill, batch {batch} x {length} tokens: equipax {rate['equipax']:,.0f}, plain JAX "
            f"{rate['plain']:,.0f} tokens/s, ratio {rate['equipax'] / rate['plain']:.2f}",
            flush=True,
        )
    return {"length": length, "by_batch": rows}


def benchmark_exp(
    exp: str,
    cli: dict[str, Any],
    *,
    batch_sizes: Sequence[int],
    batches: int,
    new_tokens: int,
    prefill_len: int = 0,
    profile: Path | None = None,
) -> dict[str, Any]:
    """Decode one trained experiment in this process, both ways, at each batch size (and read the
    CLI's records of `run_cli`); with `profile`, trace one more batch of each per batch size
    (`profile_decodes`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import decode_plain
    from equipax.core.flops import count_params
    from equipax.launch.inference.sampling import decode_texts, encode_prompts, padded_width
    from equipax.models.decode import decode as decode_call

    def decode_ours(ids: jax.Array, lengths: jax.Array) -> Any:
        # `decode` itself on prompts already on the device (what `decode_texts` adds around it:
        # tokenizing, the copies to and from the host, detokenizing), greedy, no end-of-sequence
        # stop: the work of the reference's call.
        return decode_call(model, ids, lengths, max_new_tokens=new_tokens, pad_id=tokenizer.pad_id)

    model, bcfg, params, tokenizer = load_reference(Path(cli["job"]))
    decode = decode_plain.make_greedy_decode(bcfg, new_tokens)

    def padded(texts: list[str]) -> tuple[jax.Array, jax.Array]:
        # The batch as `decode_texts` pads it: the same width, so the same cache and prefill.
        ids, lengths = encode_prompts(tokenizer, texts, model.cfg.max_seq_len)
        width = padded_width(ids.shape[1], max_seq_len=model.cfg.max_seq_len, max_new_tokens=new_tokens)
        ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=tokenizer.pad_id)
        return jnp.asarray(ids), jnp.asarray(lengths)

    # The reference's programs (one per batch shape) compiled up front, at once in threads.
    inputs = {b: [padded(_prompts(b, batches)[i : i + b]) for i in range(0, b * batches, b)] for b in batch_sizes}
    shapes = {x[0].shape: x for xs in inputs.values() for x in xs}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(shapes)) as pool:
        futures = {s: pool.submit(lambda x: decode.lower(params, *x).compile(), x) for s, x in shapes.items()}
        compiled = {s: f.result() for s, f in futures.items()}
    counted = lambda rates: rates[1:] or rates  # noqa: E731 (the first batch warms up)
    rows: dict[str, Any] = {}
    for batch in batch_sizes:
        prompts = _prompts(batch, batches)
        records = cli["by_batch"].get(str(batch), {}).get("records")
        cli_rates = [batch / records[i]["seconds_per_token"] for i in range(0, len(records), batch)] if records else []
        # In this process, interleaved batch by batch: the function `launch decode` calls
        # (`decode_texts`, its own seconds per step) and the reference, on the same prompts.
        eqx_rates, call_rates, ref_rates, generated, prefixes, cli_same = [], [], [], [], [], True
        for n, i in enumerate(range(0, len(prompts), batch)):
            texts = prompts[i : i + batch]
            samples = decode_texts(model, tokenizer, texts, max_new_tokens=new_tokens)
            eqx_rates.append(batch / samples[0].seconds_per_token)
            generated.append(max(len(s.tokens) for s in samples))
            ids, lengths = inputs[batch][n]
            jax.block_until_ready(decode_ours(ids, lengths))  # warm, as the reference below
            t0 = time.perf_counter()
            jax.block_until_ready(decode_ours(ids, lengths))
            call_rates.append(batch / ((time.perf_counter() - t0) / new_tokens))
            reference = compiled[ids.shape]
            jax.block_until_ready(reference(params, ids, lengths))  # warm
            t0 = time.perf_counter()
            tokens = np.asarray(reference(params, ids, lengths))
            ref_rates.append(batch / ((time.perf_counter() - t0) / new_tokens))
            for j, (row, sample) in enumerate(zip(tokens.tolist(), samples)):
                mine = list(sample.tokens)
                if records is not None:  # the same program on the same weights as the CLI's
                    cli_same &= records[i + j]["tokens"] == mine
                prefixes.append(_agreement(row, mine) / len(mine))
        paired = [e / r for e, r in zip(counted(eqx_rates), counted(ref_rates))]
        rows[str(batch)] = {
            "launch_decode_tokens_per_s": statistics.median(counted(cli_rates)) if cli_rates else None,
            "in_process_tokens_per_s": statistics.median(counted(eqx_rates)),
            "reference_tokens_per_s": statistics.median(counted(ref_rates)),
            "paired_ratio": statistics.median(paired),
            "paired_ratios": paired,
            # `decode` alone, timed as the reference (prompts on the device, a warm call first).
            "decode_call_tokens_per_s": statistics.median(counted(call_rates)),
            "decode_call_paired_ratio": statistics.median(
                [e / r for e, r in zip(counted(call_rates), counted(ref_rates))]
            ),
            "same_tokens": all(p == 1.0 for p in prefixes),
            "cli_same_tokens": cli_same if records is not None else None,
            # Mean fraction of each row's tokens (up to its end) before the reference's first differs.
            "token_agreement": statistics.mean(prefixes),
            "tokens_generated_per_batch": generated,
            "launch_decode_per_batch": cli_rates,
            "launch_decode_wall_s": cli["by_batch"].get(str(batch), {}).get("wall_s"),
            "in_process_per_batch": eqx_rates,
            "reference_per_batch": ref_rates,
        }
        row = rows[str(batch)]
        print(
            f"[{exp}] batch {batch}: in-process {row['in_process_tokens_per_s']:,.0f} (`decode` alone "
            f"{row['decode_call_tokens_per_s']:,.0f}), plain JAX {row['reference_tokens_per_s']:,.0f} tokens/s, "
            f"paired ratio {row['paired_ratio']:.2f} ({row['decode_call_paired_ratio']:.2f}), "
            f"agreement {row['token_agreement']:.1%}",
            flush=True,
        )
        if profile is not None:
            ids, lengths = inputs[batch][-1]
            calls = {
                "equipax": functools.partial(decode_ours, ids, lengths),
                "plain": functools.partial(reference, params, ids, lengths),
            }
            row["profile"] = profile_decodes(profile / f"{exp}_b{batch}", calls, tokens=new_tokens)
    # A decode step reads every weight once (in the compute dtype: equipax's projections held in it
    # by `for_decoding`, made once at load; the reference's float32 weights cast once per call,
    # outside the token loop, by XLA; equipax's int8 copies as int8 with model.quantization set),
    # plus the cache.
    int8 = sum(a.size for a in jax.tree.leaves(model) if getattr(a, "dtype", None) == jnp.int8)
    weight_bytes = {
        "in_process": count_params(model) * jnp.dtype(bcfg.dtype).itemsize + int8,
        "reference": (count_params(model) + int8) * jnp.dtype(bcfg.dtype).itemsize,
    }
    for batch, row in rows.items():
        for side in ("in_process", "reference"):
            row[f"{side}_weight_gb_per_s"] = weight_bytes[side] * row[f"{side}_tokens_per_s"] / int(batch) / 1e9
    prefill_rows = None
    if prefill_len:
        prefill_rows = benchmark_prefill(model, bcfg, params, batch_sizes=batch_sizes, length=prefill_len)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "prefill": prefill_rows,
        "exp": exp,
        "experiment": JOBS.get(exp, (exp, ()))[0],
        "params": count_params(model) + int8,
        "dtype": bcfg.dtype,
        "quantization": model.cfg.quantization,
        "weight_bytes_in_dtype": weight_bytes["in_process"],
        "reference_weight_bytes": weight_bytes["reference"],
        "baseline_config": dataclasses.asdict(bcfg),
        "new_tokens": new_tokens,
        "batches": batches,
        "train_wall_s": cli["train_wall_s"],
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "by_batch": rows,
    }


def profile_decodes(out: Path, calls: dict[str, Any], *, tokens: int) -> dict[str, Any]:
    """One `jax.profiler` trace per call (`calls`: label -> a warm, argument-less call) under
    `out/<label>`, and their per-op device time per generated token side by side
    (benchmarks/op_profile.py; `out/op_profile.json`, printed)."""
    import jax

    from benchmarks import op_profile

    traces = {}
    for label, call in calls.items():
        jax.block_until_ready(call())  # warm: the trace holds no compile
        with jax.profiler.trace(str(out / label), create_perfetto_trace=True):
            jax.block_until_ready(call())
        traces[label] = op_profile.find_trace(out / label)
    summary = op_profile.compare_traces(traces, steps=tokens)
    print(f"per-op device time per generated token, {out.name} (benchmarks/op_profile.py)")
    print(op_profile.format_comparison(summary))
    (out / "op_profile.json").write_text(json.dumps(summary, indent=2) + "\n")
    return {label: {"device_ms_per_token": s["device_ms_per_step"]} for label, s in summary.items()}


def _sizes(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--exps", default=",".join(DEFAULT_EXPS), help="comma-separated experiments (or JOBS names)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated prompts per batch")
    p.add_argument(
        "--cli-batch-sizes",
        default=None,
        help="the batch sizes `launch decode` runs at, one process each (default: --batch-sizes; '' = none)",
    )
    p.add_argument("--batches", type=int, default=4, help="batches per size (the first is a warm-up)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--prefill-len", type=int, default=0, help="also time prefill alone on prompts this long (0: not)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="a knob for the training runs (repeatable)")
    p.add_argument("--job-root", type=Path, default=None, help="where the trained jobs live (default: a temp dir)")
    p.add_argument(
        "--compile-cache",
        default=None,
        help="JAX's persistent compilation cache, shared with the launch processes (default: <job-root>/"
        "compile_cache; '' = none)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="also trace one batch of each side per batch size into DIR/<exp>_b<batch>/ and print "
        "their per-op device time per token (benchmarks/op_profile.py)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        The results written to `--out`: per experiment and batch size, both tokens/s, their ratio
        and how far the tokens agreed.
    """
    args = _parser().parse_args(argv)
    exps = [e.strip() for e in args.exps.split(",") if e.strip()]
    sizes = _sizes(args.batch_sizes)
    cli_sizes = sizes if args.cli_batch_sizes is None else _sizes(args.cli_batch_sizes)
    job_root = args.job_root or Path(tempfile.mkdtemp(prefix="decode_reference_"))
    cache = str(job_root / "compile_cache") if args.compile_cache is None else args.compile_cache
    previous = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if cache:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # the launch processes' (and this one's, below)
    try:
        settings = {"sets": args.sets, "batch_sizes": cli_sizes, "batches": args.batches, "new_tokens": args.new_tokens}
        cli = {e: run_cli(e, job_root=job_root, **settings) for e in exps}
    finally:
        if previous is None:
            os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        else:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = previous
    import jax

    before = jax.config.jax_compilation_cache_dir
    if cache:
        from jax._src import compilation_cache  # its directory is read once; reset it to switch

        jax.config.update("jax_compilation_cache_dir", cache)
        compilation_cache.reset_cache()
    try:
        experiments = {
            e: benchmark_exp(
                e,
                cli[e],
                batch_sizes=sizes,
                batches=args.batches,
                new_tokens=args.new_tokens,
                prefill_len=args.prefill_len,
                profile=args.profile,
            )
            for e in exps
        }
    finally:
        if cache:
            jax.config.update("jax_compilation_cache_dir", before)
            compilation_cache.reset_cache()
    results = {
        "benchmark": "decode_reference",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "experiments": experiments,
    }
    print(f"greedy, {args.new_tokens} new tokens, median of {max(args.batches - 1, 1)} batches per size")
    print(
        f"  {'experiment':<24} {'batch':>5} {'launch decode':>14} {'in-process':>11} {'plain JAX':>10} "
        f"{'paired ratio':>13} {'agreement':>10}   (tokens/s)"
    )
    for e, r in results["experiments"].items():
        for b, row in r["by_batch"].items():
            cli_rate = row["launch_decode_tokens_per_s"]
            print(
                f"  {e:<24} {b:>5} {'-' if cli_rate is None else f'{cli_rate:,.0f}':>14} "
                f"{row['in_process_tokens_per_s']:>11,.0f} {row['reference_tokens_per_s']:>10,.0f} "
                f"{row['paired_ratio']:>13.2f} {row['token_agreement']:>10.1%}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
