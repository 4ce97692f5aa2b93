"""The docs site (mkdocs.yml) builds strictly; its API reference covers every public name of the
four packages, and the knob tables (generated from the config dataclasses) give every knob a
meaning. The built HTML is read as a reader's browser gets it: `mkdocs build --strict` passes on
a page whose code fences the site's Markdown did not recognise (they become paragraphs of text),
so every page is parsed for literal fences, unrendered Markdown, broken internal links and
missing images."""

import dataclasses
import functools
import html
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from helpers import REPO


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("mkdocs is not installed in this environment (dev dependency group)")
    if sys.version_info < (3, 12):
        pytest.skip("the site's notebook plugin, mkdocs-jupyter, needs Python 3.12 (pyproject.toml's dev group)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [exe, "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_api_reference_covers_every_public_name(site):
    sys.path.insert(0, str(REPO))
    from docs_hooks import api_modules

    missing = []
    for pkg in ("core", "models", "data", "launch"):
        html = (site / "api" / pkg / "index.html").read_text()
        for name in api_modules(pkg):
            module = importlib.import_module(name)
            for public in getattr(module, "__all__", []):
                if isinstance(getattr(module, public), type(module)):
                    continue  # a subpackage re-exported by name: documented as a module
                obj = getattr(module, public)
                # A name re-exported from its defining module is documented there too.
                where = {f"{name}.{public}", f"{getattr(obj, '__module__', name)}.{public}"}
                if not any(f'id="{w}"' in html for w in where):
                    missing.append(f"{name}.{public}")
    assert not missing, f"not in the API reference: {missing}"


def test_every_knob_has_a_meaning(site):
    sys.path.insert(0, str(REPO))
    from docs_hooks import knob_rows
    from equipax.launch.configs.experiment import ExperimentConfig
    from equipax.launch.experiments.registry import get_experiment

    rows = [row for _, section in knob_rows(ExperimentConfig) for row in section]
    undocumented = [knob for knob, _, _, meaning in rows if not meaning]
    assert not undocumented, f"knobs without a meaning (document them on their dataclass): {undocumented}"
    page = (site / "knobs" / "index.html").read_text()
    # Every knob of an LM and of an image experiment is on the page.
    for exp in ("shakespeare_tiny", "cnn_digits"):
        cfg = get_experiment(exp)
        from equipax.core.knobs import flatten

        for knob in flatten(cfg):
            assert f"<code>{knob}</code>" in page, knob
    assert dataclasses.is_dataclass(ExperimentConfig)


def test_library_page_and_serving_instructions():
    text = (REPO / "docs" / "library.md").read_text()
    for topic in ("From a checkout", "From git", "From wheels", "install_import_hook", "LossContractError"):
        assert topic in text
    assert "uv run mkdocs serve" in (REPO / "README.md").read_text()


# Markdown syntax that survives into a page's text only when the Markdown was not rendered.
UNRENDERED = {
    "a code fence": re.compile(r"```|~~~"),
    "inline code": re.compile(r"(?<!`)`(?!`)"),
    "a link or image": re.compile(r"\]\(|\]\[|!\["),
    "bold text": re.compile(r"\*\*\S|\S\*\*"),
    "a heading": re.compile(r"(?m)^\s*#{1,6} "),
    "a table row": re.compile(r"(?m)^\s*\|.*\|\s*$"),
    "an admonition or mkdocstrings block": re.compile(r"(?m)^\s*(!!!|\?\?\?|:::) "),
}
VERBATIM = {"pre", "code", "script", "style", "textarea", "kbd", "samp"}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Page(HTMLParser):
    """A built page: its text outside code (per block element), ids, links, images, comments."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.verbatim: list[bool] = []
        self.text: list[str] = []
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []
        self.assets: list[str] = []  # scripts and stylesheets the page loads
        self.comments: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if a.get("name") and tag == "a":
            self.ids.add(a["name"])
        if tag == "a" and a.get("href") is not None:
            self.links.append(a["href"] or "")
        if tag == "img":
            self.images.append(a.get("src") or "")
        if tag == "script" and a.get("src"):
            self.assets.append(a["src"] or "")
        if tag == "link" and a.get("rel") == "stylesheet":
            self.assets.append(a.get("href") or "")
        if tag in ("p", "li", "td", "th", "h1", "h2", "h3", "h4", "h5", "h6", "div", "dd", "dt"):
            self.text.append("\n")
        if tag not in VOID:
            # Text a reader does not see as prose: code, and hidden elements (mkdocs-jupyter's
            # copy-to-clipboard buffer holds each cell's source as plain text).
            hidden = "hidden" in a or "clipboard-copy-txt" in (a.get("class") or "").split()
            self.stack.append(tag)
            self.verbatim.append(tag in VERBATIM or hidden)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack:
                self.verbatim.pop()
                if self.stack.pop() == tag:
                    break

    def handle_data(self, data):
        if not any(self.verbatim):
            self.text.append(data)

    def handle_comment(self, data):
        self.comments.append(data)


def page_problems(page: Path, site: Path) -> list[str]:
    """What a reader of the built `page` (inside the built `site`) would see broken."""
    parsed = _Page()
    parsed.feed(page.read_text())
    here = page.relative_to(site).as_posix()
    problems = []
    text = "".join(parsed.text)
    for what, pattern in UNRENDERED.items():
        lines = dict.fromkeys(line.strip() for line in text.splitlines() if pattern.search(line))
        problems += [f"{here}: unrendered Markdown ({what}): {line[:160]!r}" for line in lines]
    for comment in parsed.comments:
        if re.match(r"\s*(knobs|api:)", comment):
            problems.append(f"{here}: unexpanded docs_hooks marker <!--{comment}-->")
    for href in parsed.links:
        url = urlsplit(html.unescape(href))
        if url.scheme or url.netloc:
            continue  # external: not checked offline
        target = (page.parent / unquote(url.path)).resolve() if url.path else page
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file() or site.resolve() not in target.resolve().parents:
            problems.append(f"{here}: broken link {href!r} (no {target})")
        elif url.fragment and target.suffix == ".html":
            ids = parsed.ids if target == page else _ids(target)
            if unquote(url.fragment) not in ids:
                problems.append(
                    f"{here}: broken link {href!r} (no id {url.fragment!r} in {target.relative_to(site.resolve())})"
                )
    for src in parsed.assets:
        if urlsplit(src).scheme in ("http", "https") or src.startswith("//"):
            problems.append(f"{here}: loads {src!r}, which is not part of the site (it must work offline)")
    for src in parsed.images:
        url = urlsplit(src)
        if url.scheme in ("http", "https") or url.netloc:
            problems.append(f"{here}: image {src!r} is not part of the site (it must load offline)")
        elif url.scheme != "data" and not (src and (page.parent / unquote(url.path)).is_file()):
            problems.append(f"{here}: missing image {src!r}")
    return problems


@functools.cache
def _ids(page: Path) -> set[str]:
    parsed = _Page()
    parsed.feed(page.read_text())
    return parsed.ids


def site_pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def test_every_page_renders(site):
    """No built page shows a literal code fence or other unrendered Markdown, links to a page or
    anchor that is not there, or shows a missing image."""
    pages = site_pages(site)
    assert len(pages) >= 20, pages
    problems = [problem for page in pages for problem in page_problems(page, site)]
    assert not problems, f"{len(problems)} problems on the built site:\n" + "\n".join(problems)


def test_page_problems_sees_each_kind_of_breakage(tmp_path):
    """The checker fails on each kind of breakage it claims to see (and passes a clean page)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "pic.png").write_bytes(b"png")
    ok = (
        '<h1 id="top">T</h1><p>Run <code>`x`</code>:</p><pre><code>```bash\n**x**</code></pre>'
        '<a href="a/">A</a> <a href="#top">top</a> <img src="pic.png"> <a href="https://x.org/">x</a>'
    )
    (tmp_path / "a" / "index.html").write_text('<p id="here">a</p>')
    page = tmp_path / "index.html"
    page.write_text(ok)
    assert page_problems(page, tmp_path) == []
    broken = {
        "a code fence": "<p>```bash no-run\nuv run x\n```</p>",
        "inline code": "<p>the `knob` is</p>",
        "a link or image": "<p>see [the page](a.md)</p>",
        "bold text": "<p>a **bold** claim</p>",
        "a heading": "<p>\n## Title</p>",
        "a table row": "<p>| a | b |</p>",
        "an admonition or mkdocstrings block": "<p>::: equipax.core</p>",
        "unexpanded docs_hooks marker": "<!-- knobs -->",
        "broken link 'b/'": '<a href="b/">b</a>',
        "no id 'nowhere'": '<a href="a/#nowhere">b</a>',
        "no id 'gone'": '<a href="#gone">b</a>',
        "missing image": '<img src="nope.png">',
        "image 'https://x.org/p.png' is not part of the site": '<img src="https://x.org/p.png">',
        "loads 'https://cdn.x.org/m.js'": '<script src="https://cdn.x.org/m.js"></script>',
    }
    for what, snippet in broken.items():
        page.write_text(ok + snippet)
        problems = page_problems(page, tmp_path)
        assert problems and all(what in problem for problem in problems), (what, problems)


def test_search_index_holds_the_knobs_and_api_names(site):
    """The site's search finds every knob and every public API name."""
    sys.path.insert(0, str(REPO))
    from docs_hooks import api_modules, knob_rows
    from equipax.launch.configs.experiment import ExperimentConfig

    index = json.loads((site / "search" / "search_index.json").read_text())
    text = "\n".join(f"{doc['location']} {doc['title']} {doc['text']}" for doc in index["docs"])
    knobs = [knob for _, section in knob_rows(ExperimentConfig) for knob, *_ in section]
    names = [
        f"{name}.{public}"
        for pkg in ("core", "models", "data", "launch")
        for name in api_modules(pkg)
        for public in getattr(importlib.import_module(name), "__all__", [])
    ]
    missing = [n for n in knobs + names if n not in text and n.rsplit(".", 1)[-1] not in text]
    assert len(knobs) > 50 and len(names) > 100 and not missing, missing


FIGURES_DIR = REPO / "docs" / "figures"


def _figures():
    sys.path.insert(0, str(FIGURES_DIR))
    from make_figures import FIGURES

    return FIGURES, json.loads((FIGURES_DIR / "figures.json").read_text())


def test_figures_are_made_by_their_commands():
    """Every image in docs/figures is one make_figures.py draws, recorded in figures.json with the
    command(s) that made it, small, and shown on its page."""
    figures, manifest = _figures()
    files = sorted(p.name for p in FIGURES_DIR.iterdir() if p.suffix in (".png", ".svg"))
    assert sorted(entry["file"] for entry in manifest.values()) == files
    assert set(manifest) == set(figures), "regenerate: uv run python docs/figures/make_figures.py"
    for name, fig in figures.items():
        entry = manifest[name]
        assert (entry["file"], entry["page"], entry["commands"]) == (fig.file, fig.page, list(fig.commands)), (
            f"figures.json's {name!r} is not what make_figures.py makes now: "
            f"uv run python docs/figures/make_figures.py {name}"
        )
        assert entry["commands"] or entry["source"], name
        assert (FIGURES_DIR / fig.file).stat().st_size < 80_000, f"{fig.file} is over 80 KB"
        assert f"](figures/{fig.file})" in (REPO / "docs" / fig.page).read_text(), (
            f"{fig.page} does not show {fig.file}"
        )


def test_architecture_diagram_is_current():
    """The committed diagram is what the code draws now (module names, imports, hooks)."""
    sys.path.insert(0, str(FIGURES_DIR))
    from architecture import architecture_svg

    assert (FIGURES_DIR / "architecture.svg").read_text() == architecture_svg(), (
        "docs/figures/architecture.svg is out of date with the code: "
        "uv run python docs/figures/make_figures.py architecture"
    )


def test_every_figure_is_shown_with_its_command(site):
    _, manifest = _figures()
    for name, entry in manifest.items():
        stem = entry["page"].removesuffix(".md")
        page = (site / ("" if stem == "index" else stem) / "index.html").read_text()
        assert re.search(rf'<img [^>]*src="(\.\./)*figures/{re.escape(entry["file"])}"', page), name
        caption = html.unescape(re.sub(r"<[^>]+>", "", page))
        for text in (*entry["commands"], entry["regenerate"]):
            assert text in caption, (name, text)


# The browser check: where Chromium and ChromeDriver are installed (Debian: `apt-get install
# chromium chromium-driver`; .ci/run installs them), every built page is loaded headless from a
# local HTTP server, as a reader opens it.
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser(site):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no Chromium + ChromeDriver on this machine (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if not (self.server.stub_search_index and self.path.split("?")[0].endswith("/search/search_index.json")):
                return super().do_GET()
            body = self.server.stub_search_index
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")  # never what the search test reads
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    server.stub_search_index = b""  # test_every_page_in_a_browser's: see there
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import (
        Service,  # the installed driver: Selenium downloads none
    )

    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver, f"http://127.0.0.1:{server.server_address[1]}/", server
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()


PAGE_STATE = """
const article = document.querySelector('article.md-content__inner');
return {
  title: article && article.querySelector('h1') ? article.querySelector('h1').innerText : '',
  text: article ? article.innerText.length : 0,
  broken_images: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
  images: document.images.length,
};
"""


def test_every_page_in_a_browser(site, browser):
    """Each page loads without a console error, shows its main content (a title and text) and all
    its images (drawn: complete with a width).

    Each page starts the site's search worker (its script, at the page's own relative path), which
    fetches the search index and builds it: here the worker gets the index's config with no
    documents, so every page still loads and runs the worker, without rebuilding the 1.6 MB index
    per page (12 s of Chromium's CPU of 26 over the 30 pages, 2026-12-05). The real index is built
    in the browser, and searched, by test_site_search_in_a_browser (no console errors either), and
    its contents are checked by test_search_index_holds_the_knobs_and_api_names."""
    driver, base, server = browser
    index = json.loads((site / "search" / "search_index.json").read_text())
    server.stub_search_index = json.dumps({**index, "docs": []}).encode()
    try:
        problems, shown = _every_page(site, driver, base)
    finally:
        server.stub_search_index = b""
    assert not problems, "\n".join(problems)
    assert shown >= 6, f"only {shown} images shown on the whole site"


def _every_page(site: Path, driver, base: str) -> tuple[list[str], int]:
    problems, shown = [], 0
    for page in site_pages(site):
        url = base + page.relative_to(site).as_posix().removesuffix("index.html")
        driver.get(url)
        state = driver.execute_script(PAGE_STATE)
        errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        where = page.relative_to(site).as_posix()
        if errors:
            problems.append(f"{where}: console errors {errors}")
        if not state["title"] or state["text"] < 200:
            problems.append(f"{where}: no main content (title {state['title']!r}, {state['text']} characters)")
        if state["broken_images"]:
            problems.append(f"{where}: images not shown {state['broken_images']}")
        shown += state["images"] - len(state["broken_images"])
    return problems, shown


def test_site_search_in_a_browser(site, browser):
    """The search box finds a knob and an API name (Material's search runs in a web worker, which
    needs the site served over HTTP)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, base, _ = browser
    for query, expect in (("num_layers", "knobs/"), ("build_training", "api/launch/")):
        driver.get(base + "?q=" + query)
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item a"))
        links = [a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")]
        assert any(expect in link for link in links), (query, links)
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
