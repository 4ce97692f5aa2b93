"""What a transformer block saves for its backward pass: the `jax.checkpoint` policy of each
`model.transformer.remat` setting (`remat_policy`), and the names the block gives the tensors
that "save_attention_out" and "save_context" keep (`SAVED_NAMES`, `ATTENTION_OUT`, set with
`checkpoint_name`), and "dots_with_context" keeps beside the projections.

The attention's context is named `ATTENTION_OUT` once, by whatever computes it: the splash kernel
names its forward rule's residuals, its output and each row's log-sum-exp
(`equipax.core.nn.fused_attention`, and ring attention's merged pair,
`equipax.core.nn.splash_ring_attention`), so that a policy keeping them leaves nothing for the
backward pass to run the forward kernel for; the block names the context of every other kernel
(`equipax.core.nn.self_attention.Attention`). Naming both would save the context twice."""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from equipax.core.configs import REMAT_POLICIES
from equipax.core.knobs import ConfigError
from equipax.core.nn.quantization import QUANTIZED_OUTPUT, QUANTIZED_SCALE

__all__ = ["ATTENTION_OUT", "remat_policy", "SAVED_NAMES"]

# The attention's context (with splash, also the log-sum-exp its backward kernel reads): what
# remat="save_context" keeps.
ATTENTION_OUT = "attention_out"
# The tensors remat="save_attention_out" keeps: the context and the residual stream entering the MLP.
SAVED_NAMES = (ATTENTION_OUT, "mlp_in")


@dataclasses.dataclass(frozen=True)
class _ProjectionsSaveable:
    """JAX's `dots_with_no_batch_dims_saveable`, with quantized projections kept at their output:
    the int32 (fp8: float32) sums of a dot of one-byte operands are not saved (twice the bytes of
    the bfloat16 output they become), the output named `QUANTIZED_OUTPUT` is, with its activations'
    per-token scales (`QUANTIZED_SCALE`), and the backward rounds its operands again from those.
    `names`: further named tensors kept (remat="dots_with_context": the attention's context)."""

    names: tuple[str, ...] = ()

    def __call__(self, prim: Any, *args: Any, **params: Any) -> bool:
        if prim.name == "name":
            return params["name"] in (QUANTIZED_OUTPUT, QUANTIZED_SCALE, *self.names)
        if any(getattr(a, "dtype", None) is not None and a.dtype.itemsize == 1 for a in args):
            return False
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)


def remat_policy(remat: str) -> Callable[..., bool] | None:
    """The `jax.checkpoint` policy of a remat setting other than "none" (None = save nothing).

    "offload_attention_out" moves the saved tensors to pinned host memory, which only backends
    with host memory spaces (TPU, GPU) compile.
    """
    policies = jax.checkpoint_policies
    if remat == "full":
        return None
    if remat == "dots_saveable":
        return _ProjectionsSaveable()
    if remat == "dots_with_context":
        return _ProjectionsSaveable(names=(ATTENTION_OUT,))
    if remat == "save_attention_out":
        return policies.save_only_these_names(*SAVED_NAMES)
    if remat == "save_context":
        return policies.save_only_these_names(ATTENTION_OUT)
    if remat == "offload_attention_out":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(SAVED_NAMES),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ConfigError(
        f"model.transformer.remat={remat!r} is not a policy a block can apply"
        + (
            ": 'auto' is chosen by compiling before the model is built (`launch run`, `launch compile`, "
            "or equipax.launch.aot.remat.choose_remat); a model built directly needs one of "
            + ", ".join(repr(p) for p in REMAT_POLICIES)
            + "."
            if remat == "auto"
            else "."
        )
    )
