"""What XLA:TPU makes of the LM head's loss (compiled for a v5e on this host with libtpu, not run):
the float32 `[batch seq vocab]` logits are never written to memory, with a logit cap the
forward pass's reductions read the logits in the head matmul's own pass (one write, then the two
backward matmuls read them: no extra pass for the cap), and `model.num_vocab_tiling` holds no
`[batch seq vocab]` array at all. Skipped where libtpu is missing.
"""

import dataclasses
import re

import pytest

from equipax.core.nn import TransformerConfig
from equipax.models import LMConfig

B, S, V = 4, 1024, 16384  # bfloat16 logits of 128 MiB: too large for the chip's on-core memory
CFG = LMConfig(
    vocab_size=V,
    max_seq_len=S,
    dtype="bfloat16",
    output_logit_cap=30.0,
    transformer=TransformerConfig(num_layers=1, model_dims=128, num_heads=1, head_dim=128, hidden_dims=256),
)


def _logits_passes(cfg: LMConfig) -> dict[str, int]:
    """How XLA:TPU's program for `lm_loss`'s gradient and metrics treats arrays of the logits'
    shape `[B, S, V]` outside fusions: `{"f32 writes", "bf16 writes", "reads"}` (ops that produce
    one, by dtype; ops that read one through: a gather of the labels' logits reads a few elements, not
    a pass). Each test compiles its own program: a program compiled for a compile-only device
    cannot be loaded back from the persistent cache."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from equipax.launch.hardware.tpu import lookup_slice, topology_devices
    from equipax.models import TransformerLM, lm_loss

    device = topology_devices(lookup_slice("v5e-1"))[0]
    mesh = Mesh(np.array([device]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = eqx.filter_eval_shape(TransformerLM, cfg, key=jax.random.key(0))
    params, static = eqx.partition(shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), params)
    batch = {
        "ids": jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=sharding),
        "labels": jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=sharding),
        "weights": jax.ShapeDtypeStruct((B, S), jnp.float32, sharding=sharding),
    }

    def grads(params, batch):  # the accuracy too, as a train step reports it
        return jax.grad(lambda p: lm_loss(eqx.combine(p, static), batch, mesh=mesh), has_aux=True)(params)

    hlo = jax.jit(grads).lower(placed, batch).compile().as_text()
    fused = set(re.findall(r"calls=%([\w.\-]+)", hlo))  # fusions' bodies: not memory passes
    logits = re.compile(rf"\b(f32|bf16)\[{B},{S},{V}\]|\b(f32|bf16)\[{B * S},{V}\]")
    counts = {"f32 writes": 0, "bf16 writes": 0, "reads": 0}
    holders: set[str] = set()
    top = False
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            top = head.group(1) not in fused
            continue
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)", line)
        if not top or not m:
            continue
        name, shape, op, rest = m.groups()
        if op in ("parameter", "get-tuple-element", "tuple", "bitcast"):
            if logits.search(shape):
                holders.add(name)
            continue
        operands = {o.split("#")[0] for o in re.findall(r"%([\w.\-#]+)", rest.split("), ")[0])}
        counts["reads"] += bool(operands & holders) and op != "gather" and not name.startswith("gather")
        for f32, bf16 in logits.findall(shape):
            counts["f32 writes" if (f32 or bf16) == "f32" else "bf16 writes"] += 1
            holders.add(name)
    return counts


@pytest.fixture(autouse=True)
def _libtpu():
    from equipax.launch.hardware.tpu import libtpu_available

    if not libtpu_available():
        pytest.skip("libtpu is not installed (the `aot` dependency group)")


@pytest.mark.slow
def test_capped_head_writes_the_logits_once_and_reads_them_in_the_backward_matmuls():
    # The forward's max, sum of exponentials and label are in the head matmul's pass; the backward
    # recomputes the softmax inside its two matmuls. (The float32 logits used to be written for the
    # label's gather: 1 GB per step at c4_1b_6l's size, benchmarks/README.md, "The LM head".)
    assert _logits_passes(CFG) == {"f32 writes": 0, "bf16 writes": 1, "reads": 2}


@pytest.mark.slow
def test_uncapped_head_adds_one_read_for_the_maximum():
    counts = _logits_passes(dataclasses.replace(CFG, output_logit_cap=None))
    assert counts == {"f32 writes": 0, "bf16 writes": 1, "reads": 3}


@pytest.mark.slow
def test_vocabulary_tiling_never_holds_the_logits():
    counts = _logits_passes(dataclasses.replace(CFG, num_vocab_tiling=8))
    assert counts == {"f32 writes": 0, "bf16 writes": 0, "reads": 0}
