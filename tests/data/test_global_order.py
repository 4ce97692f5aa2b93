"""The global data order: the same global batches, packing included, at any number of hosts.

S simulated hosts are S inputs in one process with `infeed_host_index` 0..S-1; their per-host
batches, concatenated in host order, are the global batch the mesh would see.
"""

import json

import numpy as np
import pytest

from equipax.data import ByteTokenizer, DocumentLMInput, SyntheticLMInput, TokenWindowInput
from equipax.data.documents import packed_row_spans
from helpers.inputs import assert_batches_equal, drain

TOK = ByteTokenizer()
SEQ = 16
# Lengths 3..60 tokens: many documents are longer than a row of 16, some span four rows.
DOCS = [f"d{i:02d}" + "xyzw"[i % 4] * ((i * 7) % 53) for i in range(37)]
GLOBAL = 8


def documents(hosts, index, packing, repeat=True, docs=DOCS, global_batch=GLOBAL):
    return DocumentLMInput(
        docs,
        tokenizer=TOK,
        seq_len=SEQ,
        packing=packing,
        batch_size=global_batch // hosts,
        num_infeed_hosts=hosts,
        infeed_host_index=index,
        seed=4,
        repeat=repeat,
        read_threads=0,
    )


def windows(hosts, index, packing=None, repeat=True):
    tokens = (np.arange(61 * (SEQ + 1) + 5, dtype=np.int32) * 7) % 251
    return TokenWindowInput(
        tokens,
        seq_len=SEQ,
        batch_size=GLOBAL // hosts,
        num_infeed_hosts=hosts,
        infeed_host_index=index,
        seed=4,
        repeat=repeat,
    )


def synthetic(hosts, index, packing=None, repeat=True):
    return SyntheticLMInput(
        vocab_size=50,
        seq_len=SEQ,
        batch_size=GLOBAL // hosts,
        num_infeed_hosts=hosts,
        infeed_host_index=index,
        seed=4,
        repeat=repeat,
        num_batches=None if repeat else 3,
    )


def global_batches(make, hosts, n, **kw):
    """The first `n` global batches (fewer at the end of an eval pass) and every host's final state."""
    inputs = [make(hosts, h, **kw) for h in range(hosts)]
    out = []
    for _ in range(n):
        try:
            parts = [inp.get_next() for inp in inputs]
        except StopIteration:
            break
        out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return out, [inp.get_state() for inp in inputs]


def images(hosts, index, packing=None, repeat=True):
    from equipax.data import ImageClassificationInput, synthetic_images

    x, y = synthetic_images(44, image_size=4, channels=1, seed=0)
    return ImageClassificationInput(
        x, y, batch_size=GLOBAL // hosts, num_infeed_hosts=hosts, infeed_host_index=index, seed=4, repeat=repeat
    )


CASES = [
    pytest.param(documents, True, id="documents-packed"),
    pytest.param(documents, False, id="documents-unpacked"),
    pytest.param(windows, None, id="token-windows"),
    pytest.param(synthetic, None, id="synthetic"),
    pytest.param(images, None, id="images"),
]


@pytest.mark.parametrize("make, packing", CASES)
@pytest.mark.parametrize("repeat", [True, False], ids=["train", "eval"])
def test_global_batches_are_byte_identical_at_any_host_count(make, packing, repeat):
    kw = {} if packing is None else {"packing": packing}
    reference, (state,) = global_batches(make, 1, 14, repeat=repeat, **kw)  # 14 x 8 rows: past an epoch
    assert len(reference) >= 3
    for hosts in (2, 4, 8):
        batches, states = global_batches(make, hosts, 14, repeat=repeat, **kw)
        assert_batches_equal(batches, reference)
        assert all(s == state for s in states), states  # one state, the same on every host
        assert make(hosts, 0, repeat=repeat, **kw).global_state


def test_a_per_host_packer_fails_the_identity_check():
    """The check can fail: packing each host's own slice of the documents (the layout the order
    replaces) gives other rows at 2 hosts than at 1."""

    def per_host_packer(hosts, index, packing=True, repeat=True):
        return documents(1, 0, packing, repeat, docs=DOCS[index::hosts], global_batch=GLOBAL // hosts)

    reference, _ = global_batches(per_host_packer, 1, 6)
    batches, _ = global_batches(per_host_packer, 2, 6)
    with pytest.raises(AssertionError):
        assert_batches_equal(batches, reference)


def test_packed_row_spans_match_a_dense_concatenation():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 30)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    stream = np.concatenate([np.full(n, j) for j, n in enumerate(lengths)])  # token -> its document
    offsets = np.concatenate([np.arange(n) for n in lengths])
    for row in range(-(-len(stream) // SEQ)):
        spans = packed_row_spans(starts, row, SEQ)
        got = [(j, o) for j, b, e in spans for o in range(b, e)]
        lo, hi = row * SEQ, (row + 1) * SEQ
        assert got == list(zip(stream[lo:hi].tolist(), offsets[lo:hi].tolist()))


def split_documents(rows):
    """The documents in packed rows, in order: pieces joined across rows, split at bos."""
    tokens = np.concatenate([r["ids"][r["weights"] > 0] for r in rows]).tolist()
    docs, current = [], []
    for t in tokens:
        if t == TOK.bos_id and current:
            docs.append(current)
            current = []
        current.append(t)
    return [*docs, current]


def test_every_document_once_per_epoch_across_epoch_boundaries_and_rows():
    inp = documents(1, 0, True, global_batch=1)
    per_epoch = inp.rows_per_epoch
    lengths = inp.document_lengths()
    assert per_epoch == -(-int(lengths.sum()) // SEQ) and int(lengths.max()) > 3 * SEQ
    # Read two epochs and a bit as global batches of 8 at 4 hosts: batches straddle the boundary.
    n = -(-(2 * per_epoch + 3) // GLOBAL)
    batches, _ = global_batches(documents, 4, n, packing=True)
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(GLOBAL)]
    expected = sorted([TOK.bos_id, *TOK.encode(d)] for d in DOCS)  # ids: bos + text (eos is the last label)
    orders = []
    for e in range(2):
        epoch = rows[e * per_epoch : (e + 1) * per_epoch]
        assert epoch[-1]["weights"].sum() < SEQ or int(lengths.sum()) % SEQ == 0  # the last row is padded
        assert epoch[0]["positions"][0] == 0 and epoch[0]["ids"][0] == TOK.bos_id  # starts with a document
        found = split_documents(epoch)
        assert sorted(found) == expected
        orders.append([TOK.decode(d[1:])[:3] for d in found])
        # segment ids count the pieces of each row; positions restart in every piece
        for r in epoch:
            seg = r["segment_ids"]
            assert ((seg > 0) == (r["weights"] > 0)).all()
            for s in np.unique(seg[seg > 0]):
                assert r["positions"][seg == s].tolist() == list(range(int((seg == s).sum())))
            labels_ok = r["labels"][r["weights"] > 0]
            assert (labels_ok != TOK.pad_id).all()
    assert orders[0] != orders[1]  # reshuffled every epoch
    assert rows[2 * per_epoch]["ids"][0] == TOK.bos_id


def test_eval_pass_covers_every_document_once_with_a_padded_last_batch():
    for packing in (True, False):
        for hosts in (1, 4):
            batches, _ = global_batches(documents, hosts, 100, packing=packing, repeat=False)
            inp = documents(hosts, 0, packing, repeat=False)
            assert len(batches) == inp.num_batches == -(-inp.rows_per_epoch // GLOBAL)
            rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(GLOBAL)]
            assert all(r["weights"].sum() == 0 for r in rows[inp.rows_per_epoch :])  # the padding rows
            if packing:
                assert split_documents(rows) == [[TOK.bos_id, *TOK.encode(d)] for d in DOCS]  # in order
            else:
                ids = [int(r["example_id"]) for r in rows]
                assert ids == list(range(len(DOCS))) + [-1] * (len(rows) - len(DOCS))


@pytest.mark.parametrize("packing", [True, False])
def test_a_state_resumes_on_another_host_count(packing):
    original, _ = global_batches(documents, 4, 9, packing=packing)
    first = [documents(4, h, packing) for h in range(4)]
    for _ in range(5):
        for inp in first:
            inp.get_next()
    state = json.loads(json.dumps(first[0].get_state()))
    for hosts in (1, 2, 8):
        resumed = [documents(hosts, h, packing) for h in range(hosts)]
        for inp in resumed:
            inp.set_state(state)
        got = []
        for _ in range(4):
            parts = [inp.get_next() for inp in resumed]
            got.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        assert_batches_equal(got, original[5:])


def test_bad_states_are_refused_with_the_reason():
    inp = documents(2, 0, True)
    inp.get_next()
    state = inp.get_state()
    other_batch = documents(2, 0, True, global_batch=4)
    with pytest.raises(ValueError, match="global batch of 8 rows, but this input reads 4"):
        other_batch.set_state(state)
    other_data = documents(2, 0, True, docs=DOCS[:-1])
    with pytest.raises(ValueError, match="different dataset, seq_len, packing or tokenizer"):
        other_data.set_state(state)
    with pytest.raises(ValueError, match="per-host positions"):
        inp.set_state({"grain": {}, "batches": 3})
    with pytest.raises(ValueError, match="not the start of a global batch"):
        inp.set_state(dict(state, row=3))
    evaluation = documents(2, 0, True, repeat=False)
    with pytest.raises(ValueError, match="not the start of a global batch"):
        evaluation.set_state(dict(state, rows_per_epoch=evaluation.rows_per_epoch, row=10_000 * GLOBAL))
    assert inp.get_state() == state  # a refused state changes nothing


def test_threaded_encoding_matches_inline():
    inline = drain(documents(2, 1, True), 5)
    threaded = drain(
        DocumentLMInput(
            DOCS,
            tokenizer=TOK,
            seq_len=SEQ,
            batch_size=4,
            num_infeed_hosts=2,
            infeed_host_index=1,
            seed=4,
            read_threads=3,
        ),
        5,
    )
    assert_batches_equal(threaded, inline)


def test_given_lengths_are_checked_against_the_documents():
    """Token counts computed before (a job's cache) replace the encoding pass; counts of another
    dataset or tokenizer are refused, naming the first document that disagrees."""
    counted = DocumentLMInput(DOCS, tokenizer=TOK, seq_len=SEQ, batch_size=4)
    lengths = counted.document_lengths()
    given = DocumentLMInput(DOCS, tokenizer=TOK, seq_len=SEQ, batch_size=4, lengths=lengths)
    assert given.rows_per_epoch == counted.rows_per_epoch
    assert_batches_equal([given.get_next() for _ in range(3)], [counted.get_next() for _ in range(3)])
    with pytest.raises(ValueError, match=r"one positive token count per document \(37\); got shape \(36,\)"):
        DocumentLMInput(DOCS, tokenizer=TOK, seq_len=SEQ, batch_size=4, lengths=lengths[:-1])
    wrong = lengths.copy()
    wrong[len(DOCS) // 3] += 1
    with pytest.raises(ValueError, match="lengths\\[12\\] = .* document 12 encodes to .* another dataset or tokenizer"):
        DocumentLMInput(DOCS, tokenizer=TOK, seq_len=SEQ, batch_size=4, lengths=wrong)


def test_tokenizer_fingerprints_follow_the_vocabulary():
    from pathlib import Path

    from equipax.data import HFTokenizer

    chat = Path(__file__).parents[1] / "fixtures" / "chat" / "llama3"
    assert ByteTokenizer().fingerprint() == ByteTokenizer().fingerprint()
    hf = HFTokenizer.load(chat)
    assert hf.fingerprint() == HFTokenizer.load(chat).fingerprint() != ByteTokenizer().fingerprint()
