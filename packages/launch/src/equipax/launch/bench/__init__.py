"""Benchmarks the launcher runs: `launch bench attention` (`attention.py`)."""
