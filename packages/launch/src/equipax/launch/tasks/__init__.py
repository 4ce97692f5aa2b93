"""Task families as the launcher sees them: one module per family, the same functions in each.

`equipax.core.task.AbstractTask` is the model side of a family (model, loss, eval sums, batch
shapes). What the launcher adds per family lives here, in `lm_family.py` and `image_family.py`:

- `numbers(cfg)`: derived numbers from the config alone (parameters, FLOPs, throughput units);
  pure and cheap, for `launch list` / `show` (no loop, no data, no devices);
- `make_task(cfg, mesh)`: the family's Task for this experiment;
- `build_inputs(cfg, job_dir, *, mesh, log)`: this host's train and eval inputs (`Inputs`): the
  rows of each global batch that `mesh` gives it (`equipax.core.infeed.host_infeed(mesh)`'s
  `num_infeed_hosts` and `infeed_host_index`);
- `finish(cfg, model, inputs, *, key, log)`: what a finished run adds (the LM's sample).

`family(cfg)` picks the implementation by `cfg.kind` (the data config's family name). A new
family registers any object with those functions (and `UNIT`, `units_per_example`) with
`register_family(kind, impl)` (docs/extending.md).
"""

import dataclasses
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from equipax.data import BaseInput
else:
    # Not imported at run time: equipax.data pulls in grain and orbax (seconds), which `launch list`
    # and `launch show` (derived_numbers) never use; `build_inputs` imports it when it runs.
    BaseInput = Any

__all__ = ["derived_numbers", "FAMILIES", "family", "Inputs", "register_family"]

# cfg.kind -> a module of this package (imported on first use), or a registered object.
FAMILIES: dict[str, Any] = {"lm": "lm_family", "image_classification": "image_family"}


@dataclasses.dataclass
class Inputs:
    """This host's inputs for one run, and what the family reports about them.

    Attributes:
        train: the training input (repeating).
        eval: the eval input (reset before each eval run).
        info: family-specific facts for the run's result (e.g. `unigram_entropy`).
        extra: family-specific objects the `finish` step needs (e.g. the tokenizer).
    """

    train: BaseInput
    eval: BaseInput
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def register_family(kind: str, impl: Any, *, configs: tuple[type, ...] = ()) -> None:
    """Make `launch run`/`compile`/`show` handle experiments whose `data.kind` is `kind`.

    Arguments:
        kind: the family's name (the data config's `kind` class attribute).
        impl: a module or object with `UNIT`, `numbers`, `units_per_example`, `make_task`,
            `build_inputs` and `finish` (see `equipax.launch.tasks.lm_family` for their contracts).
        configs: the family's own config classes (its model and data configs), so a job's
            config.json reads back into them (`equipax.core.knobs.register_config`).
    """
    from equipax.core.knobs import register_config

    for cls in configs:
        register_config(cls)
    FAMILIES[kind] = impl


def family(cfg: Any) -> ModuleType | Any:
    """The implementation of `cfg`'s task family."""
    impl = FAMILIES.get(cfg.kind)
    if impl is None:
        raise KeyError(
            f"No task family {cfg.kind!r} is registered (known: {sorted(FAMILIES)}); "
            "call equipax.launch.tasks.register_family first."
        )
    return importlib.import_module(f"{__name__}.{impl}") if isinstance(impl, str) else impl


def derived_numbers(cfg: Any) -> dict[str, Any]:
    """Numbers computed from the config alone (no devices touched)."""
    return family(cfg).numbers(cfg)
