"""The machine's cache (`EQUIPAX_CACHE_DIR`, equipax.launch.store.machine_cache): a fresh job on
the same plays copies the vocabulary trained before and reads the encoded plays; an empty value
turns it off; its default place is under XDG_CACHE_HOME."""

import sys
from pathlib import Path

import numpy as np
import pytest

from equipax.core.knobs import apply_overrides
from equipax.launch.configs.experiment import as_lm
from equipax.launch.experiments.registry import get_experiment
from equipax.launch.store.machine_cache import cache_root
from equipax.launch.tasks.lm_data import TOKENIZER_FILE, build_lm_inputs, build_tokenizer
from helpers.toy import TOY


def _inputs(job: Path):
    cfg = as_lm(apply_overrides(get_experiment("shakespeare_tiny"), TOY)[0])
    said: list[str] = []
    tok = build_tokenizer(cfg, job, log=said.append)
    inputs = build_lm_inputs(cfg, tok)
    return tok, inputs, said


def test_a_fresh_job_reuses_the_vocabulary_and_tokens_of_an_earlier_one(tmp_path, monkeypatch):
    monkeypatch.setenv("EQUIPAX_CACHE_DIR", str(tmp_path / "cache"))
    _, in1, said1 = _inputs(tmp_path / "one")
    _, in2, said2 = _inputs(tmp_path / "two")
    assert not any("trained on these texts before" in s for s in said1), said1
    assert any(f"copied from {tmp_path / 'cache'} (EQUIPAX_CACHE_DIR)" in s for s in said2), said2
    assert (tmp_path / "one" / TOKENIZER_FILE).read_bytes() == (tmp_path / "two" / TOKENIZER_FILE).read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tokens", "vocabularies"]
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2  # the training and the eval plays
    # The second job's batches are the first's.
    for _ in range(3):
        a, b = in1.train.get_next(), in2.train.get_next()
        for name in a:
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    assert in1.unigram_entropy == in2.unigram_entropy and in1.train_tokens == in2.train_tokens > 0


def test_an_empty_cache_dir_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EQUIPAX_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() is None
    _, _, said1 = _inputs(tmp_path / "one")
    _, _, said2 = _inputs(tmp_path / "two")
    assert not any("before" in s for s in said1 + said2)
    assert not (tmp_path / "xdg").exists()


def test_the_default_place_is_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("EQUIPAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "equipax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "equipax"


@pytest.mark.parametrize("filelock", [True, False], ids=["filelock", "no-filelock"])
def test_compiled_programs_go_to_the_machines_cache_by_default(tmp_path, monkeypatch, filelock):
    """`train.compiler.cache_dir="machine"` (the default): JAX's compilation cache in the machine
    cache's `xla/`, size-limited, where another job finds the programs; the job's own
    `compile_cache/` where the machine's cache is off. JAX's settings are restored after. Without
    the `filelock` package (a TPU image) JAX refuses a size-limited cache: it is then unlimited,
    and works."""
    import importlib.util

    import jax

    from equipax.launch.configs.train import CompilerConfig
    from equipax.launch.training.startup import MACHINE, MACHINE_CACHE_BYTES, compile_cache

    assert CompilerConfig().cache_dir == MACHINE
    # The suite shares one cache through JAX's config, which compile_cache leaves alone: off here.
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    if not filelock:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "filelock" else find_spec(n, *a))
        monkeypatch.setitem(sys.modules, "filelock", None)  # `import filelock` fails, as where it is missing
    shared = jax.config.jax_compilation_cache_dir
    limit = jax.config.values["jax_compilation_cache_max_size"]
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        monkeypatch.setenv("EQUIPAX_CACHE_DIR", str(tmp_path / "machine"))
        with compile_cache(MACHINE, tmp_path / "job") as path:
            assert path == tmp_path / "machine" / "xla"
            want = MACHINE_CACHE_BYTES if filelock else limit
            assert jax.config.values["jax_compilation_cache_max_size"] == want
            jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0)).block_until_ready()
        assert any(p.name.startswith("jit_") for p in path.iterdir()), list(path.iterdir())
        assert jax.config.values["jax_compilation_cache_max_size"] == limit
        monkeypatch.setenv("EQUIPAX_CACHE_DIR", "")
        with compile_cache(MACHINE, tmp_path / "job") as path:
            assert path == tmp_path / "job" / "compile_cache"
    finally:
        jax.config.update("jax_compilation_cache_dir", shared)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    assert not (tmp_path / "job").exists() or not any((tmp_path / "job").iterdir())
