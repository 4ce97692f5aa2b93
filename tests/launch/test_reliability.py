"""Crash safety: partial and damaged checkpoints, and real processes killed (SIGTERM, SIGKILL) and
resumed to the uninterrupted run's bits (the in-graph non-finite skip: tests/core/test_step.py)."""

import jax.numpy as jnp
import numpy as np
import pytest


def _state(value: float):
    return {"w": jnp.full((4, 3), value, jnp.float32), "b": jnp.arange(3, dtype=jnp.float32) + value}


def test_latest_step_ignores_unfinished_saves_and_removes_them(tmp_path):
    from equipax.launch.jobdir.checkpoints import Checkpointer

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    ckpt.save(2, _state(1.0), {"batches": 2})
    ckpt.close()
    # What a save killed half-way leaves: orbax's temporary directory, never renamed.
    partial = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1234567"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "half-written").write_bytes(b"\0" * 10)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    assert ckpt.latest_step() == 2
    found = ckpt.restore_latest(_state(0.0))
    assert found is not None
    step, state, data, loop = found
    assert step == 2 and data == {"batches": 2} and loop == {}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.ones((4, 3), np.float32))
    ckpt.save(4, state, {"batches": 4})
    ckpt.close()
    assert not partial.exists()  # the next run removes what the killed save left
    assert Checkpointer(tmp_path / "checkpoints", keep=3).all_steps() == [2, 4]


@pytest.mark.parametrize("damage", ["garble", "delete-state", "delete-metadata"])
def test_damaged_newest_checkpoint_is_set_aside(tmp_path, damage):
    from equipax.launch.jobdir.checkpoints import Checkpointer

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    ckpt.save(2, _state(1.0), {"batches": 2}, loop_state={"nonfinite_total": 1})
    ckpt.save(4, _state(2.0), {"batches": 4})
    ckpt.close()
    newest = tmp_path / "checkpoints" / "4"
    if damage == "garble":
        for p in (newest / "state").rglob("*"):
            if p.is_file():
                p.write_bytes(b"\0garbage")
    elif damage == "delete-state":
        import shutil

        shutil.rmtree(newest / "state")
    else:
        for p in newest.rglob("*metadata*"):
            if p.is_file():
                p.unlink()
    messages = []
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    found = ckpt.restore_latest(_state(0.0), log=messages.append)
    assert found is not None
    step, state, data, loop = found
    assert step == 2 and data == {"batches": 2} and loop == {"nonfinite_total": 1}
    np.testing.assert_array_equal(np.asarray(state["b"]), np.arange(3, dtype=np.float32) + 1)
    assert len(messages) == 1 and "step 4 does not restore" in messages[0], messages
    assert ckpt.all_steps() == [2]
    assert [p.name[:2] for p in (tmp_path / "corrupt_checkpoints").iterdir()] == ["4-"]
    ckpt.close()


def test_shape_mismatch_is_not_treated_as_damage(tmp_path):
    from equipax.core.knobs import ConfigError
    from equipax.launch.jobdir.checkpoints import Checkpointer

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    ckpt.save(2, _state(1.0), {})
    ckpt.close()
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    with pytest.raises(ConfigError, match="different shapes"):
        ckpt.restore_latest({"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)})
    assert ckpt.all_steps() == [2] and not (tmp_path / "corrupt_checkpoints").exists()
    ckpt.close()


@pytest.mark.slow
def test_killed_and_preempted_runs_resume_bit_for_bit(tmp_path):
    """Real processes: SIGTERM after the first step (exit 75, checkpoint), then SIGKILL at a seeded
    random moment, then a run to the end: its parameters equal an uninterrupted run's bit for bit."""
    from benchmarks.fault_injection import run_trials

    figures = run_trials(
        1,
        seed=3,
        steps=12,
        kills=2,
        tokenizer="byte",
        work=tmp_path,
        signals=["SIGTERM", "SIGKILL"],
        anchored=True,
        first_delay_s=0.0,
        timeout=240,
    )
    kills = figures["records"][0]["kills"]
    assert kills[0]["sent"] and kills[0]["exit"] == 75, kills  # graceful stop after a checkpoint
    assert figures["mismatches"] == 0, figures
    assert figures["corrupt_checkpoints_found"] == 0, figures
