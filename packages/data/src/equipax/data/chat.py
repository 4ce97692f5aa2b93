"""Chat conversations: reading them, rendering them with a chat template, and their loss masks.

A conversation is `{"messages": [{"role": ..., "content": ...}, ...]}` (one JSON object a line).
It is rendered with the model's chat template, a Jinja template rendered the way transformers'
`apply_chat_template` renders it (a sandboxed environment with `trim_blocks`, `lstrip_blocks`,
`raise_exception`, `tojson`, `strftime_now`; the tokenizer's special tokens as variables), or a
built-in one (`llama3`, `chatml`, `mistral`: `equipax/data/chat_templates/`).

The loss mask comes from the template itself, with no `{% generation %}` tag needed: for each
assistant message `i`, the text the template renders for `messages[:i]` with the generation prompt
is where the reply starts, and the text it renders for `messages[:i + 1]` holds the reply up to and
including the end-of-turn token. The whole conversation is tokenized once and each reply's character
span is mapped to tokens: a token is weighted 1 when it overlaps a reply (the reply's text and its
end-of-turn token), 0 otherwise (system, user and tool text, headers, padding). Where a template has
`{% generation %}` tags around exactly that text, this equals transformers'
`return_assistant_tokens_mask` (tests/data/test_chat.py checks both against committed references).
"""

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from equipax.data.sources import DataError
from equipax.data.sources.c4 import ShardPath, read_json_lines
from equipax.data.tokenizers import HFTokenizer

__all__ = [
    "BUILTIN_TEMPLATES",
    "ROLES",
    "ChatError",
    "ChatExample",
    "ChatTemplate",
    "Conversations",
    "chat_example",
    "check_messages",
    "read_conversations",
]

ROLES = ("system", "user", "assistant", "tool")

# Built-in templates: (file in chat_templates/, its end-of-turn token, the special tokens it writes).
BUILTIN_TEMPLATES: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    "llama3": ("llama3.jinja", "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "chatml": ("chatml.jinja", "<|im_end|>", ("<|im_start|>", "<|im_end|>")),
    "mistral": ("mistral.jinja", None, ("[INST]", "[/INST]")),  # ends a turn with eos_token
}


class ChatError(DataError):
    """A conversation, chat template or tokenizer that cannot make a chat example (exit 2)."""


def check_messages(record: object, where: str) -> list[dict[str, Any]]:
    """The messages of one conversation record, checked: a list of `{"role", "content"}` objects.

    Arguments:
        record: a parsed JSON record, `{"messages": [...]}` (or the list itself).
        where: how the error names the example (e.g. `"chat.jsonl line 3"`).

    Raises:
        ChatError: no messages, a message that is not an object, an unknown role, or content that
            is not a string.
    """
    messages = record.get("messages") if isinstance(record, Mapping) else record
    if not isinstance(messages, list) or not messages:
        raise ChatError(
            f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}} with at least one '
            f"message; got {json.dumps(record)[:200]}."
        )
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatError(f"{where}: message {j} is not an object with a string 'role': {json.dumps(m)[:200]}.")
        if m["role"] not in ROLES:
            raise ChatError(
                f"{where}: message {j} has the unknown role {m['role']!r}; the roles are {', '.join(ROLES)}. "
                "Rename it in the data."
            )
        if not isinstance(m.get("content"), str):
            raise ChatError(f"{where}: message {j} ({m['role']}) has no string 'content': {json.dumps(m)[:200]}.")
    return [dict(m) for m in messages]


@dataclass(frozen=True)
class Conversations:
    """Conversations read from JSON-lines files, each with where it came from (for error messages)."""

    messages: tuple[tuple[dict[str, Any], ...], ...]
    origins: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, index: int, /) -> list[dict[str, Any]]:
        return list(self.messages[index])


def read_conversations(files: Sequence[str | ShardPath]) -> Conversations:
    """Every conversation of JSON-lines files (`.jsonl`, `.json`, optionally `.gz`; local or in a
    store, as `find_shards` gives them), checked.

    Raises:
        ChatError: a line that is not JSON, or a conversation `check_messages` rejects (naming the
            file and line); a file without conversations.
    """
    messages, origins = [], []
    for file in (Path(f) if isinstance(f, str) else f for f in files):
        if not file.is_file():
            raise ChatError(f"no conversation file {str(file)!r}.")
        raw = read_json_lines(file, "Conversation file")
        before = len(messages)
        for n, line in enumerate(raw.split(b"\n"), start=1):
            if not line.strip():
                continue
            where = f"{file} line {n}"
            try:
                record = json.loads(line)
            except (ValueError, UnicodeDecodeError) as e:
                raise ChatError(f"{where} is not a JSON object ({e}).") from None
            messages.append(tuple(check_messages(record, where)))
            origins.append(where)
        if len(messages) == before:
            raise ChatError(f"{str(file)!r} holds no conversations (expected one JSON object a line).")
    return Conversations(tuple(messages), tuple(origins))


@functools.cache
def _environment() -> Any:
    """A Jinja environment as transformers compiles chat templates in (`apply_chat_template`)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; rendering ignores the tag."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A chat template (Jinja source) with the special tokens it is rendered with.

    Arguments:
        source: the Jinja template (a tokenizer's `chat_template`, or a built-in one's file).
        name: how errors name it (`"llama3"`, or the tokenizer's path).
        special_tokens: template variables such as `bos_token`, `eos_token`.
        end_of_turn: the token that ends an assistant turn (weighted 1 with the reply); None: the
            `eos_token`.
        required_tokens: special tokens the template writes, which the tokenizer must hold.

    Raises:
        ChatError: a template that does not compile.
    """

    def __init__(
        self,
        source: str,
        *,
        name: str,
        special_tokens: Mapping[str, str] | None = None,
        end_of_turn: str | None = None,
        required_tokens: Sequence[str] = (),
    ) -> None:
        import jinja2

        self.source = source
        self.name = name
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        eot = end_of_turn or self.special_tokens.get("eos_token")
        if not eot:
            raise ChatError(f"chat template {name}: no end-of-turn token (set data.end_of_turn, or give an eos_token).")
        self.end_of_turn: str = eot
        self.required_tokens: tuple[str, ...] = tuple(dict.fromkeys([*required_tokens, eot]))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatError(f"chat template {name} does not compile: {e}.") from None

    @classmethod
    def builtin(
        cls, name: str, *, special_tokens: Mapping[str, str] | None = None, end_of_turn: str | None = None
    ) -> "ChatTemplate":
        """One of `BUILTIN_TEMPLATES` (`llama3`, `chatml`, `mistral`); ChatError for another name."""
        if name not in BUILTIN_TEMPLATES:
            raise ChatError(
                f"no built-in chat template {name!r}; the built-in ones are {', '.join(BUILTIN_TEMPLATES)}."
            )
        file, eot, required = BUILTIN_TEMPLATES[name]
        source = resources.files("equipax.data").joinpath("chat_templates", file).read_text(encoding="utf-8")
        return cls(
            source, name=name, special_tokens=special_tokens, end_of_turn=end_of_turn or eot, required_tokens=required
        )

    @classmethod
    def for_tokenizer(cls, tokenizer: HFTokenizer, name: str = "", *, end_of_turn: str | None = None) -> "ChatTemplate":
        """The tokenizer's own chat template (`name=""`) or a built-in one, with the tokenizer's
        special tokens; ChatError when a token the template needs is not one token of the vocabulary.
        """
        special = {f"{role}_token": text for role, text in tokenizer.tokens.items() if text is not None}
        if name:
            template = cls.builtin(name, special_tokens=special, end_of_turn=end_of_turn)
        elif tokenizer.chat_template is None:
            raise ChatError(
                f"the tokenizer {tokenizer.path} has no chat template (chat_template.jinja, or tokenizer_config.json's "
                "chat_template); name a built-in one with data.chat_template="
                f"{' / '.join(repr(n) for n in BUILTIN_TEMPLATES)}."
            )
        else:
            name = tokenizer.chat_template_origin or f"of {tokenizer.path}"  # where the template is written
            template = cls(tokenizer.chat_template, name=name, special_tokens=special, end_of_turn=end_of_turn)
        missing = [t for t in template.required_tokens if tokenizer.token_id(t) is None]
        if missing:
            raise ChatError(
                f"chat template {template.name} writes the special token(s) {', '.join(map(repr, missing))}, which "
                f"the tokenizer {tokenizer.path} does not hold as single tokens: its vocabulary is not the one this "
                "template was written for. Use the model's own tokenizer, or another data.chat_template."
            )
        return template

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, where: str = ""
    ) -> str:
        """The template's text for `messages` (`where` names the example in errors).

        Raises:
            ChatError: the template raised (its message, the example and the template).
        """
        import jinja2

        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except (jinja2.TemplateError, TypeError, KeyError, IndexError) as e:
            raise ChatError(
                f"{where or 'a conversation'}: chat template {self.name} fails to render it: {e}."
            ) from None


@dataclass(frozen=True)
class ChatExample:
    """One tokenized conversation: its ids, their loss weights and the text they encode.

    `spans` are the `(start, end)` character spans of the assistant replies in `text` (each ending
    with the end-of-turn token); `weights[t]` is 1 where token `t` overlaps a span.
    """

    ids: np.ndarray
    weights: np.ndarray
    text: str
    spans: tuple[tuple[int, int], ...]


def reply_spans(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant reply in it."""
    text = template.render(messages, where=where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, where=f"{where} (messages before {i})")
        upto = template.render(messages[: i + 1], where=f"{where} (messages up to {i})")
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ChatError(
                f"{where}: chat template {template.name} does not render this conversation's prefixes as prefixes of "
                f"the whole (the text before assistant message {i} changes once later messages follow), so its "
                "replies cannot be located. Use a template that renders earlier turns independently of later ones."
            )
        end = upto.rfind(template.end_of_turn, len(before))
        if end < 0:
            raise ChatError(
                f"{where}: chat template {template.name} renders assistant message {i} without the end-of-turn "
                f"token {template.end_of_turn!r}; a model trained on it would never stop. Set data.end_of_turn to "
                "the token the template ends replies with."
            )
        spans.append((len(before), end + len(template.end_of_turn)))
    return text, spans


def token_weights(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1.0 on every token from the one holding a span's first character to the one holding its
    last (transformers' `char_to_token` rule), 0.0 elsewhere."""
    weights = np.zeros((len(offsets),), np.float32)
    if not len(offsets):
        return weights
    starts = np.asarray([a for a, _ in offsets])
    ends = np.asarray([b for _, b in offsets])
    for s, e in spans:
        first = int(np.argmax(ends > s)) if np.any(ends > s) else len(offsets)
        last = int(np.nonzero(starts < e)[0][-1]) if np.any(starts < e) else -1
        weights[first : last + 1] = 1.0
    return weights


def chat_example(
    tokenizer: HFTokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    where: str = "a conversation",
    assistant_only_loss: bool = True,
) -> ChatExample:
    """Render, tokenize once and weight one conversation.

    Arguments:
        tokenizer: the model's tokenizer.
        template: its chat template (`ChatTemplate.for_tokenizer`).
        messages: the conversation.
        where: how errors name it.
        assistant_only_loss: weight the replies only (True) or every token (False: plain text
            continuation).

    Raises:
        ChatError: the template fails, renders no reply or no end-of-turn token; a mask that is all
            zeros or (with assistant_only_loss) all ones.
    """
    text, spans = reply_spans(template, messages, where)
    ids, offsets = tokenizer.encode_with_offsets(text)
    if not assistant_only_loss:
        return ChatExample(np.asarray(ids, np.int32), np.ones((len(ids),), np.float32), text, tuple(spans))
    weights = token_weights(offsets, spans)
    if not weights.any():
        raise ChatError(
            f"{where}: no token has loss weight 1 (the conversation has no assistant reply the template renders). "
            "Drop it from the data, or set data.assistant_only_loss=False to train on every token."
        )
    if weights.all():
        raise ChatError(
            f"{where}: every token has loss weight 1: chat template {template.name} renders nothing but the "
            "assistant replies, so prompts would be trained on too. Check the template, or set "
            "data.assistant_only_loss=False if plain text continuation is meant."
        )
    return ChatExample(np.asarray(ids, np.int32), weights, text, tuple(spans))
