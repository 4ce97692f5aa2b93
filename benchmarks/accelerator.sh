#!/usr/bin/env bash
# The accelerator figures (benchmarks/README.md, "accelerator.sh"), on one GPU or TPU host, in under 8 minutes:
#   1. the device and its measured bf16 matmul peak;
#   2. tokens/s and MFU (PaLM definition: model FLOPs / datasheet peak; remat not counted) of the
#      ~1B LM train step (c4_1b on synthetic tokens, all local chips) in bf16 with the best
#      attention kernel (attention_impl=auto) under c4_1b's full remat and under remat=auto (the
#      cheapest policy whose compiled step fits the device), in bf16 with plain XLA attention, and in f32;
#   3. the attention kernels' speed (forward + backward, causal, bf16): xla vs the platform's
#      fused kernel (cuDNN on GPU, splash on TPU);
#   4. (GPU) both PGLE workflows of docs/pgle.md on a 4-layer, 1024-wide c4_1b: `launch pgle collect` writes a
#      non-empty profile.pb, a `train.pgle.mode=manual` run with it logs XLA's "Found profile" line, a
#      `train.pgle.mode=auto` run reports its recompile with the profile.
# Usage: from the repository root, `bash benchmarks/accelerator.sh [OUT_DIR]` after
# `uv sync --extra cuda` (GPU) or `uv sync --extra tpu` (TPU). Prints tables; writes OUT_DIR/*.json.
# Where the packages are installed without uv (an image with JAX already in it), set
# PY="python3" LAUNCH="python3 -m equipax.launch.cli" with the four packages' src/ on PYTHONPATH.
# PARTS picks the parts and their order (default 1234); RUNS the train-step variants of part 2.
# Not run in CI (no accelerator there): benchmarks/README.md, "Accelerator figures".
set -euo pipefail
OUT=${1:-runs/accelerator_bench}
mkdir -p "$OUT"
STEPS=${STEPS:-20}
EXP=${EXP:-c4_1b}    # EXP=c4_1b_smoke PARTS=2: a dry run of part 2 on a CPU
PARTS=${PARTS:-1234}
RUNS=${RUNS:-"bf16_auto bf16_remat_auto bf16_xla f32_xla"}
# EXTRA: more knobs for every part-2 run, e.g. the Llama-style 1B at c4_1b's batch shape:
#   EXP=llama3_2_1b EXTRA="data.seq_len=1024 data.per_device_batch=32" PARTS=2 bash benchmarks/accelerator.sh
EXTRA=${EXTRA:-}
PY=${PY:-uv run python}
LAUNCH=${LAUNCH:-uv run launch}
export PYTHONUNBUFFERED=1

part1() {
echo "== 1. device and bf16 matmul peak"
timeout 120 $PY - "$OUT" <<'EOF'
import json, sys, time
import jax, jax.numpy as jnp
d = jax.devices()[0]
print(f"{len(jax.devices())} x {d.device_kind} ({d.platform}), JAX {jax.__version__}")
n = 8192
a = jnp.ones((n, n), jnp.bfloat16); b = jnp.ones((n, n), jnp.bfloat16)
f = jax.jit(lambda a, b: a @ b)
f(a, b).block_until_ready()
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(10):
        c = f(a, b)
    c.block_until_ready()
    best = min(best, (time.perf_counter() - t0) / 10)
tflops = 2 * n**3 / best / 1e12
print(f"bf16 matmul {n}x{n}: {tflops:.1f} TFLOP/s per device (best of 5 x 10)")
json.dump({"device_kind": d.device_kind, "platform": d.platform, "devices": len(jax.devices()),
           "bf16_matmul_tflops": tflops}, open(f"{sys.argv[1]}/device.json", "w"), indent=2)
EOF
}

part2() {
echo "== 2. $EXP train step (synthetic tokens, ${STEPS} steps; the last logged step is reported)"
run() {  # name, then extra --set knobs
  local name=$1; shift
  local sets=(--set data.source=synthetic --set data.packing=False --set "mesh.ici_mesh_shape=(1,-1,1)" --set train.num_steps="$STEPS"
              --set train.log_every=5 --set train.eval_every=100000 --set train.checkpoint_every=100000
              --set train.sample.tokens=0 --set model.transformer.atten_logit_cap=None)
  for s in "$@" $EXTRA; do sets+=(--set "$s"); done
  rm -rf "$OUT/$name"
  timeout "${RUN_TIMEOUT:-150}" $LAUNCH run --exp "$EXP" --job-log-dir "$OUT/$name" "${sets[@]}" > "$OUT/$name.log" 2>&1 \
    || echo "$name: failed (see $OUT/$name.log)"
  tail -3 "$OUT/$name.log"
  rm -rf "$OUT/$name/checkpoints"  # ~16 GB of c4_1b state per run: three would fill a small disk
}
# bf16_auto runs c4_1b's own remat (full: Pax's SAVE_NOTHING); bf16_remat_auto the cheapest
# policy whose compiled step fits this device (docs/compile.md, "Choosing remat by compiling").
declare -A VARIANT=([bf16_auto]="model.dtype=bfloat16 model.transformer.attention_impl=auto"
                     [bf16_remat_auto]="model.dtype=bfloat16 model.transformer.attention_impl=auto model.transformer.remat=auto"
                     [bf16_xla]="model.dtype=bfloat16 model.transformer.attention_impl=xla"
                     [f32_xla]="model.dtype=float32 model.transformer.attention_impl=xla")
for name in $RUNS; do
  # shellcheck disable=SC2086  # the variant's knobs are separate words
  run "$name" ${VARIANT[$name]}
done
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); rows = {}
print(f"{'run':<16} {'remat':<22} {'step s':>8} {'tokens/s':>12} {'TFLOP/s/dev':>12} {'MFU':>7}")
for name in ("bf16_auto", "bf16_remat_auto", "bf16_xla", "f32_xla"):
    path = out / name / "metrics.jsonl"
    train = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == "train"] if path.exists() else []
    if not train:
        print(f"{name:<16} (no train records)"); continue
    cfg = out / name / "config.json"  # the policy the run used (remat=auto: the one it chose)
    remat = json.loads(cfg.read_text())["model"]["transformer"]["remat"] if cfg.exists() else "?"
    r = rows[name] = {**train[-1], "remat": remat}
    print(f"{name:<16} {remat:<22} {r['step_time_s']:>8.3f} {r['tokens_per_s']:>12,.0f} "
          f"{r.get('tflops_per_s_per_device', 0):>12.1f} {r.get('mfu', float('nan')):>7.1%}")
json.dump(rows, open(out / "train_step.json", "w"), indent=2)
EOF
}

part3() {
echo "== 3. attention kernels: causal, bf16, batch 8, 16 heads x 128, forward + backward"
timeout 150 $PY - "$OUT" <<'EOF'
import json, sys, time
import jax, jax.numpy as jnp, jax.random as jr
from equipax.core.nn.attention import softmax_attention
from equipax.core.nn.fused_attention import mesh_platform
fused = {"gpu": "cudnn", "tpu": "splash"}.get(mesh_platform(None))
impls = ["xla"] + ([fused] if fused else [])
rows = []
print(f"{'seq':>6} " + " ".join(f"{i + ' ms':>12}" for i in impls) + "   speed-up")
for seq in (1024, 2048, 4096, 8192):
    q, k, v = (jr.normal(kk, (8, seq, 16, 128), jnp.bfloat16) for kk in jr.split(jr.key(0), 3))
    times = {}
    for impl in impls:
        loss = lambda q, k, v: jnp.sum(softmax_attention(q, k, v, causal=True, impl=impl).astype(jnp.float32))
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        try:
            jax.block_until_ready(f(q, k, v))
            t0 = time.perf_counter()
            for _ in range(10):
                res = f(q, k, v)
            jax.block_until_ready(res)
            times[impl] = (time.perf_counter() - t0) / 10 * 1e3
        except Exception as e:  # out of memory at long sequences for xla: report, go on
            times[impl] = None; print(f"  {impl} at {seq}: {type(e).__name__}: {str(e)[:120]}")
    fmt = lambda t: f"{t:>12.2f}" if t is not None else f"{'-':>12}"
    x, y = times.get("xla"), times.get(fused) if fused else None
    print(f"{seq:>6} " + " ".join(fmt(times[i]) for i in impls) + (f"   {x / y:.2f}x" if x and y else ""))
    rows.append({"seq": seq, **{f"{i}_ms": times[i] for i in impls}})
json.dump(rows, open(f"{sys.argv[1]}/attention.json", "w"), indent=2)
EOF
}

part4() {
echo "== 4. PGLE on a 4-layer, 1024-wide $EXP (synthetic tokens): manual (collect, then a run with the profile) and automatic"
local sets=(--set data.source=synthetic --set data.packing=False --set "mesh.ici_mesh_shape=(1,-1,1)"
            --set model.transformer.num_layers=4 --set model.transformer.model_dims=1024 --set model.transformer.num_heads=8
            --set model.transformer.hidden_dims=4096 --set train.sample.tokens=0 --set train.log_every=1
            --set train.eval_every=100000 --set train.checkpoint_every=100000 --set model.dtype=bfloat16)
rm -rf "$OUT/pgle_collect" "$OUT/pgle_manual" "$OUT/pgle_auto"
timeout 150 $LAUNCH pgle collect --exp "$EXP" --warmup 2 --steps 3 --job-log-dir "$OUT/pgle_collect" "${sets[@]}" \
  > "$OUT/pgle_collect.log" 2>&1 || echo "pgle collect: failed (see $OUT/pgle_collect.log)"
tail -3 "$OUT/pgle_collect.log"
if [[ -s $OUT/pgle_collect/profile.pb ]]; then
  echo "profile.pb: $(stat -c %s "$OUT/pgle_collect/profile.pb") bytes"
  # XLA logs the profile's use at INFO level, which JAX hides unless TF_CPP_MIN_LOG_LEVEL=0.
  TF_CPP_MIN_LOG_LEVEL=0 timeout 150 $LAUNCH run --exp "$EXP" --job-log-dir "$OUT/pgle_manual" "${sets[@]}" \
    --set train.num_steps=6 --set train.pgle.mode=manual --set "train.pgle.profile_path=$OUT/pgle_collect/profile.pb" \
    > "$OUT/pgle_manual.log" 2>&1 || echo "pgle manual run: failed (see $OUT/pgle_manual.log)"
  # JAX 0.11.2's XLA: "Found profile for module jit_train_step, using profile guided latency estimator",
  # then warnings "Found N instructions from the profile" / "Missing M" when some are not in it.
  echo "manual: $(grep -c 'Found profile for module .*using profile guided latency estimator' "$OUT/pgle_manual.log" || true) modules used the profile; the train step:"
  grep -A2 'Found profile for module jit_train_step' "$OUT/pgle_manual.log" | sed 's/^.*\] /  /' || echo "  (no line for jit_train_step)"
else
  echo "profile.pb: missing or empty"
fi
timeout 150 $LAUNCH run --exp "$EXP" --job-log-dir "$OUT/pgle_auto" "${sets[@]}" \
  --set train.num_steps=8 --set train.pgle.mode=auto --set train.pgle.profiling_runs=2 \
  > "$OUT/pgle_auto.log" 2>&1 || echo "pgle auto run: failed (see $OUT/pgle_auto.log)"
echo "auto: $(grep -h 'recompiled with its PGLE profile' "$OUT/pgle_auto.log" || echo 'no recompile reported')"
[[ -f $OUT/pgle_auto/metrics.jsonl ]] && $PY -c "import json, sys; print('auto: step times', [(r['step'], round(r['step_time_s'], 4)) for r in map(json.loads, open(sys.argv[1])) if r.get('split') == 'train'])" "$OUT/pgle_auto/metrics.jsonl"
}

for (( i = 0; i < ${#PARTS}; i++ )); do
  "part${PARTS:i:1}"
done
echo "Wrote the parts' JSON and logs under $OUT"
