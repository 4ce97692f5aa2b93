"""equipax.data on grain: host disjointness, eval passes, rolling eval, exact resume, custom inputs."""

import json

import numpy as np
import pytest

from equipax.data import (
    BaseInput,
    ByteTokenizer,
    DocumentLMInput,
    MappedInput,
    RollingEvalInput,
    TokenWindowInput,
    make_eval_input,
)
from helpers.inputs import assert_batches_equal, drain

TOK = ByteTokenizer()
DOCS = [f"doc{i:03d} " + "abcdefgh"[: i % 8] * (i % 5 + 1) for i in range(41)]


def doc_input(packing, **kw):
    kw.setdefault("batch_size", 3)
    return DocumentLMInput(DOCS, tokenizer=TOK, seq_len=16, packing=packing, read_threads=0, **kw)


def doc_starts(batches):
    """Document numbers whose first token (after bos) appears in packed rows."""
    found = []
    for b in batches:
        for row, seg, pos in zip(b["ids"], b["segment_ids"], b["positions"]):
            for s in np.unique(seg[seg > 0]):
                piece = row[seg == s]
                if pos[seg == s][0] == 0 and piece[0] == TOK.bos_id and len(piece) >= 7:
                    found.append(int(TOK.decode(piece[:7])[3:6]))
    return found


def test_four_hosts_disjoint_within_an_epoch():
    hosts, n = 4, len(DOCS)
    firsts, seen = [], []
    for h in range(hosts):
        inp = doc_input(False, num_infeed_hosts=hosts, infeed_host_index=h, seed=5)
        batches = drain(inp, 3)  # 9 rows <= 10 documents per host
        firsts.append(batches[0]["ids"])
        ids = np.concatenate([b["example_id"] for b in batches]).tolist()
        assert len(set(ids)) == len(ids)
        seen.append(set(ids))
    for a in range(hosts):
        for b in range(a + 1, hosts):
            assert not np.array_equal(firsts[a], firsts[b])
            assert not seen[a] & seen[b], (a, b)
    # One shared shuffle: the hosts' whole first epochs partition the documents.
    epoch = []
    for h in range(hosts):
        inp = doc_input(False, num_infeed_hosts=hosts, infeed_host_index=h, seed=5, batch_size=1)
        epoch += [int(b["example_id"][0]) for b in drain(inp, len(range(h, n, hosts)))]
    assert sorted(epoch) == list(range(n))
    assert epoch[:5] != [0, 4, 8, 12, 16]  # shuffled


def test_four_hosts_packed_disjoint():
    starts = []
    for h in range(4):
        inp = doc_input(True, num_infeed_hosts=4, infeed_host_index=h, seed=5)
        starts.append(set(doc_starts(drain(inp, 2))))
        assert starts[-1]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not starts[a] & starts[b]


@pytest.mark.parametrize("packing", [False, True])
def test_eval_pass_exactly_once_equal_batch_counts(packing):
    hosts = 4
    counts, real_tokens, example_ids = [], [], []
    for h in range(hosts):
        inp = doc_input(packing, num_infeed_hosts=hosts, infeed_host_index=h, repeat=False)
        batches = drain(inp)
        counts.append(len(batches))
        assert len(batches) == inp.num_batches
        with pytest.raises(StopIteration):
            inp.get_next()
        for b in batches:
            assert b["ids"].shape == (3, 16)
            w = b["weights"]
            assert set(np.unique(w).tolist()) <= {0.0, 1.0}
            assert (b["labels"][w == 0] == TOK.pad_id).all()
            if packing:
                assert ((b["segment_ids"] > 0) == (w > 0)).all()
                real_tokens.append(b["labels"][w > 0])
            else:
                real = b["example_id"] >= 0
                assert (w[~real] == 0).all() and (w[real].sum(axis=1) > 0).all()
                example_ids += b["example_id"][real].tolist()
        inp.reset()
        assert_batches_equal(drain(inp), batches)
    assert len(set(counts)) == 1
    if packing:
        # Every document's tokens appear exactly once over all hosts (as targets: text + eos).
        expected = sum(len(TOK.encode(d)) + 1 for d in DOCS)
        assert sum(len(t) for t in real_tokens) == expected
        assert np.concatenate(real_tokens).tolist().count(TOK.eos_id) == len(DOCS)
    else:
        assert sorted(example_ids) == list(range(len(DOCS)))


def test_eval_padding_does_not_change_metrics():
    batches = drain(doc_input(False, repeat=False, batch_size=4))  # 41 documents: 3 padding rows
    assert sum(int((b["example_id"] < 0).sum()) for b in batches) == 3
    table = np.random.default_rng(0).random(TOK.vocab_size)  # a stand-in per-token loss

    def weighted_mean(bs):
        return sum(float((table[b["labels"]] * b["weights"]).sum()) for b in bs) / sum(
            float(b["weights"].sum()) for b in bs
        )

    real_rows = [{k: v[b["example_id"] >= 0] for k, v in b.items()} for b in batches]
    scrambled = [dict(b, labels=np.where(b["weights"] > 0, b["labels"], 7)) for b in batches]
    assert weighted_mean(batches) == pytest.approx(weighted_mean(real_rows))
    assert weighted_mean(batches) == pytest.approx(weighted_mean(scrambled))


@pytest.mark.parametrize("packing", [False, True])
def test_mid_epoch_checkpoint_restore_gives_same_next_batches(packing):
    kw = dict(num_infeed_hosts=2, infeed_host_index=1, seed=9)
    original = doc_input(packing, **kw)
    drain(original, 5)
    state = json.loads(json.dumps(original.get_state()))
    expected = drain(original, 8)
    resumed = doc_input(packing, **kw)
    resumed.set_state(state)
    assert_batches_equal(drain(resumed, 8), expected)
    assert resumed.get_state() == original.get_state()
    with pytest.raises(ValueError, match="get_state"):
        resumed.set_state({"epoch": 0})


def test_threaded_reading_matches_inline():
    a = drain(doc_input(True, seed=2), 6)
    b = drain(DocumentLMInput(DOCS, tokenizer=TOK, seq_len=16, batch_size=3, seed=2, read_threads=2), 6)
    assert_batches_equal(a, b)


def test_rolling_eval_continues_across_runs():
    source = TokenWindowInput(np.arange(2000, dtype=np.int32) % 200, seq_len=8, batch_size=2, seed=1)
    reference = drain(TokenWindowInput(np.arange(2000, dtype=np.int32) % 200, seq_len=8, batch_size=2, seed=1), 9)
    rolling = make_eval_input(source, reset_for_eval=False, num_batches=3)
    assert isinstance(rolling, RollingEvalInput)
    runs = []
    for _ in range(3):
        rolling.reset()  # what the loop does before every eval run: must not rewind
        runs += drain(rolling)
        assert len(runs) % 3 == 0
    assert_batches_equal(runs, reference)
    state = json.loads(json.dumps(rolling.get_state()))
    again = RollingEvalInput(
        TokenWindowInput(np.arange(2000, dtype=np.int32) % 200, seq_len=8, batch_size=2, seed=1), 3
    )
    again.set_state(state)
    again.reset()
    rolling.reset()
    assert_batches_equal(drain(again), drain(rolling))


def test_invalid_eval_combinations_fail_with_a_message():
    repeating = doc_input(False)
    one_pass = doc_input(False, repeat=False)
    with pytest.raises(ValueError, match="repeat=False"):
        make_eval_input(repeating, reset_for_eval=True, num_batches=0)
    with pytest.raises(ValueError, match="eval_loop_num_batches"):
        make_eval_input(repeating, reset_for_eval=False, num_batches=0)
    with pytest.raises(ValueError, match="repeating input"):
        make_eval_input(one_pass, reset_for_eval=False, num_batches=2)
    assert make_eval_input(one_pass, reset_for_eval=True, num_batches=0) is one_pass


class UpperCaseInput(TokenWindowInput):
    """The Pax pattern: subclass and post-process `get_next`."""

    def get_next(self):
        batch = super().get_next()
        batch["ids"] = np.where((batch["ids"] >= 97) & (batch["ids"] <= 122), batch["ids"] - 32, batch["ids"])
        return batch


def test_custom_inputs_subclass_and_wrapper():
    stream = np.asarray(TOK.encode("to be or not to be, that is the question. " * 20), np.int32)
    plain = TokenWindowInput(stream, seq_len=12, batch_size=2, seed=3, tokenizer=TOK)
    sub = UpperCaseInput(stream, seq_len=12, batch_size=2, seed=3, tokenizer=TOK)
    b, s = plain.get_next(), sub.get_next()
    assert [t.upper() for t in plain.ids_to_strings(b["ids"])] == sub.ids_to_strings(s["ids"])

    def add_loss_scale(batch):
        return dict(batch, weights=batch["weights"] * 0.5, doubled=batch["ids"] * 2)

    wrapped = MappedInput(TokenWindowInput(stream, seq_len=12, batch_size=2, seed=3, tokenizer=TOK), add_loss_scale)
    assert isinstance(wrapped, BaseInput) and wrapped.seq_len == 12
    first = drain(wrapped, 3)
    np.testing.assert_array_equal(first[0]["doubled"], b["ids"] * 2)
    assert (first[0]["weights"] == 0.5).all()
    state = wrapped.get_state()
    after = drain(wrapped, 2)
    wrapped.set_state(state)
    assert_batches_equal(drain(wrapped, 2), after)
    bad = MappedInput(plain, lambda batch: {"ids": batch["ids"][:1]})
    with pytest.raises(ValueError, match="leading per-host batch"):
        bad.get_next()


def test_image_input_epochs_padding_and_resume():
    from equipax.data import ImageClassificationInput, split_digits, synthetic_images

    x, y = synthetic_images(10, image_size=4, channels=1, seed=0)
    train = ImageClassificationInput(x, y, batch_size=4, seed=1)
    assert train.steps_per_epoch == 2  # 10 // 4: the remainder is dropped
    seen = [train.get_next()["labels"] for _ in range(4)]
    state = train.get_state()
    nxt = train.get_next()
    again = ImageClassificationInput(x, y, batch_size=4, seed=1)
    again.set_state(state)
    np.testing.assert_array_equal(again.get_next()["images"], nxt["images"])
    assert len(seen) == 4
    test = ImageClassificationInput(x, y, batch_size=4, repeat=False, shuffle=False)
    batches = list(test)
    assert len(batches) == 3 and batches[-1]["weights"].tolist() == [1, 1, 0, 0]
    (tr_x, tr_y), (te_x, _) = split_digits(0.2, seed=0)
    assert tr_x.shape == (1438, 8, 8, 1) and te_x.shape == (359, 8, 8, 1)
    assert tr_x.min() >= 0.0 and tr_x.max() <= 1.0 and set(np.unique(tr_y)) == set(range(10))
    (_, tr_y2), _ = split_digits(0.2, seed=0)
    np.testing.assert_array_equal(tr_y, tr_y2)  # a fixed split
