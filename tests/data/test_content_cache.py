"""equipax.data.ContentCache: results kept by a digest of their inputs, checked on every read; the
vocabularies and token streams kept there equal the ones computed afresh."""

import numpy as np
import pytest

from equipax.data import ContentCache, SentencePieceTokenizer, build_lm_texts_tokens, content_key, load_plays


def test_a_kept_payload_reads_back_and_a_damaged_one_reads_as_absent(tmp_path):
    cache = ContentCache(tmp_path / "kind")
    assert cache.get("k") is None
    assert cache.put("k", b"payload bytes")
    assert cache.get("k") == b"payload bytes"
    assert cache.put("empty", b"") and cache.get("empty") == b""

    # One flipped bit, a truncation, a file shorter than its checksum: absent, and removed.
    data = bytearray(cache.path("k").read_bytes())
    data[3] ^= 1
    cache.path("k").write_bytes(bytes(data))
    assert cache.get("k") is None and not cache.path("k").exists()
    cache.put("k", b"payload bytes")
    cache.path("k").write_bytes(cache.path("k").read_bytes()[:-1])
    assert cache.get("k") is None
    cache.path("short").write_bytes(b"abc")
    assert cache.get("short") is None and not cache.path("short").exists()
    assert [p.name for p in (tmp_path / "kind").iterdir()] == ["empty"]  # no temporary files left


def test_a_file_in_place_of_the_directory_keeps_nothing_and_raises_nothing(tmp_path):
    (tmp_path / "kind").write_text("not a directory")
    cache = ContentCache(tmp_path / "kind")
    assert not cache.put("k", b"x")
    assert cache.get("k") is None


def test_content_keys_tell_apart_every_different_sequence_of_parts():
    keys = {
        content_key("ab", "c"),
        content_key("a", "bc"),
        content_key(["ab", "c"]),
        content_key(["a", "bc"]),
        content_key(["abc"]),
        content_key("abc"),
        content_key(b"abc"),
        content_key(["ab"], ["c"]),
        content_key(1, "2"),
        content_key("1", "2"),
    }
    assert len(keys) == 10
    assert content_key("a", ["b", "c"], 3) == content_key("a", iter(["b", "c"]), 3)


@pytest.fixture(scope="module")
def plays():
    p = load_plays()
    return [p["macbeth"], p["the-tempest"]], [p["hamlet"]]


def test_a_vocabulary_from_the_cache_is_the_one_training_writes(tmp_path, plays):
    texts, other = plays
    cache = ContentCache(tmp_path / "vocabularies")
    fresh = SentencePieceTokenizer.train(texts, vocab_size=400, model_path=tmp_path / "fresh.model")
    first = SentencePieceTokenizer.train(texts, vocab_size=400, model_path=tmp_path / "a.model", cache=cache)
    again = SentencePieceTokenizer.train(texts, vocab_size=400, model_path=tmp_path / "b.model", cache=cache)
    assert not fresh.from_cache and not first.from_cache and again.from_cache
    model = (tmp_path / "fresh.model").read_bytes()
    assert (tmp_path / "a.model").read_bytes() == model == (tmp_path / "b.model").read_bytes()
    assert again.encode(texts[0][:500]) == fresh.encode(texts[0][:500])

    # Other texts, another size, another cap on the lines: trained, not the kept model.
    for kwargs in (
        dict(texts=other, vocab_size=400),
        dict(texts=texts, vocab_size=420),
        dict(texts=texts, vocab_size=400, max_sentences=1000),
    ):
        tok = SentencePieceTokenizer.train(model_path=tmp_path / "c.model", cache=cache, **kwargs)  # type: ignore[arg-type]
        assert not tok.from_cache, kwargs
        assert (tmp_path / "c.model").read_bytes() != model
    assert len(list((tmp_path / "vocabularies").iterdir())) == 4


def test_a_token_stream_from_the_cache_is_the_one_encoding_gives(tmp_path, plays):
    texts, other = plays
    cache = ContentCache(tmp_path / "tokens")
    a = SentencePieceTokenizer.train(texts, vocab_size=400, model_path=tmp_path / "a.model")
    b = SentencePieceTokenizer.train(texts, vocab_size=420, model_path=tmp_path / "b.model")
    expected = build_lm_texts_tokens(texts, a)
    first = build_lm_texts_tokens(iter(texts), a, cache=cache)
    kept = build_lm_texts_tokens(texts, a, cache=cache)
    assert kept.dtype == np.int32 and kept.flags.writeable
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(kept, expected)
    assert len(list((tmp_path / "tokens").iterdir())) == 1
    # Another vocabulary or other texts: encoded afresh, never the kept stream.
    np.testing.assert_array_equal(build_lm_texts_tokens(texts, b, cache=cache), build_lm_texts_tokens(texts, b))
    np.testing.assert_array_equal(build_lm_texts_tokens(other, a, cache=cache), build_lm_texts_tokens(other, a))
    assert len(list((tmp_path / "tokens").iterdir())) == 3
