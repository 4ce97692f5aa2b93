"""MaxText's config files as its loader (`maxtext.configs.pyconfig`) reads them: a YAML config,
the model file `model_name` names under `models/`, `key=value` overrides, merged by
`maxtext.merge`. Errors are `ConfigError`s (`launch convert maxtext` exits 2 with them)."""

from pathlib import Path
from typing import Any

from equipax.core.knobs import ConfigError
from equipax.launch.translators.maxtext.translate import merge

__all__ = ["read_maxtext"]


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        values = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"Cannot read the MaxText config {path}: {e} (a MaxText config is a YAML text file)."
        ) from None
    if not isinstance(values, dict):
        raise ConfigError(
            f"{path} is not a MaxText config (a YAML mapping of key: value); found a {type(values).__name__}."
        )
    return {str(k): _number(v) for k, v in values.items()}


def _model_file(config: Path, name: str) -> Path:
    """Where MaxText looks for `model_name`'s file: `models/NAME.yml` next to the config, then one
    directory up (`-Instruct` names the base model's architecture)."""
    name = name.replace("-Instruct", "")
    tried = [config.parent / "models" / f"{name}.yml", config.parent.parent / "models" / f"{name}.yml"]
    for path in tried:
        if path.is_file():
            return path
    raise ConfigError(
        f"model_name={name}: no model file {tried[0]} (nor {tried[1]}). Give the MaxText configs directory's "
        "base.yml (its models/ holds one file per model), or the model file itself as the second argument."
    )


def read_maxtext(config: Path, args: list[str], notes: list[str] | None = None) -> dict[str, Any]:
    """A MaxText config as MaxText's loader merges it: CONFIG (e.g. base.yml), then the model file
    (given as an argument, or `model_name`'s file under models/), then `key=value` overrides
    (values parsed as YAML, as on MaxText's command line). `notes` collects what was resolved."""
    import yaml

    notes = [] if notes is None else notes
    overrides: dict[str, Any] = {}
    model_path: Path | None = None
    for text in args:
        key, sep, raw = text.partition("=")
        if not sep and text.endswith((".yml", ".yaml")) and model_path is None:
            model_path = Path(text)
            continue
        if not sep or not key.strip():
            raise ConfigError(
                f"MaxText overrides are key=value (e.g. per_device_batch_size=16), after at most one model file "
                f"(MODEL.yml); got {text!r}."
            )
        try:
            overrides[key.strip()] = _number(yaml.safe_load(raw)) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"The override {text!r} is not key=YAML value: {e}") from None
    base = _load_yaml(config)
    name = str(overrides.get("model_name", base.get("model_name", "default")))
    model: dict[str, Any] = {}
    if model_path is not None:
        model = _load_yaml(model_path)
        if name == "default":  # what MaxText would be told to load this file
            overrides.setdefault("model_name", model_path.stem)
    elif name != "default":
        model_path = _model_file(config, name)
        model = _load_yaml(model_path)
        notes.append(f"model_name={name}: read {model_path} over {config.name}.")
    elif config.parent.name == "models" and "model_name" not in base:
        base["model_name"] = config.stem  # a model file alone: it is the model of that name
    return merge(base, model, overrides)


def _number(value: Any) -> Any:
    """YAML 1.1 reads `1e-3` (no dot) as a string; MaxText means a number."""
    if isinstance(value, str):
        try:
            return float(value) if value.strip() and value.strip().lower() not in ("nan", "inf", "infinity") else value
        except ValueError:
            return value
    return value
