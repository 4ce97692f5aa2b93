"""The range of every seed knob (`train.seed`, `data.seed`, `train.vn.vn_seed`, `launch decode
--seed`), checked when the config is built: JAX's keys take a 64-bit signed seed
(`jax.random.key(2**63)` overflows a C long, long after the config was accepted), and numpy's
generators no negative one."""

from typing import Any

from equipax.core.knobs import ConfigError

__all__ = ["check_seed", "SEED_LIMIT"]

SEED_LIMIT = 2**63


def check_seed(value: Any, what: str) -> None:
    """Raise ConfigError unless `value` is a seed: an int in `[0, 2**63)`. `what` names the knob or option."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise ConfigError(
            f"{what}: expected a seed, an int in [0, 2**63) ({SEED_LIMIT - 1} at most), found {value!r}. "
            f"Give a non-negative int of at most 19 digits (every seed gives its own independent stream)."
        )
