"""equipax's benchmarks (benchmarks/README.md: what each one measures, how to run it, the figures).

A package so that the scripts import each other as modules (`from benchmarks import baseline_lm`).
Each script runs from the repository root as `python benchmarks/NAME.py` (a script that imports a
sibling first puts the repository root on `sys.path`) or as `python -m benchmarks.NAME`. Nothing
is imported here: `op_profile.py` runs with the standard library alone wherever a trace is copied.
"""
