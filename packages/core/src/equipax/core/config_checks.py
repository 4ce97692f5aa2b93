"""Cross-field checks of `TransformerConfig` (heads, mixture of experts, attention kernel, pipeline)
and the checks against a mesh and a global batch (`check_experts`, `check_pipeline`).

`TransformerConfig.__post_init__` (`equipax.core.configs`) calls the field checks; a model's config
calls the mesh checks (`equipax.models.configs`). Same rule as there: no JAX, numpy or equinox
imports, so the CLI's `list`, `show` and knob errors stay fast.
"""

import math
from typing import Any

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import BATCH_AXES, EXPERT, STAGE, MeshConfig

# The checks take a `TransformerConfig` (typed `Any`: importing configs.py here, even for types
# only, would make the two modules import each other).
TransformerConfig = Any

__all__ = [
    "bubble_fraction",
    "check_attention_impl",
    "check_experts",
    "check_heads",
    "check_layer_groups",
    "check_moe",
    "check_pipeline",
    "check_pipeline_knobs",
    "num_microbatches",
]

_KNOB = "model.transformer"


def check_heads(cfg: TransformerConfig) -> None:
    """Raise ValueError for key/value heads, windows and layouts that do not fit together."""
    kv = cfg.num_kv_heads
    if kv is not None:
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
            raise ValueError(f"{_KNOB}.num_kv_heads must be a positive int or None (= num_heads), got {kv!r}.")
        if cfg.num_heads % kv:
            divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
            raise ValueError(
                f"{_KNOB}.num_kv_heads={kv} does not divide num_heads={cfg.num_heads}: each key/value head "
                f"serves a group of query heads. Use one of {divisors} (num_heads = multi-head, 1 = "
                "multi-query)."
            )
    if cfg.fused_qkv and cfg.kv_heads != cfg.num_heads:
        raise ValueError(
            f"{_KNOB}.fused_qkv=True packs queries, keys and values of num_heads heads each, but "
            f"num_kv_heads={kv} < num_heads={cfg.num_heads}; set {_KNOB}.fused_qkv=False (separate query and "
            "key/value projections) for grouped-query attention."
        )
    window = cfg.sliding_window
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"{_KNOB}.sliding_window must be a positive int (keys each query sees, itself "
                f"included) or None for the whole causal prefix; got {window!r}."
            )
        if cfg.attention != "softmax":
            raise ValueError(
                f"{_KNOB}.sliding_window={window} needs softmax attention ({_KNOB}.attention="
                f"{cfg.attention!r} has no window); set attention='softmax' or sliding_window=None."
            )
    if cfg.attention == "linear" and cfg.kv_heads != cfg.num_heads:
        raise ValueError(
            f"{_KNOB}.attention='linear' runs multi-head attention only (num_kv_heads="
            f"{kv} < num_heads={cfg.num_heads}); set num_kv_heads=None or attention='softmax'."
        )


def _is_int(value: Any, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def check_moe(cfg: TransformerConfig) -> None:
    """Raise ValueError for mixture-of-experts knobs that are out of range or contradict the block."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if not _is_int(e, 0):
        raise ValueError(f"{_KNOB}.num_experts must be an int >= 0 (0 = a dense feed-forward), got {e!r}.")
    for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise ValueError(f"{_KNOB}.{name} must be a finite number >= 0 (0 = off), got {value!r}.")
    # Each knob's own range is checked whether or not the block has experts: a value out of range
    # is a mistake either way, and a dense block would otherwise carry it silently until it got some.
    if not _is_int(k, 1):
        raise ValueError(
            f"{_KNOB}.num_experts_per_tok={k!r} must be an int >= 1 (each token goes to that many "
            "distinct experts, at most num_experts)."
        )
    size = cfg.moe_intermediate_size
    if size is not None and not _is_int(size, 1):
        raise ValueError(
            f"{_KNOB}.moe_intermediate_size must be a positive int (each expert's hidden width) or None "
            f"(= hidden_dims), got {size!r}."
        )
    cf = cfg.capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, int | float) or not 0 < cf < math.inf):
        raise ValueError(
            f"{_KNOB}.capacity_factor must be None (dropless) or a finite number > 0 (1.0 = an even "
            f"share of the tokens per expert), got {cf!r}."
        )
    if not _is_int(cfg.shared_expert_intermediate_size, 0):
        raise ValueError(
            f"{_KNOB}.shared_expert_intermediate_size must be an int >= 0 (0 = no shared expert), "
            f"got {cfg.shared_expert_intermediate_size!r}."
        )
    if e == 0:
        if cfg.router_bias_update_rate:
            raise ValueError(
                f"{_KNOB}.router_bias_update_rate={cfg.router_bias_update_rate!r} balances the experts of a "
                "mixture of experts, but num_experts=0 (a dense feed-forward); set num_experts > 0 or the rate to 0."
            )
        return
    if k > e:
        raise ValueError(
            f"{_KNOB}.num_experts_per_tok={k!r} must be an int from 1 to num_experts={e} (each token "
            f"goes to that many distinct experts); set num_experts_per_tok <= {e}, or more experts."
        )
    if not cfg.gated or cfg.use_bias:
        raise ValueError(
            f"{_KNOB}.num_experts={e}: the experts are gated MLPs without biases (SwiGLU with "
            f"activation='silu'), but gated={cfg.gated}, use_bias={cfg.use_bias}; set gated=True and "
            "use_bias=False, or num_experts=0."
        )
    if cfg.pipeline_stages > 1 or cfg.tensor_parallel != "gspmd":
        raise ValueError(
            f"{_KNOB}.num_experts={e}: a mixture-of-experts block runs with tensor_parallel='gspmd' and "
            f"without a pipeline (found tensor_parallel={cfg.tensor_parallel!r}, pipeline_stages="
            f"{cfg.pipeline_stages}); set tensor_parallel='gspmd' and pipeline_stages=1."
        )


def check_attention_impl(cfg: TransformerConfig) -> None:
    """Raise ValueError for an attention kernel the other knobs rule out (no platform needed)."""
    impl = cfg.attention_impl
    if impl in ("xla", "auto"):
        return
    fix = f"set {_KNOB}.attention_impl='xla' (or 'auto')"
    if cfg.attention != "softmax":
        raise ValueError(
            f"{_KNOB}.attention_impl={impl!r} is a softmax kernel but {_KNOB}.attention="
            f"{cfg.attention!r}; {fix}, or attention='softmax'."
        )
    if impl == "cudnn" and cfg.atten_logit_cap is not None:
        raise ValueError(
            f"{_KNOB}.attention_impl='cudnn' has no tanh logit cap ({_KNOB}.atten_logit_cap="
            f"{cfg.atten_logit_cap}); set {_KNOB}.atten_logit_cap=None, or {fix}."
        )
    if impl == "splash" and (cfg.pipeline_stages > 1 or cfg.tensor_parallel != "gspmd"):
        raise ValueError(
            f"{_KNOB}.attention_impl='splash' runs in its own shard_map and cannot nest in a "
            f"pipeline stage or tensor_parallel='shard_map' (pipeline_stages={cfg.pipeline_stages}, "
            f"tensor_parallel={cfg.tensor_parallel!r}); {fix}."
        )


def check_pipeline_knobs(cfg: TransformerConfig) -> None:
    """Raise ValueError for pipeline knobs that contradict each other (no mesh, no batch needed)."""
    s, r = cfg.pipeline_stages, cfg.pipeline_repeats
    if cfg.pipeline_schedule == "gpipe" and r != 1:
        raise ValueError(
            f"{_KNOB}.pipeline_repeats={r} needs pipeline_schedule='circular' (GPipe visits each "
            "stage once); set pipeline_schedule='circular' or pipeline_repeats=1."
        )
    if cfg.pipeline_schedule == "circular" and r < 2:
        raise ValueError(
            f"{_KNOB}.pipeline_schedule='circular' needs pipeline_repeats >= 2 (virtual stages per "
            f"device), got {r}; set pipeline_repeats=2 (or more) or pipeline_schedule='gpipe'."
        )
    if cfg.num_layers % (s * r):
        raise ValueError(
            f"{_KNOB}.num_layers={cfg.num_layers} is not divisible by pipeline_stages x "
            f"pipeline_repeats = {s} x {r} = {s * r}: every (virtual) stage needs the same number "
            f"of layers. Use num_layers a multiple of {s * r}, or change pipeline_stages / "
            "pipeline_repeats."
        )
    if cfg.pipeline_microbatches is not None and cfg.pipeline_microbatch_size is not None:
        raise ValueError(
            f"{_KNOB}.pipeline_microbatches={cfg.pipeline_microbatches} and pipeline_microbatch_size="
            f"{cfg.pipeline_microbatch_size} are both set; set one of them (the other = None)."
        )
    for name in ("pipeline_microbatches", "pipeline_microbatch_size"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"{_KNOB}.{name} must be >= 1 or None, got {value}.")
    if s > 1 and cfg.tensor_parallel == "shard_map":
        raise ValueError(
            f"{_KNOB}.pipeline_stages={s} runs its stages inside a shard_map over `stage`; "
            "tensor_parallel='shard_map' cannot nest in it. Use tensor_parallel='gspmd'."
        )


def bubble_fraction(num_stages: int, num_microbatches: int, num_repeats: int = 1) -> float:
    """The idle share of each stage's time: (S - 1) / (R x M + S - 1); 0 without a pipeline.

    Arguments:
        num_stages: S, pipeline stages.
        num_microbatches: M, microbatches per step.
        num_repeats: R, virtual stages per device (circular schedule; 1 for GPipe).

    Returns:
        A fraction in [0, 1).
    """
    idle = num_stages - 1
    return idle / (num_repeats * num_microbatches + idle)


def num_microbatches(cfg: TransformerConfig, global_batch: int) -> int:
    """Microbatches per step: `pipeline_microbatches`, or the batch / `pipeline_microbatch_size`,
    or (neither set) one per stage."""
    if cfg.pipeline_microbatches is not None:
        return cfg.pipeline_microbatches
    if cfg.pipeline_microbatch_size is not None:
        return max(global_batch // cfg.pipeline_microbatch_size, 1)
    return cfg.pipeline_stages


def check_experts(cfg: TransformerConfig, mesh: MeshConfig) -> None:
    """Raise ConfigError unless the mesh's `expert` axis divides the experts (docs/moe.md).

    Arguments:
        cfg: the transformer config.
        mesh: the experiment's mesh (an `expert` axis of -1 is checked once fitted).
    """
    ep = mesh.axis_size(EXPERT)
    unfitted = EXPERT in mesh.axis_names and mesh.ici_mesh_shape[mesh.axis_names.index(EXPERT)] == -1
    if cfg.num_experts and ep > 1 and not unfitted and cfg.num_experts % ep:
        divisors = [d for d in range(1, cfg.num_experts + 1) if cfg.num_experts % d == 0]
        raise ConfigError(
            f"{_KNOB}.num_experts={cfg.num_experts} cannot be split over the mesh's `expert` axis of size "
            f"{ep} (axes {mesh.axis_names}, shape {mesh.shape}): each device holds num_experts / expert "
            f"experts. Make the `expert` axis one of {divisors}, or change num_experts."
        )


def check_pipeline(cfg: TransformerConfig, mesh: MeshConfig, global_batch: int) -> None:
    """Raise ConfigError unless the pipeline knobs fit the mesh and the global batch.

    Arguments:
        cfg: the transformer config.
        mesh: the experiment's mesh (a `stage` ICI axis of -1 is checked once fitted).
        global_batch: examples per step.
    """
    stages, axis = cfg.pipeline_stages, mesh.num_stages
    names = mesh.axis_names
    stage_unfitted = STAGE in names and mesh.ici_mesh_shape[names.index(STAGE)] == -1
    if stages != axis and not stage_unfitted:
        if STAGE not in names:
            fix = f"use mesh.axis_names={('stage', *names)} with the stage axis first, sized {stages} (ici x dcn)"
        else:
            fix = f"make the `stage` axis of mesh.ici_mesh_shape x mesh.dcn_mesh_shape {stages}"
        if stages == 1:
            fix = f"set {_KNOB}.pipeline_stages={axis}, or drop the `stage` axis from the mesh"
        raise ConfigError(
            f"{_KNOB}.pipeline_stages={stages} but the mesh's `stage` axis has size {axis} "
            f"(axes {names}, shape {mesh.shape}); {fix}."
        )
    if stages == 1 or mesh.flexible:
        return  # a -1 axis: the global batch is known once the mesh is fitted to the devices
    m = num_microbatches(cfg, global_batch)
    if cfg.pipeline_microbatch_size is not None and global_batch % cfg.pipeline_microbatch_size:
        raise ConfigError(
            f"The global batch {global_batch} is not divisible into microbatches of "
            f"{_KNOB}.pipeline_microbatch_size={cfg.pipeline_microbatch_size}; use a divisor of "
            f"{global_batch}, or change data.batch_size / data.per_device_batch."
        )
    if global_batch % m:
        raise ConfigError(
            f"The global batch {global_batch} is not divisible into {m} microbatches "
            f"({_KNOB}.pipeline_microbatches); use a divisor of {global_batch}."
        )
    dp = mesh.axis_size(*(a for a in BATCH_AXES if a != STAGE))
    if (global_batch // m) % dp:
        raise ConfigError(
            f"A microbatch of {global_batch // m} examples (global batch {global_batch} / {m} "
            f"microbatches) does not split evenly over the {dp} data x fsdp devices of a stage; "
            f"use fewer {_KNOB}.pipeline_microbatches (or a microbatch size that is a multiple of {dp})."
        )
    if cfg.pipeline_schedule == "circular" and m < stages:
        raise ConfigError(
            f"The circular schedule needs at least as many microbatches as stages (a microbatch's "
            f"next round starts on stage 0 after it left the last stage): {m} microbatches < "
            f"{_KNOB}.pipeline_stages={stages}. Raise {_KNOB}.pipeline_microbatches."
        )


def check_layer_groups(cfg: TransformerConfig) -> None:
    """Raise ValueError for a `num_hidden_groups` (shared layers) the stack cannot build."""
    g = cfg.num_hidden_groups
    if g is None:
        return
    if not _is_int(g, 1) or cfg.num_layers % g:
        raise ValueError(
            f"{_KNOB}.num_hidden_groups={g!r} must be a positive divisor of num_layers={cfg.num_layers} "
            "(each shared block serves num_layers / num_hidden_groups consecutive layers); e.g. 1 (ALBERT: "
            "every layer one block), or None for no sharing."
        )
    if cfg.pipeline_stages > 1:
        raise ValueError(
            f"{_KNOB}.num_hidden_groups={g} shares blocks across layers, but pipeline_stages="
            f"{cfg.pipeline_stages} splits the layers' weights over stages; use one of them."
        )
    if cfg.num_experts > 0:
        raise ValueError(
            f"{_KNOB}.num_hidden_groups={g} with num_experts={cfg.num_experts}: shared mixture-of-experts "
            "blocks are not supported (each layer's router keeps its own load and biases); set "
            "num_hidden_groups=None or num_experts=0."
        )
