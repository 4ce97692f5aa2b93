#!/usr/bin/env bash
# equipax on a TPU host whose JAX is preinstalled (a Cloud TPU VM image, a container), offline.
# The one script a developer or a user runs there (docs/library.md, "A machine with JAX
# preinstalled"; the figures it made: benchmarks/README.md, "On a real TPU"):
#
#   bash benchmarks/tpu/run.sh [--wheels DIR] [--out DIR] [--source] [PART ...]
#
# It installs the wheels that benchmarks/tpu/wheels.sh made on a networked machine (default
# .whl-tpu/) into a folder of its own (TARGET, default /tmp/equipax-site) added at the end of
# PYTHONPATH, so the image's jax, jaxlib and libtpu stay the ones imported (none is among the
# wheels; pip, or uv where the interpreter has no pip, runs with --no-deps and --no-index: it never
# fetches, upgrades or replaces anything), checks that `jax` comes from the image and that
# `jax.devices()` is a TPU, and runs the parts asked for, each writing into one results folder
# (default runs/tpu/):
#   check      only the install and those checks (what every other part starts with)
#   usage      what a user does (benchmarks/tpu/usage.py): the default `launch run` trains; a
#              checkpointed run stopped with SIGTERM resumes bit for bit; `launch decode` and
#              `launch eval` of the job; `launch compile --topology v5e-8` on the host's CPU
#   runs       `launch run` of experiments as a user runs them, at their defaults cut to one chip
#              (benchmarks/tpu/user_runs.py: c4_1b at 6 layers as written and at its best settings,
#              qwen3_0_6b, llama3_2_1b at 6 layers; 20 steps each: time to first step by phase,
#              tokens/s and MFU of the last logged step, wall time; runs/runs.json)
#   speed      equipax's train step against a hand-written plain-JAX step of the same model on the
#              chip (benchmarks/train_step.py --compare: tokens/s, MFU, ratio)
#   profile    a jax.profiler trace of both steps and their per-op device time (op_profile.py)
#   peak       the chip's bf16 matmul peak (benchmarks/accelerator.sh, part 1)
#   attention  the attention kernels: XLA against splash (accelerator.sh, part 3)
#   decode     `launch decode` tokens/s against a plain-JAX KV-cache loop of the same model, batch 1,
#              8 and 32, and prefill alone on 512-token prompts (benchmarks/decode_reference.py:
#              c4_1b at 6 layers, bf16, 128 new tokens; decode.json)
#   moe        the MoE train step, dropless (ragged_dot) against capacity dispatch, at expert
#              parallelism 1 (benchmarks/moe_dispatch.py --real-devices: tokens/s, MFU; moe.json)
#   ring       ring attention on one chip, where the context axis can only be 1
#              (benchmarks/ring_one_chip.py: the train step's program and time with the ring
#              strategy, the ring kernels' forward + backward against XLA's and splash; ring.json)
# Default parts: usage speed. USAGE_ARGS, RUNS_ARGS, SPEED_ARGS, PROFILE_ARGS, DECODE_ARGS, MOE_ARGS and
# RING_ARGS replace a part's arguments (its JSON goes to --out regardless); PART_TIMEOUT=S stops a
# part after S seconds (the rest still run); PY the interpreter (default: the first of python3,
# python3.11, python3.12 and python3.13 that imports JAX: pyenv may make plain python3 follow the
# checkout's .python-version). --source imports equipax from packages/*/src instead of its wheels (a
# developer's edit, without building wheels again). ALLOW_CPU=1 runs on a host without a TPU (a dry run; tests/repo/test_wheels.py
# runs `check` so; toy-size arguments for decode, moe and ring: benchmarks/README.md).
# --wheels, --out and TARGET are read from the directory you run it in (the defaults are in the
# checkout). Before installing it checks the wheels folder against wheels.sh's list (needs.txt: every
# wheel it names there, and equipax's four, each a whole zip file; no wheel of JAX) and refuses a
# folder that fails, naming wheels.sh. TARGET is emptied first when run.sh made it (its marker file
# .equipax-run.sh); a TARGET with files but no marker is refused, never emptied. Every refusal and
# every failed step (a --out it cannot write, no PY, no usable TPU, a read-only TARGET, a full disk)
# stops it with one paragraph, exit 2; a part that fails is reported and the rest run (exit 1).
set -Eeuo pipefail
die() {
    printf 'run.sh: %s\n' "$*" >&2
    exit 2
}
trap 'rc=$?; echo "run.sh: stopped: \`$BASH_COMMAND\` failed (exit $rc, line $LINENO); its message is above." >&2; exit $rc' ERR
USAGE="bash benchmarks/tpu/run.sh [--wheels DIR] [--out DIR] [--source] [PART ...] (parts: check usage runs speed profile peak attention decode moe ring; --help: what each does)"
CALLER=$(pwd)
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
# A path as given on the command line: from the caller's directory, not the checkout.
from_caller() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$CALLER" "$1" ;; esac; }
WHEELS=$ROOT/.whl-tpu
OUT=$ROOT/runs/tpu
SOURCE=0
PARTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels|--out)
            { [ $# -ge 2 ] && [ -n "$2" ] && [[ $2 != -* ]]; } || die "$1 needs a folder after it. Usage: $USAGE"
            if [ "$1" = --wheels ]; then WHEELS=$(from_caller "$2"); else OUT=$(from_caller "$2"); fi
            shift 2 ;;
        --wheels=?*) WHEELS=$(from_caller "${1#*=}"); shift ;;
        --out=?*) OUT=$(from_caller "${1#*=}"); shift ;;
        --wheels=|--out=) die "${1%=} needs a folder after it. Usage: $USAGE" ;;
        --source) SOURCE=1; shift ;;
        -h|--help) sed -n '2,/^set -Eeuo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        check|usage|runs|speed|profile|peak|attention|decode|moe|ring) PARTS+=("$1"); shift ;;
        *) echo "run.sh: unknown argument '$1' (parts: check usage runs speed profile peak attention decode moe ring; options: --wheels DIR --out DIR --source)" >&2; exit 2 ;;
    esac
done
[ ${#PARTS[@]} -gt 0 ] || PARTS=(usage speed)
if [ -z "${PY:-}" ]; then
    # The Python that imports the image's JAX (jaxlib is built for one version): plain python3 may be
    # another (pyenv follows the checkout's .python-version, the workspace's default for uv).
    for cand in python3 python3.11 python3.12 python3.13; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import jax, jaxlib' >/dev/null 2>&1; then
            PY=$("$cand" -c 'import sys; print(sys.executable)')
            break
        fi
    done
    [ -n "${PY:-}" ] || PY=python3  # none imports JAX: the check below says so, naming it
fi
case "$PY" in */*) PY=$(from_caller "$PY") ;; esac  # a path, from the caller's directory; a name, from PATH
TARGET=$(from_caller "${TARGET:-/tmp/equipax-site}")
export PYTHONUNBUFFERED=1
command -v "$PY" >/dev/null 2>&1 ||
    die "the interpreter PY='$PY' was not found. Set PY to the Python that has the image's JAX (e.g. PY=/usr/bin/python3)."

# The folder: complete, as wheels.sh made it, and without JAX (before anything is written).
listed=$("$PY" benchmarks/tpu/wheel_folder.py "$WHEELS") || exit $?  # (its message is the paragraph)
mapfile -t wheels <<< "$listed"
for inside in "$OUT" "$WHEELS"; do
    case "$(realpath -m "$inside")/" in "$(realpath -m "$TARGET")"/*)
        die "'$inside' is inside TARGET='$TARGET', which run.sh empties on each run. Set TARGET to a folder of its own (default /tmp/equipax-site)." ;;
    esac
done

mkdir -p "$OUT" 2>/dev/null && [ -w "$OUT" ] ||
    die "cannot write the results folder --out '$OUT' (a parent is a file, or it is not writable). Give a folder you can write."
OUT=$(cd "$OUT" && pwd -P)

# TARGET: new, empty, or made by run.sh (its marker), emptied so nothing of an earlier install stays.
MARK=.equipax-run.sh
if [ -e "$TARGET" ] || [ -L "$TARGET" ]; then
    [ -d "$TARGET" ] || die "TARGET='$TARGET' is not a folder. Set TARGET to a new folder (default /tmp/equipax-site)."
    if [ -e "$TARGET/$MARK" ]; then
        find "$TARGET" -mindepth 1 -maxdepth 1 -exec rm -rf {} + 2>/dev/null ||
            die "cannot empty TARGET='$TARGET', which an earlier run.sh installed into (read-only, or not yours?). Set TARGET to a folder you can write."
    elif [ -n "$(ls -A "$TARGET")" ]; then
        die "TARGET='$TARGET' holds files run.sh did not put there (no $MARK in it); nothing was changed. Set TARGET to a new or empty folder, or remove that one yourself."
    fi
fi
{ mkdir -p "$TARGET" && : > "$TARGET/$MARK"; } 2>/dev/null ||
    die "cannot write TARGET='$TARGET' (read-only, not yours, or a full disk). Set TARGET to a folder you can write (default /tmp/equipax-site)."

echo "== install: the wheels in $WHEELS into $TARGET (appended to PYTHONPATH; nothing of the image's replaced)"
if [ "$SOURCE" = 1 ]; then
    kept=()
    for w in "${wheels[@]}"; do case "$(basename "$w")" in equipax_*) ;; *) kept+=("$w") ;; esac; done
    wheels=("${kept[@]}")
fi
if [ ${#wheels[@]} -gt 0 ]; then
    if "$PY" -m pip --version >/dev/null 2>&1; then
        # (PIP_CONFIG_FILE=/dev/null and --isolated: no pip.conf or PIP_* variable of the host's may
        # point pip at an index or change where it installs.)
        PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated --quiet --no-index --no-deps --no-compile \
            --no-cache-dir --disable-pip-version-check --upgrade --target "$TARGET" "${wheels[@]}"
    elif command -v uv >/dev/null 2>&1; then
        uv pip install --no-config --quiet --offline --no-index --no-deps --python "$PY" --target "$TARGET" "${wheels[@]}"
    else
        die "$PY has no pip, and there is no uv to install with: install pip for it (or put uv on PATH)."
    fi || die "installing the wheels into TARGET='$TARGET' failed (the message above): if it says 'No space left on device' or 'Read-only file system' or 'Permission denied', free space there or set TARGET to another folder. Nothing of the image's was changed."
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$TARGET"
if [ "$SOURCE" = 1 ]; then
    src=$(pwd)/packages
    export PYTHONPATH="$src/core/src:$src/models/src:$src/data/src:$src/launch/src:$PYTHONPATH"
fi

echo "== check: Python, JAX and the devices"
"$PY" - "$OUT" "$TARGET" <<'EOF' || exit $?
import json, os, platform, sys

def refuse(text):  # one paragraph, exit 2 (the script's other refusals)
    print(f"run.sh: {text}", file=sys.stderr)
    sys.exit(2)

try:
    import jax, jaxlib
except ImportError as e:
    refuse(f"{sys.executable} cannot import JAX ({e}). This script is for a host whose JAX is preinstalled: "
           "set PY to the interpreter that has it.")
out, target = sys.argv[1], os.path.realpath(sys.argv[2])
shadowed = [m.__name__ for m in (jax, jaxlib) if os.path.realpath(m.__file__).startswith(target)]
if shadowed:
    refuse(f"{shadowed} came from {target}, not the image: a wheel of JAX was installed there. Remove it "
           "from the wheels folder (wheels.sh never downloads one) and run again.")
try:
    import equipax.launch.cli  # noqa: F401  (the install is whole)
except ImportError as e:
    refuse(f"equipax does not import from {target} ({type(e).__name__}: {e}): the wheels folder lacks a "
           "package it needs (one the image was assumed to have: wheels.sh's IMAGE_HAS), or was made for "
           "another Python (wheels.sh's PYTHON_VERSION). Make it again with bash benchmarks/tpu/wheels.sh.")
try:
    import libtpu
    libtpu_version = getattr(libtpu, "__version__", "?")
except ImportError:
    libtpu_version = None
try:
    devices = jax.devices()
except RuntimeError as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    refuse(f"JAX could not start its devices with JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '(unset)')!r} "
           f"({first}). On a TPU host, check that no other process holds the chip (one program at a time) "
           "and that the image's libtpu is there; elsewhere, JAX_PLATFORMS=cpu ALLOW_CPU=1 runs the script "
           "on the CPU (a dry run).")
info = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "libtpu": libtpu_version, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "devices": len(devices), "glibc": "-".join(platform.libc_ver()), "jax_from": os.path.dirname(jax.__file__)}
print(json.dumps(info, indent=2))
with open(os.path.join(out, "environment.json"), "w") as f:
    json.dump(info, f, indent=2)
if devices[0].platform != "tpu" and os.environ.get("ALLOW_CPU") != "1":
    refuse(f"jax.devices() is {devices[0].platform} ({devices[0].device_kind}), not a TPU. "
           "On a TPU host, check that nothing else holds the chip and that JAX_PLATFORMS is unset or "
           "names tpu; ALLOW_CPU=1 runs the script on a CPU anyway (a dry run).")
EOF

LAUNCH="$PY -m equipax.launch.cli"
# A part's defaults on one chip (each about 2 minutes, compiles included; benchmarks/README.md).
DECODE_DEFAULT="--exps c4_1b_6l --batch-sizes 1,8,32 --batches 4 --new-tokens 128 --prefill-len 512"
MOE_DEFAULT="--devices 1 --ep 1 --dtype bfloat16 --model-dims 1024 --hidden-dims 3584 --layers 4 --heads 8 \
--kv-heads 2 --head-dim 128 --vocab 32000 --remat none --seq 1024 --per-device-batch 4 --parallel-compile \
--rounds 1 --steps 10 --warmup 2"
RING_DEFAULT="--exp llama3_2_1b --layers 4 --vocab 32000 --seq 8192 --kernel-seqs 4096,8192 --steps 10"
limit=()
[ -n "${PART_TIMEOUT:-}" ] && limit=(timeout -k 10 "$PART_TIMEOUT")
status=0
summary=()
for part in "${PARTS[@]}"; do
    echo "== $part (log: $OUT/$part.log)"
    start=$(date +%s)
    rc=0
    case "$part" in
        check) true ;;
        usage) "${limit[@]}" "$PY" benchmarks/tpu/usage.py --out "$OUT/usage" ${USAGE_ARGS:-} ;;
        runs) "${limit[@]}" "$PY" benchmarks/tpu/user_runs.py --out "$OUT/runs" ${RUNS_ARGS:-} ;;
        speed) "${limit[@]}" "$PY" benchmarks/train_step.py --compare ${SPEED_ARGS:---presets c4_1b_6l,llama_1b --steps 10 --warmup 3} --out "$OUT/speed.json" ;;
        profile) "${limit[@]}" "$PY" benchmarks/train_step.py --compare ${PROFILE_ARGS:---presets c4_1b_6l --steps 3 --warmup 2} --profile "$OUT/profile" --out "$OUT/profile.json" ;;
        peak) PY="$PY" LAUNCH="$LAUNCH" PARTS=1 "${limit[@]}" bash benchmarks/accelerator.sh "$OUT/accelerator" ;;
        attention) PY="$PY" LAUNCH="$LAUNCH" PARTS=3 "${limit[@]}" bash benchmarks/accelerator.sh "$OUT/accelerator" ;;
        decode) "${limit[@]}" "$PY" benchmarks/decode_reference.py ${DECODE_ARGS:-$DECODE_DEFAULT} --out "$OUT/decode.json" ;;
        moe) "${limit[@]}" "$PY" benchmarks/moe_dispatch.py --real-devices ${MOE_ARGS:-$MOE_DEFAULT} --out "$OUT/moe.json" ;;
        ring) "${limit[@]}" "$PY" benchmarks/ring_one_chip.py ${RING_ARGS:-$RING_DEFAULT} --out "$OUT/ring.json" ;;
    esac > >(tee "$OUT/$part.log") 2>&1 || rc=$?
    summary+=("$part: $([ $rc = 0 ] && echo ok || echo "failed (exit $rc)") in $(( $(date +%s) - start )) s")
    [ $rc = 0 ] || status=1
done
echo "== summary (results in $OUT)"
printf '  %s\n' "${summary[@]}"
exit $status
