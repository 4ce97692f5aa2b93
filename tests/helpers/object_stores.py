"""Local object stores for the tests, listening on 127.0.0.1 at a free port: a GCS emulator
(`gcp-storage-emulator`, its own process) and an S3 one (`moto`'s server mode, a thread of the
test's process: `s3_emulator`, which can hold a chosen upload to stand for a save cut short).

Run as a script (`python object_stores.py gcs PORT BUCKET`) it is the GCS emulator, with what
TensorStore's `gcs` driver needs and the emulator leaves out: every download answers with the
object's generation (`x-goog-generation`, which TensorStore reads to write OCDBT manifests
conditionally; without it every second manifest write fails with "Malformed StorageGeneration"),
and the generation preconditions (`ifGenerationMatch` on an upload named in its query,
`ifGenerationMatch` / `ifGenerationNotMatch` on a download) are honoured as GCS does; and a client
that stalls mid-request (a run frozen by SIGSTOP) holds up no other client (`_threaded`).
"""

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the emulator exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        time.sleep(0.1)
    raise RuntimeError(f"the emulator did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


@contextlib.contextmanager
def emulator(bucket: str, log: Path) -> Iterator[dict[str, str]]:
    """Start the GCS emulator holding an empty `bucket`; yields the environment variables that
    point clients at it. Its output goes to `log`."""
    port = free_port()
    cmd = [sys.executable, __file__, "gcs", str(port), bucket]
    # gcsfs's default class asks GCS's control-plane API (gRPC) for the bucket's layout first,
    # which an emulator does not serve: a minute of retries per bucket. Read at its import.
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        _wait_for(port, proc)
        yield env
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class HeldUploads:
    """Uploads (PUTs) to the S3 emulator whose key matches `pattern` are held: `held` is set, and
    the request is answered 503 (never stored) once `release` is set. For a process killed while
    that object is being written."""

    def __init__(self) -> None:
        import threading

        self.pattern: str | None = None
        self.held, self.release = threading.Event(), threading.Event()

    def hold(self, pattern: str) -> None:
        self.pattern = pattern
        self.held.clear()
        self.release.clear()

    def wrap(self, app):
        import re

        def held_app(environ, start_response):
            pattern = self.pattern
            if pattern and environ.get("REQUEST_METHOD") == "PUT" and re.search(pattern, environ.get("PATH_INFO", "")):
                self.held.set()
                self.release.wait(timeout=120)
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
            return app(environ, start_response)

        return held_app


@contextlib.contextmanager
def s3_emulator(bucket: str) -> Iterator[tuple[dict[str, str], HeldUploads]]:
    """Start moto's S3 server holding an empty `bucket`; yields the environment variables that point
    clients at it (s3fs/botocore and TensorStore) and its `HeldUploads`."""
    import logging

    from moto.server import ThreadedMotoServer

    uploads = HeldUploads()

    class Server(ThreadedMotoServer):
        def _server_entry(self) -> None:
            from moto.moto_server.threaded_moto_server import MotoRequestHandler
            from moto.server import DomainDispatcherApplication, create_backend_app
            from werkzeug.serving import make_server

            app = uploads.wrap(DomainDispatcherApplication(create_backend_app))
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    server = Server(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=bucket)
        yield env, uploads
    finally:
        uploads.release.set()
        server.stop()


def _serve_gcs(port: int, bucket: str) -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator import storage as storage_module
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def generation(storage, request) -> str | None:
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return None
        return str(obj["generation"])

    original_download, original_insert = objects.download, objects.insert

    def download(request, response, storage, *args, **kwargs):
        current = generation(storage, request)
        match = request.query.get("ifGenerationMatch", [None])[0]
        not_match = request.query.get("ifGenerationNotMatch", [None])[0]
        if current is not None and match is not None and match != current:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return
        if current is not None and not_match is not None and not_match == current:
            response["x-goog-generation"] = current
            response.status = HTTPStatus.NOT_MODIFIED
            return
        if current is not None:
            response["x-goog-generation"] = current
            response["x-goog-metageneration"] = "1"
        return original_download(request, response, storage, *args, **kwargs)

    def insert(request, response, storage, *args, **kwargs):
        match = request.query.get("ifGenerationMatch", [None])[0]
        name = request.query.get("name", [None])[0]
        if match is not None and name is not None:
            try:
                current = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
            except NotFound:
                current = "0"
            if current != match:
                response.status = HTTPStatus.PRECONDITION_FAILED
                return
        return original_insert(request, response, storage, *args, **kwargs)

    objects.download, objects.insert = download, insert
    for _, handlers in server.HANDLERS:
        for method, fn in list(handlers.items()):
            if fn is original_download:
                handlers[method] = download
            elif fn is original_insert:
                handlers[method] = insert
    server.APIThread = _threaded(server)
    _unsaved_metadata(storage_module)
    srv = server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    srv.run()


def _unsaved_metadata(storage_module) -> None:
    """The in-memory emulator without its metadata file: after every write (each upload, each
    delete) it serialises every object's metadata in every bucket (`json.dumps(..., indent=2)`)
    into an in-memory `.meta` that it reads back only when it starts. With the suite's jobs in one
    emulator (thousands of checkpoint, summary and cache objects) that grew to most of an upload's
    cost: quadratic in the objects written. The metadata stays in the emulator's dicts, as before."""
    storage_module.Storage._write_config_to_file = lambda self: None


def _threaded(emulator):
    """The emulator's API thread, serving each connection in a thread of its own. Its HTTP server
    takes one connection at a time: a run frozen (SIGSTOP) halfway through sending an upload, or
    through reading a download, would hold up every other client until it resumed (the tests'
    own `fs.exists` waited for it, for ever). Each request is read whole first and its answer
    written after; what lies between (the storage, which is not thread-safe) runs under one lock,
    so requests are still served one at a time."""
    import functools
    import io
    import threading
    from http.server import ThreadingHTTPServer

    lock = threading.Lock()

    class Handler(emulator.RequestHandler):
        def _serialized(self, handle) -> None:
            body = emulator._read_raw_data(self) or b""
            del self.headers["Content-Length"], self.headers["Transfer-Encoding"]
            self.headers["Content-Length"] = str(len(body))
            wfile, self.rfile, self.wfile = self.wfile, io.BytesIO(body), io.BytesIO()
            try:
                with lock:
                    handle(self)
            finally:
                answer, self.wfile = self.wfile.getvalue(), wfile
                wfile.write(answer)

        def do_GET(self):
            self._serialized(emulator.RequestHandler.do_GET)

        def do_POST(self):
            self._serialized(emulator.RequestHandler.do_POST)

        def do_DELETE(self):
            self._serialized(emulator.RequestHandler.do_DELETE)

        def do_PUT(self):
            self._serialized(emulator.RequestHandler.do_PUT)

        def do_PATCH(self):
            self._serialized(emulator.RequestHandler.do_PATCH)

    class APIThread(emulator.APIThread):
        def run(self) -> None:
            self._httpd = ThreadingHTTPServer((self._host, self._port), functools.partial(Handler, self._storage))
            self._httpd.daemon_threads = True
            self.is_running.set()
            self._httpd.serve_forever()

    return APIThread


if __name__ == "__main__":
    if sys.argv[1] == "gcs":
        _serve_gcs(int(sys.argv[2]), sys.argv[3])
