"""The mesh config and the mesh-axis vocabulary: axis names, the logical-axis rules' default,
`MeshConfig` (re-exported by `equipax.core.mesh`, which builds the mesh). No JAX here, so the CLI's
`list`, `show` and knob errors stay fast.
"""

import dataclasses
import math

from equipax.core.knobs import ConfigError

__all__ = [
    "AXES",
    "BATCH_AXES",
    "CONTEXT",
    "CONTEXT_AXES",
    "DATA",
    "DEFAULT_LOGICAL_AXIS_RULES",
    "EXPERT",
    "EXPERT_AXES",
    "FSDP",
    "LogicalAxisRules",
    "MeshConfig",
    "PIPELINE_AXES",
    "STAGE",
    "TENSOR",
]


# Axis vocabulary (docs/sharding.md). Pax: replica -> data, data -> fsdp, mdl -> tensor.
DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
AXES = (DATA, FSDP, TENSOR)
# Pipeline parallelism (Pax's `stage`): layers split into consecutive stages along this axis.
STAGE = "stage"
PIPELINE_AXES = (STAGE, DATA, FSDP, TENSOR)
# Expert parallelism (docs/moe.md): a mixture-of-experts layer's experts split over this axis, and
# the batch with them (each device's tokens travel to the experts' devices by all-to-all).
EXPERT = "expert"
EXPERT_AXES = (DATA, FSDP, EXPERT, TENSOR)
# Context parallelism (docs/long_context.md): the sequence of every activation split over this
# axis; attention gathers or rotates the keys and values along it
# (equipax.core.nn.context_parallel).
CONTEXT = "context"
CONTEXT_AXES = (DATA, FSDP, CONTEXT, TENSOR)
# Axes the batch is split over. As in Pax, a pipelined mesh also splits the batch over `stage`
# outside the pipeline (embedding, logits); `stage` comes last so that each microbatch keeps an
# even share on every (data, fsdp) device (equipax.core.nn.pipeline). The `expert` axis splits the
# batch too (outside the experts it is one more data-parallel axis). Absent axes count 1.
BATCH_AXES = (DATA, FSDP, EXPERT, STAGE)

# Logical axis -> mesh axis (None = replicated): the default of `mesh.logical_axis_rules`, the
# sharding of every declared weight dimension (docs/sharding.md): FSDP over `embed`, Megatron
# tensor parallelism over vocab/heads/hidden, a pipelined stack's stages over `stage`.
LogicalAxisRules = tuple[tuple[str, str | None], ...]

DEFAULT_LOGICAL_AXIS_RULES: LogicalAxisRules = (
    # Transformer weights.
    ("embed", FSDP),
    ("vocab", TENSOR),
    ("heads", TENSOR),
    ("hidden", TENSOR),
    ("head_dim", None),
    ("qkv", None),
    ("layers", None),
    # A mixture-of-experts layer's expert index (equipax.core.nn.moe): over the `expert` axis.
    ("expert", EXPERT),
    # A pipelined stack's stage index (PipelinedStack: stage, repeat, layer within the stage).
    ("stage", STAGE),
    # Norm scales and biases: small, so replicated.
    ("norm", None),
    # Convolutions and the CNN's dense head: small, so replicated (data parallel).
    ("kernel_height", None),
    ("kernel_width", None),
    ("in_channels", None),
    ("out_channels", None),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh of an experiment.

    ici_mesh_shape: devices per slice along `axis_names`. One entry may be -1 (as
        MaxText's `ici_*_parallelism=-1`): that axis takes all devices the others leave, fixed
        when the run starts (`fit`); until then it counts as 1.
    dcn_mesh_shape: slices (or hosts, on GPU clusters) along the same axes.
    axis_names: (data, fsdp, tensor), or `PIPELINE_AXES` (stage, data, fsdp, tensor) for a
        pipelined model (`model.transformer.pipeline_stages` > 1), or `EXPERT_AXES` (data, fsdp,
        expert, tensor) for expert parallelism (`model.transformer.num_experts` > 0), or
        `CONTEXT_AXES` (data, fsdp, context, tensor) for context parallelism (the sequence split
        over `context`; docs/long_context.md).
    logical_axis_rules: (logical axis, mesh axis or None) pairs, MaxText's `logical_axis_rules`:
        the mesh axis each declared weight dimension is split over (None = replicated). The
        default is FSDP over `embed` and Megatron tensor parallelism over `vocab`, `heads` and
        `hidden` (docs/sharding.md); e.g. `--set "mesh.logical_axis_rules=(('embed', None),
        ('vocab', 'tensor'), ...)"` turns FSDP off. Every logical axis a model declares needs a rule.
    """

    ici_mesh_shape: tuple[int, ...] = (1, 1, 1)
    dcn_mesh_shape: tuple[int, ...] = (1, 1, 1)
    axis_names: tuple[str, ...] = AXES
    logical_axis_rules: LogicalAxisRules = DEFAULT_LOGICAL_AXIS_RULES

    def __post_init__(self) -> None:
        n = len(self.axis_names)
        for name in ("ici_mesh_shape", "dcn_mesh_shape"):
            shape = getattr(self, name)
            if len(shape) != n:
                raise ValueError(
                    f"mesh.{name}={shape} has {len(shape)} entries but mesh.axis_names="
                    f"{self.axis_names} has {n}; give one size per axis."
                )
            if any(s < 1 for s in shape) and (
                name == "dcn_mesh_shape" or any(s < -1 or s == 0 for s in shape) or list(shape).count(-1) > 1
            ):
                raise ValueError(
                    f"mesh.{name}={shape}: every size must be >= 1"
                    + (" (or one -1: all devices left)." if name == "ici_mesh_shape" else ".")
                )
        if len(set(self.axis_names)) != n:
            raise ValueError(f"mesh.axis_names={self.axis_names} repeats a name.")
        logical = [rule[0] for rule in self.logical_axis_rules]
        if repeated := sorted({a for a in logical if logical.count(a) > 1}):
            raise ValueError(
                f"mesh.logical_axis_rules maps {repeated[0]!r} more than once; give one rule per logical axis."
            )
        known = {*self.axis_names, *PIPELINE_AXES, EXPERT, CONTEXT}
        if bad := [rule for rule in self.logical_axis_rules if rule[1] is not None and rule[1] not in known]:
            raise ValueError(
                f"mesh.logical_axis_rules: {bad[0]} names the mesh axis {bad[0][1]!r}, which is not "
                f"one of {sorted(known)}; map each logical axis to one of them or to None (replicated)."
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The device mesh shape (ICI x DCN, elementwise; an unfitted -1 counts as 1)."""
        return tuple(max(i, 1) * d for i, d in zip(self.ici_mesh_shape, self.dcn_mesh_shape))

    @property
    def flexible(self) -> bool:
        """True while an ICI axis is -1 (sized by `fit` from the devices present)."""
        return -1 in self.ici_mesh_shape

    def fit(self, num_devices: int) -> "MeshConfig":
        """This mesh with its -1 axis sized to use `num_devices` devices (unchanged if none is -1).

        Raises:
            ConfigError: the fixed axes do not divide `num_devices`.
        """
        if not self.flexible:
            return self
        fixed = math.prod(self.shape)
        if num_devices % fixed:
            raise ConfigError(
                f"mesh.ici_mesh_shape={self.ici_mesh_shape} x dcn_mesh_shape={self.dcn_mesh_shape} needs a "
                f"multiple of {fixed} devices for its -1 axis; {num_devices} are available."
            )
        ici = tuple(num_devices // fixed if s == -1 else s for s in self.ici_mesh_shape)
        return dataclasses.replace(self, ici_mesh_shape=ici)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def num_slices(self) -> int:
        return math.prod(self.dcn_mesh_shape)

    def axis_size(self, *names: str) -> int:
        """Product of the sizes of the named axes (missing names count 1)."""
        sizes = dict(zip(self.axis_names, self.shape))
        return math.prod(sizes.get(n, 1) for n in names)

    @property
    def batch_parallelism(self) -> int:
        """How many ways the global batch is split (data x fsdp, x stage when pipelined)."""
        return self.axis_size(*BATCH_AXES)

    @property
    def num_stages(self) -> int:
        """Size of the `stage` axis (1 when the mesh has none)."""
        return self.axis_size(STAGE)
