"""What equipax knows of the machines it runs on: the accelerators' peaks and memory
(`accelerators.py`), Cloud TPU slices and libtpu's environment (`tpu.py`), and the compiler flags
an experiment sets before JAX starts (`compiler_flags.py`).

Layer 0 of launch (docs/extending.md, "Layers"): it imports only `equipax.launch.store` (the
machine's cache of flags known to work)."""

__all__: list[str] = []
