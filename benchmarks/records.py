"""What the benchmark scripts share to record their results."""

import json
import platform
import time
from pathlib import Path
from typing import Any


def header() -> dict[str, Any]:
    """When and with which Python and JAX a result was taken (no device is opened: the caller may be
    timing processes that need the accelerator to themselves)."""
    import jax

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "python": platform.python_version(),
        "jax_version": jax.__version__,
    }


def write_json(path: Path | None, result: dict[str, Any]) -> dict[str, Any]:
    """`result` written to `path` as indented JSON (its folder made), where a path is given; returned."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result
