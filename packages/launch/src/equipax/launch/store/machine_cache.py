"""The machine's cache: what equipax derives from data or probes once and may reuse across jobs.

`EQUIPAX_CACHE_DIR` names it; unset, it is `$XDG_CACHE_HOME/equipax` (`~/.cache/equipax` where
that is unset too), as Hugging Face keeps `~/.cache/huggingface`; set to an empty string, nothing
is kept there. It holds:

- `vocabularies/`: SentencePiece models a job trained, by a digest of their training lines and
  settings (`equipax.data.SentencePieceTokenizer.train`). A fresh job on the same texts copies the
  model into its own directory instead of training it again; the job's copy is what its
  checkpoints use, so clearing the cache changes nothing for an existing job.
- `tokens/`: corpora encoded with a vocabulary, by a digest of the texts and the vocabulary
  (`equipax.data.build_lm_texts_tokens`): a fresh job or a resume reads the stream instead of
  encoding every document again.
- `compiler_flags.json`: compiler-flag sets a child process already checked
  (`equipax.launch.hardware.compiler_flags`).
- `remat/`: the policies `model.transformer.remat="auto"` chose, by a digest of the step's knobs,
  the mesh, the device kind, the memory budget and the compiler's versions
  (`equipax.launch.aot.remat`): another job of the same experiment compiles nothing to choose.

Every entry is named by what it was computed from and checked against its own SHA-256 when read
(`equipax.data.ContentCache`), so an entry is either exactly the result of those inputs or
ignored; deleting the directory at any time is safe. docs/data.md, "The machine's cache".
"""

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # equipax.data is imported where a cache is opened: `cache_root` runs before JAX starts
    from equipax.data import ContentCache

__all__ = ["CACHE_ENV", "cache_root", "content_cache"]

CACHE_ENV = "EQUIPAX_CACHE_DIR"


def cache_root() -> Path | None:
    """The cache directory (not created here), or None when `EQUIPAX_CACHE_DIR` is empty."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return Path(value).expanduser() if value.strip() else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "equipax"


def content_cache(kind: str) -> "ContentCache | None":
    """The cache of one kind of result (`vocabularies`, `tokens`), or None when caching is off."""
    from equipax.data import ContentCache

    root = cache_root()
    return ContentCache(root / kind) if root is not None else None
