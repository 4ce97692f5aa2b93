"""Build an experiment's tokenizer and train/eval inputs (the job-directory side of data)."""

import dataclasses
from pathlib import Path

import numpy as np

from equipax.core.config import ConfigError
from equipax.data import (
    BaseInput,
    ByteTokenizer,
    SentencePieceTokenizer,
    SyntheticLMInput,
    TokenWindowInput,
    Tokenizer,
    build_lm_texts_tokens,
    split_plays,
    unigram_entropy,
)
from equipax.launch.experiment import ExperimentConfig

TOKENIZER_FILE = "tokenizer.model"


@dataclasses.dataclass
class LMInputs:
    """What the loop needs from the data side."""

    tokenizer: Tokenizer
    train: BaseInput
    eval: BaseInput
    train_tokens: int
    unigram_entropy: float | None  # nats/token of the training tokens; None for synthetic data


def _shakespeare_split(cfg: ExperimentConfig) -> tuple[dict[str, str], dict[str, str]]:
    try:
        return split_plays(cfg.data.validation_plays)
    except ValueError as e:
        raise ConfigError(f"data.validation_plays: {e}") from None


def build_tokenizer(cfg: ExperimentConfig, job_dir: Path, log=print) -> Tokenizer:
    """The byte tokenizer, or the job's SentencePiece model (trained on first use, then reloaded).

    Arguments:
        cfg: the experiment.
        job_dir: where `tokenizer.model` lives.
        log: progress messages go here.
    """
    if cfg.data.tokenizer == "byte" or cfg.data.source == "synthetic":
        return ByteTokenizer()
    path = Path(job_dir) / TOKENIZER_FILE
    if path.exists():
        tok = SentencePieceTokenizer.load(path)
        if tok.vocab_size != cfg.model.vocab_size:
            raise ConfigError(
                f"{path} has {tok.vocab_size} pieces but model.vocab_size={cfg.model.vocab_size}. "
                "Use a new --job-log-dir, or delete the tokenizer file together with the checkpoints."
            )
        return tok
    train, _ = _shakespeare_split(cfg)
    log(f"Training a {cfg.model.vocab_size}-piece SentencePiece BPE vocabulary on {len(train)} plays...")
    try:
        return SentencePieceTokenizer.train(
            train.values(), vocab_size=cfg.model.vocab_size, model_path=path,
            max_sentences=cfg.data.tokenizer_max_sentences,
        )
    except ValueError as e:
        raise ConfigError(
            f"Could not train a {cfg.model.vocab_size}-piece tokenizer: {e} "
            "Raise model.vocab_size, or use --set data.tokenizer=byte."
        ) from None


def build_lm_inputs(
    cfg: ExperimentConfig, tokenizer: Tokenizer, *, num_infeed_hosts: int = 1, infeed_host_index: int = 0
) -> LMInputs:
    """Training (repeating, shuffled) and evaluation (one ordered pass) inputs for this host."""
    d = cfg.data
    common = dict(seq_len=d.seq_len, batch_size=d.batch_size, num_infeed_hosts=num_infeed_hosts,
                  infeed_host_index=infeed_host_index)
    if d.source == "synthetic":
        train = SyntheticLMInput(vocab_size=cfg.model.vocab_size, seed=d.seed, repeat=True, **common)
        evaluation = SyntheticLMInput(vocab_size=cfg.model.vocab_size, seed=d.seed + 1, repeat=False,
                                      num_batches=max(cfg.train.eval_batches, 1), **common)
        return LMInputs(tokenizer, train, evaluation, train_tokens=0, unigram_entropy=None)
    train_texts, eval_texts = _shakespeare_split(cfg)
    train_tokens = build_lm_texts_tokens(train_texts.values(), tokenizer)
    eval_tokens = build_lm_texts_tokens(eval_texts.values(), tokenizer)
    if int(np.max(train_tokens)) >= cfg.model.vocab_size:
        raise ConfigError(
            f"The tokenizer emits ids up to {int(np.max(train_tokens))} but model.vocab_size="
            f"{cfg.model.vocab_size}; raise model.vocab_size."
        )
    try:
        train = TokenWindowInput(train_tokens, seed=d.seed, repeat=True, tokenizer=tokenizer, **common)
        evaluation = TokenWindowInput(eval_tokens, seed=d.seed, repeat=False, tokenizer=tokenizer, **common)
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    return LMInputs(
        tokenizer, train, evaluation, train_tokens=int(train_tokens.size),
        unigram_entropy=unigram_entropy(train_tokens, tokenizer.vocab_size),
    )
