"""The default experiment shrunk to toy size (seconds on a CPU), shared by CLI and docs tests."""

TOY = [
    "model.vocab_size=384",
    "model.max_seq_len=32",
    "model.transformer.num_layers=2",
    "model.transformer.model_dims=32",
    "model.transformer.num_heads=2",
    "model.transformer.head_dim=16",
    "model.transformer.hidden_dims=64",
    "data.seq_len=32",
    "data.batch_size=4",
    "train.eval_batches=2",
    "train.sample.tokens=8",
    "learner.schedule.warmup_steps=2",
    "learner.schedule.decay_steps=60",
]

# Added after a documented command's own overrides: a few steps, logged and saved.
TOY_SHORT = [*TOY, "train.num_steps=4", "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4"]


# For `*_smoke` experiments, already toy-sized: just a few steps.
SMOKE_SHORT = [
    "train.num_steps=2",
    "train.log_every=1",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.eval_batches=1",
]


def set_args(overrides):
    return [arg for o in overrides for arg in ("--set", o)]


# The image classifiers (cnn_*) shrunk to toy size: seconds on a CPU.
CNN_TOY = [
    "model.stem_channels=8",
    "model.stage_channels=(16, 32)",
    "model.blocks_per_stage=1",
    "model.num_heads=2",
    "model.hidden_dims=32",
    "model.bn_momentum=0.9",
    "model.dropout_rate=0.1",
    "learner.schedule.peak_learning_rate=1e-2",
    "learner.schedule.warmup_steps=5",
    "learner.schedule.decay_steps=90",
]

# Added after a documented cnn_* command's own overrides: one short epoch.
CNN_SHORT = [*CNN_TOY, "train.num_epochs=1", "data.num_train=128", "data.num_test=32", "data.batch_size=32"]


def shared_compile_cache(cache_dir) -> dict:
    """JAX's settings (config names) for a persistent compilation cache in `cache_dir` that several
    processes read and write at once: a maximum size, far above what the suite writes (nothing is
    evicted), which makes JAX read and write each entry under a file lock, so no process reads an
    entry another is still writing. A process killed mid-write (or one under a file-size limit) can
    leave a truncated entry: give such processes a cache of their own.

    Only programs that took at least half a second to compile are written (train and eval steps,
    the multi-device equivalence programs): with a maximum size, every write first lists the whole
    cache and reads each entry's access time, under the lock, so its cost grows with the number of
    entries. Caching every eager op's program too (tens of thousands of sub-second entries by the
    end of a suite) made each write take about half a second: two tests that take 4.5 s with a
    fresh cache took 106 s with 20000 entries in it; their programs recompile in milliseconds."""
    return {
        "jax_compilation_cache_dir": str(cache_dir),
        "jax_compilation_cache_max_size": 64 << 30,
        "jax_persistent_cache_min_compile_time_secs": 0.5,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }


def suite_compile_cache_env() -> dict[str, str]:
    """The environment variables that put a child process on the suite's compile cache
    (tests/conftest.py; empty outside the suite): for children that run to their end (never
    killed, no file-size limit), e.g. `run_with_devices`, `launch_process`."""
    import os

    suite = os.environ.get("EQUIPAX_TEST_DIR")
    if not suite:
        return {}
    return {k.upper(): str(v) for k, v in shared_compile_cache(os.path.join(suite, "compile_cache")).items()}


# XLA:CPU compiling with less LLVM optimisation (several times faster to compile): for children
# that compare two computations compiled alike (sharded == one device, at a tolerance; a resumed
# run == an uninterrupted one), never for numbers checked against values recorded at the default
# level (golden files). The suite now compiles this way everywhere (JAX_DISABLE_MOST_OPTIMIZATIONS,
# set by tests/conftest.py and inherited by children), so these flags only say, where a test passes
# them, that its check does not depend on the level.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def fast_compile_in_process():
    """A context manager: this process's compiles inside it take JAX's cheaper options
    (`jax_disable_most_optimizations`: LLVM at level 0 as `FAST_COMPILE`, and no expensive LLVM
    passes), the setting restored after. `FAST_COMPILE` reaches child processes only (XLA reads
    `XLA_FLAGS` once, when the backend starts); in-process `launch` commands (the CLI tests, the docs'
    commands) check behaviour, not numbers recorded at the default level, so they compile this way:
    a toy `launch run` in-process took 74-80 s against 95-107 s on a loaded 2-core machine (one run of
    each, interleaved). Compiled programs get their own persistent-cache entries (the options are
    part of the key), so nothing compiled at the default level is reused here, nor the reverse."""
    return most_optimizations_disabled(True)


def most_optimizations_disabled(disabled: bool):
    """A context manager: `jax_disable_most_optimizations` set to `disabled` in this process inside
    it, the setting restored after (`fast_compile_in_process`; False: JAX's default options, the
    `xla_default_level` marker of tests/conftest.py)."""
    import contextlib

    @contextlib.contextmanager
    def setting():
        import jax
        from jax._src import compiler

        before = compiler._DISABLE_MOST_OPTIMIZATIONS.value
        jax.config.update("jax_disable_most_optimizations", disabled)
        try:
            yield
        finally:
            jax.config.update("jax_disable_most_optimizations", before)

    return setting()


def with_xla_flags(env: dict, flags: str) -> dict:
    """`env` with `flags` appended to its XLA_FLAGS (those already there kept).

    `FAST_COMPILE` is left out where `env` compiles with JAX's cheaper options
    (`JAX_DISABLE_MOST_OPTIMIZATIONS=1`, the suite's setting): JAX then sets XLA:CPU's LLVM level to
    0 in every compile's options whatever XLA_FLAGS says, so the flag changes no program; but JAX
    hashes XLA_FLAGS' text into each persistent-cache key, and the suite's processes with the flag
    and those without it compiled the same programs once each (a c4_22b_2x_smoke train step in
    three tests: `launch compile`'s budget check, README's 8-device run and the Pax README's)."""
    if env.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1":
        flags = " ".join(f for f in flags.split() if f != FAST_COMPILE)
    return {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {flags}".strip()} if flags else env


def compile_cache_env(cache_dir) -> dict:
    """The environment for `launch` subprocesses that share JAX's persistent compilation cache in
    `cache_dir`: a test that runs the same experiment several times (straight, then stopped and
    resumed, on one host and on several) compiles its programs once. The cached executables are
    the ones compiled, so bit-for-bit comparisons between the runs hold as before. The runs compare
    with each other only, so they compile with `FAST_COMPILE` (the 3-run pipelined resume test:
    26.6-29.6 s of CPU against 32.2-32.6 s)."""
    import os

    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return with_xla_flags(env, FAST_COMPILE)


def persistent_compile_cache(cache_dir):
    """A context manager: JAX's persistent compilation cache on in `cache_dir` for this process (and,
    through the returned env-form settings, for child processes), JAX's settings restored after.
    In-process `launch run`s build fresh jitted functions, so without it each one recompiles."""
    import contextlib

    @contextlib.contextmanager
    def cache():
        import jax
        from jax._src import compilation_cache

        settings = shared_compile_cache(cache_dir)
        before = {k: getattr(jax.config, k) for k in settings}
        for k, v in settings.items():
            jax.config.update(k, v)
        try:
            yield {k.upper(): str(v) for k, v in settings.items()}
        finally:
            for k, v in before.items():
                jax.config.update(k, v)
            compilation_cache.reset_cache()

    return cache()
