"""Orbax checkpoints in S3 (`s3://BUCKET/...`): arrays through TensorStore's own `s3` kvstore
driver, and each step committed by orbax's commit marker, never by a rename.

Orbax 0.12 knows `s3://` only as "remote" (`tensorstore_utils._REMOTE_URL_PREFIXES`): it builds
TensorStore kvstore specs for `gs://` (`gcs_utils.get_kvstore_for_gcs`) and for local paths, and
an `s3://` checkpoint directory fails there ("Checkpoint path should be absolute": `os.path.normpath`
makes it `s3:/...`). `install` routes `s3://` directories to an `s3` kvstore spec (`kvstore_spec`)
in the same three places orbax handles `gs://`. And orbax picks its commit protocol from the path
(`atomicity_defaults.get_default_temporary_path_class`): `CommitFileTemporaryPath` (write in place,
`commit_success.txt` last) for `gs://`, `AtomicRenameTemporaryPath` (write `<step>.orbax-checkpoint-
tmp-*`, rename it) for everything else, including `s3://`, where s3fs's rename is a copy of each
object then a delete (not atomic; it also fails outright). `atomicity_options` asks for the commit
marker on S3 (`manager_options`, which equipax's `Checkpointer` uses). docs/object_storage.md.

TensorStore's `s3` driver does not read `AWS_ENDPOINT_URL` (s3fs's botocore does), so the endpoint
(`AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`) goes into the spec.
"""

import os
from typing import Any

import orbax.checkpoint as ocp

from equipax.core.paths import remote_scheme

__all__ = ["atomicity_options", "endpoint", "install", "kvstore_spec", "manager_options"]


def endpoint() -> str | None:
    """The S3 endpoint set for this process (an emulator, MinIO, another region's URL), or None for
    AWS's own."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def kvstore_spec(path: str) -> dict[str, Any]:
    """TensorStore's `s3` kvstore spec for the key prefix `path` (`s3://BUCKET/KEY`)."""
    bucket, _, key = path.removeprefix("s3://").partition("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
    if (url := endpoint()) is not None:
        spec["endpoint"] = url
    if region := os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        # TensorStore's default chain reads ~/.aws/config first and logs an error line per missing
        # file; with keys in the environment it goes straight to them.
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def atomicity_options(directory: object) -> ocp.options.AtomicityOptions | None:
    """Orbax's commit protocol for a checkpoint directory: the commit marker on S3 (what orbax
    itself picks on `gs://`), orbax's default elsewhere."""
    if remote_scheme(str(directory)) == "s3":
        return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
    return None


def manager_options(directory: object, **options: Any) -> ocp.CheckpointManagerOptions:
    """`ocp.CheckpointManagerOptions(**options)` with the commit protocol for `directory`
    (`atomicity_options`)."""
    return ocp.CheckpointManagerOptions(**options, atomicity_options=atomicity_options(directory))


def install() -> None:
    """Make orbax's TensorStore specs for `s3://` directories use TensorStore's `s3` driver
    (idempotent; `gs://` and local paths unchanged)."""
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils

    if getattr(tensorstore_utils._use_gcs_driver, "equipax_s3", False):
        return

    normalize, native, for_gcs = (
        tensorstore_utils._normalize_path,
        tensorstore_utils._use_gcs_driver,
        gcs_utils.get_kvstore_for_gcs,
    )

    def normalize_path(path: str) -> str:
        out = normalize(path)
        return "s3://" + out.removeprefix("s3:/") if str(path).startswith("s3://") else out

    def use_native_driver(directory: str) -> bool:
        return directory.startswith("s3://") or native(directory)

    def kvstore_for(path: str) -> dict[str, Any]:
        return kvstore_spec(path) if path.startswith("s3://") else for_gcs(path)

    use_native_driver.equipax_s3 = True  # pyright: ignore[reportFunctionMemberAccess]
    tensorstore_utils._normalize_path = normalize_path
    gcs_utils.get_kvstore_for_gcs = kvstore_for
    tensorstore_utils._use_gcs_driver = use_native_driver
