"""benchmarks/tpu/wheels.sh with stand-ins for uv and pip (no network): it deletes nothing it did not
make, reads OUT_DIR from the caller's directory, prints its header for --help, and stops on a
failing step (a full disk) with one paragraph, exit 2, leaving a folder run.sh refuses.

The script runs from a copy of the checkout in a temporary folder (it works from the checkout it sits
in), so whatever it does can touch nothing of the repository's."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO

BASH = shutil.which("bash") or "/bin/bash"

# What the stand-in `uv pip compile` resolves: jax and numpy are the image's (IMAGE_HAS), so the
# script downloads the other two.
RESOLVED = "./packages/core\nabsl-py==2.1.0\njax==0.10.2\nnumpy==2.0.0\nequinox==0.11.0\n"
NEEDS = "absl-py==2.1.0\nequinox==0.11.0\n"

SHIM = '''#!{python}
"""A stand-in for `{tool}`: logs its arguments, fails where {fails} is set, makes small wheels."""
import os, sys, zipfile
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["SHIM_LOG"], "a") as f:
    f.write("{tool} " + " ".join(args) + "\\n")


def wheel(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(path.name.split("-")[0] + ".py", "")


if args[:3] == ["-m", "pip", "--version"]:
    print("pip 24.0")
    sys.exit(0)
if os.environ.get("{fails}"):
    print("ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device", file=sys.stderr)
    sys.exit(1)
if args[0] == "build":
    out = Path(args[args.index("--out-dir") + 1])
    out.mkdir(parents=True, exist_ok=True)
    wheel(out / f"equipax_{{Path(args[-1]).name}}-0.1.0-py3-none-any.whl")
elif args[:2] == ["pip", "compile"]:
    Path(args[args.index("-o") + 1]).write_text({resolved!r})
elif args[:3] == ["-m", "pip", "download"]:
    out = Path(args[args.index("-d") + 1])
    for line in Path(args[args.index("-r") + 1]).read_text().split():
        name, version = line.split("==")
        wheel(out / f"{{name.replace('-', '_')}}-{{version}}-py3-none-any.whl")
'''


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A copy of what wheels.sh reads of the checkout, with a .git of its own."""
    root = tmp_path / "checkout"
    (root / "benchmarks" / "tpu").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "tpu" / "wheels.sh", root / "benchmarks" / "tpu")
    (root / ".ci" / "compat").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "compat" / "overrides.txt", root / ".ci" / "compat")
    for pkg in ("core", "models", "data", "launch"):
        (root / "packages" / pkg).mkdir(parents=True)
        (root / "packages" / pkg / "pyproject.toml").write_text(f"# equipax-{pkg}\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return root


@pytest.fixture
def shims(tmp_path) -> Path:
    """`uv` and `python3` stand-ins (the only tools of PATH's first folder)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool, fails in (("uv", "UV_FAILS"), ("python3", "PIP_FAILS")):
        path = bin_ / tool
        path.write_text(SHIM.format(python=sys.executable, tool=tool, fails=fails, resolved=RESOLVED))
        path.chmod(0o755)
    return bin_


def wheels_sh(checkout: Path, shims: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    log = shims.parent / "shim.log"
    env = {"PATH": f"{shims}:/usr/bin:/bin", "HOME": str(shims.parent), "SHIM_LOG": str(log), **env}
    return subprocess.run(
        [BASH, str(checkout / "benchmarks" / "tpu" / "wheels.sh"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (and root itself) with a file's bytes; a folder as None."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def ran_tools(shims: Path) -> list[str]:
    """What the stand-ins were asked to do, but the check that pip is there."""
    log = shims.parent / "shim.log"
    return [line for line in log.read_text().splitlines() if "--version" not in line] if log.exists() else []


def one_paragraph(stderr: str, *needles: str) -> None:
    assert "Traceback" not in stderr and "unbound variable" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("wheels.sh:")]
    assert len(lines) == 1, stderr
    for needle in needles:
        assert needle in lines[0], stderr


def test_help_prints_the_header_and_runs_nothing(checkout, shims, tmp_path):
    before = tree(tmp_path / "checkout")
    done = wheels_sh(checkout, shims, "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Make the folder of wheels that benchmarks/tpu/run.sh installs" in done.stdout
    assert "OUT_DIR" in done.stdout and "#" not in done.stdout.splitlines()[0]
    assert tree(tmp_path / "checkout") == before and not ran_tools(shims)
    assert not (tmp_path / "--help").exists()
    for bad in (["--out"], ["a", "b"]):
        refused = wheels_sh(checkout, shims, *bad, cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr
        one_paragraph(refused.stderr, "Usage" if bad == ["--out"] else "one OUT_DIR")


@pytest.mark.parametrize("kind", ["folder-with-a-file", "file", "folder-with-a-folder", "wheels-only", "checkout"])
def test_an_out_it_did_not_make_is_refused_and_left_as_it_was(kind, checkout, shims, tmp_path):
    """OUT_DIR holding anything but its own wheels and needs.txt, a file, the checkout (`.` from
    there): exit 2 naming it, nothing deleted, no tool run."""
    cwd = tmp_path
    if kind == "checkout":
        out, cwd, arg = checkout, checkout, "."
    else:
        out = tmp_path / "out"
        arg = str(out)
        if kind == "file":
            out.write_text("precious")
        else:
            out.mkdir()
            (out / "a.whl").write_bytes(b"a wheel")
            if kind == "folder-with-a-file":
                (out / "notes.txt").write_text("precious")
            elif kind == "folder-with-a-folder":
                (out / "needs.txt").write_text(NEEDS)
                (out / "sub").mkdir()
                (out / "sub" / "x.whl").write_text("precious")
    before = tree(out)
    done = wheels_sh(checkout, shims, arg, cwd=cwd)
    assert done.returncode == 2, done.stdout + done.stderr
    one_paragraph(done.stderr, str(out), "nothing was changed" if kind != "file" else "left as it is")
    assert tree(out) == before
    assert not ran_tools(shims)


def test_makes_the_folder_from_the_callers_directory_and_replaces_only_its_own(checkout, shims, tmp_path):
    caller = tmp_path / "caller"
    caller.mkdir()
    done = wheels_sh(checkout, shims, "w", cwd=caller)
    assert done.returncode == 0, done.stdout + done.stderr
    out = caller / "w"
    assert not (checkout / "w").exists()
    made = sorted(p.name for p in out.iterdir())
    assert made == [
        "absl_py-2.1.0-py3-none-any.whl",
        "equinox-0.11.0-py3-none-any.whl",
        "equipax_core-0.1.0-py3-none-any.whl",
        "equipax_data-0.1.0-py3-none-any.whl",
        "equipax_launch-0.1.0-py3-none-any.whl",
        "equipax_models-0.1.0-py3-none-any.whl",
        "needs.txt",
    ]
    assert (out / "needs.txt").read_text() == NEEDS
    assert all(zipfile.is_zipfile(p) for p in out.glob("*.whl"))
    # Its own folder again, with a wheel of an earlier resolution: replaced, the stale wheel gone.
    (out / "stale-1.0-py3-none-any.whl").write_bytes(b"old")
    again = wheels_sh(checkout, shims, str(out), cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted(p.name for p in out.iterdir()) == made


@pytest.mark.parametrize("failing", ["UV_FAILS", "PIP_FAILS"])
def test_a_failing_step_stops_with_one_paragraph_and_an_unfinished_list(failing, checkout, shims, tmp_path):
    """A full disk (or no network) under uv or pip: exit 2 with one paragraph naming the step and
    the fix; needs.txt says the folder is unfinished (run.sh refuses it); a second run replaces it."""
    out = tmp_path / "out"
    done = wheels_sh(checkout, shims, str(out), cwd=tmp_path, **{failing: "1"})
    assert done.returncode == 2, done.stdout + done.stderr
    one_paragraph(done.stderr, "uv" if failing == "UV_FAILS" else "pip download", "No space left on device")
    assert (out / "needs.txt").read_text().startswith("# incomplete")
    again = wheels_sh(checkout, shims, str(out), cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (out / "needs.txt").read_text() == NEEDS


def test_missing_tools_are_named(checkout, shims, tmp_path):
    if any(Path(d, "uv").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("uv is installed system-wide here")
    (shims / "uv").unlink()
    done = wheels_sh(checkout, shims, str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2
    one_paragraph(done.stderr, "uv is not on PATH")
    assert not (tmp_path / "out").exists()


def test_a_long_image_list_still_keeps_the_images_packages_out(checkout, shims, tmp_path):
    """The image's packages never enter the list, however long IMAGE_HAS is: a name matched by
    `printf | grep -q` under pipefail slipped in whenever grep exited before printf had written all
    (every time past a pipe's 64 KB buffer; now and then under load before)."""
    image_has = "jax numpy " + " ".join(f"pkg{i:05d}" for i in range(12000))  # ~110 KB
    done = wheels_sh(checkout, shims, str(tmp_path / "out"), cwd=tmp_path, IMAGE_HAS=image_has)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "out" / "needs.txt").read_text() == NEEDS
