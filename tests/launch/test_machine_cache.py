"""The machine's cache (`EQUIPAX_CACHE_DIR`, equipax.launch.store.machine_cache): a fresh job on
the same plays copies the vocabulary trained before and reads the encoded plays; an empty value
turns it off; its default place is under XDG_CACHE_HOME."""

from pathlib import Path

import numpy as np

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
