"""The compiled program's roofline (`equipax.launch.aot.hlo_cost`), which `remat="auto"` ranks its
candidates by: a scanned loop counts every trip and reads one slice of its stacked weights per trip
(XLA's own cost analysis counts the body once), and splash attention's kernels count their matrix
multiplies (XLA's count them as nothing)."""

import json
import subprocess
import sys

import pytest

from equipax.launch.hardware.tpu import libtpu_available

LAYERS, ROWS, WIDTH = 6, 64, 128


def _scan_program(layers=LAYERS):
    import jax
    import jax.numpy as jnp

    def stack(ws, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    ws = jax.ShapeDtypeStruct((layers, WIDTH, WIDTH), jnp.float32)
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)
    return jax.jit(stack).lower(ws, x).compile()


def test_a_scanned_loop_counts_every_trip_and_reads_one_slice_per_trip():
    from equipax.launch.aot.hlo_cost import NOMINAL_HOST, program_cost

    compiled = _scan_program()
    cost = program_cost(compiled.as_text(), NOMINAL_HOST)
    per_layer = 2 * ROWS * WIDTH * WIDTH
    assert cost.flops == LAYERS * per_layer
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert xla["flops"] < 2 * per_layer  # XLA's own figure: the body once
    # Each trip reads its layer's weights, not the whole stack: twice the layers, twice the bytes
    # (not four times).
    assert cost.hbm_bytes >= LAYERS * WIDTH * WIDTH * 4
    deeper = program_cost(_scan_program(2 * LAYERS).as_text(), NOMINAL_HOST)
    assert deeper.flops == 2 * cost.flops
    assert deeper.hbm_bytes == pytest.approx(2 * cost.hbm_bytes, rel=0.1)
    assert cost.projected_s >= LAYERS * per_layer / NOMINAL_HOST.peak_flops


# Splash attention's forward and backward for one v5e chip, priced in a fresh process (libtpu).
_SPLASH = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sam
from equipax.launch.aot.hlo_cost import Roofline, program_cost
from equipax.launch.hardware.tpu import lookup_slice, topology_devices
from equipax.launch.hardware.accelerators import ACCELERATORS

jax.config.update("jax_platforms", "cpu")
mesh = jax.sharding.Mesh(np.array(topology_devices(lookup_slice("v5e-1"))), ("x",))
b, h, n, d = 2, 4, 1024, 128
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
out = {"matmul": 2.0 * b * h * n * n * d}
fused = sak.BlockSizes(
    block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128, use_fused_bwd_kernel=True
)
# Batch 1: XLA:TPU drops the vmapped axis, the kernels' operands are [h, n, d].
for name, sizes, batch in (("separate", None, b), ("fused", fused, b), ("fused_batch1", fused, 1)):
    x = jax.ShapeDtypeStruct((batch, h, n, d), jnp.bfloat16, sharding=replicated)
    mask = sam.MultiHeadMask([sam.CausalMask((n, n))] * h)
    kernel = sak.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    loss = lambda q, k, v: jax.vmap(kernel)(q, k, v).astype(jnp.float32).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    out[name] = program_cost(compiled.as_text(), Roofline.of(ACCELERATORS["tpu-v5e"])).flops
    out[name + "_xla"] = xla.get("flops", 0.0)
print(json.dumps(out))
"""


@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (XLA:TPU)")
def test_splash_kernels_count_their_matrix_multiplies():
    proc = subprocess.run([sys.executable, "-c", _SPLASH], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    # The forward (QK^T, PV), the dq kernel (3) and the dkv kernel (4), each half under the causal
    # mask; the fused backward (equipax's) runs the five of them in one kernel.
    assert got["separate"] == pytest.approx((2 + 3 + 4) * got["matmul"] / 2, rel=0.01)
    assert got["fused"] == pytest.approx((2 + 5) * got["matmul"] / 2, rel=0.01)
    assert got["fused_batch1"] == pytest.approx(got["fused"] / 2, rel=0.01)
    assert got["separate_xla"] < 0.01 * got["separate"]  # XLA's cost analysis: a custom call costs nothing


def test_an_int8_matmul_runs_at_the_int8_rate():
    """A dot of two int8 operands at the device's int8 rate (a v5e's is twice its bf16 rate), a
    float one at the float rate."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from equipax.launch.aot.hlo_cost import NOMINAL_HOST, program_cost

    def matmul(dtype):
        a, b = jax.ShapeDtypeStruct((512, 1024), dtype), jax.ShapeDtypeStruct((1024, 512), dtype)
        out = jnp.int32 if dtype == jnp.int8 else jnp.float32
        return jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=out)).lower(a, b).compile().as_text()

    # A device whose memory is fast enough that both programs are bound by their FLOPs.
    fast = dataclasses.replace(NOMINAL_HOST, hbm_bytes_per_s=1e15)
    doubled = dataclasses.replace(fast, int8_peak_flops=2 * fast.peak_flops)
    int8, f32 = matmul(jnp.int8), matmul(jnp.float32)
    assert program_cost(int8, doubled).flops == program_cost(f32, doubled).flops == 2 * 512 * 1024 * 512
    assert program_cost(int8, doubled).projected_s == pytest.approx(program_cost(int8, fast).projected_s / 2)
    assert program_cost(f32, doubled).projected_s == pytest.approx(program_cost(f32, fast).projected_s)


# A loop body as XLA:TPU writes it: the stacked int8 weights pass through a fusion that copies them
# into their own buffer (output aliased to the operand) before one layer's slice is taken.
_IN_PLACE = """HloModule m, is_scheduled=true

%copy_fusion (input: s8[6,2560,10240]) -> s8[6,2560,10240] {
  %input = s8[6,2560,10240] parameter(0)
  ROOT %copy = s8[6,2560,10240] copy(%input)
}

%sliced (param_0: s8[6,2560,10240], param_1: s32[]) -> s8[2560,10240] {
  %param_0 = s8[6,2560,10240] parameter(0)
  %param_1 = s32[] parameter(1)
  %aliased = s8[6,2560,10240] fusion(%param_0), kind=kLoop, output_to_operand_aliasing={{}: (0, {})}, calls=%copy_fusion
  %zero = s32[] constant(0)
  %slice = s8[1,2560,10240] dynamic-slice(%aliased, %param_1, %zero, %zero), dynamic_slice_sizes={1,2560,10240}
  %bitcast = s8[2560,10240] bitcast(%slice)
  ROOT %out = s8[2560,10240] copy(%bitcast)
}

ENTRY %main (w: s8[6,2560,10240], i: s32[]) -> s8[2560,10240] {
  %w = s8[6,2560,10240] parameter(0)
  %i = s32[] parameter(1)
  ROOT %layer = s8[2560,10240] fusion(%w, %i), kind=kLoop, calls=%sliced
}
"""


def test_an_in_place_copy_around_a_stacked_buffer_reads_only_the_slice():
    from equipax.launch.aot.hlo_cost import NOMINAL_HOST, program_cost

    layer = 2560 * 10240  # int8: one byte each
    assert program_cost(_IN_PLACE, NOMINAL_HOST).hbm_bytes == pytest.approx(2 * layer, rel=0.01)  # read + write
