"""The job directory itself: who owns it, checkpoints and their checksums, metrics and TensorBoard
summaries, plots. Where its files live (local or object storage) is `equipax.launch.store`'s."""

__all__: list[str] = []
