"""The train state and the one jitted train step (grad + update + metrics), plus the eval step.

The steps take a Task (`equipax.core.task.AbstractTask`) and call only its `loss` (training)
and `eval_sums` (evaluation): `task.loss(model, batch, *, key, model_state) -> (loss, aux,
new_model_state)`, with `loss` the scalar that is differentiated, `aux` a dict of scalar metrics,
`key=None` for deterministic evaluation (no dropout, non-trained state unchanged) and
`model_state` the model's non-trained state (BatchNorm statistics in an `eqx.nn.State`, kept in
`TrainState.model_state`; None for a stateless model). That is the one loss contract.

A plain loss function `loss_fn(model, batch, *, key) -> (loss, aux)` (a stateless model built by
the caller, as in docs/library.md) becomes a Task with `LossFnTask(loss_fn)`.
"""

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Int, PRNGKeyArray

from equipax.core._loss_contract import (
    LOSS_CONTRACT,
    RESERVED_METRICS,
    LossContractError,
    LossFn,
    LossFnTask,
    as_task,
    call_loss,
    check_aux,
    contract_error,
)
from equipax.core.learner_config import VariationalNoiseConfig
from equipax.core.losses import LOSS_PREFIX, SUM_PREFIX
from equipax.core.task import EVAL_SUMS, AbstractTask, Batch, Metrics, ModelState, ModelT, trainable
from equipax.core.variational_noise import add_variational_noise, noise_key

__all__ = [
    "LOSS_CONTRACT",
    "LossContractError",
    "LossFn",
    "LossFnTask",
    "RESERVED_METRICS",
    "TrainState",
    "TrainStep",
    "init_sharded_train_state",
    "init_train_state",
    "trainable",
    "make_eval_step",
    "make_train_step",
    "mean_eval_metrics",
]


# The model type of the state a step is called with (a subtype of what its loss takes: a step
# built from a loss over a model interface trains a state of the concrete model and returns
# one); the step hands back the type it was given.
_StateModelT = TypeVar("_StateModelT")


class TrainState(eqx.Module, Generic[ModelT]):
    """Everything a training step reads and writes (generic over the model's type).

    Attributes:
        step: the number of updates applied so far (0 before the first step).
        model: the model (parameters and static structure).
        opt_state: the optimizer state for the model's inexact-array leaves.
        model_state: non-trained state (BatchNorm running statistics), or None for a
            stateless model; the train step passes it to the loss function and stores the
            state the loss function returns.
    """

    step: Int[Array, ""]
    model: ModelT
    opt_state: Any  # a pytree (optax's state)
    model_state: ModelState = None


def init_train_state(
    model: ModelT, optimizer: optax.GradientTransformation, *, model_state: ModelState = None
) -> TrainState[ModelT]:
    """A train state at step 0 for `model`, owning its own buffers.

    The train step donates the state it is given, so the state must not share buffers with
    anything the caller still holds: the model's (and model state's) arrays are copied. Under
    `jit` (as in `init_sharded_train_state`) the copy costs nothing.

    Arguments:
        model: the initial model; it stays usable after training starts.
        optimizer: the optimizer that will update the model's trainable leaves (`trainable`).
        model_state: the model's initial non-trained state (`eqx.nn.make_with_state`), if any.

    Returns:
        The state, with the optimizer state initialised from the model's parameters.
    """
    model = _copy_arrays(model)
    model_state = _copy_arrays(model_state)
    opt_state = optimizer.init(eqx.filter(model, trainable(model)))
    return TrainState(step=jnp.zeros((), jnp.int32), model=model, opt_state=opt_state, model_state=model_state)


_T = TypeVar("_T")


def _copy_arrays(tree: _T) -> _T:
    return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def make_train_step(
    task: AbstractTask[ModelT],
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    state_sharding: Any | None = None,
    batch_sharding: Any | None = None,
    skip_nonfinite: bool = False,
    check_update_norm: bool = True,
    variational_noise: VariationalNoiseConfig | None = None,
    group_schedules: Mapping[str, optax.Schedule] | None = None,
    platform: str | None = None,
) -> "TrainStep[ModelT]":
    """Build the jitted train step.

    The state passed in is donated: its buffers are reused for the new state, so the caller
    must not use that state again (keep the returned one). A state from `init_train_state` owns
    its buffers, so the model it was built from stays usable. The batch and the key are not
    donated.

    A Task whose loss breaks the contract (`LOSS_CONTRACT`: a wrong number of return values, a
    non-scalar loss, aux names the step writes itself) raises `LossContractError` when the step is
    first traced; so does a call with `key=None`, or a plain function given instead of a Task.

    Arguments:
        task: the Task whose `loss` is trained (`LossFnTask(loss_fn)` for a plain loss function).
        optimizer: the optimizer the state was initialised with.
        schedule: the optimizer's learning-rate schedule (for the `learning_rate` metric).
        state_sharding: shardings of the state's arrays (`partition.train_state_shardings`);
            applied with `eqx.filter_shard` at the step's boundaries. None: leave it to XLA.
            Shardings on one device are not applied (`_placed_on_several_devices`).
        batch_sharding: sharding (or pytree of shardings) of the batch, likewise.
        skip_nonfinite: when the loss or the gradient norm is not finite, keep the old
            parameters, optimizer state and model state (in-graph, no host sync); the step
            counter still advances. An update that overflows although the gradients are finite
            (a huge learning rate) is applied only where the updated parameter stays finite, so
            no parameter ever becomes non-finite, and the step is reported as non-finite too
            (its update norm is not finite). Every select is decided before the optimizer's pass
            or per element, so it fuses into that pass. Adds the metrics `nonfinite` (1.0 for
            such a step) and `update_norm`. An optimizer that takes extra arguments
            (`optax.GradientTransformationExtraArgs`, as every `optax.chain` does) is passed the
            decision as `grads_finite` (a scalar bool, False for a step whose old state is kept).
        check_update_norm: with `skip_nonfinite`, take the update's norm every step (the
            `update_norm` metric, inf where an element of the update would overflow its
            parameter, and for a step whose loss or gradients are not finite; such a step is then
            reported non-finite at its own step). It is summed in the same pass that applies the
            update. False: no `update_norm`; the same pass still flags an update with an element
            that overflows its parameter or whose float32 square overflows (an update past
            ~1.8e19), and reports that step non-finite; parameters still never become non-finite,
            and the loss and gradient checks stay. Only an overflow of the sum of squares alone
            goes unreported without the norm.
        variational_noise: Gaussian weight noise for the loss and its gradient
            (`equipax.core.variational_noise`); the update goes to the noise-free parameters.
            None (or `vn_scale=0`): none.
        group_schedules: the schedules of the optimizer's parameter groups
            (`equipax.core.optim.group_schedules`), logged as `learning_rate/<group>`.
        platform: the platform the step is lowered for ("cpu", "gpu", "tpu";
            `equipax.core.nn.fused_attention.mesh_platform`), None = JAX's default backend. On
            "tpu" the `param_norm` sum is left to XLA to place (it fuses it into the passes that
            read the parameters anyway); elsewhere it is taken first (see the step's barrier).

    Returns:
        `train_step(state, batch, key) -> (new_state, metrics)`. The step's random key is
        `fold_in(key, state.step)`, so callers pass the same base key every step. `metrics` holds
        `loss`, every aux entry, `grad_norm` (global, before clipping), `param_norm` (of the
        parameters the loss was computed with, before any variational noise) and `learning_rate`
        (for this update).
    """

    task = as_task(task)
    state_sharding = state_sharding if _placed_on_several_devices(state_sharding) else None
    batch_sharding = batch_sharding if _placed_on_several_devices(batch_sharding) else None
    vn = variational_noise if variational_noise is not None and variational_noise.enabled else None

    def loss_and_aux(model: Any, batch: Batch, key: PRNGKeyArray, model_state: Any) -> Any:
        loss, aux, new_model_state = call_loss(task, model, batch, key, model_state)
        return loss, (aux, new_model_state)

    def step(inputs: tuple[Batch, PRNGKeyArray | None], state: TrainState[Any]) -> Any:
        batch, key = inputs
        if key is None:
            raise contract_error(
                "The train step was called with key=None; training needs a PRNG key (its loss gets "
                "`fold_in(key, step)`).",
                "Pass `jax.random.key(seed)`; for deterministic evaluation use `make_eval_step`.",
            )
        if state_sharding is not None:
            state = eqx.filter_shard(state, state_sharding)
        if batch_sharding is not None:
            batch = eqx.filter_shard(batch, batch_sharding)
        step_key = jax.random.fold_in(key, state.step)
        # The skip path keeps the old model state; an eqx.nn.State may be used only once, so
        # keep its leaves (a clone) before the loss consumes it.
        old_model_state = jax.tree.flatten(state.model_state)
        # Differentiate the trainable leaves only (`trainable`): frozen ones get no gradient.
        params, frozen = eqx.partition(state.model, trainable(state.model))

        def loss_of_params(params: Any, *args: Any) -> Any:
            if vn is not None:  # the gradient at the noisy parameters is the clean ones' gradient
                params = add_variational_noise(params, vn, key=noise_key(vn, step_key, state.step), step=state.step)
            return loss_and_aux(eqx.combine(params, frozen), *args)

        (loss, (aux, model_state)), grads = eqx.filter_value_and_grad(loss_of_params, has_aux=True)(
            params, batch, step_key, state.model_state
        )
        check_aux(aux)
        params = eqx.filter(params, eqx.is_inexact_array)
        grad_norm, param_norm = optax.tree.norm(grads), optax.tree.norm(params)
        # The update overwrites the parameters' donated buffers in place. Nothing orders the
        # `param_norm` read of the old parameters before it, so XLA would copy every parameter
        # at the start of the step (a second copy of the model in memory); the barrier makes the
        # update read the parameters only once the norm is taken. (On the parameters, not the
        # gradients: a barrier on the gradients kept XLA from sharing `grad_norm` with the
        # optimizer's global-norm clip, a second pass over every gradient, benchmarks/README.md.)
        # (Not on a TPU: XLA:TPU orders the read itself, without a copy, and fuses the sum into
        # the passes that read the parameters anyway, e.g. the optimizer's: a pass over the
        # embedding less per step, benchmarks/README.md; tests/launch/test_compile_tpu.py.)
        if (platform or jax.default_backend()) != "tpu":
            params, param_norm = jax.lax.optimization_barrier((params, param_norm))
        # The guard's decision (below) is known before the optimizer's pass; an optimizer that
        # takes extra arguments is told it, so it may compute its update from the state the step
        # keeps (`equipax.core.optim.scale_by_adam_of_kept_moments`).
        grads_ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        told = skip_nonfinite and isinstance(optimizer, optax.GradientTransformationExtraArgs)
        extra = {"grads_finite": grads_ok} if told else {}
        updates, opt_state = optimizer.update(grads, state.opt_state, params, **extra)
        metrics = {
            "loss": loss,
            **aux,
            "grad_norm": grad_norm,
            "param_norm": param_norm,
            "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
            **{
                f"learning_rate/{name}": jnp.asarray(group(state.step), jnp.float32)
                for name, group in (group_schedules or {}).items()
            },
        }
        if not skip_nonfinite:
            model = task.update_model(eqx.apply_updates(eqx.combine(params, state.model), updates), model_state)
            new_state = TrainState(step=state.step + 1, model=model, opt_state=opt_state, model_state=model_state)
        else:
            # Pax's in-graph skip of invalid steps. The counter still advances, so step numbers,
            # step keys and the schedule stay aligned with the batches consumed (and on resume).
            # Every select below is decided by values known before the optimizer's pass, or is
            # one element's own, so XLA fuses it into that pass:
            # - `grads_ok` (loss and gradient norm finite) guards everything: parameters, moments
            #   and model state keep their old values when it fails;
            # - an update that overflows although the gradients are finite (a huge learning rate)
            #   is applied only where the updated parameter is finite (elementwise), so no
            #   parameter ever becomes non-finite; the step is reported non-finite (`ok` adds the
            #   update's norm, or without it each element's flag) and `train.on_nonfinite` decides.
            # Each parameter and moment is read and written once, as in an unguarded step. The
            # update's norm is summed from the same elements the apply computes (`_update_square_sum`),
            # so XLA:TPU fuses it into the apply; `optax.tree.norm(updates)` made it write every
            # update to memory and read it back (benchmarks/README.md, "On a real TPU").
            ok = grads_ok & jnp.isfinite(param_norm)
            applied = jax.tree.map(_apply_where_finite, params, updates, is_leaf=lambda x: x is None)
            if check_update_norm:
                squares = jax.tree.map(_update_square_sum, params, updates, is_leaf=lambda x: x is None)
                norm = jnp.sqrt(sum(jax.tree.leaves(squares), jnp.zeros((), jnp.float32)))
                metrics["update_norm"] = jnp.where(grads_ok, norm, jnp.inf)  # none is applied otherwise
                ok = ok & jnp.isfinite(metrics["update_norm"])
            else:
                # No norm, but the same elements' flag, folded in the same pass: an update that
                # overflows an element (or its float32 square: weights past ~1.8e19, which no
                # forward pass survives) is still reported at its own step.
                largest = jax.tree.map(_update_square_max, params, updates, is_leaf=lambda x: x is None)
                ok = ok & jnp.isfinite(jnp.max(jnp.stack([jnp.zeros((), jnp.float32), *jax.tree.leaves(largest)])))
            model = task.update_model(eqx.combine(applied, state.model), model_state)
            old_model_state_tree = jax.tree.unflatten(old_model_state[1], old_model_state[0])
            new_state = TrainState(
                step=state.step + 1,
                model=_select(grads_ok, model, state.model),
                opt_state=_select(grads_ok, opt_state, state.opt_state),
                model_state=_select(ok, model_state, old_model_state_tree),
            )
            metrics["nonfinite"] = jnp.where(ok, 0.0, 1.0).astype(jnp.float32)
        if state_sharding is not None:
            new_state = eqx.filter_shard(new_state, state_sharding)
        return new_state, metrics

    return TrainStep(step)


def _placed_on_several_devices(shardings: Any) -> bool:
    """Whether a pytree of shardings places anything on more than one device. On one device a
    sharding constraint changes nothing but the program's size (deep12's step, benchmarks/README.md:
    458 lines of StableHLO of them; tracing and lowering 0.87 s without them against 0.93-0.99 s,
    XLA's compile the same within noise); the step still compiles once for every call."""
    leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return any(len(s.device_set) > 1 for s in leaves if isinstance(s, jax.sharding.Sharding))


def _apply_where_finite(param: Array | None, update: Array | None) -> Array | None:
    """`param + update` where that is finite, else `param` (elementwise; see the step's guard)."""
    if param is None or update is None:
        return param
    new = (param + update).astype(param.dtype)
    return jnp.where(jnp.isfinite(new), new, param)


def _update_squares(param: Array, update: Array) -> Array:
    """The update's elementwise squares (float32), inf where `param + update` overflows (the
    elements `_apply_where_finite` refuses)."""
    finite = jnp.isfinite((param + update).astype(param.dtype))
    return jnp.where(finite, jnp.square(update.astype(jnp.float32)), jnp.inf)


def _update_square_sum(param: Array | None, update: Array | None) -> Array | None:
    """The update's squared norm (float32), or inf where `param + update` overflows: the elements
    `_apply_where_finite` refuses make the step's `update_norm` non-finite, so it is reported."""
    if param is None or update is None:
        return None
    return jnp.sum(_update_squares(param, update))


def _update_square_max(param: Array | None, update: Array | None) -> Array | None:
    """The largest of `_update_squares` (inf where the update overflows its parameter or its
    float32 square does): the check without the norm's sum. A max, because XLA:TPU fuses it into
    the apply pass as it does the sum, while an `all` of the elements' flags cost two more reads
    of every weight (tests/launch/test_compile_tpu.py counts them)."""
    if param is None or update is None:
        return None
    return jnp.max(_update_squares(param, update), initial=0.0)


def _select(pred: Array, on_true: _T, on_false: _T) -> _T:
    """`on_true` where the scalar `pred` holds, else `on_false`, leaf by leaf (same structure).
    (`jnp.where(pred, new, old)`: `equipax.core.optim.scale_by_adam_of_kept_moments` writes the
    same select of the moments, so XLA computes it once.)"""
    a, static = eqx.partition(on_true, eqx.is_array)
    b, _ = eqx.partition(on_false, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b), static)


def _is_abstract_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


_ModelT_contra = TypeVar("_ModelT_contra", contravariant=True)


class TrainStep(Generic[_ModelT_contra]):
    """`train_step(state, batch, key) -> (new_state, metrics)`; `.lower(...)` for AOT compiles.

    Calls and AOT lowering go through the same `jax.jit` of the state's array leaves (the rest
    of the state, its tree structure and any non-array leaves, is bound once per structure), so
    `lower` on abstract arguments gives exactly the program a call with concrete arguments runs.
    A call costs one C++ tree flatten and a dictionary lookup on the host, not `eqx.filter_jit`'s
    per-call filtering (~0.7 ms more per call, benchmarks/README.md; several ms on a loaded machine).
    """

    def __init__(self, step: Callable[..., Any]) -> None:
        self._step = step
        self._jitted: dict[Any, Any] = {}

    def _for(self, state: Any) -> tuple[Any, list[Any], tuple[Any, tuple[bool, ...], tuple[Any, ...]]]:
        leaves, treedef = jax.tree.flatten(state)
        is_array = tuple(_is_abstract_array(x) for x in leaves)
        static = tuple(x for x, a in zip(leaves, is_array) if not a)
        structure = (treedef, is_array, static)
        fn = self._jitted.get(structure)
        if fn is None:

            def train_step(arrays, batch, key):  # XLA module jit_train_step (profiles, logs)
                new_state, metrics = self._step((batch, key), _unflatten(structure, arrays))
                new_leaves, new_treedef = jax.tree.flatten(new_state)
                if new_treedef != treedef:
                    raise ValueError(f"The train step changed the state's structure: {treedef} -> {new_treedef}.")
                return [x for x, a in zip(new_leaves, is_array) if a], metrics

            # Only the state's arrays are donated: the batch and the key stay the caller's.
            fn = self._jitted[structure] = jax.jit(train_step, donate_argnums=0)
        return fn, [x for x, a in zip(leaves, is_array) if a], structure

    def __call__(
        self, state: TrainState[_StateModelT], batch: Batch, key: PRNGKeyArray
    ) -> tuple[TrainState[_StateModelT], Metrics]:
        fn, arrays, structure = self._for(state)
        new_arrays, metrics = fn(arrays, batch, key)
        return _unflatten(structure, new_arrays), metrics

    def lower(self, state: Any, batch: Any, key: Any) -> Any:
        """Lower the step for ahead-of-time compilation (the same jit a call runs).

        Arguments may be `jax.ShapeDtypeStruct`s (with shardings): nothing is allocated.
        """
        fn, arrays, _ = self._for(state)
        return fn.lower(arrays, batch, key)

    def trace(self, state: Any, batch: Any, key: Any) -> Any:
        """Trace the step as `lower` does, without lowering it: `jax.stages.Traced`, whose `jaxpr`
        is the program (the backward pass included) and whose `lower()` is `lower`'s."""
        fn, arrays, _ = self._for(state)
        return fn.trace(arrays, batch, key)


def _unflatten(structure: tuple[Any, tuple[bool, ...], tuple[Any, ...]], arrays: list[Any]) -> Any:
    """The state of `structure` (`TrainStep._for`) with `arrays` as its array leaves."""
    treedef, is_array, static = structure
    arrays_it, static_it = iter(arrays), iter(static)
    return jax.tree.unflatten(treedef, [next(arrays_it) if a else next(static_it) for a in is_array])


def make_eval_step(task: AbstractTask[ModelT]) -> Callable[..., Metrics]:
    """Build the jitted eval step.

    Arguments:
        task: the Task whose `eval_sums` are computed (deterministic: `key=None`, the model state
            unchanged); sums, so that results over batches combine by addition.
            `LossFnTask(loss_fn)` gives a plain loss function's aux.

    Returns:
        `eval_step(model, batch, model_state=None) -> sums`.
    """
    task = as_task(task)

    @eqx.filter_jit
    def eval_step(model: ModelT, batch: Batch, model_state: ModelState = None) -> Metrics:
        return task.eval_sums(model, batch, model_state=model_state)

    return eval_step


def init_sharded_train_state(
    make_model: Callable[[PRNGKeyArray], ModelT],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    key: PRNGKeyArray,
    rules: Mapping[str, str | None] | None = None,
) -> tuple[TrainState[ModelT], Any]:
    """Build the train state directly in its sharded layout (no full copy on one device).

    The state's shape is traced abstractly first (`eqx.filter_eval_shape`), its shardings come
    from the partition rules, and the initialiser runs under jit with those output shardings.

    Arguments:
        make_model: `key -> model`.
        optimizer: the optimizer.
        mesh: the device mesh.
        key: the init key.
        rules: logical axis -> mesh axis (default `equipax.core.partition.LOGICAL_TO_MESH`).

    Returns:
        `(state, state_sharding)`; pass the sharding to `make_train_step`.
    """
    from equipax.core.partition import train_state_shardings

    def make_state(k: PRNGKeyArray) -> TrainState[ModelT]:
        return init_train_state(make_model(k), optimizer)

    abstract = eqx.filter_eval_shape(make_state, key)
    sharding = train_state_shardings(abstract, optimizer, mesh, rules)
    state = eqx.filter_jit(lambda k: eqx.filter_shard(make_state(k), sharding))(key)
    return state, sharding


def mean_eval_metrics(aux_batches: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Combine per-batch eval sums into weighted means over the whole pass.

    Arguments:
        aux_batches: host values of each batch's eval aux (`EVAL_SUMS`, and `loss_sum/<name>`
            for each named loss: `equipax.core.losses`).

    Returns:
        `loss` and `accuracy` (weighted means; NaN when there were no batches), `weight` (the
        total weight: tokens or examples counted), `batches`, and `loss/<name>` for each named loss.
    """
    totals: dict[str, float] = dict.fromkeys(EVAL_SUMS, 0.0)
    count = 0
    for aux in aux_batches:
        for k in EVAL_SUMS:
            totals[k] += float(aux[k])
        for k, v in aux.items():
            if k.startswith(SUM_PREFIX):
                totals[k] = totals.get(k, 0.0) + float(v)
        count += 1
    weight = max(totals["weight_sum"], 1e-9)
    named = {LOSS_PREFIX + k[len(SUM_PREFIX) :]: v / weight for k, v in totals.items() if k.startswith(SUM_PREFIX)}
    return {
        "loss": totals["loss_sum"] / weight if count else float("nan"),
        "accuracy": totals["correct_sum"] / weight if count else float("nan"),
        "weight": totals["weight_sum"],
        "batches": float(count),
        **named,
    }
