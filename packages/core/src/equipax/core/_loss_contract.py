"""The one loss contract of the steps (public in `equipax.core.step`, which re-exports it): a Task,
its `loss` checked against the contract, and `LossFnTask`, the adapter that makes a plain loss
function a Task.

The steps call only a Task's `loss(model, batch, *, key, model_state) -> (loss, aux,
new_model_state)` (training) and `eval_sums` (evaluation); `LOSS_CONTRACT` says it in full and
every `LossContractError` quotes it with what was found and the fix.
"""

import inspect
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray, Scalar

from equipax.core.losses import (
    LOSS_PREFIX,
    NamedLosses,
    aggregate_losses,
    check_named_losses,
    is_named_losses,
    named_loss_sums,
)
from equipax.core.task import AbstractTask, Batch, Metrics, ModelState, ModelT

__all__ = [
    "as_task",
    "call_loss",
    "check_aux",
    "checked_loss",
    "contract_error",
    "LOSS_CONTRACT",
    "LossContractError",
    "LossFn",
    "LossFnTask",
    "RESERVED_METRICS",
]


# Metric names the train step writes itself; a loss function's aux may not reuse them.
RESERVED_METRICS = ("loss", "grad_norm", "param_norm", "learning_rate", "nonfinite", "update_norm")

LOSS_CONTRACT = (
    "The loss contract: the steps take a Task (equipax.core.task.AbstractTask) whose "
    "`loss(model, batch, *, key, model_state)` returns `(loss, aux, new_model_state)`, with `loss` a "
    "scalar array (or named losses `{name: (value, weight)}`, which the steps sum: "
    "equipax.core.losses), `aux` a dict of scalar metrics whose names are not "
    f"{', '.join(RESERVED_METRICS)}, and `key` a PRNG key or None (deterministic evaluation); a plain "
    "`loss_fn(model, batch, *, key) -> (loss, aux)` is wrapped as `LossFnTask(loss_fn)`."
)

_ModelT_contra = TypeVar("_ModelT_contra", contravariant=True)


class LossContractError(TypeError, ValueError):
    """A loss function (or Task) broke the loss contract; the message says what was found, the
    contract (`LOSS_CONTRACT`) and the fix."""


def contract_error(found: str, fix: str) -> LossContractError:
    return LossContractError(f"{found} {fix}\n{LOSS_CONTRACT}")


@runtime_checkable
class LossFn(Protocol[_ModelT_contra]):
    """`loss_fn(model, batch, *, key) -> (loss, aux)`: `loss` the scalar that is differentiated,
    `aux` a dict of scalar metrics; `key=None` means deterministic (evaluation)."""

    def __call__(
        self, model: _ModelT_contra, batch: Batch, /, *, key: PRNGKeyArray | None
    ) -> tuple[Scalar | NamedLosses, Mapping[str, Array]]:
        """The loss (or named losses) and its metrics on one batch."""
        ...


def _check_signature(loss_fn: Any) -> None:
    """Refuse, before anything is traced, a loss function that cannot take `key=` by keyword."""
    if not callable(loss_fn):
        raise contract_error(
            f"The loss function is a {type(loss_fn).__name__}, not a callable.", "Pass a function (or a Task)."
        )
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature (a builtin): checked when called
        return
    kinds = {p.name: p.kind for p in params}
    if inspect.Parameter.VAR_KEYWORD in kinds.values():
        return
    if kinds.get("key") not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise contract_error(
            f"The loss function {getattr(loss_fn, '__qualname__', loss_fn)!r} takes no `key` keyword "
            f"(its parameters: {', '.join(kinds) or 'none'}).",
            "Add `*, key: PRNGKeyArray | None = None` (and ignore it if the model is deterministic).",
        )


def checked_loss(out: Any, want: int) -> tuple[Scalar, Metrics, Any]:
    """What a loss returned, checked against the contract: `(loss, aux, model_state or None)`."""
    if not isinstance(out, tuple) or len(cast(tuple[Any, ...], out)) != want:
        shape = (
            f"a tuple of {len(cast(tuple[Any, ...], out))}"
            if isinstance(out, tuple)
            else f"an array of shape {jnp.shape(out)}"
            if hasattr(out, "shape")
            else type(out).__name__
        )
        raise contract_error(
            f"The loss function returned {shape}; expected a tuple of {want} "
            f"({'(loss, aux)' if want == 2 else '(loss, aux, new_model_state)'}).",
            "Return `loss, {}` when there are no metrics."
            if want == 2
            else "Return the state the model's layers gave back as the third element.",
        )
    loss, aux = out[0], out[1]
    if not isinstance(aux, Mapping):
        raise contract_error(
            f"The loss function's aux is a {type(aux).__name__}, not a dict.",
            "Return a dict of scalar metrics (`{}` for none).",
        )
    aux = dict(cast(Mapping[str, Array], aux))
    if is_named_losses(loss):
        problem = check_named_losses(loss)
        if problem is not None:
            raise contract_error(problem, "Return `{name: (scalar value, weight)}` with names like `cross_entropy`.")
        loss, parts = aggregate_losses(loss)
        clash = sorted(set(parts) & set(aux))
        if clash:
            raise contract_error(
                f"The loss function's aux uses the metric name(s) {clash}, which its named losses write.",
                f"Rename these aux entries (`{LOSS_PREFIX}<name>` is each named loss's metric).",
            )
        aux |= parts
    elif jnp.shape(loss) != ():
        raise contract_error(
            f"The loss function's loss has shape {jnp.shape(loss)}; expected a scalar.",
            "Reduce it to one number (e.g. `jnp.mean`), or return named losses `{name: (value, weight)}`.",
        )
    return loss, aux, out[2] if want == 3 else None


class LossFnTask(AbstractTask[ModelT]):
    """A plain loss function as the Task the steps take: `LossFnTask(loss_fn)`, for a stateless
    model the caller builds (docs/library.md). The steps call only a Task's `loss` and `eval_sums`;
    this one has no `init` or `abstract_batch` (a model family for the launcher writes a full
    Task: docs/extending.md).

    Arguments:
        loss_fn: `loss_fn(model, batch, *, key) -> (loss, aux)`; with `key=None` it evaluates.
            Its aux entries are what the eval step returns: sums (summed loss, example weight)
            combine over batches by addition.
    """

    loss_fn: LossFn[ModelT] = eqx.field(static=True)

    def __check_init__(self) -> None:
        _check_signature(self.loss_fn)

    def init(self, key: PRNGKeyArray) -> tuple[ModelT, None]:
        raise NotImplementedError(
            "LossFnTask wraps a loss function for make_train_step / make_eval_step; it builds no model. "
            "Build the model yourself, or write a Task (docs/extending.md)."
        )

    def abstract_batch(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        raise NotImplementedError(
            "LossFnTask wraps a loss function and does not know its batch; write a Task for that (docs/extending.md)."
        )

    def loss(
        self, model: ModelT, batch: Batch, *, key: PRNGKeyArray | None, model_state: ModelState
    ) -> tuple[Scalar, Metrics, ModelState]:
        if model_state is not None:
            raise contract_error(
                "The train state holds a model_state (non-trained state such as BatchNorm statistics), "
                "but a plain loss function takes none.",
                "Write a Task whose `loss` takes and returns the state (equipax.models.ImageClassificationTask "
                "is one).",
            )
        loss, aux, _ = checked_loss(self.loss_fn(model, batch, key=key), 2)
        return loss, aux, None

    def eval_sums(self, model: ModelT, batch: Batch, *, model_state: ModelState) -> Metrics:
        aux = self.loss(model, batch, key=None, model_state=model_state)[1]
        return aux | named_loss_sums(aux)


def as_task(task: Any) -> AbstractTask[Any]:
    if isinstance(task, AbstractTask):
        return task
    if callable(task):
        raise contract_error(
            f"The steps take a Task; got the function {getattr(task, '__qualname__', task)!r}.",
            "Wrap a plain loss function as `LossFnTask(loss_fn)` (equipax.core.step).",
        )
    raise contract_error(f"The steps take a Task; got a {type(task).__name__}.", "Pass a Task.")


def call_loss(
    task: AbstractTask[Any], model: Any, batch: Batch, key: Any, model_state: Any
) -> tuple[Scalar, Metrics, Any]:
    """`task.loss`, with what it returns checked against the contract: `(loss, aux, model_state)`."""
    return checked_loss(task.loss(model, batch, key=key, model_state=model_state), 3)


def check_aux(aux: Metrics) -> None:
    clash = sorted(set(aux) & set(RESERVED_METRICS))
    if clash:
        raise contract_error(
            f"The loss function's aux uses the metric name(s) {clash}, which the train step writes itself.",
            "Rename these aux entries.",
        )
