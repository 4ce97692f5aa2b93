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
    expected = train_losses(reference)
    for devices in (2, 8):
        # The uninterrupted run's job as a run killed right after its checkpoint of step 4 left it
        # (the checkpoint of step 6 and result.json gone; a resumed run drops the records written
        # after step 4): the 4-device checkpoint of step 4, without a second 4-device run to write it.
        job = tmp_path / f"on{devices}"
        shutil.copytree(reference, job)
        shutil.rmtree(job / "checkpoints" / "6")
        (job / "result.json").unlink()
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


def test_host_rows_must_be_the_contiguous_block_the_input_reads():
    """The batch sharding decides which rows of a global batch, and which positions of each
    sequence, a process's devices hold; the input of infeed host h reads rows [h * b, (h + 1) * b)
    and the process places the positions its `HostInfeed` names. Anything else is refused."""
    from types import SimpleNamespace

    import numpy as np

    from equipax.core.infeed import HostInfeed
    from equipax.core.knobs import ConfigError
    from equipax.launch.program.program import Program, check_host_rows

    class Placed(Program):  # what check_host_rows reads of a process's program on a 4-device mesh
        def __init__(self, blocks, infeed):
            sharding = SimpleNamespace(
                addressable_devices_indices_map=lambda shape: {
                    d: (slice(*r), slice(*p)) for d, (r, p) in enumerate(blocks)
                }
            )
            for name, value in dict(
                batch_sharding=sharding, mesh=SimpleNamespace(shape={"data": 4}), infeed=infeed
            ).items():
                object.__setattr__(self, name, value)

        def abstract_batch(self):
            return {"ids": np.zeros((8, 4))}

    def training(*blocks, infeed):  # blocks: (rows, positions) each device holds
        return Placed(blocks, infeed)

    infeed, every = HostInfeed(num_infeed_hosts=2, infeed_host_index=1), (0, 4)  # every position
    host1 = SimpleNamespace(infeed_host_index=1, num_infeed_hosts=2, batch_size=4)
    check_host_rows(training(((4, 6), every), ((6, 8), every), infeed=infeed), host1)  # two devices, one block
    with pytest.raises(ConfigError, match="holds 4 rows from 2 to 7 .* but its input reads rows 4 to 7"):
        check_host_rows(training(((2, 4), every), ((6, 8), every), infeed=infeed), host1)
    # The second host of a context group: every row, the second half of each sequence.
    group = HostInfeed(1, 0, hosts_per_index=2, leads_index=False, seq_blocks=(1, 2), num_seq_blocks=2)
    reader = SimpleNamespace(infeed_host_index=0, num_infeed_hosts=1, batch_size=8)
    check_host_rows(training(((0, 8), (2, 4)), infeed=group), reader)
    with pytest.raises(ConfigError, match="holds positions 0 to 1 of each sequence .* would place positions 2 to 3"):
        check_host_rows(training(((0, 8), (0, 2)), infeed=group), reader)
    # Its input built with the process index and count instead of the mesh's.
    by_process = SimpleNamespace(infeed_host_index=1, num_infeed_hosts=2, batch_size=4)
    with pytest.raises(ConfigError, match=r"holds 8 rows from 0 to 7 .* reads rows 4 to 7 .*infeed_host_index=0, num"):
        check_host_rows(training(((0, 8), (2, 4)), infeed=group), by_process)


def test_the_hosts_of_a_context_group_count_what_they_read_once():
    """The hosts of one context group read the same rows: only the first of them adds its input's
    counters (data_* in the train records) to the sum over processes."""
    from types import SimpleNamespace

    from equipax.core.infeed import HostInfeed
    from equipax.launch.training.train_log import StepTimer, TrainLog

    def counted(infeed):
        run = SimpleNamespace(
            cfg=SimpleNamespace(train=SimpleNamespace(log_every=1)),
            total=1,
            training=SimpleNamespace(infeed=infeed),
            inputs=SimpleNamespace(
                train=SimpleNamespace(counters=lambda: {"tokens": 12}, counter_metrics=lambda t: dict(t))
            ),
        )
        log = TrainLog.__new__(TrainLog)  # a stand-in run, as in test_moe_experiments
        log.run, log.timer, log.pending = run, StepTimer(0), None  # pyright: ignore[reportAttributeAccessIssue]
        log.after_dispatch(1, {}, stopping=False)
        assert log.pending is not None
        return log.pending[2]

    assert counted(HostInfeed(1, 0, hosts_per_index=2, leads_index=True)) == {"tokens": 12}
    assert counted(HostInfeed(1, 0, hosts_per_index=2, leads_index=False)) == {"tokens": 0}


def test_a_data_state_that_does_not_fit_is_refused_or_with_the_flag_a_new_order():
    import numpy as np

    from equipax.core.knobs import ConfigError
    from equipax.data import TokenWindowInput
    from equipax.launch.training.resume_checks import restore_data_state

    inp = TokenWindowInput(np.arange(400, dtype=np.int32), seq_len=7, batch_size=2)
    inp.get_next()
    good = {"global": inp.get_state()}
    old = {"hosts": [{"epoch": 0, "position": 2}]}  # a per-host state of an earlier version
    fresh = TokenWindowInput(np.arange(400, dtype=np.int32), seq_len=7, batch_size=2)
    notes = []
    assert not restore_data_state(fresh, good, moved=False, allow_new_data_order=False, log=notes.append)
    assert fresh.get_state() == inp.get_state()
    with pytest.raises(ConfigError, match="per-host positions.*--allow-new-data-order"):
        restore_data_state(fresh, old, moved=False, allow_new_data_order=False, log=notes.append)
    start = TokenWindowInput(np.arange(400, dtype=np.int32), seq_len=7, batch_size=2)
    assert restore_data_state(start, old, moved=True, allow_new_data_order=True, log=notes.append)
    assert start.get_state()["row"] == 0 and "The data starts a new order" in notes[-1]
