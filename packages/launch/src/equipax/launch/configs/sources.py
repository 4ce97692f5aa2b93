"""Input sources: each value of `data.source` is one class that checks its knobs and builds its inputs.

A source is registered under its `name` for one data kind (`"lm"`: token data, read by
`DataConfig`; `"image_classification"`: labelled images, read by `ImageDataConfig`). The data
config looks its source up by `data.source`, so a misspelled value is a config error listing the
registered ones, and nothing else branches on the string: adding a source is one class
(`equipax.launch.configs.token_sources` and `image_sources` hold the built-in ones; docs/extending.md,
"Adding an input source").

`check(data)` runs while the config is built (pure: no files, no devices); `build(...)` runs when
a job starts, with this process's share of the global batch as one `HostShard`.
"""

import dataclasses
import difflib
from typing import Any, ClassVar, TypeVar

from equipax.core.knobs import ConfigError

__all__ = ["HostShard", "Source", "register_source", "registered_sources", "source_for"]


@dataclasses.dataclass(frozen=True)
class HostShard:
    """This process's share of the global batch: host `index` of `count`, `batch_size` rows each."""

    count: int = 1
    index: int = 0
    batch_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count or self.batch_size < 1:
            raise ValueError(f"HostShard: need 0 <= index < count and batch_size >= 1; got {self}.")

    def input_kwargs(self) -> dict[str, int]:
        """The keyword arguments every `equipax.data` input takes for its host share."""
        return {"batch_size": self.batch_size, "num_infeed_hosts": self.count, "infeed_host_index": self.index}


class Source:
    """One input source (base class). Subclasses set `name` and `kind` and override `check`/`build`."""

    name: ClassVar[str]  # the value of data.source
    kind: ClassVar[str]  # the data kind it serves: "lm" or "image_classification"

    def check(self, data: Any) -> None:
        """Raise ValueError when the data config's knobs do not suit this source (config time, pure)."""

    def fingerprint(self, data: Any) -> str | None:
        """What identifies the training examples on disk (saved with checkpoints), or None."""
        return None


_SOURCES: dict[str, dict[str, Source]] = {}


S = TypeVar("S", bound=Source)


def register_source(cls: type[S]) -> type[S]:
    """Class decorator: make `cls` the source of its `kind` named `cls.name`."""
    for attr in ("name", "kind"):
        if not isinstance(getattr(cls, attr, None), str):
            raise TypeError(f"{cls.__name__} needs a class attribute `{attr}` (a string) to be registered.")
    _SOURCES.setdefault(cls.kind, {})[cls.name] = cls()
    return cls


def registered_sources(kind: str) -> dict[str, Source]:
    """`{name: source}` of one data kind, in registration order."""
    return dict(_SOURCES.get(kind, {}))


def source_for(kind: str, name: str) -> Source:
    """The source of `kind` registered as `name`; ConfigError naming `data.source` and the choices."""
    sources = registered_sources(kind)
    if name in sources:
        return sources[name]
    close = difflib.get_close_matches(str(name), list(sources), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"Knob 'data.source' must be one of {', '.join(repr(n) for n in sources)} for this experiment's "
        f"data; got {name!r}.{hint}"
    )
