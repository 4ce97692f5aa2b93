"""Golden values of every registered language-model experiment's `_smoke` / tiny variant.

For each experiment: the parameter count (traced and analytic), next-token logits on a fixed batch
(one sequence per row, and the same ids packed as two documents per row) and the loss of four train
steps on fixed batches with the experiment's own learner (the fourth step's loss is the loss after
three updates). They were recorded from the code as it was before the LM families shared one
decoder stack (`golden/lm.json`, `golden/lm_logits.npz`); the model code must keep reproducing
them (logits to 1e-5 in float32, losses to 1e-6: the logits' tolerance covers the difference
between CPU models, see LOGITS_TOL).

The models run on one CPU device, without a mesh: a pipelined stack then runs its stages one after
another (the same numbers; `tests/test_pipeline.py` compares the two).

Regenerate (only when a change of the numbers is intended, and say why in the commit):

    uv run python tests/launch/test_golden_lm.py --write
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
JSON_PATH, LOGITS_PATH = GOLDEN / "lm.json", GOLDEN / "lm_logits.npz"
BATCH, SEQ = 2, 16
STEPS = 4  # losses of 4 steps: the last is the loss after 3 updates
KEEP_VOCAB = 64  # logits kept per position (all positions); plus logsumexp and argmax over the vocabulary
# Logits are compared to 1e-5: XLA:CPU's float32 kernels differ by CPU model (vector width, FMA,
# the order of a dot's partial sums), and the values recorded on an Intel AVX-512 host differ on an
# AMD EPYC host by up to 2.4e-6 (absolute, on logits of magnitude ~1; measured 2026-12-02 over every
# recorded experiment, losses within 1.5e-7 relative; XLA:CPU's LLVM at level 0 against the default
# stays within both tolerances). A model change is far larger: the mutation
# test below (one norm scale x 1.001) moves the logits by ~1e-3.
LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)
LOSS_TOL = dict(rtol=1e-6, atol=1e-6)


def lm_experiment_names() -> list[str]:
    """Registered LM experiments that run at toy size: `*_smoke` and `*tiny*`."""
    from equipax.launch.experiments.registry import entries, get_experiment

    names = []
    for e in entries():
        if e.kind != "train" or not (e.name.endswith("_smoke") or "tiny" in e.name):
            continue
        if get_experiment(e.name).kind == "lm":
            names.append(e.name)
    return names


def config_groups(names: list[str]) -> list[list[str]]:
    """`names` grouped by identical model, learner and packing (one computation serves a group)."""
    from equipax.launch.experiments.registry import get_experiment

    groups: dict[str, list[str]] = {}
    for name in names:
        cfg = get_experiment(name)
        groups.setdefault(repr((cfg.model, cfg.learner, cfg.data.packing)), []).append(name)
    return list(groups.values())


def _batches(vocab: int, packed: bool) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, vocab, size=(BATCH, SEQ + 1), dtype=np.int32)
        batch = {
            "ids": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "weights": (rng.random((BATCH, SEQ)) < 0.9).astype(np.float32),
        }
        if packed:
            batch |= _packing()
        out.append(batch)
    return out


def _packing() -> dict[str, np.ndarray]:
    """Two documents per row (boundaries at 10 and 5), positions restarting at each."""
    cuts = (10, 5)
    seg = np.stack([np.where(np.arange(SEQ) < c, 1, 2) for c in cuts]).astype(np.int32)
    pos = np.stack([np.where(np.arange(SEQ) < c, np.arange(SEQ), np.arange(SEQ) - c) for c in cuts]).astype(np.int32)
    return {"segment_ids": seg, "positions": pos}


def _summarise(logits) -> dict[str, np.ndarray]:
    import jax

    return {
        "head": np.asarray(logits[..., :KEEP_VOCAB]),
        "logsumexp": np.asarray(jax.nn.logsumexp(logits, axis=-1)),
        "argmax": np.asarray(logits.argmax(-1)).astype(np.int32),
    }


def compute(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    """The golden values of one experiment: (JSON-able numbers, arrays)."""
    import equinox as eqx
    import jax

    from equipax.core.flops import count_params
    from equipax.core.optim import make_learner
    from equipax.core.step import init_train_state, make_train_step
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import family

    cfg = get_experiment(name)
    task = family(cfg).make_task(cfg, None)
    model, _ = eqx.filter_jit(task.init)(jax.random.key(0))  # jitted, as a run initialises
    vocab = cfg.model.vocab_size
    ids = _batches(vocab, False)[0]["ids"]
    pack = _packing()

    # Linear attention has no segment mask: its experiment has no packed logits.
    packable = getattr(getattr(cfg.model, "transformer", None), "attention", "softmax") == "softmax"

    @eqx.filter_jit
    def forward(model, ids, seg, pos):
        return model(ids), model(ids, segment_ids=seg, positions=pos) if packable else None

    plain, packed = forward(model, ids, pack["segment_ids"], pack["positions"])
    arrays = {f"{name}/plain/{k}": v for k, v in _summarise(plain).items()}
    if packed is not None:
        arrays |= {f"{name}/packed/{k}": v for k, v in _summarise(packed).items()}

    learner = make_learner(cfg.learner)
    state = init_train_state(model, learner.optimizer)
    step = make_train_step(task, learner.optimizer, learner.schedule)
    losses, grad_norms = [], []
    key = jax.random.key(1)
    for batch in _batches(vocab, bool(getattr(task, "packed", False))):
        state, metrics = step(state, batch, key)
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    numbers = {
        "params_traced": int(count_params(model)),
        "params_analytic": int(cfg.model.param_counts()["total"]),
        "losses": losses,
        "grad_norms": grad_norms,
    }
    return numbers, arrays


def _load():
    golden = json.loads(JSON_PATH.read_text())
    with np.load(LOGITS_PATH) as f:
        arrays = {k: f[k] for k in f.files}
    return golden, arrays


@pytest.fixture(scope="module")
def golden():
    return _load()


def test_every_recorded_experiment_is_still_registered(golden):
    recorded = sorted(golden[0]["experiments"])
    registered = set(lm_experiment_names())
    missing = [n for n in recorded if n not in registered]
    assert not missing, f"golden experiments no longer registered: {missing}"
    assert len(recorded) >= 12


def _recorded() -> list[str]:
    return sorted(json.loads(JSON_PATH.read_text())["experiments"]) if JSON_PATH.exists() else []


# Recorded by `--write` (outside the suite) at XLA's default compile options, compared at the
# suite's cheaper ones (tests/conftest.py): LLVM at level 0 moves no logit past LOGITS_TOL nor any
# loss past LOSS_TOL (every group passes at both, 2026-12-04; the default level took 80 CPU-s for the
# module on 2 cores, the cheaper one 58); `EQUIPAX_TEST_XLA_DEFAULT=1` compares at the default.
@pytest.mark.parametrize("names", config_groups(_recorded()), ids=lambda names: "+".join(names))
def test_golden_values_unchanged(names, golden):
    got, got_arrays = compute(names[0])
    for name in names:
        want, want_arrays = golden[0]["experiments"][name], golden[1]
        assert got["params_traced"] == want["params_traced"], name
        assert got["params_analytic"] == want["params_analytic"] == want["params_traced"], name
        recorded = {k for k in want_arrays if k.startswith(f"{name}/")}
        assert {k.replace(names[0], name, 1) for k in got_arrays} == recorded, name
        for k, v in got_arrays.items():
            k_want = k.replace(names[0], name, 1)
            if k.endswith("argmax"):
                np.testing.assert_array_equal(v, want_arrays[k_want], err_msg=k_want)
            else:
                np.testing.assert_allclose(v, want_arrays[k_want], **LOGITS_TOL, err_msg=k_want)
        np.testing.assert_allclose(got["losses"], want["losses"], **LOSS_TOL, err_msg=f"{name} losses")
        np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=1e-5, err_msg=f"{name} grad norms")


def test_golden_check_detects_a_changed_model(golden):
    """Mutation: a model that differs slightly (one norm scale x 1.001) fails the logit comparison."""
    import equinox as eqx
    import jax

    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import family

    name = "shakespeare_llama_tiny"
    cfg = get_experiment(name)
    task = family(cfg).make_task(cfg, None)
    model, _ = eqx.filter_jit(task.init)(jax.random.key(0))
    model = eqx.tree_at(lambda m: m.final_norm.scale, model, model.final_norm.scale * 1.001)
    ids = _batches(cfg.model.vocab_size, False)[0]["ids"]
    got = _summarise(eqx.filter_jit(lambda m, x: m(x))(model, ids))["head"]  # one program, not op by op
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(got, golden[1][f"{name}/plain/head"], **LOGITS_TOL)


def write() -> None:
    """Record the golden values of every LM smoke / tiny experiment from the current code."""
    GOLDEN.mkdir(parents=True, exist_ok=True)
    numbers, arrays = {}, {}
    for names in config_groups(lm_experiment_names()):
        print(f"[golden] {' = '.join(names)}", file=sys.stderr, flush=True)
        got, a = compute(names[0])
        for name in names:
            numbers[name] = got
            arrays |= {k.replace(names[0], name, 1): v for k, v in a.items()}
    meta = {"batch": BATCH, "seq": SEQ, "steps": STEPS, "keep_vocab": KEEP_VOCAB, "experiments": numbers}
    JSON_PATH.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(LOGITS_PATH, **arrays)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    write()
