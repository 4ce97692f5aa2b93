"""`decode_texts` (what `launch decode` and decode during training call) pads each batch of prompts
to a power-of-two width: batches of prompts of other lengths reuse one compiled decode program
(on a TPU each width was an XLA compile of the whole decode loop), and the samples are those of
the unpadded batch."""

import jax.numpy as jnp
import jax.random as jr
import numpy as np


def test_prompts_of_other_lengths_share_one_decode_program_and_decode_as_unpadded():
    from equipax.core.nn import TransformerConfig
    from equipax.data import ByteTokenizer
    from equipax.launch.aot.compile_events import CompileEvents
    from equipax.launch.inference.sampling import decode_texts, encode_prompts, padded_width
    from equipax.models.decode import decode
    from equipax.models.lm import LMConfig, TransformerLM

    tokenizer = ByteTokenizer()
    block = TransformerConfig(num_layers=1, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64)
    model = TransformerLM(LMConfig(vocab_size=tokenizer.vocab_size, max_seq_len=40, transformer=block), key=jr.key(0))
    batches = [["ROMEO:", "O, "], ["First Citizen:", "To be"]]  # 6 and 14 bytes wide: both padded to 16
    assert [padded_width(w, max_seq_len=40, max_new_tokens=6) for w in (6, 14, 17, 33)] == [16, 16, 32, 34]
    assert padded_width(36, max_seq_len=40, max_new_tokens=6) == 36  # already past the room: never narrower
    decode_texts(model, tokenizer, batches[0], max_new_tokens=6)  # compiles (or loads) the width-16 program
    with CompileEvents() as compiling:
        samples = decode_texts(model, tokenizer, batches[1], max_new_tokens=6)
    assert compiling.seconds == 0.0  # traced, lowered and compiled nothing
    ids, lengths = encode_prompts(tokenizer, batches[1], 40)
    ids, lengths = jnp.asarray(ids), jnp.asarray(lengths)
    want, counts = decode(model, ids, lengths, max_new_tokens=6, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    assert [s.tokens for s in samples] == [row[:n] for row, n in zip(np.asarray(want).tolist(), np.asarray(counts))]
