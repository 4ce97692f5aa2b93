"""What the test modules share (on `sys.path` through pyproject.toml's `pythonpath`): the toy-sized
knobs (`toy`), the CLI in-process (`cli`), fresh processes with simulated devices (`multidevice`),
small models and partition specs (`cnn`, `partition`), what a traced program runs (`jaxprs`). No
test module imports another."""

from pathlib import Path

__all__ = ["REPO"]

# The repository's root (pyproject.toml, docs/, examples/, benchmarks/, packages/).
REPO = Path(__file__).resolve().parents[2]
