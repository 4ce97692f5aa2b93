"""ChatSFTInput: rows of whole conversations, exact resume, the same global batches at any host count,
truncation, eval padding
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
    with pytest.raises(ValueError, match="per-host positions cannot be mapped onto the global order"):
        b.set_state({"position": 1, "batches": 1})


def _global_batches(hosts: int, n: int, *, state=None, **kw) -> tuple[list[dict], list[dict]]:
    """`n` global batches of 6 rows read by `hosts` hosts (each host's rows concatenated in host
    order), optionally from `state`; and each host's state after them."""
    inputs = [make(batch_size=6 // hosts, num_infeed_hosts=hosts, infeed_host_index=h, **kw) for h in range(hosts)]
    if state is not None:
        for inp in inputs:
            inp.set_state(state)
    batches = []
    for _ in range(n):
        parts = [inp.get_next() for inp in inputs]
        batches.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return batches, [inp.get_state() for inp in inputs], [inp.counters() for inp in inputs]


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_global_batches_and_resume_are_the_same_at_any_host_count(packing):
    """The rows of a global batch do not depend on how many hosts read it (train across epoch
    boundaries, and eval with its padding); a state saved at 3 hosts (the same on each) resumes at
    2 and at 1 host to the batches of an uninterrupted run; the counters summed over hosts are the
    1-host run's."""
    straight, _, totals = _global_batches(1, 14, packing=packing)
    for hosts in (2, 3, 6):
        batches, states, counters = _global_batches(hosts, 14, packing=packing)
        _assert_same(batches, straight)
        assert {k: sum(c[k] for c in counters) for k in counters[0]} == totals[0]
    _, states, _ = _global_batches(3, 5, packing=packing)
    assert states[0] == states[1] == states[2]
    for hosts in (1, 2):
        resumed, _, counters = _global_batches(hosts, 9, state=states[0], packing=packing)
        _assert_same(resumed, straight[5:])
    # The counters continue the run's: those of the 5 batches before the state, plus these 9.
    assert {k: sum(c[k] for c in counters) for k in counters[0]} == totals[0]
    evals = {
        h: _global_batches(
            h, make(batch_size=6, repeat=False, packing=packing).num_batches, repeat=False, packing=packing
        )[0]
        for h in (1, 2, 3)
    }
    _assert_same(evals[2], evals[1])
    _assert_same(evals[3], evals[1])


def test_every_conversation_once_per_epoch():
    """Each epoch's rows hold every conversation exactly once (next fit over that epoch's shuffle),
    the epochs in different orders; eval is one ordered pass, padded to whole global batches."""
    inp = make(batch_size=1)
    for epoch in range(3):
        plan = inp._plan(epoch)
        assert sorted(plan.members.tolist()) == list(range(len(CONVERSATIONS)))
        assert plan.stats[:, 0].sum() == len(CONVERSATIONS)
    assert inp._plan(1).members.tolist() != inp._plan(0).members.tolist()
    ids = [inp.get_next()["segment_ids"].max() for _ in range(inp._plan(0).rows + inp._plan(1).rows)]
    assert sum(ids) == 2 * len(CONVERSATIONS)  # two whole epochs, every conversation a segment
    ev = make(batch_size=2, num_infeed_hosts=3, infeed_host_index=2, repeat=False, packing=False)
    assert ev.num_batches == -(-len(CONVERSATIONS) // 6) == 9  # 49 conversations, 54 rows read
    for _ in range(ev.num_batches):
        ev.get_next()
    with pytest.raises(StopIteration):
        ev.get_next()


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
    with pytest.raises(ChatError, match="49 conversations is longer than seq_len=40 and is skipped .truncation='drop'"):
        make(seq_len=40, truncation="drop")


def test_when_no_conversation_fits_the_advice_names_the_other_mode_only_where_it_helps():
    """With truncation='truncate' already, what skips every conversation is that no reply starts
    within the row: the error says so and does not advise 'truncate'."""
    first_reply = min(int(np.argmax(chat_example(TOK, TEMPLATE, c).weights[1:] > 0)) for c in CONVERSATIONS)
    with pytest.raises(ChatError, match="its cut keeps no reply token") as e:
        make(seq_len=first_reply, truncation="truncate")
    assert "data.truncation" not in str(e.value)
