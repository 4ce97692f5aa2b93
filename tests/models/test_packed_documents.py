"""Packed rows give each document the loss it gets alone; eval padding leaves metrics unchanged."""

import equinox as eqx
import jax
import numpy as np
import pytest

from equipax.core.nn import TransformerConfig
from equipax.data import ByteTokenizer, DocumentLMInput
from equipax.models import LMConfig, TransformerLM, lm_loss

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    cfg = LMConfig(
        vocab_size=TOK.vocab_size,
        max_seq_len=48,
        transformer=TransformerConfig(
            num_layers=2, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64, scan_layers=True
        ),
    )
    return TransformerLM(cfg, key=jax.random.key(3))


def doc_losses(model, batch):
    """Per-document summed NLL: documents identified by (row, segment)."""

    def arr(k):
        return None if k not in batch else jax.numpy.asarray(batch[k])

    logits = eqx.filter_jit(lambda m, *a: m(a[0], segment_ids=a[1], positions=a[2]))(
        model, arr("ids"), arr("segment_ids"), arr("positions")
    )
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), batch["labels"][..., None], axis=-1)[..., 0]
    return nll * batch["weights"]


def test_packed_and_unpacked_give_the_same_per_document_loss(model):
    # bos + text = 24 ids each for the first two, so they fill row 0 exactly; no document is split.
    docs = ["To be, or not to be, th", "at is the question: Whe", "ther 'tis nobler", "in the mind"]
    packed = DocumentLMInput(
        docs, tokenizer=TOK, seq_len=48, batch_size=2, repeat=False, packing=True, read_threads=0
    ).get_next()
    alone = DocumentLMInput(
        docs, tokenizer=TOK, seq_len=48, batch_size=4, repeat=False, packing=False, read_threads=0
    ).get_next()
    assert packed["segment_ids"].max() == 2 and packed["positions"].max() > 0
    packed_nll = doc_losses(model, packed)
    alone_nll = doc_losses(model, alone)
    got = []
    for row in range(2):
        for s in (1, 2):
            got.append(packed_nll[row][packed["segment_ids"][row] == s])
    for doc, (p, a) in enumerate(zip(got, alone_nll)):
        a = a[alone["weights"][doc] > 0]
        np.testing.assert_allclose(p, a, rtol=2e-5, atol=2e-5, err_msg=f"document {doc}")
    # Without the segment mask and position reset, the second document of a row would differ.
    unmasked = doc_losses(model, {k: v for k, v in packed.items() if k not in ("segment_ids", "positions")})
    second = unmasked[0][packed["segment_ids"][0] == 2]
    assert not np.allclose(second, got[1], atol=1e-3)
    # lm_loss reads the packing arrays from the batch.
    _, aux = lm_loss(model, {k: jax.numpy.asarray(v) for k, v in packed.items()})
    assert float(aux["loss_sum"]) == pytest.approx(float(packed_nll.sum()), rel=1e-5)


def test_eval_metrics_unchanged_by_padding_rows(model):
    docs = [f"line {i}: " + "ab" * i for i in range(5)]
    inp = DocumentLMInput(docs, tokenizer=TOK, seq_len=48, batch_size=4, repeat=False, packing=False, read_threads=0)
    batches = [inp.get_next(), inp.get_next()]  # 5 documents -> 3 padding rows in the second batch
    assert int((batches[1]["example_id"] < 0).sum()) == 3
    sums = [lm_loss(model, {k: jax.numpy.asarray(v) for k, v in b.items()})[1] for b in batches]
    real = {k: v[:1] for k, v in batches[1].items()}
    alone = lm_loss(model, {k: jax.numpy.asarray(v) for k, v in real.items()})[1]
    for k in ("loss_sum", "weight_sum", "correct_sum"):
        assert float(sums[1][k]) == pytest.approx(float(alone[k]), rel=1e-6)
