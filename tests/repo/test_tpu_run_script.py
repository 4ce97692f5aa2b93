"""benchmarks/tpu/run.sh's refusals and failures, each one paragraph and exit 2 with nothing written
where it should not be: a wheels folder that is not the whole of what wheels.sh made (or holds a
JAX), flags without values, a missing PY, an --out or TARGET it cannot write, a TARGET it did not
make, no usable TPU; paths read from the caller's directory; TARGET emptied of an earlier install.
And usage.py's --out: only a folder it wrote before is replaced.

Small stand-in wheels and this environment's Python as the image's (its jax; equipax from the
workspace); the script runs from a copy of the checkout in a temporary folder, so nothing it writes
can land in the repository. tests/repo/test_wheels.py runs it with the real wheels."""

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO

BASH = shutil.which("bash") or "/bin/bash"
EQUIPAX = ("equipax_core", "equipax_models", "equipax_data", "equipax_launch")


def make_wheel(folder: Path, name: str, version: str = "1.0") -> Path:
    """A small installable wheel of `name` (one empty module, `<name>_stub`)."""
    dist = f"{name}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}_stub.py", "")
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        z.writestr(f"{dist}.dist-info/WHEEL", wheel)
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture
def checkout(tmp_path) -> Path:
    root = tmp_path / "checkout"
    (root / "benchmarks" / "tpu").mkdir(parents=True)
    for name in ("run.sh", "wheel_folder.py", "usage.py"):
        shutil.copy(REPO / "benchmarks" / "tpu" / name, root / "benchmarks" / "tpu")
    return root


@pytest.fixture
def wheels(tmp_path) -> Path:
    """A folder as wheels.sh makes it: equipax's four and what needs.txt lists."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in (*EQUIPAX, "absl_py"):
        make_wheel(folder, name, "0.1.0" if name.startswith("equipax") else "2.1.0")
    (folder / "needs.txt").write_text("absl-py==2.1.0\n")
    return folder


def run_sh(checkout: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    base |= {"PY": sys.executable, "TARGET": str(cwd / "site"), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [BASH, str(checkout / "benchmarks" / "tpu" / "run.sh"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=base | env,
        cwd=cwd,
    )


def one_paragraph(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "unbound variable" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("run.sh:")]
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], done.stderr


@pytest.mark.parametrize("args", [["--out"], ["--wheels"], ["--out", "--source"], ["--out="], ["check", "--wheels"]])
def test_a_flag_without_its_value_gets_the_usage(args, checkout, tmp_path):
    one_paragraph(run_sh(checkout, *args, cwd=tmp_path), "needs a folder after it", "Usage: bash benchmarks/tpu/run.sh")


@pytest.mark.parametrize("py", ["/nonexistent/python3", "no-such-python3"])
def test_a_missing_interpreter_is_named(py, checkout, wheels, tmp_path):
    done = run_sh(checkout, "--wheels", str(wheels), "--out", str(tmp_path / "out"), "check", cwd=tmp_path, PY=py)
    one_paragraph(done, f"PY='{py}' was not found")
    assert not (tmp_path / "out").exists() and not (tmp_path / "site").exists()


def _no_needs(folder: Path) -> None:
    (folder / "needs.txt").unlink()


def _unfinished(folder: Path) -> None:
    (folder / "needs.txt").write_text("# incomplete: benchmarks/tpu/wheels.sh has not finished this folder\n")


def _listed_missing(folder: Path) -> None:
    (folder / "needs.txt").write_text("absl-py==2.1.0\nequinox==0.11.0\n")


def _equipax_missing(folder: Path) -> None:
    next(folder.glob("equipax_launch-*.whl")).unlink()


def _truncated(folder: Path) -> None:
    path = next(folder.glob("absl_py-*.whl"))
    path.write_bytes(path.read_bytes()[:40])


def _jax(folder: Path) -> None:
    make_wheel(folder, "jax", "0.10.2")
    (folder / "needs.txt").write_text("absl-py==2.1.0\njax==0.10.2\n")


def _jax_plugin(folder: Path) -> None:
    make_wheel(folder, "jax_cuda12_plugin", "0.10.2")


def _other_python(folder: Path) -> None:
    """absl-py's wheel for CPython 2.7 in place of the pure one (wheels.sh run for another Python)."""
    path = next(folder.glob("absl_py-*.whl"))
    path.rename(folder / "absl_py-2.1.0-cp27-cp27m-manylinux1_x86_64.whl")


@pytest.mark.parametrize(
    "damage, needle",
    [
        (_no_needs, "has no needs.txt"),
        (_unfinished, "is unfinished"),
        (_listed_missing, "equinox==0.11.0"),
        (_equipax_missing, "equipax_launch"),
        (_truncated, "absl_py-2.1.0-py3-none-any.whl is not a whole zip file"),
        (_jax, "jax-0.10.2-py3-none-any.whl"),
        (_jax_plugin, "jax_cuda12_plugin-0.10.2-py3-none-any.whl"),
        (_other_python, "was made for Python cp27"),
    ],
    ids=["no-needs", "unfinished", "listed-missing", "equipax-missing", "truncated", "jax", "jax-plugin", "cp27"],
)
def test_a_wheels_folder_that_is_not_whole_is_refused_before_anything_is_written(
    damage, needle, checkout, wheels, tmp_path
):
    damage(wheels)
    done = run_sh(checkout, "--wheels", str(wheels), "--out", str(tmp_path / "out"), "check", cwd=tmp_path)
    one_paragraph(done, needle, "bash benchmarks/tpu/wheels.sh")
    assert not (tmp_path / "out").exists() and not (tmp_path / "site").exists()


def test_an_out_it_cannot_create_stops_it(checkout, wheels, tmp_path):
    (tmp_path / "file").write_text("a file")
    out = tmp_path / "file" / "out"
    done = run_sh(checkout, "--wheels", str(wheels), "--out", str(out), "check", cwd=tmp_path, ALLOW_CPU="1")
    one_paragraph(done, str(out))
    assert sorted(p.name for p in checkout.iterdir()) == ["benchmarks"] and not list(tmp_path.rglob("*.log"))


def test_relative_paths_are_read_from_the_callers_directory(checkout, wheels, tmp_path):
    caller = tmp_path / "caller"
    caller.mkdir()
    shutil.move(wheels, caller / "w")
    done = run_sh(checkout, "--wheels", "w", "--out", "o", "check", cwd=caller, TARGET="site", ALLOW_CPU="1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (caller / "o" / "environment.json").exists() and (caller / "o" / "check.log").exists()
    assert (caller / "site" / "absl_py_stub.py").exists()
    assert sorted(p.name for p in checkout.iterdir()) == ["benchmarks"]


def test_target_is_emptied_of_an_earlier_install(checkout, wheels, tmp_path):
    """TARGET, which run.sh made (its marker), is emptied each run: a package an earlier run left
    there (here a broken `jax` that would shadow the image's) is gone, as is one no longer listed."""
    target = tmp_path / "site"
    args = ["--wheels", str(wheels), "--out", str(tmp_path / "out"), "check"]
    first = run_sh(checkout, *args, cwd=tmp_path, TARGET=str(target), ALLOW_CPU="1")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert (target / ".equipax-run.sh").exists() and (target / "absl_py_stub.py").exists()
    (target / "jax").mkdir()
    (target / "jax" / "__init__.py").write_text("raise ImportError('a stale jax of an earlier install')\n")
    (wheels / "needs.txt").write_text("")
    (wheels / "absl_py-2.1.0-py3-none-any.whl").unlink()
    second = run_sh(checkout, *args, cwd=tmp_path, TARGET=str(target), ALLOW_CPU="1")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert not (target / "jax").exists() and not (target / "absl_py_stub.py").exists()
    assert (target / "equipax_core_stub.py").exists()


def test_an_install_that_fails_is_one_paragraph(checkout, wheels, tmp_path):
    """pip or uv failing (here on a wheel without its metadata; a full disk or a read-only TARGET
    fails the same way): exit 2 naming TARGET and what to check, nothing run after it."""
    path = next(wheels.glob("absl_py-*.whl"))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("absl_py_stub.py", "")
    done = run_sh(checkout, "--wheels", str(wheels), "--out", str(tmp_path / "out"), "check", cwd=tmp_path)
    one_paragraph(done, "installing the wheels into TARGET=", "No space left on device")
    assert "== check" not in done.stdout


def test_a_failing_part_is_reported_and_the_others_run(checkout, wheels, tmp_path):
    args = ["--wheels", str(wheels), "--out", str(tmp_path / "out"), "usage", "check"]
    done = run_sh(checkout, *args, cwd=tmp_path, ALLOW_CPU="1", USAGE_ARGS="--no-such-option")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "usage: failed (exit 2)" in done.stdout and "check: ok" in done.stdout
    assert "stopped:" not in done.stderr and "no-such-option" in (tmp_path / "out" / "usage.log").read_text()


def test_a_target_it_did_not_make_or_cannot_write_is_refused(checkout, wheels, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("kept")
    args = ["--wheels", str(wheels), "--out", str(tmp_path / "out"), "check"]
    done = run_sh(checkout, *args, cwd=tmp_path, TARGET=str(foreign), ALLOW_CPU="1")
    one_paragraph(done, f"TARGET='{foreign}' holds files run.sh did not put there")
    assert sorted(p.name for p in foreign.iterdir()) == ["precious.txt"]
    (tmp_path / "file").write_text("a file")
    done = run_sh(checkout, *args, cwd=tmp_path, TARGET=str(tmp_path / "file" / "site"), ALLOW_CPU="1")
    one_paragraph(done, "cannot write TARGET")
    if os.geteuid() != 0:  # (root writes anywhere)
        readonly = tmp_path / "readonly"
        readonly.mkdir(mode=0o555)
        done = run_sh(checkout, *args, cwd=tmp_path, TARGET=str(readonly), ALLOW_CPU="1")
        one_paragraph(done, "cannot write TARGET")
    inside = run_sh(checkout, *args, cwd=tmp_path, TARGET=str(tmp_path), ALLOW_CPU="1")
    one_paragraph(inside, "is inside TARGET")


def test_no_usable_tpu_is_one_paragraph(checkout, wheels, tmp_path):
    if Path("/dev/accel0").exists() or Path("/dev/vfio").exists():
        pytest.skip("this host may have a TPU")
    done = run_sh(
        checkout, "--wheels", str(wheels), "--out", str(tmp_path / "out"), "check", cwd=tmp_path, JAX_PLATFORMS="tpu"
    )
    one_paragraph(done, "JAX_PLATFORMS='tpu'", "no other process holds the chip")


def test_launch_with_no_usable_tpu_is_one_paragraph(tmp_path):
    """`launch run` with JAX_PLATFORMS=tpu where there is no TPU (or libtpu): exit 2, one paragraph
    naming JAX_PLATFORMS and what to check on a TPU host."""
    if Path("/dev/accel0").exists() or Path("/dev/vfio").exists():
        pytest.skip("this host may have a TPU")
    args = ["run", "--exp", "shakespeare_tiny", "--job-log-dir", str(tmp_path / "job"), "--set", "train.num_steps=1"]
    env = {**os.environ, "JAX_PLATFORMS": "tpu"}
    done = subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.count("error:") == 1, done.stderr
    assert "JAX_PLATFORMS='tpu'" in done.stderr and "no other process holds the chip" in done.stderr, done.stderr


def _usage(monkeypatch):
    spec = importlib.util.spec_from_file_location("tpu_usage", REPO / "benchmarks" / "tpu" / "usage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def no_launch(*args, **kwargs):
        raise AssertionError("launch ran")

    monkeypatch.setattr(module, "_run", no_launch)
    return module


def test_usage_replaces_only_a_folder_it_wrote(tmp_path, monkeypatch, capsys):
    usage = _usage(monkeypatch)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "default").mkdir()
    (theirs / "default" / "checkpoints").mkdir()
    assert usage.main(["--out", str(theirs)]) == 2  # a `default` job, but no usage.json: not its own
    assert "nothing was changed" in capsys.readouterr().err
    assert (theirs / "default" / "checkpoints").is_dir()
    (tmp_path / "file").write_text("kept")
    assert usage.main(["--out", str(tmp_path / "file")]) == 2 and (tmp_path / "file").read_text() == "kept"
    own = tmp_path / "own"
    (own / "default").mkdir(parents=True)
    (own / "usage.json").write_text("{}")
    (own / "train.log").write_text("old")
    with pytest.raises(AssertionError, match="launch ran"):
        usage.main(["--out", str(own)])
    assert sorted(p.name for p in own.iterdir()) == ["usage.json"]


def test_without_py_it_runs_the_python_that_imports_jax(checkout, wheels, tmp_path):
    """PY unset: the first of python3, python3.11, ... that imports JAX, not plain python3 when that
    is another Python (pyenv follows the checkout's .python-version: on the TPU image plain python3
    became a 3.12 without the image's JAX and pip refused the 3.11 wheels)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\necho 'no JAX in this one' >&2\nexit 1\n")
    (bin_dir / "python3.11").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "ALLOW_CPU": "1"}
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PY")}
    done = subprocess.run(
        [BASH, str(checkout / "benchmarks" / "tpu" / "run.sh"), "--wheels", str(wheels), "--out", "o", "check"],
        capture_output=True,
        text=True,
        timeout=300,
        env=base | env | {"TARGET": str(tmp_path / "site"), "JAX_PLATFORMS": "cpu"},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads((tmp_path / "o" / "environment.json").read_text())["python"] == platform.python_version()
