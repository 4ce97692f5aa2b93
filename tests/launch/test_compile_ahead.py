"""A run compiles its train step, eval step and checkpoint checksums on a background thread
(`equipax.launch.training.ahead`): the main thread, which initialises the state meanwhile and then
trains, evaluates and saves, compiles none of them itself."""

import json
import threading

from helpers.cli import FAST

# The programs compiled ahead, as JAX names them in its compile events.
AHEAD = {"jit(train_step)", "jit(eval_step)", "jit(_checksums)"}


def test_the_first_step_eval_and_checkpoint_compile_nothing_on_the_main_thread(tmp_path, monkeypatch):
    import jax

    from equipax.core.knobs import apply_overrides
    from equipax.launch.aot.compile_events import BACKEND_COMPILE
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.jobdir import checksums
    from equipax.launch.training.loop import run_experiment

    # The checksums by their device program (what an accelerator runs), not numpy.
    monkeypatch.setattr(checksums, "HOST_CHECKSUM_MAX_BYTES", 0)
    compiled: list[tuple[str, bool]] = []  # (program, on the main thread)

    def listen(event: str, duration: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE:
            compiled.append((str(kwargs.get("fun_name")), threading.current_thread() is threading.main_thread()))

    cfg, _ = apply_overrides(
        get_experiment("shakespeare_tiny"),
        [*FAST, "train.num_steps=2", "train.eval_every=2", "train.compiler.cache_dir="],
    )
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = run_experiment(cfg, job_dir=tmp_path / "job")
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    background = {name for name, main in compiled if not main}
    on_main = {name for name, main in compiled if main}
    assert background >= AHEAD and not AHEAD & on_main, compiled
    # ... and the run is the run: evaluated, saved, its digest the saved checkpoint's.
    assert result.final_eval_loss is not None
    assert json.loads((tmp_path / "job" / "result.json").read_text())["state_digest"] == result.state_digest
