"""MaxText 0.2.5's configs as equipax knobs, and back (docs/maxtext.md), one idea a module:

- `translate.py`: the entry points (`to_equipax`, `to_maxtext`, `apply_translation`, `merge`,
  `markdown_table`) that `launch convert maxtext` and `launch show --format maxtext` call;
- `rules.py`: the translation table, `RULES`, one rule per group of keys;
- `values.py`: MaxText's defaults, the values one translation reads (`Values`), shared converters;
- `blocks.py`: the decoder blocks (`decoder_block`) equipax's stack has, and those it lacks;
- `mesh.py`: the parallelism keys, pipeline and per-device batch;
- `training.py`: the optimizer, schedule, steps, profiler and data keys;
- `files.py`: MaxText's YAML files and `key=value` overrides, read as its loader reads them.
"""

__all__: list[str] = []
