"""Several independent snippets in ONE fresh process with N simulated CPU devices: one Python, JAX
and equipax start-up (about 1.5 s of CPU each) for a module's multi-device tests, not one per test.
Each snippet runs in a namespace of its own (only `jax` given, as `run_with_devices`'s prelude
gives it); its stdout and any exception are kept apart, so each test still passes or fails on its
own snippet alone."""

import json

from helpers.multidevice import run_with_devices

__all__ = ["part_stdout", "run_parts_with_devices"]

_RUNNER = """
import contextlib, io, json, textwrap, traceback
_results = {}
for _name, _code in json.loads(_PARTS).items():
    _out = io.StringIO()
    try:
        with contextlib.redirect_stdout(_out):
            exec(compile(textwrap.dedent(_code), f"<{_name}>", "exec"), {"__name__": "__main__", "jax": jax})
        _results[_name] = {"stdout": _out.getvalue(), "error": None}
    except BaseException:
        _results[_name] = {"stdout": _out.getvalue(), "error": traceback.format_exc()}
print(json.dumps(_results))
"""


def run_parts_with_devices(parts: dict[str, str], devices: int = 8, timeout: float = 600, xla_flags: str = "") -> dict:
    """Run each of `parts` ({name: code}) in turn in one `run_with_devices` child; return
    {name: {"stdout": ..., "error": traceback or None}} (read it with `part_stdout`)."""
    code = f"_PARTS = {json.dumps(parts)!r}\n" + _RUNNER
    out = run_with_devices(code, devices=devices, timeout=timeout, xla_flags=xla_flags)
    return json.loads(out.strip().splitlines()[-1])


def part_stdout(results: dict, name: str) -> str:
    """The stdout of part `name`; fails the calling test with its output and traceback if it raised."""
    r = results[name]
    if r["error"] is not None:
        raise AssertionError(f"part {name!r} failed in the child:\n{r['stdout'][-3000:]}\n{r['error']}")
    return r["stdout"]
