"""equipax.core: the model-agnostic library (configs, layers, optimizers, sharding, train step).

Every submodule is reachable after `import equipax.core` (`equipax.core.optim.make_learner`);
the names each one exports are listed in its `__all__`. `equipax` itself stays a PEP 420
namespace shared with `equipax.models`, `equipax.data` and `equipax.launch`.
"""

from equipax.core import config, flops, mesh, nn, optim, partition, step, task

__all__ = ["config", "flops", "mesh", "nn", "optim", "partition", "step", "task"]
