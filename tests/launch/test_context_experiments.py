"""Context-parallelism knob errors reach the CLI as exit 2 (tests/models/test_context_parallel_lm.py
checks each error; this, that `launch show` reports it before anything is built)."""

import subprocess
import sys


def test_context_errors_reach_the_cli():
    """A sequence the zigzag layout cannot cut is exit 2 at `launch show`, naming the knobs."""
    sets = [
        "mesh.axis_names=('data', 'fsdp', 'context', 'tensor')",
        "mesh.ici_mesh_shape=(1, 1, 4, 1)",
        "mesh.dcn_mesh_shape=(1, 1, 1, 1)",
        "data.seq_len=36",
    ]
    cmd = [sys.executable, "-m", "equipax.launch.cli", "show", "--exp", "shakespeare_llama_tiny"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.seq_len=36 cannot be split" in proc.stdout + proc.stderr
    assert "multiple of 8" in proc.stdout + proc.stderr
