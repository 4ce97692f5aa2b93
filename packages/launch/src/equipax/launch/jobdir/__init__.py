"""The job directory: who owns it, checkpoints and their checksums, what may change on resume,
metrics and TensorBoard summaries, plots."""

__all__: list[str] = []
