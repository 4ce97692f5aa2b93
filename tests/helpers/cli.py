"""The launch CLI in-process: invoke a command, run the toy experiment, snapshot a job directory,
check a one-paragraph error."""

import hashlib
from pathlib import Path

from helpers.toy import TOY, set_args

FAST = [
    *TOY,
    "data.tokenizer=byte",
    "train.sample.tokens=0",
    "train.log_every=1",
    "train.eval_every=4",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=3",
]


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def run(job, *overrides, exp="shakespeare_tiny"):
    return invoke("run", "--exp", exp, "--job-log-dir", job, *set_args([*FAST, *overrides]))


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_one_paragraph(output: str, *needles: str):
    assert "Traceback" not in output, output
    assert "error:" in output, output
    for n in needles:
        assert n in output, output
