"""Chat templates and loss masks against the committed transformers references (tests/fixtures/chat).

For three template styles (Llama 3, ChatML/Qwen, Mistral [INST]) and 50 conversations (multi-turn,
system prompts, tool messages, empty replies, unicode, whitespace; tests/fixtures/chat/make_fixtures.py),
the masks equipax computes from the untagged built-in templates by prefix rendering must equal the
`return_assistant_tokens_mask` transformers computed from the `{% generation %}`-tagged versions.
"""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from equipax.data import HFTokenizer
from equipax.data.chat import ChatError, ChatTemplate, chat_example, read_conversations, reply_spans, token_weights

FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat"
FAMILIES = ("llama3", "chatml", "mistral")


def _conversations():
    return read_conversations([FIXTURES / "conversations.jsonl"])


def _references(family: str) -> list[dict]:
    return json.loads((FIXTURES / family / "reference.json").read_text(encoding="utf-8"))["references"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tagged", [False, True], ids=["builtin", "tokenizer_template"])
def test_masks_equal_transformers_assistant_masks(family: str, tagged: bool) -> None:
    tok = HFTokenizer.load(FIXTURES / family)
    template = ChatTemplate.for_tokenizer(tok, "" if tagged else family)
    conversations = _conversations()
    checked = 0
    for i, ref in enumerate(_references(family)):
        messages, where = conversations[i], conversations.origins[i]
        if "error" in ref:
            with pytest.raises(ChatError, match="fails to render"):
                chat_example(tok, template, messages, where=where)
            continue
        if not any(m["role"] == "assistant" for m in messages):
            with pytest.raises(ChatError, match="no token has loss weight 1"):
                chat_example(tok, template, messages, where=where)
            assert not any(ref["mask"])
            continue
        ex = chat_example(tok, template, messages, where=where)
        assert ex.text == ref["text"], where
        np.testing.assert_array_equal(ex.ids, ref["ids"], err_msg=where)
        np.testing.assert_array_equal(ex.weights, np.asarray(ref["mask"], np.float32), err_msg=where)
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("family", FAMILIES)
def test_weighted_tokens_are_the_replies_and_their_end_of_turn(family: str) -> None:
    """Independently of the references: each run of weight-1 tokens decodes to one reply as the
    template writes it, ending with the end-of-turn token, and no other token holds reply text."""
    tok = HFTokenizer.load(FIXTURES / family)
    template = ChatTemplate.for_tokenizer(tok, family)
    conversations = _conversations()
    eot = tok.token_id(template.end_of_turn)
    for i in range(len(conversations)):
        messages = conversations[i]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        try:
            ex = chat_example(tok, template, messages)
        except ChatError:
            continue
        w = np.concatenate([[0.0], ex.weights, [0.0]])
        starts, ends = np.nonzero(np.diff(w) > 0)[0], np.nonzero(np.diff(w) < 0)[0]
        assert len(starts) == len(replies), conversations.origins[i]
        for s, e, reply in zip(starts, ends, replies):
            run = ex.ids[s:e]
            assert run[-1] == eot  # the end-of-turn token is trained on: generations stop
            text = tok.decode(run, skip_special_tokens=False)
            assert text.endswith(template.end_of_turn)
            body = text[: -len(template.end_of_turn)]
            if family == "llama3":  # the template trims replies
                assert body == reply.strip()
            elif family == "mistral":  # " " + reply, spaces as Metaspace decodes them
                assert body.strip() == reply.strip() or "<unk>" in tok.decode(run, skip_special_tokens=False)
            else:
                assert body == reply


def test_mask_mutations_are_caught() -> None:
    """The reference comparison fails for the mistakes it exists to catch: the end-of-turn token
    left out, a mask shifted by one token, a mask over the whole text."""
    tok = HFTokenizer.load(FIXTURES / "chatml")
    template = ChatTemplate.for_tokenizer(tok, "chatml")
    ref = _references("chatml")[1]
    text, spans = reply_spans(template, _conversations()[1], "case")
    _, offsets = tok.encode_with_offsets(text)
    good = token_weights(offsets, spans)
    np.testing.assert_array_equal(good, ref["mask"])
    no_eot = token_weights(offsets, [(s, e - len("<|im_end|>")) for s, e in spans])
    shifted = np.roll(good, 1)
    for bad in (no_eot, shifted, np.ones_like(good)):
        assert not np.array_equal(bad, ref["mask"])


def test_bad_input_errors(tmp_path: Path) -> None:
    tok = HFTokenizer.load(FIXTURES / "llama3")
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(
        gzip.compress(
            b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "narrator", "content": "x"}]}\n'
        )
    )
    with pytest.raises(ChatError, match=r"bad.jsonl.gz line 2: message 0 has the unknown role 'narrator'"):
        read_conversations([bad])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ChatError, match="holds no conversations"):
        read_conversations([tmp_path / "empty.jsonl"])
    # A tokenizer without the template's special tokens (ChatML on the Llama 3 vocabulary).
    with pytest.raises(ChatError, match=r"'<\|im_start\|>', '<\|im_end\|>'.*does not hold"):
        ChatTemplate.for_tokenizer(tok, "chatml")
    with pytest.raises(ChatError, match="no built-in chat template 'llama4'; the built-in ones are llama3, chatml"):
        ChatTemplate.for_tokenizer(tok, "llama4")
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    # A template that renders no end-of-turn token after a reply.
    no_eot = ChatTemplate(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
        name="plain",
        end_of_turn="<|eot_id|>",
    )
    with pytest.raises(ChatError, match="without the end-of-turn token '<\\|eot_id\\|>'"):
        chat_example(tok, no_eot, convo)
    # A template that renders the reply only: all ones is an error unless asked for.
    only = ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}",
        name="replies",
        end_of_turn="<|eot_id|>",
    )
    with pytest.raises(ChatError, match="every token has loss weight 1"):
        chat_example(tok, only, convo)
    assert chat_example(tok, only, convo, assistant_only_loss=False).weights.all()
    # A template that fails to render names the example and the template's own message.
    with pytest.raises(ChatError, match=r"case 7: chat template mistral fails to render it: Conversation roles must"):
        chat_example(
            tok,
            ChatTemplate.builtin("mistral", special_tokens={"eos_token": "</s>", "bos_token": ""}),
            convo[::-1],
            where="case 7",
        )
    with pytest.raises(ChatError, match="does not compile"):
        ChatTemplate("{% for %}", name="broken", end_of_turn="x")


def test_a_tokenizer_template_error_names_the_file_the_template_is_in(tmp_path: Path) -> None:
    """The tokenizer's own template lives in chat_template.jinja or tokenizer_config.json, never
    tokenizer.json: that is the file its errors name."""
    import shutil

    d = tmp_path / "tok"
    shutil.copytree(FIXTURES / "llama3", d)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ raise_exception('no ' + m['role']) }}{% endfor %}"
    )
    with pytest.raises(ChatError, match=r"chat template /\S+/chat_template\.jinja fails to render it: no user"):
        ChatTemplate.for_tokenizer(HFTokenizer.load(d)).render([{"role": "user", "content": "q"}])
    (d / "chat_template.jinja").unlink()
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": "{% for %}"}))
    with pytest.raises(ChatError, match=r"tokenizer_config\.json \(its chat_template\) does not compile") as e:
        ChatTemplate.for_tokenizer(HFTokenizer.load(d))
    assert "tokenizer.json" not in str(e.value).replace("tokenizer_config.json", "")
