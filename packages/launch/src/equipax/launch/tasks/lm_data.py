"""Build an experiment's tokenizer and train/eval inputs (the job-directory side of data).

The inputs come from the token source `data.source` names (`equipax.launch.configs.token_sources`:
each source builds its own, given this host's `HostShard`); this module adds what every source
shares: the vocabulary and the eval wrapper.
"""

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path

from equipax.core.knobs import ConfigError
from equipax.data import BaseInput, ByteTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer, make_eval_input
from equipax.launch.configs.experiment import LMExperiment
from equipax.launch.configs.sources import HostShard
from equipax.launch.store.checks import data_path
from equipax.launch.store.machine_cache import CACHE_ENV, cache_root, content_cache
from equipax.launch.store.storage import AnyPath, is_remote, job_path, local_copy, local_file

__all__ = [
    "build_lm_inputs",
    "build_tokenizer",
    "HF_TOKENIZER_FILE",
    "LMInputs",
    "per_host_batch_size",
    "tokenizer_path",
    "DATA_CACHE",
    "TOKENIZER_FILE",
]

TOKENIZER_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"
# Under the job directory: what a source keeps for the job's next start (`build_lm_inputs`).
DATA_CACHE = "data_cache"


def tokenizer_path(cfg: LMExperiment, job_dir: AnyPath) -> AnyPath | None:
    """The vocabulary file the job's token ids come from (None: bytes, or synthetic ids)."""
    d = cfg.data
    if d.tokenizer == "byte" or not d.token_source.uses_tokenizer:
        return None
    if d.vocab_path:
        path = job_path(d.vocab_path)  # local, or in a bucket (`gs://`)
        return path / HF_TOKENIZER_FILE if d.tokenizer == "huggingface" and path.is_dir() else path
    return job_path(job_dir) / (HF_TOKENIZER_FILE if d.tokenizer == "huggingface" else TOKENIZER_FILE)


def _hf_tokenizer(cfg: LMExperiment, job_dir: AnyPath) -> Tokenizer:
    if cfg.data.vocab_path:
        data_path(cfg.data.vocab_path, "data.vocab_path")  # a bucket's: checked before it is listed
    path = tokenizer_path(cfg, job_dir)
    assert path is not None
    knob = f"data.vocab_path={cfg.data.vocab_path!r}" if cfg.data.vocab_path else f"The job's {path}"
    try:
        tok = HFTokenizer.load(_local_vocabulary(path, siblings=HF_SIBLINGS))
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
    train_tokens: int  # tokens in the training split; 0 where unknown (streams: synthetic, c4)
    unigram_entropy: float | None  # nats/token of the training tokens; None where unknown


def build_tokenizer(cfg: LMExperiment, job_dir: AnyPath, log: Callable[[str], object] = print) -> Tokenizer:
    """The byte tokenizer, `data.vocab_path`, the job's SentencePiece model (trained on first use) or
    its Hugging Face tokenizer.json.

    Arguments:
        cfg: the experiment.
        job_dir: where `tokenizer.model` lives.
        log: progress messages go here.
    """
    source = cfg.data.token_source
    if cfg.data.tokenizer == "byte" or not source.uses_tokenizer:
        return ByteTokenizer()
    if cfg.data.tokenizer == "huggingface":
        return _hf_tokenizer(cfg, job_dir)
    if cfg.data.vocab_path:
        try:
            tok = SentencePieceTokenizer.load(_local_vocabulary(data_path(cfg.data.vocab_path, "data.vocab_path")))
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"data.vocab_path={cfg.data.vocab_path!r}: {e}") from None
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"data.vocab_path={cfg.data.vocab_path!r} has {tok.vocab_size} pieces but model.vocab_size="
                f"{cfg.model.vocab_size}; set model.vocab_size to at least {tok.vocab_size}."
            )
        return tok
    path = job_path(job_dir) / TOKENIZER_FILE
    if path.exists():
        try:
            tok = SentencePieceTokenizer.load(local_file(path))
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
    log(
        f"Training a {cfg.model.vocab_size}-piece SentencePiece BPE vocabulary on the training "
        f"{source.describe(cfg.data)}..."
    )
    try:
        with local_copy(path.parent) as folder:  # a store's job: trained here, then uploaded
            tok = SentencePieceTokenizer.train(
                source.vocabulary_texts(cfg.data),
                vocab_size=cfg.model.vocab_size,
                model_path=folder / TOKENIZER_FILE,
                max_sentences=cfg.data.tokenizer_max_sentences,
                cache=content_cache("vocabularies"),
            )
        if tok.from_cache:
            log(f"  the same vocabulary was trained on these texts before: copied from {cache_root()} ({CACHE_ENV})")
        return tok
    except ConfigError:
        raise  # the training texts are unusable (missing data.path...): that message, not "raise vocab_size"
    except ValueError as e:
        raise ConfigError(
            f"Could not train a {cfg.model.vocab_size}-piece tokenizer: {e} "
            "Raise model.vocab_size, point data.vocab_path at an existing .model file, "
            "or use --set data.tokenizer=byte."
        ) from None


# What `HFTokenizer.load` reads beside a tokenizer.json.
HF_SIBLINGS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _local_vocabulary(path: AnyPath, siblings: tuple[str, ...] = ()) -> Path:
    """`path` as a local file the tokenizer libraries can open: a store's object downloaded (with
    its `siblings`), or FileNotFoundError naming the object when there is none."""
    if is_remote(path) and not path.is_file():
        raise FileNotFoundError(f"no vocabulary file {str(path)!r} in the bucket; upload it there or fix the path")
    return local_file(path, siblings=siblings)


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
    cfg: LMExperiment,
    tokenizer: Tokenizer,
    *,
    num_infeed_hosts: int = 1,
    infeed_host_index: int = 0,
    cache_dir: AnyPath | None = None,
) -> LMInputs:
    """Training (repeating, shuffled) and evaluation inputs for host `infeed_host_index`.

    `cache_dir` (a job's `data_cache/`): where the source keeps what is slow to compute from the
    data, for the job's next start (packed documents' token counts); None computes it each time.

    The eval input follows `data.reset_for_eval`: a padded full pass (True) or rolling batches
    from a repeating input (False). Data problems (missing directory, empty or malformed shards,
    bad host layout) raise ConfigError.
    """
    d = cfg.data
    shard = HostShard(
        count=num_infeed_hosts, index=infeed_host_index, batch_size=per_host_batch_size(cfg, num_infeed_hosts)
    )
    try:
        # A source written before `cache_dir` existed (a user's, docs/extending.md) builds without one.
        takes_cache = "cache_dir" in inspect.signature(d.token_source.build).parameters
        built = d.token_source.build(
            d,
            tokenizer=tokenizer,
            vocab_size=cfg.model.vocab_size,
            eval_batches=cfg.train.eval_batches,
            shard=shard,
            **({"cache_dir": cache_dir} if takes_cache else {}),
        )
        evaluation = make_eval_input(built.eval, reset_for_eval=d.reset_for_eval, num_batches=cfg.train.eval_batches)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    return LMInputs(
        tokenizer, built.train, evaluation, train_tokens=built.train_tokens, unigram_entropy=built.unigram_entropy
    )
