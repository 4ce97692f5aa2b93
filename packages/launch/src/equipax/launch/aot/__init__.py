"""Ahead-of-time compilation: reports of the exact train step for CPU or real TPU topologies."""

__all__: list[str] = []
