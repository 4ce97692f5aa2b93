"""Imported weights compute what the Hugging Face definitions compute (the numpy reference), and
each way of getting the conversion wrong is caught.

Every family's tiny random model (MHA/GQA/MQA, head_dim != hidden / heads, tied and untied, llama3
rope scaling, a sliding window shorter than the sequence, Mixtral's and Qwen3-MoE's experts) at T =
64, weights at std 1/sqrt(fan_in): equipax's float32 logits equal the float64 reference at rtol 1e-5
(relative to the logits' scale). The mutations are the real-world failures: Meta's interleaved q/k
layout instead of Hugging Face's rotate-half one, query heads grouped with the wrong key/value head,
the rope scaling or theta dropped, a v5 config read as v4 (theta falls back to 1e4); for the
experts, their order against the router's columns, gate and up (Mixtral's w1 and w3) swapped, the
top-k renormalisation changed."""

import copy
import dataclasses

import equinox as eqx
import numpy as np
import pytest

from equipax.models.hf.config import lm_config_from_hf, read_hf_config
from equipax.models.hf.reference import logit_kl, reference_logits
from equipax.models.hf.weights import load_lm, model_logits
from helpers.hf import FAMILIES, write_hf_dir

KL_GATE = 1e-6


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (directory, config, loaded model, ids, reference logits)."""
    out = {}
    ids = np.random.default_rng(1).integers(0, 96, (2, 64))
    for family in FAMILIES:
        directory = write_hf_dir(tmp_path_factory.mktemp(family), family)
        cfg = lm_config_from_hf(read_hf_config(directory))
        out[family] = (directory, cfg, load_lm(directory, cfg), ids, reference_logits(directory, ids))
    return out


def _close(ours, ref):
    return np.allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_the_reference(families, family):
    _, _, model, ids, ref = families[family]
    ours = model_logits(model, ids)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert logit_kl(ref, ours) < KL_GATE
    assert np.std(ref) > 0.5  # the logits are far from uniform: differences would show


def _mutations(cfg):
    t = cfg.transformer
    hd, group = t.head_dim, t.num_heads // t.kv_heads
    interleave = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])  # Meta's pairs vs rotate-half

    def permute_qk(m):
        m = eqx.tree_at(lambda m: m.stack.layers.attention.q, m, m.stack.layers.attention.q[..., interleave])
        return eqx.tree_at(lambda m: m.stack.layers.attention.kv, m, m.stack.layers.attention.kv[..., interleave])

    def regroup(m):  # query head h reads kv head h % kv_heads instead of h // group
        order = np.arange(t.num_heads).reshape(t.kv_heads, group).T.reshape(-1)
        q, out = m.stack.layers.attention.q, m.stack.layers.attention.out
        m = eqx.tree_at(lambda m: m.stack.layers.attention.q, m, q[:, :, order])
        return eqx.tree_at(lambda m: m.stack.layers.attention.out, m, out[:, order])

    out = {"q/k layout permuted": (None, permute_qk)}
    if cfg.rope_theta != 1e4:  # theta dropped = the 1e4 default
        out["rope theta dropped"] = (dataclasses.replace(cfg, rope_theta=1e4), None)
    if group > 1 and t.kv_heads > 1:
        out["GQA grouping changed"] = (None, regroup)
    if cfg.rope_scaling is not None:
        out["rope scaling dropped"] = (dataclasses.replace(cfg, rope_scaling=None), None)
    if t.num_experts:
        order = np.roll(np.arange(t.num_experts), 1)  # expert e's weights under the router's column e+1

        def reorder(m):
            ffn = m.stack.layers.ffn
            where = lambda m: (m.stack.layers.ffn.gate, m.stack.layers.ffn.up, m.stack.layers.ffn.down)  # noqa: E731
            return eqx.tree_at(where, m, (ffn.gate[:, order], ffn.up[:, order], ffn.down[:, order]))

        def swap_gate_up(m):  # Mixtral's w1 read as up and w3 as gate
            ffn = m.stack.layers.ffn
            return eqx.tree_at(lambda m: (m.stack.layers.ffn.gate, m.stack.layers.ffn.up), m, (ffn.up, ffn.gate))

        def flip_renormalisation(m):  # a static field: on a copy of the layer
            ffn = copy.copy(m.stack.layers.ffn)
            object.__setattr__(ffn, "norm_topk_prob", not ffn.norm_topk_prob)
            return eqx.tree_at(lambda m: m.stack.layers.ffn, m, ffn)

        out["expert order changed"] = (None, reorder)
        out["expert gate and up swapped"] = (None, swap_gate_up)
        out["top-k renormalisation changed"] = (None, flip_renormalisation)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mutations_fail_the_check(families, family):
    directory, cfg, _, ids, ref = families[family]
    for name, (mutated_cfg, edit) in _mutations(cfg).items():
        m = load_lm(directory, mutated_cfg or cfg)
        ours = model_logits(edit(m) if edit else m, ids)
        assert not _close(ours, ref), f"{family}: {name} went unnoticed"
        assert logit_kl(ref, ours) > KL_GATE, f"{family}: {name} passes the gate"


def test_every_mutation_is_tried(families):
    tried = {name for _, cfg, *_ in families.values() for name in _mutations(cfg)}
    assert tried == {
        "q/k layout permuted",
        "rope theta dropped",
        "GQA grouping changed",
        "rope scaling dropped",
        "expert order changed",
        "expert gate and up swapped",
        "top-k renormalisation changed",
    }


def test_v5_config_read_as_v4_fails_the_check(families):
    directory, _, _, ids, ref = families["llama3_2_tied_scaled"]
    hf = read_hf_config(directory)
    assert "rope_parameters" in hf and "rope_theta" not in hf
    as_v4 = lm_config_from_hf({k: v for k, v in hf.items() if k != "rope_parameters"})
    assert as_v4.rope_theta == 1e4 and as_v4.rope_scaling is None
    ours = model_logits(load_lm(directory, as_v4), ids)
    assert not _close(ours, ref)
    assert logit_kl(ref, ours) > KL_GATE


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load_exactly(tmp_path, dtype):
    directory = write_hf_dir(tmp_path, "qwen3_tied", dtype=dtype)
    cfg = lm_config_from_hf(read_hf_config(directory))
    ids = np.arange(64)[None] % 96
    ref = reference_logits(directory, ids)
    np.testing.assert_allclose(
        model_logits(load_lm(directory, cfg), ids), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
    )
