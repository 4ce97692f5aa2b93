"""The `launch` command line. Each command group lives in `equipax.launch.commands`."""

import sys
from pathlib import Path

from equipax.launch.failures import Interrupted
from equipax.launch.training.preemption import EARLY

__all__ = ["app", "main"]

# The entry point's signal handlers go in before the heavy imports below, so a Ctrl-C or SIGTERM
# during them ends the command cleanly (exit 75) instead of with a traceback. Not when this module
# is imported by something else (tests, a notebook): their signals stay theirs.
INTERRUPTS = EARLY
if __name__ == "__main__" or Path(sys.argv[0]).name == "launch":
    INTERRUPTS.install()

from typing import Annotated

import typer

from equipax.launch.commands.bench_command import bench_app
from equipax.launch.commands.compile_command import compile_cmd
from equipax.launch.commands.convert_command import convert_app
from equipax.launch.commands.data_command import data_app
from equipax.launch.commands.decode_command import decode_cmd
from equipax.launch.commands.eval_command import eval_cmd
from equipax.launch.commands.k8s_command import k8s_cmd
from equipax.launch.commands.local_cluster_command import local_cluster
from equipax.launch.commands.pgle_command import pgle_app
from equipax.launch.commands.slurm_command import slurm_cmd
from equipax.launch.commands.train_command import list_cmd, run, show
from equipax.launch.errors import GuardedGroup, describe
from equipax.launch.exit_codes import EXIT_PREEMPTED

app: typer.Typer = typer.Typer(
    help="Configure and run ML experiments on JAX (equipax).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=GuardedGroup,  # exceptions -> one paragraph + exit code (docs/errors.md)
)


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks of unexpected errors.")] = False,
) -> None:
    """Read by GuardedGroup (errors.py) from the group's parsed parameters."""


app.command("list")(list_cmd)
app.command()(show)
app.command()(run)
app.command("compile")(compile_cmd)
app.command("decode")(decode_cmd)
app.command("eval")(eval_cmd)
app.command("local-cluster", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})(
    local_cluster
)
app.command("slurm")(slurm_cmd)
app.command("k8s")(k8s_cmd)
app.add_typer(bench_app, name="bench")
app.add_typer(data_app, name="data")
app.add_typer(pgle_app, name="pgle")
app.add_typer(convert_app, name="convert")


def main() -> None:
    """Console-script entry point."""
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")  # what a signal interrupts
    try:
        INTERRUPTS.arm()  # from here a signal raises Interrupted (reported, exit 75)
        app(prog_name="launch")
    except Interrupted as e:  # a BaseException: it passes GuardedGroup and every `except Exception`
        print(f"error: {describe(e, command)[0]}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except SystemExit as e:
        if INTERRUPTS.pending is not None and e.code in (0, None):  # a signal something swallowed
            print(f"error: {describe(Interrupted(INTERRUPTS.pending), command)[0]}", file=sys.stderr)
            sys.exit(EXIT_PREEMPTED)
        raise


if __name__ == "__main__":
    sys.exit(main())
