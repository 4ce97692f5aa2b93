"""Data sources: Shakespeare's plays, C4-format shards, synthetic tokens and images, digits."""

from equipax.data.sources.c4 import (
    DataError,
    ShardPath,
    TextShards,
    check_complete_sets,
    find_shards,
    input_files,
    iter_text_documents,
    shard_split,
)
from equipax.data.sources.c4_write import check_shard_output, write_shards
from equipax.data.sources.digits import load_digits, split_digits
from equipax.data.sources.images import ImageClassificationInput, synthetic_images
from equipax.data.sources.shakespeare import clean_markdown, list_plays, load_plays, play_conversations, split_plays
from equipax.data.sources.synthetic import SyntheticLMInput

__all__ = [
    "DataError",
    "ImageClassificationInput",
    "SyntheticLMInput",
    "ShardPath",
    "TextShards",
    "check_complete_sets",
    "check_shard_output",
    "clean_markdown",
    "find_shards",
    "input_files",
    "iter_text_documents",
    "list_plays",
    "load_digits",
    "load_plays",
    "play_conversations",
    "split_digits",
    "shard_split",
    "split_plays",
    "synthetic_images",
    "write_shards",
]
