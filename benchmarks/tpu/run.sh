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
#   speed      equipax's train step against a hand-written plain-JAX step of the same model on the
#              chip (benchmarks/train_step.py --compare: tokens/s, MFU, ratio)
#   profile    a jax.profiler trace of both steps and their per-op device time (op_profile.py)
#   peak       the chip's bf16 matmul peak (benchmarks/accelerator.sh, part 1)
#   attention  the attention kernels: XLA against splash (accelerator.sh, part 3)
#   decode     `launch decode` tokens/s against a plain-JAX KV-cache loop of the same model, batch 1
#              and 8 (benchmarks/decode_reference.py: c4_1b at 6 layers, bf16, 128 new tokens;
#              decode.json)
#   moe        the MoE train step, dropless (ragged_dot) against capacity dispatch, at expert
#              parallelism 1 (benchmarks/moe_dispatch.py --real-devices: tokens/s, MFU; moe.json)
#   ring       ring attention on one chip, where the context axis can only be 1
#              (benchmarks/ring_one_chip.py: the train step's program and time with the ring
#              strategy, the ring kernels' forward + backward against XLA's and splash; ring.json)
# Default parts: usage speed. USAGE_ARGS, SPEED_ARGS, PROFILE_ARGS, DECODE_ARGS, MOE_ARGS and
# RING_ARGS replace a part's arguments (its JSON goes to --out regardless); PART_TIMEOUT=S stops a
# part after S seconds (the rest still run); PY the interpreter (default python3). --source
# imports equipax from packages/*/src instead of its wheels (a developer's edit, without building
# wheels again). ALLOW_CPU=1 runs on a host without a TPU (a dry run; tests/repo/test_wheels.py
# runs `check` so; toy-size arguments for decode, moe and ring: benchmarks/README.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.whl-tpu
OUT=runs/tpu
SOURCE=0
PARTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --source) SOURCE=1; shift ;;
        -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
        check|usage|speed|profile|peak|attention|decode|moe|ring) PARTS+=("$1"); shift ;;
        *) echo "run.sh: unknown argument '$1' (parts: check usage speed profile peak attention decode moe ring; options: --wheels DIR --out DIR --source)" >&2; exit 2 ;;
    esac
done
[ ${#PARTS[@]} -gt 0 ] || PARTS=(usage speed)
PY=${PY:-python3}
TARGET=${TARGET:-/tmp/equipax-site}
export PYTHONUNBUFFERED=1
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "run.sh: no wheels in '$WHEELS'. Make them on a machine with network first: bash benchmarks/tpu/wheels.sh $WHEELS" >&2
    exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

echo "== install: the wheels in $WHEELS into $TARGET (appended to PYTHONPATH; nothing of the image's replaced)"
wheels=("$WHEELS"/*.whl)
if [ "$SOURCE" = 1 ]; then
    wheels=()
    for w in "$WHEELS"/*.whl; do case "$(basename "$w")" in equipax_*) ;; *) wheels+=("$w") ;; esac; done
fi
if [ ${#wheels[@]} -gt 0 ]; then
    if "$PY" -m pip --version >/dev/null 2>&1; then
        # (PIP_CONFIG_FILE=/dev/null and --isolated: no pip.conf or PIP_* variable of the host's may
        # point pip at an index or change where it installs.)
        PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated --quiet --no-index --no-deps --no-compile \
            --no-cache-dir --disable-pip-version-check --upgrade --target "$TARGET" "${wheels[@]}"
    elif command -v uv >/dev/null 2>&1; then
        uv pip install --quiet --offline --no-index --no-deps --python "$PY" --target "$TARGET" "${wheels[@]}"
    else
        echo "run.sh: $PY has no pip, and there is no uv to install with" >&2; false
    fi || { echo "run.sh: installing the wheels failed" >&2; exit 1; }
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$TARGET"
if [ "$SOURCE" = 1 ]; then
    src=$(pwd)/packages
    export PYTHONPATH="$src/core/src:$src/models/src:$src/data/src:$src/launch/src:$PYTHONPATH"
fi

echo "== check: Python, JAX and the devices"
"$PY" - "$OUT" "$TARGET" <<'EOF' || exit $?
import json, os, platform, sys
import jax, jaxlib
out, target = sys.argv[1], os.path.realpath(sys.argv[2])
import equipax.launch.cli  # noqa: F401  (the install is whole)
shadowed = [m.__name__ for m in (jax, jaxlib) if os.path.realpath(m.__file__).startswith(target)]
try:
    import libtpu
    libtpu_version = getattr(libtpu, "__version__", "?")
except ImportError:
    libtpu_version = None
devices = jax.devices()
info = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "libtpu": libtpu_version, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "devices": len(devices), "glibc": "-".join(platform.libc_ver()), "jax_from": os.path.dirname(jax.__file__)}
print(json.dumps(info, indent=2))
json.dump(info, open(os.path.join(out, "environment.json"), "w"), indent=2)
if shadowed:
    sys.exit(f"run.sh: {shadowed} came from {target}, not the image: a wheel of JAX was in the wheels folder.")
if devices[0].platform != "tpu" and os.environ.get("ALLOW_CPU") != "1":
    sys.exit(f"run.sh: jax.devices() is {devices[0].platform} ({devices[0].device_kind}), not a TPU. "
             "On a TPU host, check that nothing else holds the chip and that JAX_PLATFORMS is unset or "
             "names tpu; ALLOW_CPU=1 runs the script on a CPU anyway (a dry run).")
EOF

LAUNCH="$PY -m equipax.launch.cli"
# A part's defaults on one chip (each about 2 minutes, compiles included; benchmarks/README.md).
DECODE_DEFAULT="--exps c4_1b_6l --batch-sizes 1,8 --batches 4 --new-tokens 128"
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
    case "$part" in
        check) true ;;
        usage) "${limit[@]}" "$PY" benchmarks/tpu/usage.py --out "$OUT/usage" ${USAGE_ARGS:-} ;;
        speed) "${limit[@]}" "$PY" benchmarks/train_step.py --compare ${SPEED_ARGS:---presets c4_1b_6l,llama_1b --steps 10 --warmup 3} --out "$OUT/speed.json" ;;
        profile) "${limit[@]}" "$PY" benchmarks/train_step.py --compare ${PROFILE_ARGS:---presets c4_1b_6l --steps 3 --warmup 2} --profile "$OUT/profile" --out "$OUT/profile.json" ;;
        peak) PY="$PY" LAUNCH="$LAUNCH" PARTS=1 "${limit[@]}" bash benchmarks/accelerator.sh "$OUT/accelerator" ;;
        attention) PY="$PY" LAUNCH="$LAUNCH" PARTS=3 "${limit[@]}" bash benchmarks/accelerator.sh "$OUT/accelerator" ;;
        decode) "${limit[@]}" "$PY" benchmarks/decode_reference.py ${DECODE_ARGS:-$DECODE_DEFAULT} --out "$OUT/decode.json" ;;
        moe) "${limit[@]}" "$PY" benchmarks/moe_dispatch.py --real-devices ${MOE_ARGS:-$MOE_DEFAULT} --out "$OUT/moe.json" ;;
        ring) "${limit[@]}" "$PY" benchmarks/ring_one_chip.py ${RING_ARGS:-$RING_DEFAULT} --out "$OUT/ring.json" ;;
    esac > >(tee "$OUT/$part.log") 2>&1
    rc=$?
    summary+=("$part: $([ $rc = 0 ] && echo ok || echo "failed (exit $rc)") in $(( $(date +%s) - start )) s")
    [ $rc = 0 ] || status=1
done
echo "== summary (results in $OUT)"
printf '  %s\n' "${summary[@]}"
exit $status
