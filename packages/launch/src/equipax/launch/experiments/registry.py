"""Experiment registry: `@register`ed functions returning an `ExperimentConfig` (a training
experiment of any task family), and `@register_benchmark`ed ones returning a benchmark config
(`AttentionBenchConfig`) that `launch run` runs instead of training.

Lookup by short name (`shakespeare_tiny`) or by any dotted suffix of the full path
(`experiments.shakespeare_lms.shakespeare_tiny`). An experiment may also answer to other names
(`@also_known_as`): the Pax experiments answer to their paxml class paths, so the Pax README's
`--exp=tasks.lm.params.c4.C4Spmd1BAdam4Replicas` (or `C4Spmd1BAdam4Replicas`, or with `paxml.` in
front) is `c4_1b` (docs/coming_from_pax.md). Registering is pure: nothing runs until a config is
asked for, and building a config never touches devices.
"""

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from equipax.core.knobs import ConfigError, suggest

__all__ = [
    "also_known_as",
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
F = TypeVar("F", bound=ExperimentFn)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered experiment: its short name, dotted path, config function, kind and the other
    names it answers to (`also_known_as`: e.g. its Pax class path)."""

    name: str
    path: str
    fn: ExperimentFn
    kind: Literal["train", "benchmark"] = "train"
    aliases: tuple[str, ...] = ()


_REGISTRY: dict[str, Entry] = {}
_ALIASES: dict[str, str] = {}  # alias (a dotted path) -> the registered short name


def also_known_as(*aliases: str) -> Callable[[F], F]:
    """Let a registered experiment also answer to `aliases`: dotted paths (e.g. Pax's
    `tasks.lm.params.c4.C4Spmd1BAdam4Replicas`), found like a registered path, by the whole path
    or any dotted suffix (`C4Spmd1BAdam4Replicas`). Stack it on `@register` (in either order)."""

    def add(fn: F) -> F:
        for alias in aliases:
            owner = _ALIASES.get(alias)
            if owner is not None and owner != fn.__name__:
                raise ValueError(f"Experiment alias {alias!r} given twice: to {owner!r} and {fn.__name__!r}.")
            _ALIASES[alias] = fn.__name__
        return fn

    return add


def register(fn: F) -> F:
    """Register a training experiment (returning an ExperimentConfig) under its function name."""
    return _register(fn, "train")


def register_benchmark(fn: F) -> F:
    """Register a benchmark (`launch run --exp NAME` runs it instead of training)."""
    return _register(fn, "benchmark")


def _register(fn: F, kind: Literal["train", "benchmark"]) -> F:
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
    known: dict[str, list[str]] = {}
    for alias, name in _ALIASES.items():
        known.setdefault(name, []).append(alias)
    return sorted(
        (dataclasses.replace(e, aliases=tuple(known.get(e.name, ()))) for e in _REGISTRY.values()), key=lambda e: e.name
    )


def _suffix_of(path: str, name: str) -> bool:
    return path == name or path.endswith("." + name)


def lookup(name: str) -> Entry:
    """Find an experiment by short name or dotted suffix, or by a Pax class path (`also_known_as`;
    with `_smoke` after it: that experiment's smoke twin, `C4Spmd1BAdam4Replicas_smoke`).

    Raises:
        ConfigError: unknown or ambiguous name, listing the closest registered names.
    """
    all_entries = entries()
    by_name = {e.name: e for e in all_entries}
    if name in by_name:
        return by_name[name]
    matches = [e for e in all_entries if _suffix_of(e.path, name)]
    if not matches:  # another name: Pax's `tasks.lm.params.c4.C4Spmd1BAdam4Replicas`, `paxml.` or not,
        # and with `_smoke` after it, that experiment's smoke twin
        bare = name.removeprefix("paxml.")
        base, twin = (bare.removesuffix("_smoke"), "_smoke") if bare.endswith("_smoke") else (bare, "")
        named = [e for e in all_entries if any(_suffix_of(a, base) for a in e.aliases)]
        matches = [by_name[e.name + twin] for e in named if e.name + twin in by_name]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(
            f"Experiment name {name!r} is ambiguous: {', '.join(e.path for e in matches)}. Use a longer dotted path."
        )
    if "." in name and (entry := _from_module(name)) is not None:
        return entry
    leaf = name.rsplit(".", 1)[-1]
    alias_leaves = {a.rsplit(".", 1)[-1]: e for e in all_entries for a in e.aliases}
    close = suggest(leaf, [*by_name, *alias_leaves])
    hint = ""
    if close:
        shown = [f"{c!r} (= {alias_leaves[c].name})" if c in alias_leaves else repr(c) for c in close]
        hint = f" Did you mean {' or '.join(shown)}?"
    raise ConfigError(
        f"Unknown experiment {name!r}.{hint} Run `launch list` to see all {len(all_entries)} registered experiments"
        " and the Pax names they answer to."
    )


def get_experiment(name: str) -> Experiment:
    """The resolved config of a registered (or user-module) experiment.

    Raises:
        ConfigError: the function raised (user code), or returned something that is not its
            kind's config: named with the module and what an experiment function must be.
    """
    entry = lookup(name)
    user_code = not entry.fn.__module__.startswith("equipax.")
    try:
        cfg = entry.fn()
    except ConfigError:
        raise
    except Exception as e:
        if not user_code:
            raise  # a built-in experiment that does not build is a bug: exit 1 with --debug advice
        raise ConfigError(
            f"--exp {name}: the experiment function {entry.path} raised {type(e).__name__}"
            f"{': ' + str(e).strip().splitlines()[0] if str(e).strip() else ''} (at {_where(e)}). "
            f"Fix the function: it takes no arguments and returns an ExperimentConfig."
        ) from None
    from equipax.launch.configs.experiment import ExperimentConfig

    if entry.kind == "train" and not isinstance(cfg, ExperimentConfig):
        raise ConfigError(
            f"--exp {name}: the experiment function {entry.path} returned {_describe(cfg)}, not an "
            f"ExperimentConfig. An experiment function takes no arguments and returns an ExperimentConfig "
            f"(e.g. `return ExperimentConfig(name=..., model=..., data=...)`, or a registered experiment's "
            f"config changed with dataclasses.replace)."
        )
    if cfg.name != entry.name:
        cfg = dataclasses.replace(cfg, name=entry.name)
    return cfg


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}" if value is not None else "None"


def _where(e: BaseException) -> str:
    """file:line of the innermost frame of a traceback (the user's code that raised)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "an unknown place"


_WHAT_IT_MUST_BE = (
    "An experiment function is a Python function defined in your own module (not the standard library "
    "or a built-in), takes no arguments and returns an ExperimentConfig; `@register` makes it a short name."
)


def _from_module(path: str) -> Entry | None:
    """`--exp mypkg.experiments.fn` (Pax's `--exp=tasks.lm.params.c4.C4Spmd1B...`): import the
    user's module (which may register experiments and task families as it loads) and take `fn`
    from it, registered or not. None when no such module is importable.

    The one place that resolves user-module experiments: a module that does not import (a syntax
    error, an exception while it loads) and anything that is not an experiment function (no
    Python function, one from the standard library, one that needs arguments) is a ConfigError
    naming the module; nothing that is not recognised as an experiment function is ever called.
    """
    module_name, fn_name = path.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            return None  # no such module: an unknown name, reported with suggestions
        raise ConfigError(f"--exp {path}: importing {module_name} failed: {e}") from None
    except SyntaxError as e:
        raise ConfigError(
            f"--exp {path}: the module {module_name} does not import: {e.msg} at {e.filename}:{e.lineno}. "
            f"Fix the syntax error."
        ) from None
    except Exception as e:
        raise ConfigError(
            f"--exp {path}: importing the module {module_name} raised {type(e).__name__}: {e} (at {_where(e)}). "
            f"Fix the module: importing it should only define (and register) experiments."
        ) from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ConfigError(f"--exp {path}: module {module_name} has no experiment function {fn_name!r}.")
    registered = _REGISTRY.get(fn_name)
    if registered is not None and registered.fn is fn:
        return registered
    problem = _not_an_experiment_function(fn)
    if problem:
        raise ConfigError(f"--exp {path}: {module_name}.{fn_name} {problem}. {_WHAT_IT_MUST_BE}")
    return Entry(name=fn_name, path=path, fn=fn)


def _not_an_experiment_function(fn: object) -> str | None:
    """Why `fn` is not recognised as a user's experiment function (so it is not called), or None."""
    import inspect
    import sys

    if not inspect.isfunction(fn):
        if inspect.isbuiltin(fn):
            return "is a built-in function, not an experiment function"
        return f"is {'a class' if inspect.isclass(fn) else 'a ' + type(fn).__name__}, not a Python function"
    top = fn.__module__.split(".")[0] if fn.__module__ else ""
    if top in sys.stdlib_module_names or top == "builtins":
        return f"is a function of the standard library ({fn.__module__}), not an experiment"
    required = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        return f"needs argument(s) {', '.join(required)}"
    return None
