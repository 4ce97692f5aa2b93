"""Load MaxText configs with MaxText's own loader (`maxtext.configs.pyconfig`): does it accept them?

Runs in a throwaway environment that has the unpacked MaxText wheel, not in equipax's (equipax
never imports MaxText). docs/maxtext.md, "MaxText's own configs", has the recipe:

    uv venv /tmp/mtvenv && VIRTUAL_ENV=/tmp/mtvenv uv pip install jax flax pydantic omegaconf jinja2 pyyaml \\
        packaging pathwaysutils pytest
    for e in llama3_8b qwen3_8b ...; do  # the LM experiments
        (echo "base_config: /tmp/mt/x/maxtext/configs/base.yml"
         uv run launch show --exp $e --format maxtext) > /tmp/out/$e.yml
    done
    PYTHONPATH=/tmp/mt/x JAX_PLATFORMS=cpu /tmp/mtvenv/bin/python benchmarks/maxtext_loader_check.py /tmp/out/*.yml

MaxText checks some keys against the devices present: a pipelined config needs its device count
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`). `MT_EXTRA="k=v ..."` adds overrides.
"""

import logging
import os
import sys


def main() -> None:
    logging.disable(logging.WARNING)
    import pytest  # noqa: F401  (MaxText's loader starts no jax.distributed under pytest)
    from maxtext.configs import pyconfig  # pyright: ignore[reportMissingImports]

    extra = os.environ.get("MT_EXTRA", "").split()
    bad = 0
    for path in sys.argv[1:]:
        name = os.path.basename(path)
        try:
            c = pyconfig.initialize_pydantic(["train.py", path, "run_name=check", *extra])
            sizes = (c.num_decoder_layers, c.emb_dim, c.num_query_heads, c.num_kv_heads, c.mlp_dim, c.num_experts)
            print("OK", name, c.decoder_block.value, *sizes)
        except Exception as e:  # any refusal is the answer
            bad += 1
            print("FAIL", name, type(e).__name__, " ".join(str(e).split())[:300])
    print(f"{len(sys.argv) - 1 - bad} of {len(sys.argv) - 1} accepted")


if __name__ == "__main__":
    main()
