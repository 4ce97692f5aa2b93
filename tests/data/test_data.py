"""equipax.data: tokenizers, the Shakespeare source and LM inputs (Pax input semantics)."""

import json

import numpy as np
import pytest

from equipax.data import (
    ByteTokenizer,
    SentencePieceTokenizer,
    SyntheticLMInput,
    TokenWindowInput,
    build_lm_texts_tokens,
    list_plays,
    load_plays,
    split_plays,
    unigram_entropy,
)
from helpers.inputs import assert_batches_equal, drain

ODD_TEXT = "  Héllo,\tworld!  ✓ 日本語 🎭\n\nO Romeo, Romeo!  wherefore art thou Romeo?\n"


# --- tokenizers ---------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(ODD_TEXT)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == ODD_TEXT
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == ODD_TEXT
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert max(tok.pad_id, tok.bos_id, tok.eos_id) == tok.vocab_size - 1
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])


@pytest.fixture(scope="module")
def small_plays():
    plays = load_plays()
    return [plays["macbeth"], plays["the-tempest"]]


def test_sentencepiece_train_save_load_round_trip(tmp_path, small_plays):
    path = tmp_path / "sub" / "spm.model"
    tok = SentencePieceTokenizer.train(small_plays, vocab_size=512, model_path=path)
    assert path.is_file()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (512, 0, 2, 3)
    loaded = SentencePieceTokenizer.load(path)
    for text in [ODD_TEXT, small_plays[0][:2000], "", "x"]:
        ids = loaded.encode(text)
        assert loaded.decode(ids) == text
        assert ids == tok.encode(text)
    # Learned pieces actually compress English (not just byte fallback).
    sample = small_plays[1][:5000]
    assert len(loaded.encode(sample)) < 0.6 * len(sample.encode("utf-8"))
    assert loaded.decode([loaded.bos_id, *loaded.encode("to be"), loaded.eos_id, 0]) == "to be"


def test_sentencepiece_training_is_deterministic(tmp_path, small_plays):
    a = SentencePieceTokenizer.train(small_plays, vocab_size=400, model_path=tmp_path / "a.model")
    b = SentencePieceTokenizer.train(small_plays, vocab_size=400, model_path=tmp_path / "b.model")
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert a.encode(small_plays[0][:3000]) == b.encode(small_plays[0][:3000])


def test_sentencepiece_errors(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match="nope.model"):
        SentencePieceTokenizer.load(missing)
    with pytest.raises(ValueError, match="vocab_size"):
        SentencePieceTokenizer.train(["abc"], vocab_size=100, model_path=missing)
    with pytest.raises(ValueError, match="no non-empty lines"):
        SentencePieceTokenizer.train(["", "  \n"], vocab_size=300, model_path=missing)
    with pytest.raises(ValueError, match="Increase vocab_size"):  # more distinct chars than room
        SentencePieceTokenizer.train(
            [ODD_TEXT + "".join(map(chr, range(0x4E00, 0x4E60)))], vocab_size=300, model_path=missing
        )


# --- Shakespeare --------------------------------------------------------------------------


def test_shakespeare_plays_found_and_cleaned():
    names = list_plays()
    assert len(names) == 38
    assert names == sorted(names)
    assert {"hamlet", "king-lear", "the-tempest"} <= set(names)
    hamlet = load_plays()["hamlet"]
    assert "Who's there?" in hamlet
    assert "BERNARDO\nWho's there?" in hamlet
    for mark in ("**", "_", "#", "  \n", "\\["):
        assert mark not in hamlet, mark
    raw = load_plays(clean=False)["hamlet"]
    assert raw.startswith("# Hamlet") and "**BERNARDO**" in raw


def test_shakespeare_split_is_disjoint():
    train, val = split_plays(["hamlet", "macbeth"])
    assert set(val) == {"hamlet", "macbeth"}
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(list_plays())


def test_shakespeare_unknown_play_lists_close_names():
    with pytest.raises(ValueError, match="hamlet") as err:
        split_plays(["hamlett"])
    assert "Unknown play 'hamlett'" in str(err.value)
    with pytest.raises(ValueError, match="sequence of play names"):
        split_plays("hamlet")
    with pytest.raises(ValueError, match="at least one"):
        split_plays(list_plays())


# --- TokenWindowInput ----------------------------------------------------------------------

SEQ = 8


def window_input(num_windows=50, **kw):
    tokens = np.arange(num_windows * (SEQ + 1) + 3, dtype=np.int32) % 1000
    kw.setdefault("batch_size", 4)
    return TokenWindowInput(tokens, seq_len=SEQ, **kw)


def test_token_window_shapes_and_labels():
    inp = window_input()
    batch = inp.get_next()
    assert batch["ids"].shape == (4, SEQ) and batch["ids"].dtype == np.int32
    assert batch["labels"].shape == (4, SEQ) and batch["labels"].dtype == np.int32
    assert batch["weights"].shape == (4, SEQ) and batch["weights"].dtype == np.float32
    assert batch["example_id"].shape == (4,) and batch["example_id"].dtype == np.int64
    np.testing.assert_array_equal(batch["labels"][:, :-1], batch["ids"][:, 1:])
    # Window i starts at token i * (SEQ + 1) of the stream (tokens are their own positions).
    np.testing.assert_array_equal(batch["ids"][:, 0], batch["example_id"] * (SEQ + 1))
    np.testing.assert_array_equal(batch["labels"][:, -1], batch["example_id"] * (SEQ + 1) + SEQ)
    assert (batch["weights"] == 1).all()
    assert inp.global_batch_size == 4


def test_token_window_hosts_disjoint_and_cover_each_epoch():
    hosts, num_windows, per_host = 3, 50, 4
    inputs = [
        window_input(num_windows, num_infeed_hosts=hosts, infeed_host_index=h, batch_size=per_host, seed=7)
        for h in range(hosts)
    ]
    firsts = [inp.get_next() for inp in inputs]
    assert not np.array_equal(firsts[0]["ids"], firsts[1]["ids"])
    # Host h reads rows [4h, 4h + 4) of the global order: the hosts' rows of one batch are disjoint,
    # and the whole epoch (read as global batches) covers every window exactly once.
    order = window_input(num_windows, seed=7).window_order(0)
    for h, b in enumerate(firsts):
        assert b["example_id"].tolist() == order[per_host * h : per_host * (h + 1)].tolist()
    assert sorted(order.tolist()) == list(range(num_windows))
    seen = np.concatenate([b["example_id"] for b in firsts])
    for _ in range(3):
        seen = np.concatenate([seen, *[inp.get_next()["example_id"] for inp in inputs]])
    assert len(set(seen.tolist())) == len(seen) == 48  # 4 global batches of 12 < 50 windows: no repeat
    assert {inp.get_state()["row"] for inp in inputs} == {48}


def test_token_window_epochs_reshuffle_and_seed_matters():
    inp = window_input(12, batch_size=4, seed=1)
    epochs = [np.concatenate([b["example_id"] for b in drain(inp, 3)]) for _ in range(3)]
    for e in epochs:
        assert sorted(e.tolist()) == list(range(12))
    assert not np.array_equal(epochs[0], epochs[1])
    other = window_input(12, batch_size=4, seed=2).get_next()["example_id"]
    assert not np.array_equal(other, epochs[0][:4])


def test_token_window_batches_cross_epoch_boundary():
    inp = window_input(5, batch_size=4)
    ids = np.concatenate([b["example_id"] for b in drain(inp, 5)])  # 20 examples = 4 epochs
    for e in range(4):
        assert sorted(ids[5 * e : 5 * e + 5].tolist()) == list(range(5))


def test_token_window_eval_pass():
    hosts, num_windows = 3, 23  # a global batch of 15: 2 batches, the last 7 rows padding
    per_host = []
    for h in range(hosts):
        inp = window_input(num_windows, num_infeed_hosts=hosts, infeed_host_index=h, batch_size=5, repeat=False)
        assert inp.num_batches == 2
        batches = drain(inp)
        assert len(batches) == 2
        with pytest.raises(StopIteration):
            inp.get_next()
        for b in batches:
            real = b["example_id"] >= 0
            assert (b["weights"][real] == 1).all() and (b["weights"][~real] == 0).all()
        per_host.append(batches)
        inp.reset()
        assert_batches_equal(drain(inp), batches)
    # The global batches read the windows in order, once; padding at the end of the pass.
    ids = np.concatenate([per_host[h][n]["example_id"] for n in range(2) for h in range(hosts)])
    assert ids.tolist() == list(range(num_windows)) + [-1] * 7


def test_eval_host_with_no_real_examples_still_emits_padded_batches():
    inp = window_input(2, num_infeed_hosts=3, infeed_host_index=2, batch_size=2, repeat=False)
    (batch,) = drain(inp)
    assert (batch["weights"] == 0).all() and (batch["example_id"] == -1).all()


@pytest.mark.parametrize("repeat", [True, False])
def test_token_window_state_resume_is_exact(repeat):
    kw = dict(num_windows=30, num_infeed_hosts=2, infeed_host_index=1, batch_size=4, seed=3, repeat=repeat)
    original = window_input(**kw)
    drain(original, 2 if not repeat else 5)
    state = json.loads(json.dumps(original.get_state()))
    expected = drain(original, 6)
    resumed = window_input(**kw)
    resumed.set_state(state)
    assert_batches_equal(drain(resumed, 6), expected)
    assert resumed.get_state() == original.get_state()


def test_token_window_bad_arguments():
    with pytest.raises(ValueError, match="infeed_host_index"):
        window_input(num_infeed_hosts=2, infeed_host_index=2)
    with pytest.raises(ValueError, match="infeed_host_index"):
        window_input(infeed_host_index=-1)
    with pytest.raises(ValueError, match="batch_size"):
        window_input(batch_size=0)
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindowInput(np.arange(100, dtype=np.int32), seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match="fewer than one window"):
        TokenWindowInput(np.arange(5, dtype=np.int32), seq_len=8, batch_size=1)
    inp = window_input()
    with pytest.raises(ValueError, match="get_state"):
        inp.set_state({"epoch": 0, "position": 1})
    with pytest.raises(ValueError, match="not the start of a global batch"):
        inp.set_state(dict(inp.get_state(), row=3))


# --- helpers and ids_to_strings ------------------------------------------------------------


def test_text_tokens_entropy_and_ids_to_strings():
    tok = ByteTokenizer()
    docs = ["To be, or not to be", "that is the question"]
    stream = build_lm_texts_tokens(docs, tok)
    assert stream.dtype == np.int32
    assert stream.tolist() == [*tok.encode(docs[0]), tok.eos_id, *tok.encode(docs[1]), tok.eos_id]
    inp = TokenWindowInput(stream, seq_len=9, batch_size=2, repeat=False, tokenizer=tok)
    batch = inp.get_next()
    assert inp.ids_to_strings(batch["ids"]) == [docs[0][:9], docs[0][10:19]]
    assert inp.ids_to_strings(batch["ids"], lengths=[2, 0]) == ["To", ""]
    assert unigram_entropy(np.array([0, 1, 0, 1]), 4) == pytest.approx(np.log(2))
    assert unigram_entropy(np.array([5, 5, 5]), 6) == 0.0
    assert 0 < unigram_entropy(stream, tok.vocab_size) < np.log(tok.vocab_size)
    with pytest.raises(ValueError, match="vocab_size"):
        unigram_entropy(np.array([7]), 4)


# --- SyntheticLMInput ----------------------------------------------------------------------


def test_synthetic_deterministic_host_dependent_and_resumable():
    kw = dict(vocab_size=50, seq_len=16, batch_size=3, num_infeed_hosts=2, seed=0)
    a = drain(SyntheticLMInput(infeed_host_index=0, **kw), 4)
    assert_batches_equal(a, drain(SyntheticLMInput(infeed_host_index=0, **kw), 4))
    b = drain(SyntheticLMInput(infeed_host_index=1, **kw), 4)
    assert not np.array_equal(a[0]["ids"], b[0]["ids"])
    assert not set(a[0]["example_id"].tolist()) & set(b[0]["example_id"].tolist())
    assert not np.array_equal(a[0]["ids"], a[1]["ids"])
    assert a[0]["ids"].max() < 50 and a[0]["ids"].dtype == np.int32
    np.testing.assert_array_equal(a[0]["labels"][:, :-1], a[0]["ids"][:, 1:])
    other_seed = SyntheticLMInput(infeed_host_index=0, **{**kw, "seed": 1}).get_next()
    assert not np.array_equal(other_seed["ids"], a[0]["ids"])
    resumed = SyntheticLMInput(infeed_host_index=0, **kw)
    resumed.set_state({"step": 2})
    assert_batches_equal(drain(resumed, 2), a[2:])
    assert SyntheticLMInput(infeed_host_index=0, **kw).ids_to_strings(a[0]["ids"][:1, :2]) == [
        " ".join(map(str, a[0]["ids"][0, :2].tolist()))
    ]


def test_synthetic_eval_stops_and_resets():
    inp = SyntheticLMInput(vocab_size=10, seq_len=4, batch_size=2, repeat=False, num_batches=3)
    first = drain(inp)
    assert len(first) == 3
    inp.reset()
    assert_batches_equal(drain(inp), first)
    with pytest.raises(ValueError, match="num_batches"):
        SyntheticLMInput(vocab_size=10, seq_len=4, batch_size=2, repeat=False)
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticLMInput(vocab_size=0, seq_len=4, batch_size=2)
