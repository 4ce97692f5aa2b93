"""Is a folder of wheels the whole of what benchmarks/tpu/wheels.sh made? benchmarks/tpu/run.sh asks
before it installs anything, with the host's interpreter (standard library only):

    python benchmarks/tpu/wheel_folder.py DIR

Exit 0 printing the wheels to install, one path a line: every wheel needs.txt names (wheels.sh
writes it last, so a folder it did not finish has none or an unfinished one) and equipax's four,
each present once and a whole zip file. Exit 2 with one paragraph naming wheels.sh otherwise, and for
a wheel of JAX (jax, jaxlib, libtpu, a JAX plugin): on PYTHONPATH it would be imported instead of the
image's JAX, which is matched to the host's hardware.
"""

import os
import re
import sys
import zipfile

EQUIPAX = ("equipax_core", "equipax_models", "equipax_data", "equipax_launch")
# Unfinished: wheels.sh writes this first line into needs.txt before it starts downloading.
UNFINISHED = "# incomplete"


def _name(name: str) -> str:
    """A distribution name as wheel files spell it (PEP 427: runs of - _ . as one _, lower case)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _same_version(a: str, b: str) -> bool:
    try:
        from packaging.version import Version  # the image's, where it has it (Cloud TPU images do)

        return Version(a) == Version(b)
    except Exception:  # no packaging, or a version it cannot read: the spelling decides
        return a.strip().lower() == b.strip().lower()


def is_jax(name: str) -> bool:
    """jax, jaxlib, libtpu and JAX's accelerator plugins (jax-cuda12-plugin, jax-rocm60-pjrt, ...);
    not the libraries merely named after JAX (jaxtyping)."""
    n = _name(name)
    plugin = re.match(r"jax_(cuda|rocm|tpu|metal|plugin)", n) is not None
    return n == "jax" or n.startswith(("jaxlib", "libtpu")) or plugin


class Refused(Exception):
    """The folder cannot be installed; the message says why and what to do."""


def wheels_to_install(folder: str) -> tuple[list[str], list[str]]:
    """The wheels of `folder` to install (paths) and those it also holds that needs.txt does not name.

    Raises:
        Refused: no wheels, a wheel of JAX, needs.txt missing or unfinished, a wheel missing, twice
            or not a whole zip file.
    """
    again = f"Make the folder again on a machine with network: bash benchmarks/tpu/wheels.sh {folder}"
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    wheels = {f: f[: -len(".whl")].split("-") for f in files if f.endswith(".whl")}
    if not wheels:
        raise Refused(
            f"no wheels in '{folder}'. Make them first, on a machine with network: "
            f"bash benchmarks/tpu/wheels.sh {folder}"
        )
    jax = [f for f, parts in wheels.items() if is_jax(parts[0])]
    if jax:
        raise Refused(
            f"'{folder}' holds {', '.join(jax)}: a wheel of JAX would be imported instead of the image's "
            "jax, jaxlib and libtpu, which are matched to this host's hardware. Nothing was installed. "
            f"Remove it from the folder (wheels.sh never downloads one). {again}"
        )
    needs_txt = os.path.join(folder, "needs.txt")
    if not os.path.isfile(needs_txt):
        raise Refused(
            f"'{folder}' has no needs.txt, the list wheels.sh writes once every wheel is downloaded: it is "
            f"not a finished wheels.sh folder (or was copied in part). Nothing was installed. {again}"
        )
    with open(needs_txt, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if lines and lines[0].startswith(UNFINISHED):
        raise Refused(
            f"'{folder}' is unfinished: wheels.sh stopped before it had every wheel (its needs.txt says so). "
            f"Nothing was installed. {again}"
        )
    want: list[tuple[str, str | None]] = [(n, None) for n in EQUIPAX]
    for line in lines:
        req = line.split("#")[0].split(";")[0].strip()
        if not req:
            continue
        name, sep, version = req.partition("==")
        if not sep:
            raise Refused(f"{needs_txt}: '{line}' is not NAME==VERSION, as wheels.sh writes it. {again}")
        want.append((_name(name), version.strip()))
    chosen, missing = [], []
    for name, version in want:
        found = [
            f
            for f, parts in wheels.items()
            if len(parts) >= 2 and _name(parts[0]) == name and (version is None or _same_version(parts[1], version))
        ]
        if not found:
            missing.append(name if version is None else f"{name}=={version}")
        elif len(found) > 1:
            raise Refused(f"'{folder}' holds {len(found)} wheels of {name} ({', '.join(found)}): keep one. {again}")
        else:
            chosen.append(found[0])
    if missing:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise Refused(
            f"'{folder}' lacks {len(missing)} of the wheels wheels.sh made ({', '.join(missing[:6])}{more}): "
            f"a half-made or half-copied folder. Nothing was installed. {again}, and copy all of it."
        )
    damaged = []
    for f in chosen:
        try:
            with zipfile.ZipFile(os.path.join(folder, f)) as z:
                if z.testzip() is not None:
                    damaged.append(f)
        except (zipfile.BadZipFile, OSError, EOFError):
            damaged.append(f)
    if damaged:
        raise Refused(
            f"'{folder}': {', '.join(damaged)} {'is' if len(damaged) == 1 else 'are'} not a whole zip file "
            f"(cut short by a full disk or an interrupted copy). Nothing was installed. Copy the folder "
            f"again, or {again[0].lower()}{again[1:]}"
        )
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    other = [  # built for another CPython (a stable-ABI "abi3" wheel runs on later ones too)
        f
        for f in chosen
        if wheels[f][-3].startswith("cp") and wheels[f][-2] != "abi3" and here not in wheels[f][-3].split(".")
    ]
    if other:
        made_for = sorted({wheels[f][-3] for f in other})
        raise Refused(
            f"'{folder}' was made for Python {', '.join(made_for)} ({other[0]}, ...), but the interpreter run.sh "
            f"installs for is {sys.version.split()[0]} ({sys.executable}). Run it with the Python that has the "
            "image's JAX (PY=/path/to/python3.11; a .python-version file or pyenv can make plain python3 another "
            f"one), or make the wheels for this Python: PYTHON_VERSION={sys.version_info[0]}.{sys.version_info[1]} "
            f"bash benchmarks/tpu/wheels.sh {folder}"
        )
    extra = sorted(set(wheels) - set(chosen))
    return [os.path.join(folder, f) for f in chosen], extra


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/tpu/wheel_folder.py DIR", file=sys.stderr)
        return 2
    try:
        install, extra = wheels_to_install(argv[0])
    except Refused as e:
        print(f"run.sh: {e}", file=sys.stderr)
        return 2
    if extra:
        print(f"run.sh: not in needs.txt, so not installed: {', '.join(extra)}", file=sys.stderr)
    print("\n".join(install))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
