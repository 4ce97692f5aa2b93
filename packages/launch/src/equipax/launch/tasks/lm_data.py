"""Build an experiment's tokenizer and train/eval inputs (the job-directory side of data)."""

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from equipax.core.knobs import ConfigError
from equipax.data import (
    BaseInput,
    ByteTokenizer,
    DocumentLMInput,
    HFTokenizer,
    SentencePieceTokenizer,
    SyntheticLMInput,
    TextShards,
    Tokenizer,
    TokenWindowInput,
    build_lm_texts_tokens,
    find_shards,
    make_eval_input,
    split_plays,
    unigram_entropy,
)
from equipax.launch.configs.experiment import LMExperiment

__all__ = [
    "build_lm_inputs",
    "build_tokenizer",
    "HF_TOKENIZER_FILE",
    "LMInputs",
    "open_c4_split",
    "per_host_batch_size",
    "tokenizer_path",
    "TOKENIZER_FILE",
]

TOKENIZER_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"


def tokenizer_path(cfg: LMExperiment, job_dir: Path) -> Path | None:
    """The vocabulary file the job's token ids come from (None: bytes, or synthetic ids)."""
    d = cfg.data
    if d.tokenizer == "byte" or d.source == "synthetic":
        return None
    if d.vocab_path:
        path = Path(d.vocab_path)
        return path / HF_TOKENIZER_FILE if d.tokenizer == "huggingface" and path.is_dir() else path
    return Path(job_dir) / (HF_TOKENIZER_FILE if d.tokenizer == "huggingface" else TOKENIZER_FILE)


def _hf_tokenizer(cfg: LMExperiment, job_dir: Path) -> Tokenizer:
    path = tokenizer_path(cfg, job_dir)
    assert path is not None
    knob = f"data.vocab_path={cfg.data.vocab_path!r}" if cfg.data.vocab_path else f"The job's {path}"
    try:
        tok = HFTokenizer.load(path)
    except (OSError, ValueError) as e:
        fix = "" if cfg.data.vocab_path else " (`launch convert hf-import` puts the model's tokenizer there)"
        raise ConfigError(f"{knob}: {e}{fix}") from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"{knob} has {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}; set "
            f"model.vocab_size to at least {tok.vocab_size}."
        )
    return tok


@dataclasses.dataclass
class LMInputs:
    """What the loop needs from the data side.

    `eval` already follows `data.reset_for_eval`: the loop calls `eval.reset()` before every eval
    run; for rolling eval (`reset_for_eval=False`) that starts a new run of `train.eval_batches`
    batches without rewinding the data.
    """

    tokenizer: Tokenizer
    train: BaseInput
    eval: BaseInput
    train_tokens: int  # tokens in the training split; 0 where unknown (synthetic, c4)
    unigram_entropy: float | None  # nats/token of the training tokens; None for synthetic and c4


def _shakespeare_split(cfg: LMExperiment) -> tuple[dict[str, str], dict[str, str]]:
    try:
        return split_plays(cfg.data.validation_plays)
    except ValueError as e:
        raise ConfigError(f"data.validation_plays: {e}") from None


def open_c4_split(cfg: LMExperiment, split: str) -> TextShards:
    """The shards of `split` ("train" or "eval") under `data.path`, checked; ConfigError if unusable."""
    d = cfg.data
    pattern = d.train_files if split == "train" else d.eval_files
    knob = "data.train_files" if split == "train" else "data.eval_files"
    try:
        return TextShards(find_shards(d.path, pattern), max_malformed_fraction=d.max_malformed_fraction)
    except ValueError as e:
        raise ConfigError(f"{knob}={pattern!r} under data.path={d.path!r}: {e}") from None


def _tokenizer_texts(cfg: LMExperiment) -> Iterator[str]:
    """Training texts for the vocabulary: about `tokenizer_max_sentences` lines, from the start."""
    if cfg.data.source != "c4":
        yield from _shakespeare_split(cfg)[0].values()
        return
    lines = 0
    for text in open_c4_split(cfg, "train"):
        yield text
        lines += text.count("\n") + 1
        if lines >= cfg.data.tokenizer_max_sentences:
            return


def build_tokenizer(cfg: LMExperiment, job_dir: Path, log: Callable[[str], object] = print) -> Tokenizer:
    """The byte tokenizer, `data.vocab_path`, the job's SentencePiece model (trained on first use) or
    its Hugging Face tokenizer.json.

    Arguments:
        cfg: the experiment.
        job_dir: where `tokenizer.model` lives.
        log: progress messages go here.
    """
    if cfg.data.tokenizer == "byte" or cfg.data.source == "synthetic":
        return ByteTokenizer()
    if cfg.data.tokenizer == "huggingface":
        return _hf_tokenizer(cfg, job_dir)
    if cfg.data.vocab_path:
        try:
            tok = SentencePieceTokenizer.load(cfg.data.vocab_path)
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"data.vocab_path={cfg.data.vocab_path!r}: {e}") from None
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"data.vocab_path={cfg.data.vocab_path!r} has {tok.vocab_size} pieces but model.vocab_size="
                f"{cfg.model.vocab_size}; set model.vocab_size to at least {tok.vocab_size}."
            )
        return tok
    path = Path(job_dir) / TOKENIZER_FILE
    if path.exists():
        try:
            tok = SentencePieceTokenizer.load(path)
        except (OSError, RuntimeError) as e:
            raise ConfigError(
                f"The job's vocabulary {str(path)!r} does not load ({e}); its checkpoints were trained "
                "with it. Restore the file from a copy, or start fresh with a new --job-log-dir."
            ) from None
        if tok.vocab_size != cfg.model.vocab_size:
            raise ConfigError(
                f"{path} has {tok.vocab_size} pieces but model.vocab_size={cfg.model.vocab_size}. "
                "Use a new --job-log-dir, or delete the tokenizer file together with the checkpoints."
            )
        return tok
    what = "plays" if cfg.data.source == "shakespeare" else f"C4 shards in {cfg.data.path}"
    log(f"Training a {cfg.model.vocab_size}-piece SentencePiece BPE vocabulary on the training {what}...")
    try:
        return SentencePieceTokenizer.train(
            _tokenizer_texts(cfg),
            vocab_size=cfg.model.vocab_size,
            model_path=path,
            max_sentences=cfg.data.tokenizer_max_sentences,
        )
    except ConfigError:
        raise  # the training texts are unusable (missing data.path...): that message, not "raise vocab_size"
    except ValueError as e:
        raise ConfigError(
            f"Could not train a {cfg.model.vocab_size}-piece tokenizer: {e} "
            "Raise model.vocab_size, point data.vocab_path at an existing .model file, "
            "or use --set data.tokenizer=byte."
        ) from None


def per_host_batch_size(cfg: LMExperiment, num_infeed_hosts: int) -> int:
    """The global batch split over the hosts; ConfigError when it does not divide."""
    global_batch = cfg.global_batch_size
    if global_batch % num_infeed_hosts:
        raise ConfigError(
            f"The global batch {global_batch} does not split over {num_infeed_hosts} hosts; "
            f"set data.batch_size to a multiple of {num_infeed_hosts}."
        )
    return global_batch // num_infeed_hosts


def build_lm_inputs(
    cfg: LMExperiment, tokenizer: Tokenizer, *, num_infeed_hosts: int = 1, infeed_host_index: int = 0
) -> LMInputs:
    """Training (repeating, shuffled) and evaluation inputs for host `infeed_host_index`.

    The eval input follows `data.reset_for_eval`: a padded full pass (True) or rolling batches
    from a repeating input (False). Data problems (missing directory, empty or malformed shards,
    bad host layout) raise ConfigError.
    """
    d = cfg.data
    b, n, h = per_host_batch_size(cfg, num_infeed_hosts), num_infeed_hosts, infeed_host_index
    eval_repeat = not d.reset_for_eval
    train_tokens, entropy = 0, None
    train: BaseInput
    evaluation: BaseInput
    try:
        if d.source == "synthetic":
            train = SyntheticLMInput(
                vocab_size=cfg.model.vocab_size,
                seq_len=d.seq_len,
                batch_size=b,
                num_infeed_hosts=n,
                infeed_host_index=h,
                seed=d.seed,
                repeat=True,
            )
            evaluation = SyntheticLMInput(
                vocab_size=cfg.model.vocab_size,
                seq_len=d.seq_len,
                batch_size=b,
                num_infeed_hosts=n,
                infeed_host_index=h,
                seed=d.seed + 1,
                repeat=eval_repeat,
                num_batches=max(cfg.train.eval_batches, 1),
            )
        elif d.source == "c4":
            train = DocumentLMInput(
                open_c4_split(cfg, "train"),
                tokenizer=tokenizer,
                seq_len=d.seq_len,
                batch_size=b,
                num_infeed_hosts=n,
                infeed_host_index=h,
                seed=d.seed,
                repeat=True,
                packing=d.packing,
            )
            evaluation = DocumentLMInput(
                open_c4_split(cfg, "eval"),
                tokenizer=tokenizer,
                seq_len=d.seq_len,
                batch_size=b,
                num_infeed_hosts=n,
                infeed_host_index=h,
                seed=d.seed + 1,
                repeat=eval_repeat,
                packing=d.packing,
            )
        else:
            train_texts, eval_texts = _shakespeare_split(cfg)
            train_stream = build_lm_texts_tokens(train_texts.values(), tokenizer)
            eval_stream = build_lm_texts_tokens(eval_texts.values(), tokenizer)
            if int(np.max(train_stream)) >= cfg.model.vocab_size:
                raise ConfigError(
                    f"The tokenizer emits ids up to {int(np.max(train_stream))} but model.vocab_size="
                    f"{cfg.model.vocab_size}; raise model.vocab_size."
                )
            train = TokenWindowInput(
                train_stream,
                seq_len=d.seq_len,
                batch_size=b,
                num_infeed_hosts=n,
                infeed_host_index=h,
                seed=d.seed,
                repeat=True,
                tokenizer=tokenizer,
            )
            evaluation = TokenWindowInput(
                eval_stream,
                seq_len=d.seq_len,
                batch_size=b,
                num_infeed_hosts=n,
                infeed_host_index=h,
                seed=d.seed,
                repeat=eval_repeat,
                tokenizer=tokenizer,
            )
            train_tokens = int(train_stream.size)
            entropy = unigram_entropy(train_stream, tokenizer.vocab_size)
        evaluation = make_eval_input(evaluation, reset_for_eval=d.reset_for_eval, num_batches=cfg.train.eval_batches)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    return LMInputs(tokenizer, train, evaluation, train_tokens=train_tokens, unigram_entropy=entropy)
