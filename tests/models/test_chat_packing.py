"""Chat SFT packing: a packed batch of conversations has the loss and gradients of the same
conversations one per row (segment ids and restarting positions keep them apart)."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from equipax.core.nn import TransformerConfig
from equipax.data import ChatSFTInput, ChatTemplate, HFTokenizer, chat_example, read_conversations
from equipax.models import LMConfig, TransformerLM, lm_loss

FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat"
TOK = HFTokenizer.load(FIXTURES / "llama3")
TEMPLATE = ChatTemplate.for_tokenizer(TOK, "llama3")
SEQ = 256


def make(conversations, **kw) -> ChatSFTInput:
    return ChatSFTInput(conversations, tokenizer=TOK, template=TEMPLATE, seq_len=SEQ, **kw)


def test_packed_loss_and_gradients_equal_unpacked():
    conversations = read_conversations([FIXTURES / "conversations.jsonl"])
    short = [
        c
        for c in conversations
        if any(m["role"] == "assistant" for m in c) and len(chat_example(TOK, TEMPLATE, c).ids) <= 120
    ][:6]
    assert len(short) == 6
    packed = make(short, batch_size=6, repeat=False, packing=True).get_next()
    alone = make(short, batch_size=6, repeat=False, packing=False).get_next()
    assert packed["segment_ids"].max() >= 2  # rows hold several conversations
    rows = int((packed["segment_ids"] > 0).any(axis=1).sum())
    assert rows < 6
    cfg = LMConfig(
        vocab_size=TOK.vocab_size,
        max_seq_len=SEQ,
        transformer=TransformerConfig(
            num_layers=2, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64, scan_layers=True
        ),
    )
    model = TransformerLM(cfg, key=jax.random.key(0))

    def loss(m, batch):
        return lm_loss(m, {k: jnp.asarray(v) for k, v in batch.items()})

    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (lp, aux_p), gp = value_and_grad(model, packed)
    (la, aux_a), ga = value_and_grad(model, alone)
    assert float(aux_p["weight_sum"]) == float(aux_a["weight_sum"]) > 0
    np.testing.assert_allclose(float(aux_p["loss_sum"]), float(aux_a["loss_sum"]), rtol=1e-5)
    np.testing.assert_allclose(float(lp), float(la), rtol=1e-5)
    for p, a in zip(jax.tree.leaves(gp), jax.tree.leaves(ga)):
        np.testing.assert_allclose(np.asarray(p), np.asarray(a), rtol=2e-4, atol=1e-6)
    # Mutation: without the segment ids and restarting positions, the packed loss differs.
    crossing = {k: v for k, v in packed.items() if k not in ("segment_ids", "positions")}
    crossing |= {k: np.zeros_like(v) for k, v in packed.items() if k in ("segment_ids", "positions")}
    crossing["segment_ids"] += 1
    crossing["positions"] += np.arange(SEQ, dtype=np.int32)
    assert abs(float(value_and_grad(model, crossing)[0][1]["loss_sum"]) - float(aux_a["loss_sum"])) > 1e-3
