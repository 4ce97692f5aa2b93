"""The parts of `benchmarks/train_step.py`, the LM train-step benchmark: the benchmarked models
(`presets`), timing a step and what each side records (`measure`), the plain-JAX side's config and
parameters (`baseline`), equipax against plain JAX side by side (`compare`) and the printed tables
(`tables`)."""
