"""The context-parallelism knobs' checks (docs/long_context.md): what a `context` mesh axis needs
of the transformer config and the sequence length, refused at config time (exit 2).

Same rule as `equipax.core.configs`: no JAX, numpy or equinox imports.
"""

from typing import Any

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import CONTEXT, MeshConfig

# The check takes a `TransformerConfig` (typed `Any`: importing configs.py here, even for types
# only, would make the two modules import each other).
TransformerConfig = Any

__all__ = ["CONTEXT_PARALLEL_STRATEGIES", "check_context"]

_KNOB = "model.transformer"
# `model.transformer.context_parallel_strategy` (MaxText's names): "all_gather" gathers the keys and
# values of the whole sequence on each device, "ring" rotates them in blocks (less memory).
CONTEXT_PARALLEL_STRATEGIES = ("all_gather", "ring")


def check_context(cfg: TransformerConfig, mesh: MeshConfig, seq_len: int | None = None) -> None:
    """Raise ConfigError unless the model and the sequence can be split over the `context` axis.

    Arguments:
        cfg: the transformer config.
        mesh: the experiment's mesh (an unfitted -1 `context` axis is checked once fitted).
        seq_len: positions per example, if known (`data.seq_len`).
    """
    if CONTEXT not in mesh.axis_names or mesh.ici_mesh_shape[mesh.axis_names.index(CONTEXT)] == -1:
        return
    cp = mesh.axis_size(CONTEXT)
    if cp == 1:
        return
    where = f"the mesh's `context` axis has {cp} devices (axes {mesh.axis_names}, shape {mesh.shape})"
    if cfg.attention != "softmax":
        raise ConfigError(
            f"{where}, but {_KNOB}.attention={cfg.attention!r}: context parallelism splits softmax attention "
            f"over the sequence, and linear attention has no context-parallel kernel. Set {_KNOB}.attention="
            "'softmax', or make the `context` axis 1."
        )
    if cfg.attention_impl == "cudnn":
        raise ConfigError(
            f"{where}, but {_KNOB}.attention_impl='cudnn': context-parallel attention runs each device's "
            "blocks with the XLA kernel (or splash, on TPU), and "
            f"the cudnn kernel cannot take another device's keys. Set {_KNOB}.attention_impl='xla' (or "
            "'auto'), or make the `context` axis 1."
        )
    if seq_len is None:
        return
    chunks = 2 * cp if cfg.context_parallel_load_balance else cp
    if seq_len % chunks:
        layout = (
            f"the zigzag layout ({_KNOB}.context_parallel_load_balance=True) cuts it into 2 x {cp} chunks"
            if cfg.context_parallel_load_balance
            else f"each of the {cp} devices holds an equal block"
        )
        raise ConfigError(
            f"data.seq_len={seq_len} cannot be split over {where}: {layout}. Use a data.seq_len that is a "
            f"multiple of {chunks}, or another `context` axis size."
        )
    if cfg.attention_impl == "splash" and (seq_len // chunks) % 128:
        raise ConfigError(
            f"{_KNOB}.attention_impl='splash' over {where}: data.seq_len={seq_len} gives each device "
            f"chunks of {seq_len // chunks} positions, and the splash kernel's blocks are multiples of 128. "
            f"Use a data.seq_len that is a multiple of {128 * chunks}, or {_KNOB}.attention_impl='xla'."
        )
