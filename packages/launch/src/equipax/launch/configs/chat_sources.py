"""The chat sources of `DataConfig` (`data.source`): conversations for supervised fine-tuning.

- `"chat"`: JSON-lines files of `{"messages": [{"role", "content"}, ...]}` (optionally `.gz`) in
  the directory `data.path`, `data.train_files` / `data.eval_files` glob patterns inside it.
- `"play_chat"`: the Shakespeare plays' dialogue as conversations (`equipax.data.play_conversations`,
  `data.chat_turns` exchanges each), the `data.validation_plays` held out: chat data that ships
  with the package.

Both render with the model's chat template (`data.chat_template`: "" = the tokenizer's own, or a
built-in one), weight the assistant replies and their end-of-turn tokens (docs/finetuning.md) and
pack whole conversations into rows (`data.packing`). Every conversation is checked (roles, the
template rendering it, a reply to train on) when the inputs are built, before the first step.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from equipax.core.knobs import ConfigError
from equipax.launch.configs.sources import HostShard, register_source
from equipax.launch.configs.token_sources import SourceInputs, TokenSource

if TYPE_CHECKING:
    from equipax.data import ChatSFTInput, Conversations, Tokenizer

__all__ = ["CHAT_TEMPLATES", "ChatFiles", "ChatSource", "PlayChat"]

# The names of equipax.data.chat.BUILTIN_TEMPLATES, for checking `data.chat_template` at config
# time without importing equipax.data (JAX, grain): `launch list` / `show` answer without them
# (tests/launch/test_launch.py); tests/launch/test_sources.py keeps the two equal.
CHAT_TEMPLATES = ("llama3", "chatml", "mistral")


class ChatSource(TokenSource):
    """Conversations rendered with a chat template (base class): subclasses give `conversations`."""

    packs_documents: ClassVar[bool] = True

    def check(self, data: Any) -> None:
        if data.tokenizer != "huggingface":
            raise ValueError(
                f"data.source={self.name!r} renders conversations with a Hugging Face chat template and needs "
                f"data.tokenizer='huggingface' (the model's tokenizer.json); got data.tokenizer={data.tokenizer!r}."
            )
        if data.chat_template and data.chat_template not in CHAT_TEMPLATES:
            raise ValueError(
                f"data.chat_template={data.chat_template!r} is not a built-in template; use one of "
                f"{', '.join(repr(n) for n in CHAT_TEMPLATES)}, or '' for the tokenizer's own."
            )
        if data.truncation not in ("truncate", "drop"):
            raise ValueError(f"data.truncation must be 'truncate' or 'drop'; got {data.truncation!r}.")

    def conversations(self, data: Any, split: str) -> "Conversations | list[list[dict[str, str]]]":
        """The conversations of `split` ("train" or "eval")."""
        raise NotImplementedError

    def vocabulary_texts(self, data: Any) -> Iterator[str]:
        raise NotImplementedError(f"data.source={self.name!r} reads the model's own tokenizer (data.tokenizer).")

    def build(
        self, data: Any, *, tokenizer: "Tokenizer", vocab_size: int, eval_batches: int, shard: HostShard
    ) -> SourceInputs:
        from equipax.data import ChatSFTInput, ChatTemplate, HFTokenizer

        assert isinstance(tokenizer, HFTokenizer)  # check() asks for data.tokenizer='huggingface'
        template = ChatTemplate.for_tokenizer(tokenizer, data.chat_template, end_of_turn=data.end_of_turn or None)
        common: dict[str, Any] = dict(
            tokenizer=tokenizer,
            template=template,
            seq_len=data.seq_len,
            packing=data.packing,
            truncation=data.truncation,
            assistant_only_loss=data.assistant_only_loss,
            **shard.input_kwargs(),
        )
        train = ChatSFTInput(self.conversations(data, "train"), seed=data.seed, repeat=True, **common)
        evaluation = ChatSFTInput(
            self.conversations(data, "eval"), seed=data.seed + 1, repeat=not data.reset_for_eval, **common
        )
        for inp in (train, evaluation):
            _check_all(inp)
        return SourceInputs(train, evaluation)


def _check_all(inp: "ChatSFTInput") -> None:
    """Render and weight every conversation now (the examples are cached for the first epoch), so
    a bad one stops the job before its first step."""
    for i in range(len(inp.conversations)):
        inp.example(i)


@register_source
class ChatFiles(ChatSource):
    """JSON-lines conversation files under `data.path` (`data.train_files`, `data.eval_files` globs)."""

    name: ClassVar[str] = "chat"

    def check(self, data: Any) -> None:
        super().check(data)
        if not data.path:
            raise ValueError(
                "data.source='chat' needs data.path, the directory of JSON-lines conversation files "
                '({"messages": [...]} a line): --set data.path=/data/chat --set data.train_files="train*.jsonl".'
            )

    def describe(self, data: Any) -> str:
        return f"conversations in {data.path}"

    def conversations(self, data: Any, split: str) -> "Conversations":
        from equipax.data import find_shards, read_conversations
        from equipax.launch.store.checks import data_path

        pattern = data.train_files if split == "train" else data.eval_files
        knob = "data.train_files" if split == "train" else "data.eval_files"
        root = data_path(data.path, "data.path")  # local, or a bucket's (docs/object_storage.md)
        try:
            return read_conversations(find_shards(root, pattern, allow_partial=data.allow_partial_shards))
        except ValueError as e:
            raise ConfigError(f"{knob}={pattern!r} under data.path={data.path!r}: {e}") from None


@register_source
class PlayChat(ChatSource):
    """The plays' dialogue as conversations (`data.chat_turns` exchanges), `data.validation_plays` held out."""

    name: ClassVar[str] = "play_chat"

    def describe(self, data: Any) -> str:
        return "the plays' dialogue"

    def conversations(self, data: Any, split: str) -> list[list[dict[str, str]]]:
        from equipax.data import play_conversations, split_plays

        try:
            train, held_out = split_plays(data.validation_plays)
            plays = train if split == "train" else held_out
            return [c for text in plays.values() for c in play_conversations(text, turns=data.chat_turns)]
        except ValueError as e:
            raise ConfigError(f"data.validation_plays / data.chat_turns: {e}") from None
