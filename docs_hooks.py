"""mkdocs hooks (mkdocs.yml `hooks:`): pages generated from the code at build time, so they
cannot drift from it.

- `<!-- knobs -->` in docs/knobs.md becomes one table per config dataclass reachable from
  `ExperimentConfig`: every knob's dotted name, type, default and meaning. The meaning is read
  from the dataclass itself: the comment lines right above the field and the entries of its
  docstring that name it (`name: ...`, or a sentence mentioning `name`).
- `<!-- api: PACKAGE -->` in docs/api/*.md becomes a mkdocstrings `::: module` block for every
  public module of that package.
- Test markers on code fences (```` ```bash no-run ````, see `TEST_MARKERS`) are stripped: they tell
  the suite's docs-block runner what to do with the block, and the site's Markdown
  (pymdownx.superfences) would otherwise not recognise the fence at all and print it as text.
  GitHub, which renders README.md, takes the first word as the language and ignores the rest.
- An image of docs/figures/ on a line of its own (`![...](figures/NAME.png)`) gets a caption from
  docs/figures/figures.json: the command that made it, when and on what, and the command that
  regenerates it (docs/figures/make_figures.py writes both the figure and its entry).
- A notebook page without math loads no MathJax: mkdocs-jupyter adds a script that fetches it from
  a CDN on every notebook page, which fails offline (and is a request to another site for nothing).
"""

import ast
import dataclasses
import importlib
import inspect
import json
import pkgutil
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "TEST_MARKERS",
    "CodeBlock",
    "api_modules",
    "code_blocks",
    "figure_captions",
    "knob_rows",
    "knobs_markdown",
    "on_page_markdown",
    "on_post_page",
    "strip_test_markers",
]

FIGURES = Path(__file__).resolve().parent / "docs" / "figures" / "figures.json"

# What the suite's docs-block runner (tests/docs/test_docs.py) does with a fenced block whose info
# string carries the marker after its language (```` ```bash no-run ````). Unmarked `python` and
# `bash` blocks are run; any other word after the language is an error there.
TEST_MARKERS = {
    "no-run": "not run (the test command itself, external tools, long jobs)",
    "needs-hardware": "not run: needs accelerators or data the suite does not have",
    "expect-fail": "run; every command must exit with the user-error code 2",
    "gcs-emulator": "not run here: tests/launch/test_object_storage.py runs it against a local GCS emulator",
}

# A fence opens with 3+ backticks or tildes (indented as inside a list or admonition) and closes
# with the same character, at least as many, and nothing after it (CommonMark).
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")


class CodeBlock(NamedTuple):
    """A fenced code block of a Markdown text: its 1-based opening line, language, the words after
    the language (test markers), and its body (dedented by the fence's indentation)."""

    line: int
    lang: str
    markers: tuple[str, ...]
    body: str


def _fences(markdown: str) -> Iterator[tuple[int, int, re.Match[str]]]:
    """(opening line index, closing line index, opening match) of each fenced block."""
    lines = markdown.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if m is None:
            i += 1
            continue
        close = re.compile(rf"^[ \t]*{re.escape(m['fence'][0])}{{{len(m['fence'])},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        yield i, j, m
        i = j + 1


def code_blocks(markdown: str) -> Iterator[CodeBlock]:
    """Every fenced code block of `markdown`, in order."""
    lines = markdown.split("\n")
    for i, j, m in _fences(markdown):
        words = m["info"].split()
        indent = len(m["indent"])
        body = "\n".join(re.sub(rf"^[ \t]{{0,{indent}}}", "", line) for line in lines[i + 1 : j])
        yield CodeBlock(i + 1, words[0] if words else "", tuple(words[1:]), body + "\n" if j > i + 1 else "")


def strip_test_markers(markdown: str) -> str:
    """`markdown` with the `TEST_MARKERS` removed from its fences' info strings. An unknown word
    stays, so the fence stays broken on the site and the built-HTML test reports it."""
    lines = markdown.split("\n")
    for i, _, m in _fences(markdown):
        words = m["info"].split()
        if any(w in TEST_MARKERS for w in words[1:]):
            kept = [words[0], *(w for w in words[1:] if w not in TEST_MARKERS)]
            lines[i] = f"{m['indent']}{m['fence']}{' '.join(kept)}"
    return "\n".join(lines)


_FIGURE = re.compile(r"^(?P<indent>[ \t]*)!\[[^\]]*\]\((?:\.\./)*figures/(?P<file>[^)\s]+)\)[ \t]*$", re.M)


def figure_captions(markdown: str, manifest: dict[str, dict[str, Any]] | None = None) -> str:
    """`markdown` with a caption under each docs/figures image that figures.json knows."""
    if manifest is None:
        manifest = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    by_file = {entry["file"]: entry for entry in manifest.values()}

    def caption(m: re.Match[str]) -> str:
        entry = by_file.get(m["file"])
        if entry is None:
            return m[0]
        made = " then ".join(f"`{c}`" for c in entry["commands"]) or entry["source"]
        when = f" on {entry['made']} ({entry['machine']})" if entry["commands"] else f", {entry['made']}"
        return f"{m[0]}\n{m['indent']}*Made from {made}{when}; `{entry['regenerate']}` regenerates it.*"

    return _FIGURE.sub(caption, markdown)


ROOT_CLASS = ("equipax.launch.configs.experiment", "ExperimentConfig")


def _field_comments(cls: type) -> dict[str, str]:
    """Comment lines directly above each field in the class body; a field without its own takes
    the nearest block above that names it (one comment describing a group of fields)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    out: dict[str, str] = {}
    last_block = ""
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            comments: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                comments.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            if comments:
                out[node.target.id] = last_block = " ".join(comments)
            elif re.search(rf"(?<![\w.]){re.escape(node.target.id)}(?!\w)", last_block):
                out[node.target.id] = last_block
    return out


_ENTRY = re.compile(r"(?:(?<=^)|(?<=\n)|(?<=\. )|(?<=; ))\s*`?([a-z_][a-z0-9_]*(?:`?,\s*`?[a-z_][a-z0-9_]*)*)`?:\s")


def _docstring_entries(cls: type) -> list[tuple[list[str], str]]:
    """`(names, text)` for each `name[, name]: text` entry of the class docstring (prose or an
    Arguments/Attributes section)."""
    doc = inspect.getdoc(cls) or ""
    doc = re.sub(r"^\s*(Arguments|Attributes|\*\*Arguments:\*\*):\s*$", "", doc, flags=re.M)
    text = re.sub(r"\s*\n\s*", " ", doc.strip())
    text = "\n".join(part for part in re.split(r"(?<=\.)\s+(?=`?[a-z_][a-z0-9_]*`?(?:,\s*`?[a-z_]\w*`?)*:\s)", text))
    entries: list[tuple[list[str], str]] = []
    for chunk in text.split("\n"):
        m = re.match(r"`?([a-z_][a-z0-9_]*(?:`?,\s*`?[a-z_][a-z0-9_]*)*)`?:\s(.*)", chunk)
        if m:
            names = [n.strip(" `") for n in m.group(1).split(",")]
            entries.append((names, chunk))
        else:
            entries.append(([], chunk))
    return entries


def field_meanings(cls: type) -> dict[str, str]:
    """The meaning of each field of the dataclass `cls` (empty string: undocumented)."""
    comments = _field_comments(cls)
    entries = _docstring_entries(cls)
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        parts = [comments[f.name]] if f.name in comments else []
        named = [text for names, text in entries if f.name in names]
        mentioned = [
            text
            for names, text in entries
            if f.name not in names and re.search(rf"(?<![\w.]){re.escape(f.name)}(?![\w])", text)
        ]
        parts += named or mentioned
        out[f.name] = " ".join(dict.fromkeys(parts))
    return out


def _dataclass_types(annotation: Any) -> list[type]:
    args = (
        typing.get_args(annotation)
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
        else (annotation,)
    )
    return [a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)]


def _type_name(annotation: Any) -> str:
    name = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return name.replace("typing.", "")


def knob_rows(cls: type, prefix: str = "") -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """`(section title, rows)` per dataclass reachable from `cls`; a row is
    `(knob, type, default, meaning)`."""
    hints = typing.get_type_hints(cls)
    meanings = field_meanings(cls)
    rows: list[tuple[str, str, str, str]] = []
    nested: list[tuple[str, list[tuple[str, str, str, str]]]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        sub = _dataclass_types(hints[f.name])
        if sub:
            for sub_cls in sub:
                nested += knob_rows(sub_cls, f"{prefix}{f.name}.")
            if type(None) not in typing.get_args(hints[f.name]):
                continue
            # An optional group (e.g. model.rope_scaling): None is a value of the knob itself.
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append((f"{prefix}{f.name}", _type_name(hints[f.name]), default, meanings[f.name]))
    return [(f"`{prefix or '(top level)'}` — `{cls.__module__}.{cls.__qualname__}`", rows), *nested]


def knobs_markdown() -> str:
    module, name = ROOT_CLASS
    cls = getattr(importlib.import_module(module), name)
    out: list[str] = []
    for title, rows in knob_rows(cls):
        if not rows:
            continue
        out += [f"### {title}", "", "| knob | type | default | meaning |", "| --- | --- | --- | --- |"]
        for knob, typ, default, meaning in rows:
            cells = [f"`{knob}`", f"`{typ}`", f"`{default}`", meaning or "(undocumented)"]
            out.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def api_modules(package: str) -> list[str]:
    """Every public module of `equipax.<package>` (no `_private` part), sorted."""
    pkg = importlib.import_module(f"equipax.{package}")
    names = [pkg.__name__]
    names += [
        m.name
        for m in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}.")
        if not any(part.startswith("_") for part in m.name.split("."))
    ]
    return sorted(names)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: strip the code fences' test markers; expand the `<!-- knobs -->` and
    `<!-- api: PACKAGE -->` markers."""
    markdown = figure_captions(strip_test_markers(markdown))
    if "<!-- knobs -->" in markdown:
        markdown = markdown.replace("<!-- knobs -->", knobs_markdown())

    def api(m: re.Match[str]) -> str:
        return "\n\n".join(f"## `{name}`\n\n::: {name}" for name in api_modules(m.group(1)))

    return re.sub(r"<!-- api: (\w+) -->", api, markdown)


_MATHJAX = re.compile(r"<script data-mkdocs-jupyter-mathjax=.*?</script>", re.S)
_MATH = re.compile(r"\$[^$\n]+\$|\\\(|\\\[")


def on_post_page(output: str, page: Any = None, **kwargs: Any) -> str:
    """mkdocs hook: drop mkdocs-jupyter's MathJax loader from a notebook page whose Markdown cells
    hold no math (`$...$`, `\\(`, `\\[`)."""
    src = getattr(getattr(page, "file", None), "abs_src_path", None) or ""
    if not src.endswith(".ipynb") or "data-mkdocs-jupyter-mathjax" not in output:
        return output
    cells = json.loads(Path(src).read_text()).get("cells", [])
    text = "\n".join("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "markdown")
    return output if _MATH.search(text) else _MATHJAX.sub("", output)
