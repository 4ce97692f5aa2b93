"""No tracked file holds a merge's conflict markers (a merge committed with a conflict left in)."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(rb"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def test_no_tracked_file_holds_conflict_markers():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    found = []
    for name in filter(None, files):
        path = REPO / name.decode()
        if not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        if m := MARKER.search(data):
            line = data[: m.start()].count(b"\n") + 1
            found.append(f"{name.decode()}:{line}")
    assert not found, "conflict markers left by a merge: " + ", ".join(found)
