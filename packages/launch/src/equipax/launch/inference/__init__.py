"""Offline inference on a finished or running training job: `launch decode` and `launch eval`
read its config and checkpoints (never writing to them) and sample or evaluate its model."""

__all__: list[str] = []
