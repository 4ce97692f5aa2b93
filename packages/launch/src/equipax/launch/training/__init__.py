"""The training loop: where a run starts (`start.py`), the steps and their hooks."""

__all__: list[str] = []
