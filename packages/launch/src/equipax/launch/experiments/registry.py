"""Experiment registry: `@register`ed functions returning an `ExperimentConfig` (a training
experiment of any task family), and `@register_benchmark`ed ones returning a benchmark config
(`AttentionBenchConfig`) that `launch run` runs instead of training.

Lookup by short name (`shakespeare_tiny`) or by any dotted suffix of the full path
(`experiments.shakespeare_lms.shakespeare_tiny`). Registering is pure: nothing runs until a
config is asked for, and building a config never touches devices.
"""

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, Literal

from equipax.core.knobs import ConfigError, suggest

__all__ = [
    "entries",
    "Entry",
    "Experiment",
    "ExperimentFn",
    "get_experiment",
    "lookup",
    "register",
    "register_benchmark",
]

# An ExperimentConfig ("train" entries) or a benchmark config ("benchmark" entries).
Experiment = Any
ExperimentFn = Callable[[], Experiment]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered experiment: its short name, dotted path, config function and kind."""

    name: str
    path: str
    fn: ExperimentFn
    kind: Literal["train", "benchmark"] = "train"


_REGISTRY: dict[str, Entry] = {}


def register[F: ExperimentFn](fn: F) -> F:
    """Register a training experiment (returning an ExperimentConfig) under its function name."""
    return _register(fn, "train")


def register_benchmark[F: ExperimentFn](fn: F) -> F:
    """Register a benchmark (`launch run --exp NAME` runs it instead of training)."""
    return _register(fn, "benchmark")


def _register[F: ExperimentFn](fn: F, kind: Literal["train", "benchmark"]) -> F:
    name = fn.__name__
    path = f"{fn.__module__}.{name}"
    existing = _REGISTRY.get(name)
    if existing is not None and existing.path != path:
        raise ValueError(f"Experiment {name!r} registered twice: {existing.path} and {path}.")
    _REGISTRY[name] = Entry(name=name, path=path, fn=fn, kind=kind)
    return fn


def _load_builtin() -> None:
    import equipax.launch.experiments as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{mod.name}")


def entries() -> list[Entry]:
    """All registered experiments, sorted by name."""
    _load_builtin()
    return sorted(_REGISTRY.values(), key=lambda e: e.name)


def lookup(name: str) -> Entry:
    """Find an experiment by short name or dotted suffix.

    Raises:
        ConfigError: unknown or ambiguous name, listing the closest registered names.
    """
    all_entries = entries()
    by_name = {e.name: e for e in all_entries}
    if name in by_name:
        return by_name[name]
    matches = [e for e in all_entries if e.path == name or e.path.endswith("." + name)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(
            f"Experiment name {name!r} is ambiguous: {', '.join(e.path for e in matches)}. Use a longer dotted path."
        )
    if "." in name and (entry := _from_module(name)) is not None:
        return entry
    close = suggest(name.rsplit(".", 1)[-1], list(by_name))
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(
        f"Unknown experiment {name!r}.{hint} Run `launch list` to see all {len(all_entries)} registered experiments."
    )


def get_experiment(name: str) -> Experiment:
    """The resolved config of a registered experiment."""
    entry = lookup(name)
    cfg = entry.fn()
    if cfg.name != entry.name:
        cfg = dataclasses.replace(cfg, name=entry.name)
    return cfg


def _from_module(path: str) -> Entry | None:
    """`--exp mypkg.experiments.fn` (Pax's `--exp=tasks.lm.params.c4.C4Spmd1B...`): import the
    user's module (which may register experiments and task families as it loads) and take `fn`
    from it, registered or not. None when no such module is importable."""
    module_name, fn_name = path.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            return None  # no such module: an unknown name, reported with suggestions
        raise ConfigError(f"--exp {path}: importing {module_name} failed: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"--exp {path}: module {module_name} has no experiment function {fn_name!r}.")
    registered = _REGISTRY.get(fn_name)
    if registered is not None and registered.fn is fn:
        return registered
    return Entry(name=fn_name, path=path, fn=fn)
