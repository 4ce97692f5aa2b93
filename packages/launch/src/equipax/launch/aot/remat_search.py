"""Which remat candidates `remat="auto"` compiles, in what order, and when it stops (`search`);
the rule that picks one from their compiled figures (`decide`). `equipax.launch.aot.remat` is the
command-facing side (cache, table, errors).

The experiment's own policy (`own`) is compiled first, and the candidates that recompute less than
it (`faster`) one at a time beside it (tracing and lowering in this thread, XLA's compiles in a
pool: they release the GIL). A candidate that recomputes less is compiled only where
its traced program's matrix work at the device's peak is at least `min_gain` below own's
(`removed_share`): what it saves is the recomputation it skips, and own's step takes at least
own's matrix work, so one that removes less cannot be projected `min_gain` faster (c4_1b at 6
layers on a TPU v5e, benchmarks/README.md: save_context removes 0.8% of full remat's matrix
work, and its compiled program is projected 0.2% slower). Nor is a candidate other than own
compiled where its traced program's memory floor (`equipax.launch.aot.memory_floor`) is over the
budget: it cannot fit (c4_1b at 6 layers: `none`'s floor is 18.0 GiB, over the chip's 15; its
compile took 7.3 s before the next candidate could start). Nor is one compiled on speculation: once
own has compiled and fits, a candidate waits while one before it in the list still compiles that is
expected to fit (its floor plus what own's compiled program needs over own's floor is within the
budget), since that one would end the search (c4_1b at 6 layers on the chip: `dots_saveable`
started once `full` was done, 2 s before `dots_with_context` fitted, and compiled on beside the
run's first steps for 13 s; benchmarks/README.md). A candidate that compiled to more than so
expected raises the expectation of the next in proportion to what each saves over own's floor:
the temporaries a floor leaves out grow with the residuals it keeps (llama3_2_1b at 6 layers on
the chip, GiB: `dots_with_context`, floor 10.8 against own's 8.6, expected at 14.6 of a 14.96
budget, compiled to 17.5; `dots_saveable` (10.6), then expected to fit, held `save_attention_out`
(9.0) back for a compile of its own, 16.7; the miss added whole would have expected
`save_attention_out` over the budget too, compiled 13.5, and compiled `save_context` beside it for
nothing). Nor does a candidate start once one before it has compiled to a win: the search
then waits only for those between. The expectation orders the compiles only; what is
chosen is decided by the compiled figures alone. A faster candidate replaces
`own` only where it fits and its compiled program is projected at least `min_gain` faster than
own's; the first such one down the list is taken, and candidates after it are never lowered.
Only where `own` does not fit are the policies that recompute more compiled (`slower`, and those
passed over), and then the fastest projected one that fits is taken; `offload_attention_out` is
compiled only where `save_attention_out` does not fit (the same recomputation plus the copies to
host memory: it cannot be faster). The outcome depends only on the traced programs and the
compiles' figures, never on which finished first, so every host of a job takes the same policy.
"""

import collections
import concurrent.futures
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Decision", "decide", "Outcome", "removed_share", "search"]

SAVE = "save_attention_out"
OFFLOAD = "offload_attention_out"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A compiled candidate: whether it fits the budget, its projected step (None: unknown) and the
    bytes per device its compiled program needs (`total_bytes`; None: not known); or one not
    compiled because its traced memory floor (`floor_bytes`) is over the budget."""

    fits: bool
    projected_s: float | None
    floor_bytes: float | None = None
    total_bytes: int | float | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """`policy` and why (`reason`); or, while undetermined, the candidate it `waits` for; or
    `fallback`: own does not fit, the slower candidates are needed."""

    policy: str | None = None
    reason: str = ""
    waits: str | None = None
    fallback: bool = False


def _gain(candidate: Outcome, own: Outcome) -> float | None:
    if candidate.projected_s is None or own.projected_s is None or own.projected_s <= 0:
        return None
    return 1.0 - candidate.projected_s / own.projected_s


def decide(own: str, faster: Sequence[str], outcomes: Mapping[str, Outcome], min_gain: float) -> Decision:
    """The first phase's rule: own, unless a candidate that recomputes less (`faster`, in order)
    fits and is projected at least `min_gain` faster."""
    if own not in outcomes:
        return Decision(waits=own)
    mine = outcomes[own]
    if not mine.fits:
        return Decision(fallback=True)
    for policy in faster:
        if policy not in outcomes:
            return Decision(waits=policy)
        gain = _gain(outcomes[policy], mine)
        if outcomes[policy].fits and gain is not None and gain >= min_gain:
            return Decision(policy, f"projected {gain:.1%} faster than {own!r}, the experiment's own policy")
    if not faster:
        return Decision(own, "the experiment's own policy; none recomputes less")
    return Decision(own, f"the experiment's own policy; none that recomputes less fits and is projected "
                    f"at least {min_gain:.0%} faster")  # fmt: skip


def fastest_that_fits(order: Sequence[str], outcomes: Mapping[str, Outcome], own: str) -> Decision:
    """The fallback's rule: the fastest projected candidate that fits (unknown projections last,
    ties in `order`)."""
    fitting = [p for p in order if p in outcomes and outcomes[p].fits]
    if not fitting:
        return Decision()

    def projected(policy: str) -> float:
        seconds = outcomes[policy].projected_s
        return math.inf if seconds is None else seconds

    best = min(fitting, key=projected)
    return Decision(
        best, f"the fastest projected of those that fit; {own!r}, the experiment's own policy, does not fit"
    )


def removed_share(own_s: float, candidate_s: float) -> float:
    """The share of own's matrix work (`own_s` seconds at peak) a candidate's (`candidate_s`) removes."""
    return 1.0 - candidate_s / own_s if own_s > 0 else 1.0


def search(
    order: Sequence[str],
    own: str,
    *,
    trace: Callable[[str], Any],
    work: Callable[[Any], float],
    lower: Callable[[Any], Any],
    compile_: Callable[[str, Any], tuple[Outcome, Any]],
    workers: int,
    min_gain: float,
    log: Callable[[str], object],
    floor: Callable[[Any], float] = lambda traced: 0.0,
    budget: int | float = math.inf,
    under_way: Callable[[], object] = lambda: None,
) -> tuple[Decision, dict[str, Outcome], dict[str, Any], dict[str, float], dict[str, float]]:
    """Compile candidates of `order` (least recomputation first) until the rules decide.

    Arguments:
        order: the candidates on this platform, from the least recomputation to the most.
        own: the experiment's own policy (in `order`).
        trace: `policy -> traced step` (called in this thread).
        work: `traced step -> its matrix work in seconds at the device's peak`
            (`equipax.launch.aot.matrix_work.matrix_seconds`).
        lower: `traced step -> lowered step` (called in this thread).
        compile_: `(policy, lowered) -> (Outcome, compiled step)` (called in the pool).
        workers: compiles at once.
        min_gain: how much faster than own a candidate must be projected.
        log: progress messages.
        floor: `traced step -> bytes per device it needs at least`
            (`equipax.launch.aot.memory_floor.memory_floor`).
        budget: bytes per device a candidate must fit in: one other than own whose floor is over
            it is not compiled (its outcome: not fitting, with `floor_bytes`).
        under_way: called once (in this thread) when the first phase's compiles are under way:
            own's and the first faster candidate's handed to the pool, or own's alone once the
            candidates before it are traced. `choose_remat` then starts the initialisation's
            compile, whose tracing and lowering would otherwise hold Python's lock while this
            thread traces them (the chip: `none`'s tracing took 1.31 s beside it, 0.49 alone).

    Returns:
        The decision (policy None: nothing fits), the outcomes and the compiled steps by policy,
        and the matrix work (seconds at peak) and memory floor (bytes per device) of every traced
        candidate.
    """
    i = order.index(own)
    outcomes: dict[str, Outcome] = {}
    steps: dict[str, Any] = {}
    traced: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    floors: dict[str, float] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="equipax-remat")
    # Compiles beside each other slow each other (the TPU v5e's 13-core host: four train steps at
    # once took 19-22 s each, one alone 11.6 s; benchmarks/README.md), and the first candidate that
    # fits and gains ends the first phase: there it compiles beside own, the next only once it is
    # out. Where own does not fit, every candidate is needed: `workers` at once.
    limit = [min(2, max(1, workers))]
    running: dict[concurrent.futures.Future[tuple[Outcome, Any]], str] = {}
    started: set[str] = set()
    faster: list[str] = []  # the candidates that recompute less, compiled beside own in the first phase
    told: list[bool] = []

    def phase_one_under_way() -> None:
        if not told:
            told.append(True)
            under_way()

    def traces(policy: str) -> Any:
        """`policy`'s traced step, its matrix work and floor recorded; None where the floor rules
        it out (recorded as its outcome)."""
        step = traced[policy] = traced.get(policy) or trace(policy)
        seconds[policy], floors[policy] = work(step), floor(step)
        if policy != own and floors[policy] > budget:
            outcomes[policy] = Outcome(False, None, floors[policy])
            traced.pop(policy)
            return None
        return step

    def expected_to_fit(policy: str) -> bool:
        """Whether `policy` is expected to fit: its floor plus what own's compiled program needs over
        own's floor (known once own has compiled and fits; before, nothing is expected), plus, per
        byte its floor saves over own's, the most a candidate compiled so far needed over that
        expectation of it per byte its own floor saved."""
        mine = outcomes.get(own)
        if mine is None or not mine.fits or mine.total_bytes is None:
            return False
        overhead = max(0.0, mine.total_bytes - floors[own])
        missed = [
            (outcome.total_bytes - floors[p] - overhead) / (floors[p] - floors[own])
            for p, outcome in outcomes.items()
            if p in floors and outcome.total_bytes is not None and floors[p] > floors[own]
        ]
        saved = max(0.0, floors[policy] - floors[own])
        return floors[policy] + overhead + saved * max([0.0, *missed]) <= budget

    def wins(policy: str) -> bool:
        """Whether `policy` has compiled, fits and is projected at least `min_gain` faster than own."""
        outcome, mine = outcomes.get(policy), outcomes.get(own)
        gain = _gain(outcome, mine) if outcome is not None and mine is not None else None
        return outcome is not None and outcome.fits and gain is not None and gain >= min_gain

    def speculative(policy: str) -> bool:
        """Whether `policy` is needed only if a faster candidate before it, still compiling and
        expected to fit, turns out not to; or not at all, one before it having compiled to a win
        (the search then waits only for those between)."""
        ahead = faster[: faster.index(policy)] if policy in faster else []
        return any((p in running.values() and expected_to_fit(p)) or wins(p) for p in ahead)

    def start(queue: collections.deque[str], hold: Callable[[str], bool] = lambda policy: False) -> None:
        while queue and len(running) < limit[0] and not hold(queue[0]):
            policy = queue.popleft()
            step = traced.pop(policy, None) or traces(policy)
            if step is None:
                continue
            log(f"model.transformer.remat='auto': compiling with remat={policy!r}...")
            running[pool.submit(compile_, policy, lower(step))] = policy
            started.add(policy)
            if policy != own:
                phase_one_under_way()

    def run(
        queue: collections.deque[str],
        done: Callable[[], Decision | None],
        hold: Callable[[str], bool] = lambda policy: False,
    ) -> Decision | None:
        while (decision := done()) is None:
            start(queue, hold)
            if not running:
                return None
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                policy = running.pop(future)
                outcomes[policy], steps[policy] = future.result()
        return decision

    try:
        # Own compiles first; while it does, the candidates that recompute less are traced, and
        # only those whose matrix work is at least `min_gain` below own's are compiled.
        traces(own)
        queue = collections.deque([own])
        start(queue)
        for policy in order[:i]:
            if policy == OFFLOAD:
                continue
            if traces(policy) is None:
                continue  # over the budget: never compiled
            if removed_share(seconds[own], seconds[policy]) >= min_gain:
                faster.append(policy)
                queue.append(policy)
                start(queue, speculative)
            else:
                traced.pop(policy)  # not compiled in this phase: traced again if the fallback needs it
        phase_one_under_way()  # own alone, where no candidate before it is compiled beside it

        def first() -> Decision | None:
            d = decide(own, faster, outcomes, min_gain)
            return d if d.policy is not None or d.fallback else None

        decision = run(queue, first, speculative)
        if decision is None or decision.policy is None:  # own does not fit: every other candidate
            limit[0] = max(1, workers)
            # (and those still compiling, or ruled out by their floor)
            rest = [p for p in order if p not in started and p not in outcomes and p != OFFLOAD]
            run(collections.deque(rest), lambda: None)
            if OFFLOAD in order and OFFLOAD not in outcomes and not (SAVE in outcomes and outcomes[SAVE].fits):
                run(collections.deque([OFFLOAD]), lambda: None)
            decision = fastest_that_fits(order, outcomes, own)
    finally:
        # Candidates no longer needed: the queued are never lowered; a running compile finishes
        # in its thread, its result unused.
        pool.shutdown(wait=False, cancel_futures=True)
    return decision, outcomes, steps, seconds, floors
