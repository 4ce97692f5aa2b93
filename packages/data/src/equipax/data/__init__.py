"""equipax.data: inputs (Pax BaseInput semantics on grain), tokenizers and sources."""

from equipax.data.base import BaseInput, Batch, Documents
from equipax.data.chat import ChatError, ChatTemplate, Conversations, chat_example, read_conversations
from equipax.data.chat_input import ChatSFTInput
from equipax.data.content_cache import ContentCache, content_key
from equipax.data.documents import DocumentLMInput
from equipax.data.eval import RollingEvalInput, make_eval_input
from equipax.data.global_order import GlobalOrderInput, epoch_permutation
from equipax.data.lm_input import TokenWindowInput, build_lm_texts_tokens, unigram_entropy
from equipax.data.metrics import (
    MULTIPLE_CHOICE_SETS,
    MultipleChoiceItem,
    MultipleChoiceSet,
    choice_accuracy,
    exact_match,
    shakespeare_next_line,
    token_f1,
)
from equipax.data.sources import (
    DataError,
    ImageClassificationInput,
    ShardPath,
    SyntheticLMInput,
    TextShards,
    check_complete_sets,
    check_shard_output,
    clean_markdown,
    find_shards,
    input_files,
    iter_text_documents,
    list_plays,
    load_digits,
    load_plays,
    play_conversations,
    shard_split,
    split_digits,
    split_plays,
    synthetic_images,
    write_shards,
)
from equipax.data.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer
from equipax.data.wrappers import MappedInput

__all__ = [
    "Batch",
    "BaseInput",
    "ByteTokenizer",
    "ChatError",
    "ChatSFTInput",
    "ChatTemplate",
    "ContentCache",
    "Conversations",
    "DataError",
    "Documents",
    "GlobalOrderInput",
    "ImageClassificationInput",
    "DocumentLMInput",
    "HFTokenizer",
    "MappedInput",
    "MULTIPLE_CHOICE_SETS",
    "MultipleChoiceItem",
    "MultipleChoiceSet",
    "RollingEvalInput",
    "ShardPath",
    "TextShards",
    "SentencePieceTokenizer",
    "SyntheticLMInput",
    "TokenWindowInput",
    "Tokenizer",
    "build_lm_texts_tokens",
    "chat_example",
    "check_complete_sets",
    "choice_accuracy",
    "check_shard_output",
    "clean_markdown",
    "content_key",
    "epoch_permutation",
    "exact_match",
    "find_shards",
    "input_files",
    "iter_text_documents",
    "make_eval_input",
    "read_conversations",
    "list_plays",
    "load_digits",
    "load_plays",
    "play_conversations",
    "split_digits",
    "shakespeare_next_line",
    "shard_split",
    "split_plays",
    "synthetic_images",
    "token_f1",
    "unigram_entropy",
    "write_shards",
]
