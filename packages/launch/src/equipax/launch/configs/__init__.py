"""The config schemas of an experiment: `experiment.py` (the experiment, its loop and how the task
parts fit together) and `data.py` (what an experiment reads)."""

__all__: list[str] = []
