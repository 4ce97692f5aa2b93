"""Data sources: Shakespeare's plays and synthetic tokens."""

from equipax.data.sources.shakespeare import clean_markdown, list_plays, load_plays, split_plays
from equipax.data.sources.synthetic import SyntheticLMInput

__all__ = ["SyntheticLMInput", "clean_markdown", "list_plays", "load_plays", "split_plays"]
