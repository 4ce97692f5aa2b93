"""Where files live and how they are reached: local or object storage (`storage.py`, `gs://`,
`s3://`), the store's checks before any work (`checks.py`), the job's lock in a store without
`flock` (`lock.py`), orbax's S3 glue (`orbax_s3.py`) and the machine's cache (`machine_cache.py`).

Layer 0 of launch (docs/extending.md, "Layers"): nothing here imports another launch folder."""

__all__: list[str] = []
