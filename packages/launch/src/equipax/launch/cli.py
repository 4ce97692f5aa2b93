"""The `launch` command line. Each command group lives in `equipax.launch.commands`."""

import sys
from typing import Annotated

import typer

from equipax.launch.commands.bench import bench_app
from equipax.launch.commands.cluster import local_cluster
from equipax.launch.commands.compile import compile_cmd
from equipax.launch.commands.data import data_app
from equipax.launch.commands.train import list_cmd, run, show
from equipax.launch.errors import GuardedGroup

app = typer.Typer(
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
app.command("local-cluster", context_settings={"ignore_unknown_options": True,
                                               "allow_interspersed_args": False})(local_cluster)
app.add_typer(bench_app, name="bench")
app.add_typer(data_app, name="data")


def main() -> None:
    """Console-script entry point."""
    app(prog_name="launch")


if __name__ == "__main__":
    sys.exit(main())
