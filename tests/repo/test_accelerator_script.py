"""benchmarks/accelerator.sh needs an accelerator to run; here: its bash parses and its Python parts compile."""

import re
import subprocess

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "accelerator.sh"


def test_accelerator_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    parts = re.findall(r"<<'EOF'\n(.*?)^EOF$", SCRIPT.read_text(), re.S | re.M)
    assert len(parts) == 3
    for i, code in enumerate(parts):
        compile(code, f"accelerator.sh part {i + 1}", "exec")
    assert "attention_impl=auto" in SCRIPT.read_text() and "model.dtype=float32" in SCRIPT.read_text()
