"""`launch bench attention`: the command line of the attention benchmark (`equipax.launch.bench.attention_timing`)."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from equipax.core.knobs import ConfigError
from equipax.launch.commands.common import fail as _fail
from equipax.launch.experiments.attention_bench import IMPLEMENTATIONS, AttentionBenchConfig

__all__ = ["bench_app"]


def _parse_lengths(seq: str) -> tuple[int, ...]:
    parts = [s.strip() for s in seq.split(",") if s.strip()]
    if not all(p.isdigit() for p in parts):
        raise typer.BadParameter(
            f"expected comma-separated whole numbers, e.g. 128,512,2048; got {seq!r}.", param_hint="'--seq'"
        )
    return tuple(int(p) for p in parts)


bench_app: typer.Typer = typer.Typer(help="Benchmarks.", no_args_is_help=True)
_DEFAULT = AttentionBenchConfig()


@bench_app.command("attention")
def attention_cmd(
    seq: Annotated[str, typer.Option(help="Comma-separated sequence lengths.")] = ",".join(map(str, _DEFAULT.seq_lens)),
    batch: Annotated[int, typer.Option(help="Batch size.")] = _DEFAULT.batch_size,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Width of each head (d_k).")] = _DEFAULT.head_dim,
    heads: Annotated[int, typer.Option(help="Number of heads.")] = _DEFAULT.num_heads,
    repeats: Annotated[int, typer.Option(help="Timed forward passes per point.")] = _DEFAULT.repeats,
    causal: Annotated[bool, typer.Option("--causal", help="Causal masking.")] = False,
    impl: Annotated[str, typer.Option(help=f"Comma-separated, from: {', '.join(IMPLEMENTATIONS)}.")] = ",".join(
        _DEFAULT.implementations
    ),
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="Causal linear chunk.")] = _DEFAULT.chunk_size,
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/attention_bench"),
) -> None:
    """Time softmax vs linear attention forward passes by sequence length."""
    try:
        cfg = AttentionBenchConfig(
            seq_lens=_parse_lengths(seq),
            batch_size=batch,
            num_heads=heads,
            head_dim=head_dim,
            repeats=repeats,
            causal=causal,
            implementations=tuple(s.strip() for s in impl.split(",") if s.strip()),
            chunk_size=chunk_size,
        )
    except ValueError as e:
        _fail(str(e))
    from equipax.launch.bench.attention_timing import run_attention_bench  # JAX only when it runs

    try:
        run_attention_bench(cfg, out, console=Console(soft_wrap=True))
    except ConfigError as e:
        _fail(str(e))
