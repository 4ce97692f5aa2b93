"""How much `model.transformer.remat="auto"` compiles to choose: only the candidates that could be
chosen, each once, and the chosen one is the program the run executes."""

import json
import logging
import re
import threading
import time

import pytest

from helpers.cli import FAST


def test_a_candidate_that_removes_too_little_matrix_work_is_traced_not_compiled():
    """Figures of c4_1b at 6 layers, batch 8, on one TPU v5e (benchmarks/README.md): the traced
    matrix work of each policy (TFLOP per step), and its compiled outcome."""
    from equipax.launch.aot.remat import MIN_GAIN
    from equipax.launch.aot.remat_search import Outcome, search

    order = ["none", "dots_saveable", "save_attention_out", "offload_attention_out", "full"]
    work = {"none": 28.12, "dots_saveable": 28.38, "save_attention_out": 32.89, "full": 33.53}
    compiled = {
        "none": Outcome(False, None),
        "dots_saveable": Outcome(True, 0.2005),
        "save_attention_out": Outcome(True, 0.2186),
        "offload_attention_out": Outcome(True, 0.2200),
        "full": Outcome(True, 0.2180),
    }

    def choose(compiled, floors=None, budget=float("inf")):
        traced, lowered, compiles, active = [], [], [], [0, 0]  # active: now, most at once
        lock = threading.Lock()

        def compile_(policy, lowered):
            with lock:
                compiles.append(policy)
                active[0] += 1
                active[1] = max(active)
            # Own's outcome comes first: the others still compile when it does.
            time.sleep(0.1 if policy == "full" else 0.3)
            with lock:
                active[0] -= 1
            return compiled[policy], policy

        decision, outcomes, _, seconds, floor = search(
            order, "full", trace=lambda p: traced.append(p) or p, work=work.get,
            lower=lambda p: lowered.append(p) or p, compile_=compile_, workers=4, min_gain=MIN_GAIN, log=print,
            floor=lambda p: (floors or {}).get(p, 0.0), budget=budget,
            under_way=lambda: told.append(list(lowered)),
        )  # fmt: skip
        assert len(set(compiles)) == len(compiles)  # each compiled once, ...
        ruled_out = sorted(p for p, o in outcomes.items() if o.floor_bytes is not None)
        assert sorted(compiles) == sorted(lowered) == sorted(set(outcomes) - set(ruled_out))  # ... its outcome used
        assert all(not outcomes[p].fits and floor[p] > budget for p in ruled_out)
        most_at_once.append(active[1])
        return decision.policy, compiles, seconds

    most_at_once, told = [], []  # told: what was handed to the pool when `under_way` was called

    # save_attention_out removes 1.9% of full remat's matrix work: it cannot be projected 3% faster,
    # so only own and the two that remove more are compiled, however many compiles run at once.
    policy, compiles, seconds = choose(compiled)
    assert policy == "dots_saveable" and sorted(compiles) == ["dots_saveable", "full", "none"]
    # ... one at a time beside own: compiles beside each other slow each other, and the first that
    # fits and gains ends the search (workers=4 serves where own does not fit).
    assert most_at_once[0] <= 2
    assert seconds == work  # every candidate that recomputes less than own is traced
    # Own does not fit: the fastest projected of those that fit, the one passed over included; the
    # candidates compiling when that is known are waited for, not compiled again.
    no_own = compiled | {"full": Outcome(False, 0.2180), "dots_saveable": Outcome(False, 0.2005)}
    policy, compiles, _ = choose(no_own)
    assert policy == "save_attention_out" and "save_attention_out" in compiles
    assert "offload_attention_out" not in compiles  # save_attention_out fits: offloading cannot be faster
    # A candidate whose traced floor (arguments, residuals and gradients at once; GiB here) is over
    # the budget is never compiled, in either phase; own always is, whatever its floor.
    floors = {"none": 18.0, "dots_saveable": 10.1, "save_attention_out": 8.7, "offload_attention_out": 8.7, "full": 8.2}
    policy, compiles, _ = choose(compiled, floors, budget=15.0)
    assert policy == "dots_saveable" and sorted(compiles) == ["dots_saveable", "full"]
    assert most_at_once[-1] == 2  # the one that can win compiles beside own from the start
    # `under_way` (where `choose_remat` starts the initialisation's compile) comes once, when own's
    # and the first faster candidate's compiles are handed over, or after the candidates before own
    # are traced where none is compiled beside it.
    assert told == [["full", "none"], ["full", "none"], ["full", "dots_saveable"]]
    policy, compiles, _ = choose(compiled, floors | {"dots_saveable": 16.0}, budget=15.0)
    assert policy == "full" and compiles == ["full"] and told[-1] == ["full"]
    policy, compiles, _ = choose(no_own, floors | {"full": 16.0}, budget=15.0)
    assert policy == "save_attention_out" and "none" not in compiles and "full" in compiles


def test_a_candidate_waits_while_one_before_it_that_is_expected_to_fit_compiles():
    """Once own has compiled and fits, the next candidate is compiled on speculation only where the
    one before it, still compiling, is not expected to fit (its floor plus own's compiled bytes over
    own's floor, over the budget). Figures (GiB) of the chip's searches (benchmarks/README.md):
    c4_1b at 6 layers, where dots_with_context fits and dots_saveable had compiled for nothing, and
    llama3_2_1b at 6 layers, where neither fits."""
    from equipax.launch.aot.remat import MIN_GAIN
    from equipax.launch.aot.remat_search import Outcome, search

    order = ["none", "dots_with_context", "dots_saveable", "save_attention_out", "full"]
    work = {"none": 28.1, "dots_with_context": 28.1, "dots_saveable": 28.4, "save_attention_out": 31.9, "full": 33.5}

    def run(floors, compiled, budget, seconds=None):
        events, lock = [], threading.Lock()

        def compile_(policy, lowered):
            with lock:
                events.append(("start", policy))
            time.sleep((seconds or {}).get(policy, 0.05 if policy == "full" else 0.4))
            with lock:
                events.append(("end", policy))
            return compiled[policy], policy

        decision, *_ = search(
            order, "full", trace=lambda p: p, work=work.get, lower=lambda p: p, compile_=compile_, workers=4,
            min_gain=MIN_GAIN, log=lambda m: None, floor=floors.get, budget=budget,
        )  # fmt: skip
        return decision.policy, events

    c4 = {"none": 18.0, "dots_with_context": 10.3, "dots_saveable": 10.1, "save_attention_out": 8.7, "full": 8.2}
    fits = {
        "full": Outcome(True, 0.218, total_bytes=11.0),
        "dots_with_context": Outcome(True, 0.201, total_bytes=14.9),
        "dots_saveable": Outcome(True, 0.200, total_bytes=14.7),
    }
    # dots_with_context is expected to fit (10.3 + 2.8 <= 14.25): dots_saveable is never started.
    policy, events = run(c4, fits, budget=14.25 + 0.7)
    assert policy == "dots_with_context"
    assert [p for e, p in events if e == "start"] == ["full", "dots_with_context"], events
    # With own's overhead larger, dots_with_context is not expected to fit (10.3 + 4.7 > 14.95):
    # dots_saveable starts once own is done, beside it, as before.
    policy, events = run(c4, fits | {"full": Outcome(True, 0.218, total_bytes=12.9)}, budget=14.95)
    assert policy == "dots_with_context"
    assert events.index(("start", "dots_saveable")) < events.index(("end", "dots_with_context")), events

    llama = {"none": 16.9, "dots_with_context": 10.8, "dots_saveable": 10.6, "save_attention_out": 9.0, "full": 8.6}
    compiled = {
        "full": Outcome(True, 0.270, total_bytes=12.4),
        "dots_with_context": Outcome(False, 0.240, total_bytes=17.4),
        "dots_saveable": Outcome(False, 0.241, total_bytes=16.7),
        "save_attention_out": Outcome(True, 0.255, total_bytes=13.6),
    }
    policy, events = run(llama, compiled, budget=14.25)
    assert policy == "save_attention_out"
    # 10.8 + 3.8 > 14.25: dots_with_context is not expected to fit, so dots_saveable compiles beside it.
    assert events.index(("start", "dots_saveable")) < events.index(("end", "dots_with_context")), events
    # The chip's own budget (15.748 GiB less the 5% margin), and save_context, which removes more
    # than MIN_GAIN of full's matrix work: dots_with_context is expected to fit (10.8 + 3.8 <= 14.96)
    # and compiles alone beside own; it needs 17.4, 3.0 over its expectation for the 2.2 its floor
    # saves over own's, so dots_saveable, saving 2.0, is no longer expected to fit (10.6 + 3.8 + 2.7
    # > 14.96): save_attention_out compiles beside it, not after it. save_attention_out, saving
    # 0.4, is (9.0 + 3.8 + 0.5), so save_context waits for it and is never compiled.
    order.insert(4, "save_context")
    work["save_context"] = 32.4
    llama["save_context"] = 8.8
    compiled["save_context"] = Outcome(True, 0.262, total_bytes=12.9)
    # ... nor once save_attention_out has compiled to a win while dots_saveable, before it, still
    # compiles (the chip: save_attention_out's compile ended first).
    for seconds in ({}, {"dots_saveable": 0.6, "save_attention_out": 0.2}):
        policy, events = run(llama, compiled, budget=14.96, seconds=seconds)
        assert policy == "save_attention_out"
        started = [p for e, p in events if e == "start"]
        assert started == ["full", "dots_with_context", "dots_saveable", "save_attention_out"], events
        assert events.index(("end", "dots_with_context")) < events.index(("start", "dots_saveable")), events
        assert events.index(("start", "save_attention_out")) < events.index(("end", "dots_saveable")), events


def test_the_run_executes_the_chosen_candidate_and_loads_its_initialisation(tmp_path, monkeypatch, capsys, caplog):
    """`launch run` with remat="auto": the train step compiles once per candidate the search needs,
    and the run's first step compiles nothing (it runs the chosen candidate's program, not one
    loaded from JAX's persistent compilation cache); a candidate that removes under MIN_GAIN of
    own's matrix work (the toy's save_attention_out: 1.7% of full remat's) is not compiled; the
    state's initialisation, compiled beside the candidates, is loaded from the cache; the traced
    matrix work the screen reads differs between policies as the compiled programs' FLOPs do."""
    import jax

    from equipax.core.knobs import apply_overrides
    from equipax.launch.aot import remat
    from equipax.launch.aot.compile_events import BACKEND_COMPILE
    from equipax.launch.aot.hlo_cost import NOMINAL_HOST
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.training.loop import run_experiment
    from helpers.toy import persistent_compile_cache

    monkeypatch.setenv("EQUIPAX_CACHE_DIR", str(tmp_path / "machine"))
    monkeypatch.setattr(remat, "own_policy", lambda cfg: "full")  # shakespeare_tiny's own is none
    monkeypatch.setattr(remat, "_workers", lambda: 4)  # several at once, as on a TPU host
    search, submitted, told = remat.search, [], []

    def watched(*args, log, under_way, **kwargs):  # what was compiling when the initialisation was told to start
        def logged(message):
            submitted.extend(re.findall(r"compiling with remat='(\w+)'", message))
            return log(message)

        def note():
            told.append((list(submitted), any(t.name == "equipax-remat-beside" for t in threading.enumerate())))
            return under_way()

        return search(*args, log=logged, under_way=note, **kwargs)

    monkeypatch.setattr(remat, "search", watched)
    steps = []  # the threads that compiled a train step (or loaded one from the persistent cache)

    def listen(event: str, duration: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE and kwargs.get("fun_name") == "jit(train_step)":
            steps.append(threading.current_thread().name)

    cfg, _ = apply_overrides(
        get_experiment("shakespeare_tiny"), [*FAST, "train.num_steps=1", "model.transformer.remat=auto"]
    )
    # A cache of this test's own (the suite's may hold the toy's programs already), every program kept.
    with persistent_compile_cache(tmp_path / "jax"), caplog.at_level(logging.DEBUG, logger="jax._src.compiler"):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            run_experiment(cfg, job_dir=tmp_path / "job")
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    out = capsys.readouterr().out
    started = re.findall(r"compiling with remat='(\w+)'", out)
    assert "save_attention_out" not in started and {"full", "none"} <= set(started)
    # The table names it (not dots_saveable, which removes more: started, it may be undecided when
    # none is taken).
    (passed,) = re.findall(r"not compiled, removing under 3% of full's matrix work: ([^)]*)\)", " ".join(out.split()))
    assert re.search(r"save_attention_out 1\.\d%", passed) and "dots_saveable" not in passed, passed
    # The search's compiles only (one it started may finish after the run, unused), none for the
    # run itself.
    assert steps and all(name.startswith("equipax-remat") for name in steps) and len(steps) <= len(started), steps
    # The initialisation compiles beside the candidates, started once, when own's and the first
    # faster candidate's compiles were handed over (its tracing would have held theirs back), and
    # the run loads it.
    assert told == [(["full", "none"], False)], told
    loaded = [r.threadName for r in caplog.records if "cache hit for 'jit_make'" in r.getMessage()]
    assert threading.main_thread().name in loaded, [r.getMessage()[:80] for r in caplog.records]
    # What a policy saves in traced matrix work is what its compiled program saves (XLA:CPU's here,
    # XLA:TPU's for c4_1b and qwen3_0_6b in benchmarks/README.md): the screen's premise.
    (entry,) = json.loads((tmp_path / "job" / remat.CACHE_FILE).read_text()).values()
    rows = {r["policy"]: r for r in entry["candidates"]}
    saved = (rows["full"]["matrix_s"] - rows["none"]["matrix_s"]) * NOMINAL_HOST.peak_flops
    assert saved > 0 and saved == pytest.approx(rows["full"]["flops"] - rows["none"]["flops"], rel=1e-9)
    # Every traced candidate's memory floor is recorded, under its compiled program's memory.
    for row in rows.values():
        assert row["total_bytes"] is None or 0 < row["floor_bytes"] <= row["total_bytes"], row


def test_the_memory_floor_grows_with_what_a_policy_saves_and_stays_under_the_compiled_memory():
    """The floor's premise (what rules a candidate out without compiling it): for a scanned stack,
    the traced arguments + residuals + gradients grow with what the policy keeps, and no compiled
    program (XLA:CPU's here; XLA:TPU's for c4_1b and llama3_2_1b in benchmarks/README.md) needs
    less. Layers unrolled: the floor is the arguments alone."""
    import jax

    from equipax.core.knobs import apply_overrides, set_knob
    from equipax.core.mesh import build_mesh
    from equipax.launch.aot.memory import memory_figures
    from equipax.launch.aot.memory_floor import memory_floor
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.program.training import build_training
    from helpers.toy import TOY

    cfg, _ = apply_overrides(get_experiment("shakespeare_tiny"), [*TOY, "data.tokenizer=byte"])
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    floors, compiled = {}, {}
    for scan in (True, False):
        for policy in ("none", "dots_saveable", "full"):
            step = set_knob(set_knob(cfg, "model.transformer.scan_layers", scan), "model.transformer.remat", policy)
            traced = build_training(step, mesh).trace()
            floors[scan, policy] = memory_floor(traced.jaxpr, mesh.size)
            if scan and policy != "dots_saveable":
                compiled[policy] = memory_figures(traced.lower().compile().memory_analysis())["total_bytes"]
    assert floors[True, "none"] > floors[True, "dots_saveable"] > floors[True, "full"] > floors[False, "full"]
    assert floors[False, "none"] == floors[False, "dots_saveable"] == floors[False, "full"]  # the arguments
    assert all(floors[True, p] <= compiled[p] for p in compiled), (floors, compiled)


def test_matrix_work_counts_a_scan_per_trip_and_a_grouped_matmul_and_its_transposes():
    import jax
    import jax.numpy as jnp

    from equipax.launch.aot.matrix_work import matrix_flops

    m, k, n, groups = 64, 32, 16, 4
    x, w, sizes = jnp.ones((m, k)), jnp.ones((groups, k, n)), jnp.full((groups,), m // groups, jnp.int32)

    def experts(x, w):  # a mixture of experts' grouped matmul: each row meets one group's [k, n]
        return jax.lax.ragged_dot(x, w, sizes).sum()

    # Forward 2mkn, and its gradient for both operands: two transposes of the same size. The
    # gradient alone does not need the forward's product (nothing reads it): not counted, as XLA drops it.
    assert matrix_flops(jax.make_jaxpr(jax.value_and_grad(experts, argnums=(0, 1)))(x, w))[0] == 3 * 2 * m * k * n
    assert matrix_flops(jax.make_jaxpr(jax.grad(experts, argnums=(0, 1)))(x, w))[0] == 2 * 2 * m * k * n

    def layers(x, ws):  # three stacked [k, k] layers, scanned
        return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0].sum()

    assert matrix_flops(jax.make_jaxpr(layers)(x, jnp.ones((3, k, k))))[0] == 3 * 2 * m * k * k


def test_matrix_work_counts_splash_kernels_as_the_compiled_programs_are_priced():
    """Splash's kernels (traced here, in the interpreter's form, not run): forward 2 matrix
    multiplies, the fused backward 5, half of them under the causal mask, on bfloat16 operands
    (`equipax.launch.aot.hlo_cost`'s convention); besides them, the backward's row sums of dO x O."""
    import jax
    import jax.numpy as jnp

    from equipax.core.nn.fused_attention import splash_attention
    from equipax.launch.aot.matrix_work import matrix_flops

    b, s, h, d = 2, 256, 2, 128
    q = jnp.ones((b, s, h, d), jnp.bfloat16)

    def attention(q, k, v):
        return splash_attention(q, k, v, causal=True, interpret=True).astype(jnp.float32).sum()

    traced = jax.make_jaxpr(jax.grad(attention, argnums=(0, 1, 2)))(q, q, q)
    assert matrix_flops(traced)[0] == pytest.approx(2 * b * h * s * s * d / 2 * (2 + 5), rel=0.01)
