"""Data sources: Shakespeare's plays, C4-format shards and synthetic tokens."""

from equipax.data.sources.c4 import (
    DataError,
    TextShards,
    find_shards,
    iter_text_documents,
    write_shards,
)
from equipax.data.sources.shakespeare import clean_markdown, list_plays, load_plays, split_plays
from equipax.data.sources.synthetic import SyntheticLMInput

__all__ = [
    "DataError",
    "SyntheticLMInput",
    "TextShards",
    "clean_markdown",
    "find_shards",
    "iter_text_documents",
    "list_plays",
    "load_plays",
    "split_plays",
    "write_shards",
]
