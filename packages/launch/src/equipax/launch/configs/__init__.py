"""The config schemas of an experiment: `experiment.py` (the experiment, its loop and how the task
parts fit together), `data.py` (what an experiment reads) and the input sources `data.source` names
(`sources.py`: the registry; `token_sources.py`, `chat_sources.py`, `image_sources.py`: the built-in ones, registered
here so that every lookup sees them)."""

from equipax.launch.configs import chat_sources, image_sources, token_sources  # noqa: F401 (registers the built-in sources)

__all__: list[str] = []
