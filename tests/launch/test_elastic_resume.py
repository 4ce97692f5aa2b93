"""A job resumes on another number of devices: the state is re-sharded onto the new mesh and the
data order is the same, so the following losses are the uninterrupted run's (to the float
tolerance of a reduction over another sharding). Fresh processes: the device count is fixed when
JAX starts."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers.cli import FAST
from helpers.toy import set_args, suite_compile_cache_env

# fsdp takes every device present (-1): the parameters and optimizer moments are split over 2, 4
# or 8 devices, so a resume on another count restores them onto another sharding.
ELASTIC = [
    *FAST,
    "model.transformer.num_layers=1",
    "mesh.ici_mesh_shape=(1, -1, 1)",
    "data.batch_size=8",
    "train.eval_every=100",
]


def launch_run(job, devices, *overrides):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "equipax.launch.cli",
            "run",
            "--exp",
            "shakespeare_tiny",
            "--cpu-devices",
            str(devices),
            "--job-log-dir",
            str(job),
            *set_args([*ELASTIC, *overrides]),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **suite_compile_cache_env(), "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def train_losses(job):
    records = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def data_state(job, step):
    return json.loads((job / "checkpoints" / str(step) / "data" / "metadata").read_text())


@pytest.mark.slow
def test_resume_on_fewer_and_more_devices_continues_the_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    launch_run(reference, 4, "train.num_steps=6")
    saved = tmp_path / "saved"
    launch_run(saved, 4, "train.num_steps=4")
    expected = train_losses(reference)
    assert train_losses(saved) == {s: expected[s] for s in range(1, 5)}  # the same program: bit for bit
    for devices in (2, 8):
        job = tmp_path / f"on{devices}"
        shutil.copytree(saved, job)
        out = launch_run(job, devices, "train.num_steps=6")
        (line,) = [ln for ln in out.splitlines() if "Resumed from step 4" in ln]
        assert re.search(
            rf"on {devices} devices in 1 process, mesh fsdp={devices} \(the checkpoint was written on 4 devices in "
            r"1 process, mesh fsdp=4\): state re-sharded onto the new mesh, the data order is unchanged\.",
            line,
        ), line
        losses = train_losses(job)
        assert [losses[s] for s in (5, 6)] == pytest.approx([expected[5], expected[6]], rel=1e-5)
        assert losses[5] != losses[1]  # the run moved on: not the first batch again
        state = data_state(job, 6)
        assert state == data_state(reference, 6) and state["global"]["row"] == 6 * 8, state  # one global cursor
