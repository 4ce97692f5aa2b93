"""Tokenizers: a byte-level one with no dependencies, a locally trained SentencePiece one, and a
Hugging Face `tokenizer.json` (the `tokenizers` library) with its special tokens."""

import abc
import hashlib
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import sentencepiece as spm

from equipax.data.content_cache import ContentCache, content_key, write_atomic

__all__ = ["ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer"]


class Tokenizer(abc.ABC):
    """Maps text to token ids and back. `decode` drops pad/bos/eos ids."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; every id is in `[0, vocab_size)`."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def bos_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def eos_id(self) -> int: ...

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Encode `text` to ids, without bos/eos."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Decode ids to text, skipping pad/bos/eos."""

    def fingerprint(self) -> str:
        """A digest of everything that decides the ids: equal fingerprints, equal encodings (the
        class, the special ids and the vocabulary's own bytes, `_model_bytes`)."""
        head = repr((type(self).__name__, self.vocab_size, self.pad_id, self.bos_id, self.eos_id)).encode()
        return hashlib.sha256(head + self._model_bytes()).hexdigest()[:16]

    def _model_bytes(self) -> bytes:
        """The serialized vocabulary (empty for a fixed mapping such as bytes)."""
        return b""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids: id `b` is byte `b` (0..255), then pad=256, bos=257, eos=258.

    `vocab_size` is 259, the exact count; models that want a hardware-friendly embedding table
    round their own vocabulary dimension up (a tokenizer never emits the extra ids).
    Invalid UTF-8 produced by a model decodes with U+FFFD replacement characters.
    """

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def pad_id(self) -> int:
        return 256

    @property
    def bos_id(self) -> int:
        return 257

    @property
    def eos_id(self) -> int:
        return 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        data = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is outside the byte vocabulary [0, {self.vocab_size}).")
            if i < 256:
                data.append(i)
        return bytes(data).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model with pad=0, unk=1, bos=2, eos=3 and byte fallback.

    Build one with `SentencePieceTokenizer.train(...)` or `SentencePieceTokenizer.load(path)`.
    Trained models use the identity normalizer and keep whitespace, so any text round-trips.
    """

    def __init__(self, processor: spm.SentencePieceProcessor, model_path: Path | None = None) -> None:
        self._sp = processor
        self.model_path = model_path
        # True when `train` found this model in its cache instead of training it.
        self.from_cache = False

    def _model_bytes(self) -> bytes:
        return self._sp.serialized_model_proto()

    @classmethod
    def load(cls, model_path: str | os.PathLike[str]) -> "SentencePieceTokenizer":
        """Load a `.model` file written by `train` (or any SentencePiece model)."""
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"SentencePiece model not found at {str(path)!r}. Train one with "
                f"SentencePieceTokenizer.train(texts, vocab_size=..., model_path={str(path)!r}) "
                f"or fix the path."
            )
        return cls(spm.SentencePieceProcessor(model_file=str(path)), path)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        *,
        vocab_size: int,
        model_path: str | os.PathLike[str],
        model_type: Literal["bpe", "unigram", "char", "word"] = "bpe",
        max_sentences: int = 1_000_000,
        num_threads: int = 1,
        cache: ContentCache | None = None,
    ) -> "SentencePieceTokenizer":
        """Train a vocabulary on `texts` locally and write it to `model_path`.

        Training is deterministic: each text is split into non-empty lines ("sentences") and
        when there are more than `max_sentences` an evenly strided subset is used (no shuffling).

        **Arguments:**

        - `texts`: documents (e.g. the training split only, never eval data).
        - `vocab_size`: size of the vocabulary, including 4 specials and 256 byte pieces.
        - `model_path`: where the `.model` file is written (parent directories are created).
        - `model_type`: SentencePiece algorithm; "bpe" is fast, "unigram" is SentencePiece's default.
        - `max_sentences`: cap on training lines, to bound training time.
        - `num_threads`: trainer threads (unigram only; keep fixed for reproducible models).
        - `cache`: where models trained before are kept by a digest of the training lines, the
          settings and the SentencePiece version; an equal digest writes the kept model to
          `model_path` instead of training (`from_cache` is then True). None: always train.

        **Returns:** the loaded tokenizer.
        """
        if vocab_size <= 260:
            raise ValueError(f"vocab_size must exceed 260 (4 specials + 256 byte-fallback pieces), got {vocab_size}.")
        if max_sentences < 1:
            raise ValueError(f"max_sentences must be positive, got {max_sentences}.")
        lines = [line for text in texts for line in text.splitlines() if line.strip()]
        if not lines:
            raise ValueError("texts contain no non-empty lines to train a tokenizer on.")
        if len(lines) > max_sentences:
            picks = np.linspace(0, len(lines) - 1, max_sentences).round().astype(np.int64)
            lines = [lines[i] for i in picks]
        settings: dict[str, Any] = dict(
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            # Documents are encoded whole, so a line-initial word has no preceding space; training
            # lines must not get one either or line-initial pieces are never used.
            add_dummy_prefix=False,
            shuffle_input_sentence=False,
            input_sentence_size=0,
            max_sentence_length=1 << 16,
            num_threads=num_threads,
        )
        path = Path(model_path)
        key = content_key("sentencepiece", spm.__version__, repr(sorted(settings.items())), lines)
        kept = cache.get(key) if cache is not None else None
        if kept is not None:
            write_atomic(path, kept)
            tok = cls.load(path)
            tok.from_cache = True
            return tok
        writer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_writer=writer,
                minloglevel=2,  # warnings and errors only; training progress is not printed
                **settings,
            )
        except RuntimeError as err:
            raise ValueError(f"SentencePiece training failed (vocab_size={vocab_size}): {err}") from err
        write_atomic(path, writer.getvalue())
        if cache is not None:
            cache.put(key, writer.getvalue())
        return cls.load(path)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id())

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        flat = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
        for i in flat:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is outside the vocabulary [0, {self.vocab_size}).")
        return self._sp.decode(flat)


def _token_text(value: object) -> str | None:
    """A special token of tokenizer_config.json: a string, or `{"content": ...}` in older files."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(jinja_file: Path, value: object) -> tuple[str | None, str | None]:
    """The chat template beside a tokenizer and where it is written: `chat_template.jinja` (what
    transformers 5 saves), or tokenizer_config.json's `chat_template` (a string, or a list of named
    templates: "default"). `(None, None)` when there is none."""
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    origin = f"{jinja_file.with_name('tokenizer_config.json')} (its chat_template)"
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        origin = f"{jinja_file.with_name('tokenizer_config.json')} (its chat_template named 'default')"
    return (value, origin) if isinstance(value, str) else (None, None)


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (byte-level BPE, SentencePiece-style, WordPiece...), with the
    bos/eos/pad tokens of the `tokenizer_config.json` beside it.

    `encode` adds no special tokens (the inputs add bos/eos themselves); `decode` skips them. A
    vocabulary without a bos token (Qwen's) uses eos in its place, one without a pad token eos too
    (padding carries weight 0). Load one with `HFTokenizer.load(path)`.
    """

    def __init__(
        self,
        tokenizer: object,
        *,
        bos: str | None,
        eos: str,
        pad: str | None,
        path: Path | None = None,
        chat_template: str | None = None,
        chat_template_origin: str | None = None,
    ) -> None:
        import tokenizers

        assert isinstance(tokenizer, tokenizers.Tokenizer)
        self._tok = tokenizer
        self.path = path
        self.chat_template: str | None = chat_template  # the Jinja source, where the files hold one
        self.chat_template_origin = chat_template_origin  # the file it is written in (errors name it)
        self.tokens: dict[str, str | None] = {"bos": bos, "eos": eos, "pad": pad}
        self._ids = {}
        for role, text in self.tokens.items():
            if text is None:
                continue
            i = tokenizer.token_to_id(text)
            if i is None:
                raise ValueError(f"the {role} token {text!r} of tokenizer_config.json is not in the vocabulary {path}.")
            self._ids[role] = int(i)

    def _model_bytes(self) -> bytes:
        return self._tok.to_str().encode()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "HFTokenizer":
        """A `tokenizer.json` file, or a directory holding one (and tokenizer_config.json).

        Raises:
            FileNotFoundError: no tokenizer.json there.
            ValueError: a file that does not parse, or no eos token (tokenizer_config.json's
                `eos_token`) to end documents with.
        """
        import tokenizers

        file = Path(path)
        file = file / "tokenizer.json" if file.is_dir() else file
        if not file.is_file():
            raise FileNotFoundError(
                f"no Hugging Face tokenizer at {str(file)!r}: expected a tokenizer.json (what "
                "`save_pretrained` writes for a fast tokenizer)."
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises its own exception type
            raise ValueError(f"{file} does not load as a Hugging Face tokenizer ({e}).") from None
        special: dict[str, object] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            extra = file.with_name(name)
            if extra.is_file():
                try:
                    special |= dict(json.loads(extra.read_text()))
                except (OSError, ValueError, TypeError) as e:
                    raise ValueError(f"{extra} does not read as JSON ({e}).") from None
        eos = _token_text(special.get("eos_token"))
        if eos is None:
            raise ValueError(
                f"{file.with_name('tokenizer_config.json')} names no eos_token, which ends every document; add "
                '"eos_token": "<the end-of-text token>" to it.'
            )
        template, origin = _chat_template(file.with_name("chat_template.jinja"), special.get("chat_template"))
        return cls(
            tok,
            bos=_token_text(special.get("bos_token")),
            eos=eos,
            pad=_token_text(special.get("pad_token")),
            path=file,
            chat_template=template,
            chat_template_origin=origin,
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def pad_id(self) -> int:
        return self._ids.get("pad", self._ids["eos"])

    @property
    def bos_id(self) -> int:
        return self._ids.get("bos", self._ids["eos"])

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and each token's `(start, end)` character span in `text`."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def token_id(self, text: str) -> int | None:
        """The id of `text` as one token of the vocabulary (a special token's), or None."""
        i = self._tok.token_to_id(text)
        return None if i is None else int(i)

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        flat = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
        for i in flat:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is outside the vocabulary [0, {self.vocab_size}).")
        return self._tok.decode(flat, skip_special_tokens=skip_special_tokens)
