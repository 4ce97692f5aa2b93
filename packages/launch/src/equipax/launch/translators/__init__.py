"""Other frameworks' configs and checkpoints as equipax's, and back: `maxtext/` (MaxText's `base.yml`
keys), `hf_checkpoints.py` (Hugging Face model directories, behind the logit-parity gate of
`hf_parity.py`)."""

__all__: list[str] = []
