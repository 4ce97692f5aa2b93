"""Decode benchmark: tokens/s with the KV cache (`equipax.models.decode.decode`) against the
uncached reference (`equipax.models.generate`, which re-runs the whole prefix for every token),
and prefill vs decode time per token.

Default: prompt 64, 256 new tokens, batch 1, greedy, on the `shakespeare_tiny` model size
(vocab 2048, 4 layers, d 192, 4 heads x 48, MLP 768; unrolled layers) and a Llama-style model of
the same width (2 key/value heads, SwiGLU 512). `max_seq_len` is set to prompt + new tokens so
the uncached reference never slides its window and both produce the same tokens.

    uv run python benchmarks/decode.py                       # both families, table + JSON
    uv run python benchmarks/decode.py --families lm --repeats 5

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from equipax.core.flops import count_params
from equipax.core.nn import TransformerConfig
from equipax.models.decode import decode, init_cache, prefill
from equipax.models.lm import LMConfig, TransformerLM, generate

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "decode.json"
FAMILIES = ("lm", "llama")


def build_model(family: str, *, max_seq_len: int, tiny: bool) -> TransformerLM:
    """The benchmarked model of `family` (`tiny`: a 2-layer d 32 model for smoke tests)."""
    vocab, layers, dims, heads, head_dim = (256, 2, 32, 2, 16) if tiny else (2048, 4, 192, 4, 48)
    if family == "lm":
        cfg = LMConfig(
            vocab_size=vocab,
            max_seq_len=max_seq_len,
            transformer=TransformerConfig(
                num_layers=layers,
                model_dims=dims,
                num_heads=heads,
                head_dim=head_dim,
                hidden_dims=4 * dims,
                scan_layers=False,
            ),
        )
        return TransformerLM(cfg, key=jr.key(0))
    # The Llama block (as shakespeare_llama_tiny): RoPE, RMSNorm, SwiGLU, grouped-query attention.
    llama = LMConfig(
        vocab_size=vocab,
        max_seq_len=max_seq_len,
        transformer=TransformerConfig(
            num_layers=layers,
            model_dims=dims,
            num_heads=heads,
            num_kv_heads=max(1, heads // 2),
            head_dim=head_dim,
            hidden_dims=8 * dims // 3,
            activation="silu",
            gated=True,
            norm="rmsnorm",
            norm_eps=1e-5,
            fused_qkv=False,
            atten_logit_cap=None,
            scan_layers=False,
        ),
        output_logit_cap=None,
        position="rope",
        tie_embeddings=False,
        embedding_multiplier=None,
        embedding_init_std=1.0,
    )
    return TransformerLM(llama, key=jr.key(0))


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """Wall time of the first (compiling) call, and of `repeats` more calls."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, times


def benchmark_family(
    family: str, *, prompt_len: int, new_tokens: int, batch: int, repeats: int, uncached_repeats: int, tiny: bool
) -> dict[str, Any]:
    """Time prefill, cached decode and the uncached reference for one model family."""
    model = build_model(family, max_seq_len=prompt_len + new_tokens, tiny=tiny)
    vocab = model.cfg.vocab_size
    prompts = jr.randint(jr.key(1), (batch, prompt_len), 0, vocab, dtype=jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)

    run_prefill = eqx.filter_jit(lambda m, p, n: prefill(m, p, n, init_cache(m, batch, prompt_len + new_tokens))[0])
    prefill_first, prefill_times = _timed(lambda: run_prefill(model, prompts, lengths), repeats)

    def cached():
        return decode(model, prompts, lengths, max_new_tokens=new_tokens)

    cached_first, cached_times = _timed(cached, repeats)
    tokens, _ = cached()

    def uncached():
        return [generate(model, row, new_tokens) for row in prompts]

    uncached_first, uncached_times = _timed(uncached, uncached_repeats)
    reference = np.stack([np.asarray(r)[prompt_len:] for r in uncached()])

    prefill_s = statistics.median(prefill_times)
    cached_s = statistics.median(cached_times)
    uncached_s = statistics.median(uncached_times)
    generated = batch * new_tokens
    return {
        "family": family,
        "params": count_params(model),
        "prefill_s": prefill_s,
        "prefill_per_prompt_token_s": prefill_s / (batch * prompt_len),
        "cached_total_s": cached_s,
        # The decode loop's share: everything after prefill, per generated token.
        "decode_per_token_s": max(cached_s - prefill_s, 0.0) / max(new_tokens - 1, 1),
        "cached_tokens_per_s": generated / cached_s,
        "uncached_total_s": uncached_s,
        "uncached_per_token_s": uncached_s / new_tokens,
        "uncached_tokens_per_s": generated / uncached_s,
        "speedup": uncached_s / cached_s,
        "first_call_s": {"prefill": prefill_first, "cached": cached_first, "uncached": uncached_first},
        "times_s": {"prefill": prefill_times, "cached": cached_times, "uncached": uncached_times},
        "greedy_tokens_match": bool(np.array_equal(np.asarray(tokens), reference)),
    }


def _table(results: dict[str, Any]) -> str:
    s = results["settings"]
    headers = (
        "family",
        "params",
        "prefill ms",
        "prefill us/tok",
        "decode ms/tok",
        "cached tok/s",
        "uncached tok/s",
        "speedup",
        "same tokens",
    )
    rows = [
        (
            r["family"],
            f"{r['params'] / 1e6:.2f}M",
            f"{r['prefill_s'] * 1e3:.1f}",
            f"{r['prefill_per_prompt_token_s'] * 1e6:.0f}",
            f"{r['decode_per_token_s'] * 1e3:.2f}",
            f"{r['cached_tokens_per_s']:.0f}",
            f"{r['uncached_tokens_per_s']:.0f}",
            f"{r['speedup']:.1f}x",
            "yes" if r["greedy_tokens_match"] else "NO",
        )
        for r in results["families"].values()
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [
        f"decode: prompt {s['prompt_len']}, {s['new_tokens']} new tokens, batch {s['batch']}, "
        f"greedy; medians of {s['repeats']} (uncached: {s['uncached_repeats']}) timed calls",
        fmt.format(*headers),
        fmt.format(*("-" * w for w in widths)),
    ]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: lm, llama")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed calls of prefill / decode")
    p.add_argument("--uncached-repeats", type=int, default=2, help="timed calls of generate")
    p.add_argument("--tiny", action="store_true", help="a 2-layer d 32 model (smoke test)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        The results written to `--out`: `families` (per family: prefill, cached and uncached
        times, tokens/s, `speedup`, `greedy_tokens_match`), settings and the environment.
    """
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    if not names or any(n not in FAMILIES for n in names):
        raise SystemExit(f"--families: expected names from {list(FAMILIES)}, found {names!r}.")
    if min(args.prompt_len, args.new_tokens, args.batch, args.repeats, args.uncached_repeats) < 1:
        raise SystemExit("--prompt-len, --new-tokens, --batch and the repeats must be >= 1.")
    per_family = {}
    for name in dict.fromkeys(names):
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        per_family[name] = benchmark_family(
            name,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            batch=args.batch,
            repeats=args.repeats,
            uncached_repeats=args.uncached_repeats,
            tiny=args.tiny,
        )
    results = {
        "benchmark": "decode",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "settings": {
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "batch": args.batch,
            "repeats": args.repeats,
            "uncached_repeats": args.uncached_repeats,
            "tiny": args.tiny,
        },
        "families": per_family,
    }
    print(_table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
