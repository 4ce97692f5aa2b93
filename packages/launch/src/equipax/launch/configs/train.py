"""The training loop's config (`train`) and the sub-configs of what the loop runs besides steps.

`TrainConfig` holds the loop itself: how long, how often to log, evaluate and checkpoint, the
non-finite policy. Each sub-config belongs to the code that reads it: `train.sample` to the
language-model family's end-of-run sample (`equipax.launch.tasks.lm_family`), `train.decode` to
sampling during training (`equipax.launch.training.decode_hook`), `train.profile` to the profile
window (`equipax.launch.training.profiling`), `train.pgle` to PGLE (`equipax.launch.training.pgle`)
and `train.compiler` to the compiler flags set before JAX starts (`equipax.launch.hardware.compiler_flags`);
`train.vn` (variational noise, `equipax.core.configs.VariationalNoiseConfig`) to the train step.
No JAX here: `launch list` and `launch show` import this.
"""

import dataclasses
import shlex
from typing import ClassVar, Literal

from equipax.core.learner_config import VariationalNoiseConfig
from equipax.core.seeds import check_seed

__all__ = ["CompilerConfig", "DecodeConfig", "PGLEConfig", "ProfileConfig", "SampleConfig", "TrainConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleConfig:
    """Language models only: the sample generated after training.

    tokens: how many tokens to generate (0 = no sample); prompt: the text it continues;
    temperature: the sampling temperature (0 = greedy).
    """

    tokens: int = 200
    prompt: str = "ROMEO:"
    temperature: float = 0.8

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"train.sample.tokens must be >= 0 (0 = no sample); got {self.tokens}.")
        if self.temperature < 0:
            raise ValueError(f"train.sample.temperature must be >= 0; got {self.temperature}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Language models only: sampling during training (Pax's decode during training).

    every: every this many steps (0 = never), continue each of `prompts` by `tokens` tokens with the
    KV cache (greedy at `temperature` 0), written to metrics.jsonl (split "decode") and TensorBoard
    text. prompts: the texts to continue; tokens: new tokens per prompt; temperature: the sampling
    temperature.
    """

    every: int = 0
    prompts: tuple[str, ...] = ("ROMEO:",)
    tokens: int = 32
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.every < 0 or self.tokens < 1 or self.temperature < 0:
            raise ValueError(
                f"train.decode.every must be >= 0 (0 = off), train.decode.tokens >= 1 and "
                f"train.decode.temperature >= 0; got {self.every}, {self.tokens}, {self.temperature}."
            )
        if self.every and not self.prompts:
            raise ValueError(
                "train.decode.every > 0 needs at least one train.decode.prompts, e.g. "
                "--set \"train.decode.prompts=('ROMEO:',)\"."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """The profile window (docs/pgle.md, "Profiling").

    steps: trace this many steps with `jax.profiler` into `<job>/profile/` (0 = off;
    `launch run --profile START:COUNT`); start_step: the first traced step (None = the run's second
    step, so the window never holds the compiling first step unless asked for); all_processes:
    trace every process, not only process 0.
    """

    steps: int = 0
    start_step: int | None = None
    all_processes: bool = False

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"train.profile.steps must be >= 0 (0 = no profile); got {self.steps}.")
        if self.start_step is not None and self.start_step < 1:
            raise ValueError(
                f"train.profile.start_step must be a step >= 1, or None for the run's second step; got "
                f"{self.start_step}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PGLEConfig:
    """XLA's profile-guided latency estimator (GPU; docs/pgle.md).

    mode: "off"; "auto" is JAX's automatic PGLE (`profiling_runs` profiled runs, then a recompile;
    profiles aggregated at `aggregation_percentile`); "manual" compiles with the profile at
    `profile_path` (written by `launch pgle collect`). profiling_runs, aggregation_percentile,
    profile_path: as just said.
    """

    mode: Literal["off", "auto", "manual"] = "off"
    profiling_runs: int = 3
    aggregation_percentile: int = 90
    profile_path: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("off", "auto", "manual"):
            raise ValueError(f"train.pgle.mode must be 'off', 'auto' or 'manual'; got {self.mode!r}.")
        if self.profiling_runs < 1:
            raise ValueError(f"train.pgle.profiling_runs must be >= 1; got {self.profiling_runs}.")
        if not 0 <= self.aggregation_percentile <= 100:
            raise ValueError(
                f"train.pgle.aggregation_percentile must be in [0, 100]; got {self.aggregation_percentile}."
            )
        if self.mode == "manual" and not self.profile_path:
            raise ValueError(
                "train.pgle.mode='manual' needs train.pgle.profile_path: the profile.pb written by "
                "`launch pgle collect --exp NAME` (docs/pgle.md)."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompilerConfig:
    """Compiler flags, set in the environment before JAX starts (`launch run`, `launch compile`;
    docs/compile.md, "Compiler flags").

    xla_flags: XLA flags added to `XLA_FLAGS`, e.g. "--xla_gpu_enable_latency_hiding_scheduler=true";
    a flag of the same name already in the environment is replaced. XLA:CPU refuses flags it does
    not know: TPU flags go in libtpu_init_args. libtpu_init_args: flags added to `LIBTPU_INIT_ARGS`,
    which libtpu reads when it loads (TPU runs and `launch compile --topology`): Pax's and MaxText's
    way of passing XLA:TPU flags, e.g. "--xla_tpu_enable_latency_hiding_scheduler=true".
    cache_dir: JAX's persistent compilation cache for `launch run` (a job whose programs were
    compiled before loads them instead of compiling them again): "machine" = the machine's cache
    (`xla/` in `EQUIPAX_CACHE_DIR`, at most 8 GiB, shared by the jobs of this machine; the job's
    `compile_cache/` where `EQUIPAX_CACHE_DIR=""`), a relative path is under the job directory,
    "" = off. Left alone where `JAX_COMPILATION_CACHE_DIR` is set.
    """

    xla_flags: str = ""
    libtpu_init_args: str = ""
    cache_dir: str = "machine"

    def __post_init__(self) -> None:
        for name in ("xla_flags", "libtpu_init_args"):
            try:
                shlex.split(getattr(self, name))
            except ValueError as e:
                raise ValueError(
                    f"train.compiler.{name}={getattr(self, name)!r} does not split into flags ({e}); "
                    "give space-separated flags, quoting a value with spaces."
                ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The host loop around the jitted step.

    num_steps: training steps; num_epochs: when set, train this many passes over a finite
    training set instead (num_steps is then ignored: steps = num_epochs x examples // batch),
    and at each epoch's end the loop evaluates on the whole eval set, writes an `epoch` record
    (train loss/accuracy of the epoch, test loss/accuracy) and saves a checkpoint.
    eval_batches: batches per eval run; 0 = one whole pass of the eval input.
    log_every, eval_every, checkpoint_every: steps between metric lines (stdout, metrics.jsonl,
    TensorBoard), between evaluations, and between checkpoints. keep_checkpoints: how many of the
    newest checkpoints are kept. seed: the root seed of the init and step keys (the data has
    its own `data.seed`), an int in `[0, 2**63)` as every seed. peak_tflops_per_device: the
    device's peak TFLOP/s for the MFU figure; None = looked up from the device kind (it also
    prices `model.transformer.remat="auto"`'s candidates). hbm_gib_per_device: the memory per
    device that `model.transformer.remat="auto"` fits the step in; None = the device's own (its
    allocator's limit; on a CPU, the host's memory shared by its devices; `launch compile`: the
    target's HBM, or `--hbm-gib`). hbm_margin: the fraction of it kept free (the input pipeline's
    buffers, what the compiler's figure misses; 5%: XLA:TPU's figure is the program's whole need,
    and c4_1b at 6 layers with dots_saveable, at 14.70 of a TPU v5e's 15.75 GiB, runs).

    on_nonfinite: a step whose loss or gradient norm is not finite never updates the state
    (in-graph). "skip" carries on, and stops (exit 4) once more than
    `max_consecutive_nonfinite` steps in a row were skipped; "abort" stops at the first one.
    check_update_norm: also take the update's norm every step (`update_norm` in the metrics), so an
    update that overflows although the gradients are finite (a learning rate far too high) is
    reported at its own step and named in the stop message; summed in the pass that applies the
    update, so it costs no pass over memory of its own (docs/errors.md). Off, the same pass
    still flags an update with an element that overflows (or whose square does), and an
    overflowing update still never makes a parameter non-finite (applied elementwise where finite).
    debug_nan_steps: FOR TESTS ONLY: these steps' batches get NaN weights (a poisoned batch).

    sample, decode, profile, pgle, compiler, vn: the sub-configs (this module's docstring).
    """

    num_steps: int = 1000
    num_epochs: int | None = None
    log_every: int = 20
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    seed: int = 0
    peak_tflops_per_device: float | None = None
    hbm_gib_per_device: float | None = None
    hbm_margin: float = 0.05
    on_nonfinite: Literal["skip", "abort"] = "skip"
    max_consecutive_nonfinite: int = 3
    check_update_norm: bool = True
    debug_nan_steps: tuple[int, ...] = ()
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
    decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    pgle: PGLEConfig = dataclasses.field(default_factory=PGLEConfig)
    compiler: CompilerConfig = dataclasses.field(default_factory=CompilerConfig)
    vn: VariationalNoiseConfig = dataclasses.field(default_factory=VariationalNoiseConfig)

    # The knobs that moved into the sub-configs: an old path given with --set is refused naming
    # its new one, and an old job's config.json is read with them moved (`equipax.core.knobs`).
    RENAMED: ClassVar[dict[str, str]] = {
        "sample_tokens": "sample.tokens",
        "sample_prompt": "sample.prompt",
        "sample_temperature": "sample.temperature",
        "decode_every": "decode.every",
        "decode_prompts": "decode.prompts",
        "decode_tokens": "decode.tokens",
        "decode_temperature": "decode.temperature",
        "profile_steps": "profile.steps",
        "profile_start_step": "profile.start_step",
        "profile_all_processes": "profile.all_processes",
        "pgle": "pgle.mode",
        "pgle_profiling_runs": "pgle.profiling_runs",
        "pgle_aggregation_percentile": "pgle.aggregation_percentile",
        "pgle_profile_path": "pgle.profile_path",
        "xla_flags": "compiler.xla_flags",
        "libtpu_init_args": "compiler.libtpu_init_args",
    }

    def __post_init__(self) -> None:
        check_seed(self.seed, "train.seed")
        hbm = self.hbm_gib_per_device
        if hbm is not None and not (isinstance(hbm, (int, float)) and 0 < hbm < float("inf")):
            raise ValueError(
                f"train.hbm_gib_per_device must be a number of GiB > 0, or None (the device's own); got {hbm!r}."
            )
        if not 0 <= self.hbm_margin < 1:
            raise ValueError(
                f"train.hbm_margin must be a fraction in [0, 1) (0.05 keeps 5% free); got {self.hbm_margin!r}."
            )
        if self.max_consecutive_nonfinite < 0:
            raise ValueError(f"train.max_consecutive_nonfinite must be >= 0; got {self.max_consecutive_nonfinite}.")
        if self.num_epochs is not None and self.num_epochs <= 0:
            raise ValueError(f"train.num_epochs must be positive or None; got {self.num_epochs}.")
        for name in ("num_steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive; got {getattr(self, name)}.")
        if self.eval_batches < 0:
            raise ValueError(f"train.eval_batches must be >= 0 (0 = a whole pass); got {self.eval_batches}.")
