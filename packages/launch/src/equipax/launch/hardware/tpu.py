"""Real TPU topologies on any host: Cloud TPU slice names -> libtpu topologies -> devices to compile for.

`jax.experimental.topologies.get_topology_desc` asks libtpu (the `libtpu` wheel; `uv sync` installs
it) for the devices of a TPU slice that is not attached: a mesh of them lowers and compiles with
XLA:TPU on a CPU host, and `memory_analysis()` then gives the TPU compiler's own figures.

Slice names are Cloud TPU's accelerator types. v4 and v5p count TensorCores (two per chip, one
"megacore" device per chip: v4-128 is 64 chips, 4x4x4); v5e and v6e count chips (one core each:
v5e-16 is 4x4).
"""

import dataclasses
import os
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

from equipax.core.knobs import ConfigError

__all__ = [
    "host_buffer_for_new_job",
    "libtpu_available",
    "NEW_JOB_BUFFER_BYTES",
    "lookup_slice",
    "prepare_libtpu",
    "quiet_absent_tpu",
    "QUIETED_TPU",
    "topology_devices",
    "TPU_SLICES",
    "TpuSlice",
    "valid_slices_text",
]


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A Cloud TPU slice type and the libtpu topology that describes it.

    Attributes:
        name: the accelerator type, e.g. "v4-128".
        generation: "v4", "v5e", "v5p" or "v6e" (the compile target is `tpu-<generation>`).
        topology: libtpu's topology name, e.g. "v4:4x4x4".
        chip_config: "megacore" (one device per two-core chip) or "default".
        chips_per_host: chips of one host along each topology axis.
    """

    name: str
    generation: str
    topology: str
    chip_config: str
    chips_per_host: tuple[int, int, int]

    @property
    def chips(self) -> int:
        dims = [int(x) for x in self.topology.split(":")[1].split("x")]
        n = 1
        for d in dims:
            n *= d
        return n

    @property
    def target_name(self) -> str:
        return f"tpu-{self.generation}"


# Chip grids of the slice shapes Cloud TPU offers (chips per axis).
_CUBES = (
    (2, 2, 1),
    (2, 2, 2),
    (2, 2, 4),
    (2, 4, 4),
    (4, 4, 4),
    (4, 4, 8),
    (4, 8, 8),
    (8, 8, 8),
    (8, 8, 16),
    (8, 16, 16),
    (16, 16, 16),
)
_GRIDS = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))


def _slices() -> dict[str, TpuSlice]:
    out: dict[str, TpuSlice] = {}
    for generation, prefix, max_chips in (("v4", "v4", 2048), ("v5p", "v5p", 4096)):
        for a, b, c in _CUBES:
            chips = a * b * c
            if chips <= max_chips:
                # Two TensorCores per chip, fused into one megacore device.
                name = f"{generation}-{2 * chips}"
                out[name] = TpuSlice(name, generation, f"{prefix}:{a}x{b}x{c}", "megacore", (2, 2, 1))
    for generation in ("v5e", "v6e"):
        for a, b in _GRIDS:
            chips = a * b
            # Single-host slices hold all their chips on one host (1 or 8); larger ones 4 per host.
            per_host = (1, 1, 1) if chips == 1 else (2, 4, 1) if chips == 8 else (2, 2, 1)
            name = f"{generation}-{chips}"
            out[name] = TpuSlice(name, generation, f"{generation}:{a}x{b}", "default", per_host)
    return out


TPU_SLICES: dict[str, TpuSlice] = _slices()


def lookup_slice(name: str) -> TpuSlice:
    """The slice called `name` (e.g. "v4-128").

    Raises:
        ConfigError: an unknown name; the message lists the valid ones.
    """
    key = name.strip().lower()
    # Cloud TPU's own spellings of v5e/v6e slices.
    key = key.replace("v5litepod-", "v5e-").replace("v6e-lite-", "v6e-")
    if key in TPU_SLICES:
        return TPU_SLICES[key]
    raise ConfigError(f"Unknown --topology {name!r}. Valid TPU slices: {valid_slices_text()}.")


def valid_slices_text() -> str:
    """The valid slice names, grouped by generation."""
    groups: dict[str, list[str]] = {}
    for s in TPU_SLICES.values():
        groups.setdefault(s.generation, []).append(s.name)
    return "; ".join(", ".join(names) for names in groups.values())


# Set (to "1") where `quiet_absent_tpu` gave libtpu its variables, so a compile for a real slice
# (`prepare_libtpu`) knows it may replace them.
QUIETED_TPU = "EQUIPAX_QUIETED_LIBTPU"


def _has_tpu_chips(dev: Path = Path("/dev")) -> bool:
    """TPU VMs expose their chips as /dev/accel<N> (v4, v5e) or /dev/vfio/<N> (v5p, v6e)."""
    return any(dev.glob("accel*")) or any(p.name.isdigit() for p in (dev / "vfio").glob("*"))


def quiet_absent_tpu(environ: MutableMapping[str, str] | None = None, *, dev: Path = Path("/dev")) -> bool:
    """Keep libtpu quiet on a host without TPU chips; call before JAX starts.

    With JAX_PLATFORMS unset (or naming tpu) JAX loads libtpu, which on a host that is not a TPU
    VM looks for the VM's metadata, finds none and prints "Failed to find host bounds" and an
    INVALID_ARGUMENT trace on stderr before anything the user must read; it then finds no chip and
    JAX goes on with the other platforms. Where there is no chip and no TPU variable is set, this
    gives libtpu the variables that answer its question (as for a compile-only libtpu), so it
    finds no chip silently. A TPU VM (chips present, or its variables set) is left alone.

    Returns:
        Whether the variables were set.
    """
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and "tpu" not in platforms.split(","):
        return False  # libtpu is not loaded
    if any(env.get(v) for v in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID")):
        return False
    if _has_tpu_chips(dev):
        return False
    env.update(TPU_ACCELERATOR_TYPE="v4-8", TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0")
    env[QUIETED_TPU] = "1"
    return True


# libtpu's premapped host buffer for a job that restores nothing (libtpu's own default: 4 GiB).
NEW_JOB_BUFFER_BYTES = 2**30


def host_buffer_for_new_job(
    job_dir: Any, *, loads_weights: bool, environ: MutableMapping[str, str] | None = None, dev: Path = Path("/dev")
) -> str | None:
    """A 1-GiB premapped host buffer for libtpu where the job has nothing to put on the chip; call
    before JAX starts.

    libtpu pins `TPU_PREMAPPED_BUFFER_SIZE` bytes of host memory when it opens the chip (4 GiB by
    default), about 1.1 s per GiB on the TPU v5e's host. A new job initialises its state on the
    chip and copies its checkpoints off it in waves that fit the buffer
    (`equipax.launch.jobdir.host_transfer`), so a smaller one only shortens its start: c4_1b at 6
    layers opened the chip in 3.0-4.6 s instead of 6.3-9.9 s. A resume or an import of weights
    puts the whole state on the chip, which with 1 GiB took 12.6-16.7 s instead of 9.3-11.5 s
    (benchmarks/README.md, "twelfth session"), so those keep libtpu's default, as does a buffer the
    user set, and a host without TPU chips or whose `JAX_PLATFORMS` leaves the TPU out.

    Args:
        job_dir: the job directory; "new" means it holds no `checkpoints/` (one that cannot be
            read counts as holding them).
        loads_weights: the run starts from weights read from disk (`model.init_from`).

    Returns:
        The value set, or None where nothing was set.
    """
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS", "")
    if "TPU_PREMAPPED_BUFFER_SIZE" in env or loads_weights or (platforms and "tpu" not in platforms.split(",")):
        return None
    if not _has_tpu_chips(dev):
        return None
    try:
        if (job_dir / "checkpoints").exists():
            return None
    except OSError:
        return None
    env["TPU_PREMAPPED_BUFFER_SIZE"] = str(NEW_JOB_BUFFER_BYTES)
    return env["TPU_PREMAPPED_BUFFER_SIZE"]


def prepare_libtpu(accelerator_type: str) -> None:
    """Set libtpu up for compiling only, before it loads.

    On a host without TPUs, libtpu looks for the TPU VM's metadata (accelerator type, worker
    hostnames), finds none and prints harmless warnings; for an ahead-of-time compile the
    topology comes from `get_topology_desc`, so these values only answer that question. libtpu
    also takes a host-wide lock (/tmp/libtpu_lockfile) that guards the chips; a compile touches
    none, so two compiles (or a compile beside a training job on a TPU VM) may run at once.
    Variables already set (a real TPU VM) are left alone.
    """
    if os.environ.pop(QUIETED_TPU, None):  # set by quiet_absent_tpu: not a TPU VM
        for var in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"):
            os.environ.pop(var, None)
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_WORKER_ID", "0")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def libtpu_available() -> bool:
    """True if the libtpu wheel is installed (it ships XLA:TPU)."""
    try:
        import libtpu  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        return False
    return True


def topology_devices(tpu: TpuSlice, *, num_slices: int = 1) -> Sequence[Any]:
    """Compile-only devices of `num_slices` slices of type `tpu` (one per chip or megacore).

    Multi-slice devices carry `slice_index`, so `equipax.core.mesh.build_mesh` lays the DCN axes
    across slices.

    Raises:
        ConfigError: libtpu is not installed, or `num_slices` < 1.
    """
    if num_slices < 1:
        raise ConfigError(f"--slices must be >= 1; got {num_slices}.")
    if not libtpu_available():
        raise ConfigError(
            "--topology needs libtpu (XLA:TPU), which is not installed in this environment. "
            "`uv sync` installs it with the default dependency groups (or `uv sync --extra tpu`); "
            "libtpu has wheels for Linux x86_64 only."
        )
    prepare_libtpu(tpu.name)
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=tpu.topology,
        chip_config_name=tpu.chip_config,
        chips_per_host_bounds=tpu.chips_per_host,
        num_slices=num_slices,
    )
    return list(desc.devices)
