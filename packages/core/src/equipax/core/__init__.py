"""equipax.core: the model-agnostic library (configs, layers, optimizers, sharding, train step).

Every submodule is reachable after `import equipax.core` (`equipax.core.optim.make_learner`);
the names each one exports are listed in its `__all__`. `equipax` itself stays a PEP 420
namespace shared with `equipax.models`, `equipax.data` and `equipax.launch`.

The submodules are imported on first access, not with the package: `equipax.core.knobs` has no
JAX, and the CLI's `--help` and knob errors should not pay for importing JAX (benchmarks/README.md).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from equipax.core import flops, infeed, knobs, mesh, nn, optim, partition, step, task, variational_noise

__all__ = ["flops", "infeed", "knobs", "mesh", "nn", "optim", "partition", "step", "task", "variational_noise"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
