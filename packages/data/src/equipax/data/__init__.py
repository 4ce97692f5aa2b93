"""equipax.data: inputs, tokenizers and sources."""

from equipax.data.base import Batch, BaseInput
from equipax.data.lm_input import TokenWindowInput, build_lm_texts_tokens, unigram_entropy
from equipax.data.sources import SyntheticLMInput, clean_markdown, list_plays, load_plays, split_plays
from equipax.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer

__all__ = [
    "Batch",
    "BaseInput",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "SyntheticLMInput",
    "TokenWindowInput",
    "Tokenizer",
    "build_lm_texts_tokens",
    "clean_markdown",
    "list_plays",
    "load_plays",
    "split_plays",
    "unigram_entropy",
]
