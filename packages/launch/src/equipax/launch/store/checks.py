"""A job directory's object store, checked before any work: it answers, there are credentials, the
bucket exists (exit 2 in seconds, naming the variable to set). docs/object_storage.md."""

import os
import socket
import urllib.parse

from equipax.core.knobs import ConfigError
from equipax.core.paths import remote_scheme
from equipax.launch.store.storage import AnyPath, configure_endpoints, filesystem, job_path

__all__ = ["check_store", "data_path", "SUPPORTED"]

SUPPORTED = ("gs", "s3")
"""The stores a job directory or data path may be in."""


def _endpoint(scheme: str) -> tuple[str, str]:
    """(the endpoint URL requests go to, the variable that sets it) for a store (`SUPPORTED`)."""
    if scheme == "s3":
        from equipax.launch.store.orbax_s3 import endpoint

        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        default = f"https://s3.{region}.amazonaws.com" if region else "https://s3.amazonaws.com"
        return endpoint() or default, "AWS_ENDPOINT_URL"
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    url = (host if "://" in host else f"http://{host}") if host else "https://storage.googleapis.com"
    return url, "STORAGE_EMULATOR_HOST"


def _credentials_problem(scheme: str) -> str | None:
    """Why requests to the store would be refused for want of credentials, or None."""
    if scheme == "s3":
        import botocore.session

        # botocore's own chain (the environment, AWS_PROFILE's files, SSO, a container's or an EC2
        # instance's role), as s3fs uses it; TensorStore's `s3` driver follows the same sources.
        if botocore.session.get_session().get_credentials() is None:
            return (
                "no AWS credentials were found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
                "naming a profile of ~/.aws/credentials; on EC2 the instance's role is used)"
            )
        return None
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return None  # an emulator takes anonymous requests
    try:
        import google.auth

        google.auth.default()
    except Exception:
        return (
            "no Google Cloud credentials were found (Application Default Credentials: set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or run `gcloud auth "
            "application-default login`; on a Cloud TPU/GCE VM the VM's service account is used)"
        )
    return None


ANSWER_TIMEOUT_S = 30.0
"""How long the store has to answer the bucket check once it has accepted the connection. A real
store answers in well under a second; one that takes connections and never answers (a stalled
server or emulator, a proxy holding requests) would otherwise hold `launch` there for ever,
printing nothing."""


def check_store(
    path: AnyPath | str, option: str, *, timeout_s: float = 5.0, answer_timeout_s: float | None = None
) -> None:
    """Raise ConfigError, in seconds, when `path`'s store cannot be used: its endpoint does not
    accept a connection or does not answer, there are no credentials, or its bucket does not exist.
    Nothing for a local path.

    Arguments:
        path: a job directory or data path.
        option: the option or knob that gave it (named in the message).
        timeout_s: how long the endpoint has to accept a connection.
        answer_timeout_s: how long it then has to answer whether the bucket exists
            (`ANSWER_TIMEOUT_S` when None).
    """
    scheme = remote_scheme(str(path))
    if scheme is None:
        return
    if scheme not in SUPPORTED:  # `remote_scheme` names no other store
        raise ConfigError(f"{option} {str(path)!r}: {scheme}:// is not a supported store; docs/object_storage.md.")
    configure_endpoints(scheme)
    url, variable = _endpoint(scheme)
    parsed = urllib.parse.urlsplit(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname or "", port), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"{option} {str(path)!r}: the {scheme}:// endpoint {url} does not answer ({e.strerror or e}). "
            f"Check the network, or set {variable} to the store's endpoint (an emulator: "
            f"{variable}=http://127.0.0.1:PORT)."
        ) from None
    if (problem := _credentials_problem(scheme)) is not None:
        raise ConfigError(f"{option} {str(path)!r}: {problem}.")
    bucket = urllib.parse.urlsplit(str(path)).netloc
    fs, _ = filesystem(job_path(str(path)))
    answer_s = ANSWER_TIMEOUT_S if answer_timeout_s is None else answer_timeout_s
    try:
        found = _exists(fs, bucket, answer_s)
    except TimeoutError:
        raise ConfigError(
            f"{option} {str(path)!r}: the {scheme}:// endpoint {url} accepted a connection but did not answer "
            f"within {answer_s:.0f} s (a stalled server or emulator, or a proxy holding requests). Check the "
            f"network, or set {variable} to the store's endpoint."
        ) from None
    except Exception as e:  # refused credentials, a malformed name: the store's own words
        raise ConfigError(
            f"{option} {str(path)!r}: {scheme}://{bucket} could not be read ({type(e).__name__}: {e}). "
            f"Check the credentials' permissions on the bucket, or {variable}."
        ) from None
    if not found:
        create = f"aws s3 mb s3://{bucket}" if scheme == "s3" else f"gcloud storage buckets create gs://{bucket}"
        raise ConfigError(
            f"{option} {str(path)!r}: the bucket {scheme}://{bucket} does not exist at {url}. Create it "
            f"(`{create}`), or fix the bucket's name."
        )


def _exists(fs, name: str, timeout_s: float) -> bool:
    """`fs.exists(name)`, raising TimeoutError past `timeout_s` (gcsfs and s3fs are fsspec async
    filesystems, whose blocking calls take a deadline: fsspec's FSTimeoutError, a TimeoutError)."""
    from fsspec.asyn import AsyncFileSystem

    if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
        return fs.exists(name, timeout=timeout_s)
    return fs.exists(name)


def data_path(value: str, knob: str) -> AnyPath:
    """A data knob's path (`data.path`, `data.vocab_path`) to read from: local, or in a store whose
    endpoint, credentials and bucket `check_store` has checked (ConfigError naming `knob`)."""
    path = job_path(value)
    check_store(path, knob)
    return path
