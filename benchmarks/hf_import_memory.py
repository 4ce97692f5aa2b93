"""Peak host memory of a sharded Hugging Face import: each process holds its own shards only.

Writes a synthetic Llama checkpoint (random float32 weights, `--layers` layers of width
`--hidden`, sharded into files of one layer each), then loads it with
`equipax.models.hf.weights.load_lm`:

- `single`: one process, the whole model on its one device;
- `sharded`: `--processes` processes started with `jax.distributed` on localhost, 2 CPU devices
  each, the model FSDP-sharded over all of them (each array split over the embedding axis).

Each loader reports its peak resident memory during the load (Linux `VmHWM`, reset through
`/proc/self/clear_refs` just before) above its resident memory then, and the bytes of the shards
its devices hold.

    uv run python benchmarks/hf_import_memory.py --out runs/bench/hf_import_memory.json
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

LOADER = r"""
import json, os, sys
import jax
n, pid, port, directory = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if n > 1:
    jax.distributed.initialize(f"localhost:{port}", num_processes=n, process_id=pid)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from equipax.models.hf.config import lm_config_from_hf, read_hf_config
from equipax.models.hf.weights import load_lm, model_maps
cfg = lm_config_from_hf(read_hf_config(directory))
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
def spec(shape):  # split the largest axis that divides over all devices
    axes = [a for a in sorted(range(len(shape)), key=lambda a: -shape[a]) if shape[a] % mesh.size == 0]
    return P(*[("fsdp" if a == axes[0] else None) for a in range(len(shape))]) if axes else P()
shapes = [m.shape for m in model_maps(cfg).values()]
import equinox as eqx
from equipax.models.lm import TransformerLM
abstract = eqx.filter_eval_shape(lambda: TransformerLM(cfg, key=jax.random.key(0)))
leaves = jax.tree.leaves(eqx.filter(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct)))
shardings = [NamedSharding(mesh, spec(leaf.shape)) for leaf in leaves]
def status(key):  # kB -> bytes
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
before = status("VmRSS")
model = load_lm(directory, cfg, shardings)
jax.block_until_ready(jax.tree.leaves(model))
peak = status("VmHWM")
held = sum(s.data.nbytes for a in jax.tree.leaves(model) for s in a.addressable_shards)
print(json.dumps({"process": pid, "peak_above_start_bytes": peak - before, "shards_held_bytes": held}))
"""


def write_checkpoint(directory: Path, hidden: int, layers: int) -> int:
    import numpy as np

    from equipax.models.hf.weights import write_hf_weights

    cfg = {
        "model_type": "llama",
        "vocab_size": 4096,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "head_dim": 64,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    (directory / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)

    def tensors():
        d, f = hidden, 4 * hidden
        yield "model.embed_tokens.weight", rng.standard_normal((4096, d), np.float32)
        for i in range(layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", np.ones(d, np.float32)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield p + f"self_attn.{name}.weight", rng.standard_normal((d, d), np.float32) / d**0.5
            yield p + "post_attention_layernorm.weight", np.ones(d, np.float32)
            yield p + "mlp.gate_proj.weight", rng.standard_normal((f, d), np.float32) / d**0.5
            yield p + "mlp.up_proj.weight", rng.standard_normal((f, d), np.float32) / d**0.5
            yield p + "mlp.down_proj.weight", rng.standard_normal((d, f), np.float32) / f**0.5
        yield "model.norm.weight", np.ones(d, np.float32)
        yield "lm_head.weight", rng.standard_normal((4096, d), np.float32) / d**0.5

    layer_bytes = 12 * hidden * hidden * 4
    write_hf_weights(directory, tensors(), shard_bytes=layer_bytes)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def run(processes: int, directory: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1" if processes == 1 else "2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOADER, str(processes), str(i), str(port), str(directory)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        assert p.returncode == 0, stdout
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        size = write_checkpoint(directory, args.hidden, args.layers)
        result = {"checkpoint_bytes": size, "single": run(1, directory), "sharded": run(args.processes, directory)}
    worst = max(r["peak_above_start_bytes"] for r in result["sharded"])
    result["sharded_peak_over_checkpoint"] = worst / size
    result["single_peak_over_checkpoint"] = result["single"][0]["peak_above_start_bytes"] / size
    print(f"checkpoint {size / 2**20:.0f} MiB")
    print(f"single process: peak +{result['single'][0]['peak_above_start_bytes'] / 2**20:.0f} MiB")
    for r in result["sharded"]:
        print(
            f"process {r['process']} of {args.processes}: peak +{r['peak_above_start_bytes'] / 2**20:.0f} MiB, "
            f"holds {r['shards_held_bytes'] / 2**20:.0f} MiB of shards"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
