"""The training program: `build_training`, the loop and its hooks."""

__all__: list[str] = []
