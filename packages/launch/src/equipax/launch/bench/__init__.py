"""Benchmarks the launcher runs: `launch bench attention` (`attention.py`)."""

__all__: list[str] = []
