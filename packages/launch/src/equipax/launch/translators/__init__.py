"""Other frameworks' configs as equipax knobs, and back: `maxtext.py` (MaxText's `base.yml` keys)."""

__all__: list[str] = []
