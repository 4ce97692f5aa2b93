"""`launch run` opens the devices on a background thread while it imports the training code
(`equipax.launch.cluster.devices.open_devices_early`): the devices come from that thread's start of
JAX's backend, and a platform that cannot start still fails where the devices are first needed,
with JAX's message (the command's one paragraph, exit 2: tests/launch/test_reliability2.py's
test_unavailable_platform)."""

import os
import subprocess
import sys

CHILD = """
import threading, jax
from jax._src import xla_bridge
started_on = []
start = xla_bridge.backends
def watched():
    started_on.append(threading.current_thread().name)
    return start()
xla_bridge.backends = watched
from equipax.launch.cluster.devices import open_devices_early
thread = open_devices_early()
thread.join(120)
assert not thread.is_alive()
print("STARTED_ON", started_on[0] if started_on else None)
xla_bridge.backends = start
try:
    print("DEVICES", jax.device_count())
except RuntimeError as e:
    print("MAIN_THREAD_ERROR", str(e).splitlines()[0])
"""


def child(platforms: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "JAX_PLATFORMS": platforms},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "Exception in thread" not in proc.stderr, proc.stderr[-3000:]  # the thread raises nothing
    return proc.stdout


def test_the_backend_starts_on_the_background_thread():
    out = child("cpu")
    assert "STARTED_ON equipax-open-devices" in out, out
    assert "DEVICES 1" in out, out


def test_a_platform_that_cannot_start_fails_where_the_devices_are_needed():
    out = child("nosuch")  # JAX's start raises for it (the thread's error is not kept)
    assert "MAIN_THREAD_ERROR Unable to initialize backend 'nosuch'" in out, out
