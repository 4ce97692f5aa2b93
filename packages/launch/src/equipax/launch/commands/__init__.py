"""The `launch` command groups, one module each (wired together in `equipax.launch.cli`)."""

__all__: list[str] = []
