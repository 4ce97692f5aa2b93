"""Context parallelism with the splash kernel (`attention_impl='splash'`) equals dense reference
attention on the unpermuted sequence, for both strategies (`context_parallel='all_gather'`:
`splash_all_gather_attention`; `'ring'`: `splash_ring_attention`): outputs and the gradients of
queries, keys and values in float32 (atol 1e-5), the kernel run in the Pallas interpreter on
simulated CPU devices. Cases: a context axis of 2 in the zigzag layout with grouped-query heads and
packed documents crossing the shard boundaries; 2 in contiguous blocks with a sliding window and a
logit cap; 4 contiguous (all-gather: outputs; ring: gradients too, its blocks travelling 4 steps).
Splash blocks are multiples of 128, so each device's chunk is 128 positions (512 in all).

A mutation must break parity: the zigzag batch run as if it were contiguous (each chunk's mask
offset then wrong), which is what a layout flag that disagreed with the input would do. Mutations
of the ring's own code, each of which these cases caught when it was written (errors 0.2-1200):
merging pairs with equal weights instead of by their log-sum-exp, the backward kernels given a
wrong log-sum-exp, the same-chunk pair run with a full mask instead of a causal one, and the
backward's key segments not following their rotating block.
"""

import json

import pytest

from helpers.multidevice import run_with_devices

CHILD = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh
from equipax.core.nn import context_parallel as cp
from equipax.core.nn.attention import reference_attention

B, S, H, D = 1, 512, 2, 16
rng = np.random.default_rng(0)
SEG = np.repeat(np.arange(3), [100, 300, 112])[None].astype(np.int32)  # documents cross 128, 256, 384

def case(kv_heads):
    q = rng.normal(size=(B, S, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, S, kv_heads, D)).astype(np.float32) for _ in range(2))
    return q, k, v, rng.normal(size=(B, S, H, D)).astype(np.float32)

KERNELS = {"all_gather": cp.splash_all_gather_attention, "ring": cp.splash_ring_attention}

def parity(strategy, n, zigzag, kv_heads, *, window=None, cap=None, grads=True, run_as_zigzag=None):
    q, k, v, ct = case(kv_heads)
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",), axis_types=(AxisType.Auto,))
    lay = (lambda x: cp.to_zigzag(jnp.asarray(x), n)) if zigzag else jnp.asarray
    unlay = (lambda x: cp.from_zigzag(x, n)) if zigzag else (lambda x: x)
    flag = zigzag if run_as_zigzag is None else run_as_zigzag
    kw = dict(causal=True, window=window, logit_cap=cap)
    def f(q, k, v, ct, seg):
        attend = lambda q, k, v: KERNELS[strategy](
            q, k, v, zigzag=flag, segment_ids=seg, mesh=mesh, interpret=True, **kw)
        if not grads:
            return (attend(q, k, v),)
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(ct))
    got = [unlay(x) for x in jax.jit(f)(*map(lay, (q, k, v, ct, SEG)))]
    ref_f = lambda q, k, v: reference_attention(q, k, v, segment_ids=SEG, **kw)
    out, vjp = jax.vjp(ref_f, q, k, v)
    ref = [out, *vjp(jnp.asarray(ct))][: len(got)]
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, ref))

errors, mutants = {}, {}
for s in KERNELS:
    errors[f"{s}_cp2_zigzag_gqa_packed"] = parity(s, 2, True, 1)
    errors[f"{s}_cp2_contiguous_mha_window_cap"] = parity(s, 2, False, 2, window=200, cap=5.0)
    errors[f"{s}_cp4_contiguous_gqa_packed"] = parity(s, 4, False, 1, grads=s == "ring")
    mutants[f"{s}_zigzag_run_as_contiguous"] = parity(s, 2, True, 1, grads=False, run_as_zigzag=False)
print(json.dumps({"errors": errors, "mutants": mutants}))
"""


@pytest.fixture(scope="module")
def results():
    return json.loads(
        run_with_devices(CHILD, devices=4, timeout=600, xla_flags="--xla_backend_optimization_level=0").splitlines()[-1]
    )


def test_splash_context_parallel_equals_dense_reference(results):
    bad = {name: err for name, err in results["errors"].items() if not err <= 1e-5}
    assert len(results["errors"]) == 6 and not bad, results["errors"]


def test_a_wrong_layout_breaks_parity(results):
    assert len(results["mutants"]) == 2 and all(e > 1e-2 for e in results["mutants"].values()), results["mutants"]
