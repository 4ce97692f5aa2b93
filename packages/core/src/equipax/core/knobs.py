"""Frozen-dataclass configs: `--set a.b=value` overrides, type checks, provenance, JSON.

A config is a tree of frozen dataclasses. Every leaf field is a *knob* with a dotted path
(`model.transformer.num_layers`). Overrides are parsed as Python literals (never evaluated),
checked against the field's annotation, and applied with `dataclasses.replace`, so every
dataclass's `__post_init__` validation runs again on the new values.
"""

import ast
import dataclasses
import difflib
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

__all__ = [
    "check_text",
    "apply_overrides",
    "coerce",
    "ConfigError",
    "EXPERIMENT",
    "flatten",
    "format_knobs",
    "from_dict",
    "from_json",
    "is_config",
    "OVERRIDE",
    "parse_literal",
    "parse_override",
    "register_config",
    "renamed_knob",
    "set_knob",
    "set_knobs",
    "suggest",
    "to_dict",
    "to_json",
]


EXPERIMENT = "experiment"
OVERRIDE = "--set"


class ConfigError(ValueError):
    """A user mistake in a config or an override; the message says what to change."""


def is_config(obj: Any) -> bool:
    """True for a dataclass instance (a config node)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """All knobs of a config as `{dotted.path: value}`, in field order.

    Arguments:
        cfg: a dataclass config.
        prefix: prepended to every path (used in recursion).

    Returns:
        A flat dict of leaf values.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        path = f"{prefix}{f.name}"
        if is_config(value):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _groups(cfg: Any, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if is_config(value):
            out.append(prefix + f.name)
            out.extend(_groups(value, prefix + f.name + "."))
    return out


def suggest(name: str, candidates: Sequence[str], n: int = 3) -> list[str]:
    """The closest names to `name` (also matching on the last dotted component)."""
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5)
    leaf = name.rsplit(".", 1)[-1]
    for c in candidates:
        if c.rsplit(".", 1)[-1] == leaf and c not in close:
            close.append(c)
    return close[:n]


def _did_you_mean(name: str, candidates: Sequence[str]) -> str:
    close = suggest(name, candidates)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


def parse_literal(text: str) -> Any:
    """Parse an override value: Python literals, `true/false/none`, else a bare string.

    Uses `ast.literal_eval`, which accepts only literals (numbers, strings, tuples, lists,
    dicts, booleans, None) and never runs code.
    """
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(stripped)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        if re.fullmatch(r"[+-]?[0-9][0-9_]*", stripped):
            # Python refuses to parse integers of more than 4300 digits: say so, not "got a str".
            digits = sum(c.isdigit() for c in stripped)
            raise ConfigError(
                f"The value {stripped[:20]}... is an integer of {digits} digits, too large for any "
                "knob; give a number of at most a few digits (e.g. 1e30 for a float knob)."
            ) from None
        return stripped


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


_REGISTERED: list[type] = []


def register_config(cls: type) -> None:
    """Let `from_dict` / `from_json` rebuild `cls` where a field's annotation is a union of config
    classes (an experiment's `model` and `data`): for a config class defined outside those unions,
    e.g. a new task family's (docs/extending.md). `--set` needs no registration."""
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"register_config takes a dataclass, not {cls!r}.")
    if cls not in _REGISTERED:
        _REGISTERED.append(cls)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}  # pyright: ignore[reportArgumentType]


def check_text(value: str, what: str) -> None:
    """Raise ConfigError unless `value` is text that UTF-8 can hold.

    Bytes that are not UTF-8 in a command line or environment reach Python as lone surrogates
    ("surrogateescape"); such a string passes every other check and then fails when it is written
    (config.json, metrics, a sample), after the work. `what` names the knob or option.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = value[e.start : e.end].encode("utf-8", "surrogateescape")
        raise ConfigError(
            f"{what} holds bytes that are not UTF-8 text ({raw!r} at character {e.start} of {value[:40]!r}). "
            f"Give the value as UTF-8 text (e.g. 'é' rather than a Latin-1 byte: check the terminal's or "
            f"the file's encoding)."
        ) from None


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`, converting where it is lossless.

    Accepts an int for a float, a list for a tuple, and a string spelling of a number or
    bool where the annotation asks for one. Raises ConfigError otherwise.
    """
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value is None and "none" in allowed:  # `--set remat=none` (the text parses as None)
            return "none"
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise ConfigError(
            f"Knob {path!r} must be one of {', '.join(repr(a) for a in allowed)}; "
            f"got {value!r}.{_did_you_mean(str(value), [str(a) for a in allowed])}"
        )
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if isinstance(value, Mapping):
            # A union of config classes (e.g. an experiment's model: LMConfig | CNNConfig, plus
            # any class `register_config` added): the one whose fields hold every key is meant,
            # so its own error message is the one shown.
            classes = [a for a in args if dataclasses.is_dataclass(a) and isinstance(a, type)]
            if classes:
                classes += [c for c in _REGISTERED if c not in classes]
            # A class that moved some of the keys (`RENAMED`) is meant too: it reads or names them.
            fits = [a for a in classes if set(value) <= _field_names(a) | set(getattr(a, "RENAMED", None) or {})]
            if len(fits) > 1:  # several hold the keys: the one with exactly these fields (to_dict's output)
                fits = [a for a in fits if set(value) == _field_names(a)] or fits
            if len(fits) == 1:
                return coerce(value, fits[0], path)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"Knob {path!r} expects {_type_name(tp)}; got {value!r} ({type(value).__name__}).")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            check_text(value, f"Knob {path!r}")
            return value
        # A bare word that parsed as a number (e.g. a path "123") is still text.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif origin in (tuple, list) or tp in (tuple, list):
        container = origin or tp
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)):
            if container is tuple and args and args[-1] is not Ellipsis:
                if len(args) != len(value):
                    raise ConfigError(
                        f"Knob {path!r} expects {len(args)} values ({_type_name(tp)}); got {len(value)}: {value!r}."
                    )
                items = [coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
            else:
                elem = args[0] if args else Any
                items = [coerce(v, elem, f"{path}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if container is tuple else list(items)
    elif origin is dict or tp is dict:
        if isinstance(value, Mapping):
            kt, vt = typing.get_args(tp) or (Any, Any)
            return {coerce(k, kt, path): coerce(v, vt, f"{path}[{k!r}]") for k, v in value.items()}
    elif dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return from_dict(tp, value, _path=path + ".")
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"Knob {path!r} expects {_type_name(tp)}; got {value!r} ({type(value).__name__}).")


def _rebuild(cls: type, kwargs: dict[str, Any], path: str) -> Any:
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        where = f" in {path.rstrip('.')!r}" if path else ""
        raise ConfigError(f"Invalid config{where}: {e}") from None


def renamed_knob(cfg: Any, path: str) -> str | None:
    """The path a knob that moved has now, or None.

    A config class that moved some of its knobs lists them in a class attribute
    `RENAMED: ClassVar[dict[str, str]]`, old field -> new dotted path below the same class (e.g.
    `{"sample_tokens": "sample.tokens"}`).
    """
    node, prefix, parts = cfg, "", path.split(".")
    for i, part in enumerate(parts):
        moved = getattr(type(node), "RENAMED", None) or {}
        rest = ".".join(parts[i:])
        if rest in moved:
            return prefix + moved[rest]
        if not is_config(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return None
        node, prefix = getattr(node, part), prefix + part + "."
    return None


def _check_path(cfg: Any, path: str) -> None:
    knobs = flatten(cfg)
    if path in knobs:
        return
    new = renamed_knob(cfg, path)
    if new is not None:
        raise ConfigError(f"Unknown knob {path!r}: it moved. Did you mean {new!r}? (--set {new}=VALUE)")
    groups = _groups(cfg)
    if path in groups:
        fields = [k for k in knobs if k.startswith(path + ".")]
        raise ConfigError(
            f"{path!r} is a group of knobs, not a knob; set one of its fields, e.g. {', '.join(fields[:4])}."
        )
    raise ConfigError(f"Unknown knob {path!r}.{_did_you_mean(path, list(knobs))}")


C = TypeVar("C")
"""A config dataclass type (the functions below return the type they were given)."""


def set_knobs(cfg: C, values: Mapping[str, Any]) -> C:
    """Return `cfg` with the knobs at the dotted paths in `values` replaced (type-checked).

    All values are applied first and validation runs once on the result, so knobs that
    must agree (e.g. `data.seq_len <= model.max_seq_len`) can be changed together. Each changed
    group is rebuilt as the class it already is, so a config class defined outside this
    package's unions (a new task family's model config) takes `--set` like the built-in ones.

    Arguments:
        cfg: a dataclass config.
        values: `{dotted.path: value}` with already parsed values.

    Returns:
        A new config of the same type.
    """
    changes = _Changes()
    for path, value in values.items():
        _check_path(cfg, path)
        *parents, leaf = path.split(".")
        node = changes
        for p in parents:
            node = node.setdefault(p, _Changes())
        node[leaf] = value
    return _with_changes(cfg, changes, "")


class _Changes(dict):
    """The knobs to change below one group, by field name (nested groups are `_Changes` too)."""


def _with_changes(node: Any, changes: "_Changes", path: str) -> Any:
    hints = _hints(type(node))
    kwargs = {f.name: getattr(node, f.name) for f in dataclasses.fields(node) if f.init}
    for key, value in changes.items():
        if isinstance(value, _Changes):
            kwargs[key] = _with_changes(kwargs[key], value, f"{path}{key}.")
        else:
            kwargs[key] = coerce(value, hints[key], path + key)
    return _rebuild(type(node), kwargs, path)


def set_knob(cfg: C, path: str, value: Any) -> C:
    """Return `cfg` with the knob at dotted `path` replaced by `value` (type-checked)."""
    return set_knobs(cfg, {path: value})


def parse_override(text: str) -> tuple[str, Any]:
    """Split `a.b=value` into the path and the parsed literal value."""
    if "=" not in text:
        raise ConfigError(
            f"Override {text!r} is not of the form KNOB=VALUE, e.g. --set model.transformer.num_layers=2."
        )
    path, raw = text.split("=", 1)
    path = path.strip()
    if not path:
        raise ConfigError(f"Override {text!r} has no knob name before '='.")
    check_text(raw, f"Knob {path!r}")
    try:
        return path, parse_literal(raw)
    except ConfigError as e:
        raise ConfigError(f"Knob {path!r}: {e}") from None


def apply_overrides(cfg: C, overrides: Sequence[str]) -> tuple[C, dict[str, str]]:
    """Apply `--set KNOB=VALUE` overrides in order.

    Arguments:
        cfg: the experiment's config.
        overrides: strings of the form `a.b.c=VALUE`.

    Returns:
        The new config and `{knob: source}` for every knob, where source is
        `"experiment"` or `"--set"`.
    """
    sources = {k: EXPERIMENT for k in flatten(cfg)}
    values: dict[str, Any] = {}
    for text in overrides:
        path, value = parse_override(text)
        _check_path(cfg, path)
        values[path] = value
        sources[path] = OVERRIDE
    return set_knobs(cfg, values), sources


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready nested dict of the config (tuples become lists)."""

    def conv(v: Any) -> Any:
        if is_config(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def from_dict(cls: type[C], data: Mapping[str, Any], *, _path: str = "") -> C:
    """Build a config of type `cls` from a nested dict (the inverse of `to_dict`).

    Unknown keys are an error with a "did you mean" hint; missing keys take defaults. Keys a
    class lists as moved (`RENAMED`, see `renamed_knob`) are read at their new place, so a config
    saved before the move still reads, unless the class refuses that saved layout
    (`saved_layout_error(data) -> message or None`: a layout whose meaning changed, not only its
    paths).
    """
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    refuse = getattr(cls, "saved_layout_error", None)
    if refuse is not None and (message := refuse(data)):
        raise ConfigError(message)
    data = _moved(cls, data)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"Unknown knob {_path + key!r}.{_did_you_mean(key, names)}")
        kwargs[key] = coerce(value, hints[key], _path + key)
    return _rebuild(cls, kwargs, _path)


def _moved(cls: type, data: Mapping[str, Any]) -> Mapping[str, Any]:
    """`data` with the keys `cls.RENAMED` lists moved to their new nested place."""
    moved: dict[str, str] = getattr(cls, "RENAMED", None) or {}
    old = [k for k in data if k in moved and not isinstance(data[k], Mapping)]
    if not old:
        return data
    out: dict[str, Any] = {k: v for k, v in data.items() if k not in old}
    for key in old:
        *groups, leaf = moved[key].split(".")
        node = out
        for g in groups:
            child = node.get(g, {})
            if not isinstance(child, Mapping):  # not a group here: leave the old key to fail by name
                out[key] = data[key]
                break
            node[g] = node = dict(child)
        else:
            node.setdefault(leaf, data[key])
    return out


def to_json(cfg: Any) -> str:
    """The config as indented JSON."""
    return json.dumps(to_dict(cfg), indent=2, sort_keys=False)


def from_json(cls: type[C], text: str) -> C:
    """Parse a config of type `cls` from `to_json` output (ConfigError unless it is a JSON object)."""
    data = json.loads(text)
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"The config must be a mapping of knob names to values (a JSON object); got "
            f"{type(data).__name__} {repr(data)[:60]}."
        )
    return from_dict(cls, data)


def format_knobs(cfg: Any, sources: Mapping[str, str] | None = None) -> str:
    """One line per knob: `path = value  # source`, aligned, for knobs.txt and `launch show`."""
    knobs = flatten(cfg)
    width = max((len(k) for k in knobs), default=0)
    lines = []
    for k, v in knobs.items():
        src = (sources or {}).get(k, EXPERIMENT)
        lines.append(f"{k.ljust(width)} = {v!r}  # {src}")
    return "\n".join(lines) + "\n"
