"""ChatSFTInput: rows of whole conversations, exact resume, host shares, truncation, eval padding
(packed == unpacked loss and gradients: tests/models/test_chat_packing.py)."""

from pathlib import Path

import numpy as np
import pytest

from equipax.data import ChatError, ChatSFTInput, ChatTemplate, HFTokenizer, chat_example, read_conversations

FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat"
TOK = HFTokenizer.load(FIXTURES / "llama3")
TEMPLATE = ChatTemplate.for_tokenizer(TOK, "llama3")
ALL = read_conversations([FIXTURES / "conversations.jsonl"])
# The conversations with a reply (the others are an error, tests/data/test_chat.py).
CONVERSATIONS = [ALL[i] for i in range(len(ALL)) if any(m["role"] == "assistant" for m in ALL[i])]
SEQ = 256


def make(conversations=CONVERSATIONS, **kw) -> ChatSFTInput:
    args = dict(tokenizer=TOK, template=TEMPLATE, seq_len=SEQ, batch_size=4) | kw
    return ChatSFTInput(conversations, **args)


def test_rows_segments_and_weights():
    batch = make(packing=True).get_next()
    for r in range(batch["ids"].shape[0]):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        assert np.all(batch["weights"][r][seg == 0] == 0)
        for s in range(1, seg.max() + 1):
            np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
    # Each row's segments are whole conversations: the first one's ids are its tokens[:-1].
    first = make(packing=False, repeat=False, batch_size=1).get_next()
    ex = chat_example(TOK, TEMPLATE, CONVERSATIONS[0])
    n = len(ex.ids) - 1
    np.testing.assert_array_equal(first["ids"][0][:n], ex.ids[:-1])
    np.testing.assert_array_equal(first["labels"][0][:n], ex.ids[1:])
    np.testing.assert_array_equal(first["weights"][0][:n], ex.weights[1:])
    assert not first["weights"][0][n:].any()


def test_resume_mid_epoch_is_exact():
    a = make()
    for _ in range(3):
        a.get_next()
    state = a.get_state()
    after = [a.get_next() for _ in range(12)]  # crosses into later epochs (49 conversations)
    b = make()
    b.set_state(state)
    for x, y in zip(after, (b.get_next() for _ in range(12))):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert a.get_state() == b.get_state()
    with pytest.raises(ValueError, match="set_state expects a dict with keys"):
        b.set_state({"position": 1})


def test_hosts_share_no_conversation_within_an_epoch_and_eval_pads_equally():
    seen = []
    for host in range(3):
        inp = make(packing=False, repeat=False, batch_size=2, num_infeed_hosts=3, infeed_host_index=host)
        assert inp.num_batches == -(-len(CONVERSATIONS) // 3 // 2) == 9  # 49 conversations: 17, 16, 16
        firsts = []
        for _ in range(inp.num_batches):
            b = inp.get_next()
            firsts += [tuple(r) for r, w in zip(b["ids"], b["weights"]) if w.any()]
        with pytest.raises(StopIteration):
            inp.get_next()
        seen.append(set(firsts))
    assert sum(len(s) for s in seen) == len(set().union(*seen)) == len(CONVERSATIONS)


def test_truncation_is_explicit_and_counted():
    examples = [chat_example(TOK, TEMPLATE, c) for c in CONVERSATIONS]
    lengths = [len(ex.ids) - 1 for ex in examples]
    seq = 100
    longer = sum(n > seq for n in lengths)
    no_reply = sum(not ex.weights[1 : seq + 1].any() for ex in examples)  # dropped even by "truncate"
    assert 0 < longer < len(lengths)
    cut = make(seq_len=seq, repeat=False, packing=False)
    while True:
        try:
            b = cut.get_next()
        except StopIteration:
            break
        assert b["ids"].shape == (4, seq)
    assert cut.stats["truncated"] == longer - no_reply and cut.stats["dropped"] == no_reply
    assert cut.stats["conversations"] == len(lengths) - no_reply
    drop = make(seq_len=seq, repeat=False, packing=True, truncation="drop")
    for _ in range(drop.num_batches or 0):
        drop.get_next()
    assert drop.stats["dropped"] == longer and drop.stats["truncated"] == 0
    assert drop.stats["conversations"] == len(lengths) - longer
    assert 0.5 < drop.packing_efficiency() <= 1.0


def test_a_cut_that_keeps_no_reply_is_dropped_and_counted():
    """Truncating a conversation whose replies all start past the row would train on nothing: it
    is skipped and counted as dropped, never a row of zero weights."""
    examples = [chat_example(TOK, TEMPLATE, c) for c in CONVERSATIONS]
    seq = min(int(np.argmax(ex.weights[1:] > 0)) for ex in examples) + 8  # some replies fit, not all
    no_reply = sum(not ex.weights[1 : seq + 1].any() for ex in examples)
    cut = sum(len(ex.ids) - 1 > seq and ex.weights[1 : seq + 1].any() for ex in examples)
    assert 0 < no_reply < len(examples)
    inp = make(seq_len=seq, repeat=False, packing=False)
    rows = 0
    for _ in range(inp.num_batches or 0):
        b = inp.get_next()
        weighted = b["weights"].any(axis=1)
        rows += int(weighted.sum())
        assert (weighted | (b["ids"] == TOK.pad_id).all(axis=1)).all()  # a row is a reply's or padding
    assert inp.stats["dropped"] == no_reply and inp.stats["truncated"] == cut
    assert rows == inp.stats["conversations"] == len(examples) - no_reply
    counts = inp.counter_metrics(inp.counters())
    assert counts["data_dropped"] == no_reply and counts["data_packing_efficiency"] == inp.packing_efficiency()


def test_play_conversations_alternate_speeches_of_a_scene():
    from equipax.data import play_conversations, split_plays

    hamlet = split_plays(["hamlet"])[1]["hamlet"]
    convs = play_conversations(hamlet, turns=2)
    assert len(convs) > 100
    first = convs[0]
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant"]
    assert first[0]["content"] == "A scene from Hamlet. Answer in character."
    assert first[1]["content"] == "BERNARDO\nWho's there?"
    assert first[2]["content"].startswith("FRANCISCO\nNay, answer me")
    # No stage direction or heading is a message, and every message is a speaker's speech.
    for c in convs:
        for m in c[1:]:
            speaker, *lines = m["content"].split("\n")
            assert speaker.isupper() and lines and not speaker.startswith(("ACT ", "SCENE ", "Enter "))
    with pytest.raises(ValueError, match="turns must be >= 1"):
        play_conversations(hamlet, turns=0)
    every = make(seq_len=40, truncation="drop")
    with pytest.raises(ChatError, match="every conversation of this host's 49 is longer than seq_len=40"):
        every.get_next()
