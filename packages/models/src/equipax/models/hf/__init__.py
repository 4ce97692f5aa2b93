"""Hugging Face checkpoints in and out: safetensors, config.json, weights, a numpy reference.

- `safetensors`: the file format (numpy; byte-range reads) and checkpoint directories;
- `config`: config.json (transformers 4 and 5 schemas) <-> `LMConfig` (no JAX);
- `params`: which Hugging Face tensors each model array is made of (no JAX);
- `reference`: a numpy forward pass of the Hugging Face definitions and the logit KL;
- `weights`: sharded loading into a `TransformerLM`, export to tensors and files, the parity gate.

docs/hf.md has the commands (`launch convert hf-import`, `hf-export`) built on them.
"""

__all__: list[str] = []  # the submodules are the API (import them by name)
