"""The job directory's safety checks, before a run writes anything into it.

- It must be a writable directory (checked by creating and removing a probe file), so a
  typo'd or read-only `--job-log-dir` fails in a second with a message, not after compiling.
- It must not belong to another experiment: resuming `B` from `A`'s checkpoints would be
  wrong even when the shapes happen to match.
- Small files are replaced atomically (`write_text_atomic`), so a kill never leaves half a
  config.json, tokenizer or metrics file behind.
"""

import json
import os
from pathlib import Path

from equipax.core.config import ConfigError


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (never half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_job_dir(job_dir: Path, experiment: str) -> None:
    """Create `job_dir` if needed and check it is writable and holds no other experiment.

    Raises:
        ConfigError: not a directory, not writable, or another experiment's job directory.
    """
    job_dir = Path(job_dir)
    fix = "Choose another --job-log-dir, or fix the directory's permissions."
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        probe = job_dir / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"The job directory {str(job_dir)!r} is not a writable directory "
            f"({e.strerror or type(e).__name__}: {e.filename or job_dir}). {fix}"
        ) from None
    recorded = job_dir / "config.json"
    checkpoints = job_dir / "checkpoints"
    if not (recorded.exists() and checkpoints.is_dir() and any(checkpoints.iterdir())):
        return
    try:
        name = json.loads(recorded.read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return  # unreadable record: the checkpoint shape check still guards the restore
    if name is not None and name != experiment:
        raise ConfigError(
            f"The job directory {str(job_dir)!r} holds checkpoints of experiment {name!r} "
            f"(its config.json), not {experiment!r}; resuming one from the other would be wrong. "
            f"Point --job-log-dir at a new directory to start {experiment!r} fresh, or run "
            f"--exp {name} to resume that job."
        )
