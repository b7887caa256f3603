"""A link shaper for the benchmarks: a TCP proxy that makes loopback look like a cloud link.

On loopback every object-store client is bound by the fake server's CPU, so a benchmark
against a fake says little about a real bucket, where one TCP connection to S3 or GCS
carries a few MiB/s to a few tens of MiB/s and every request waits a round trip.
:class:`Shaper` puts such a link between a client and a fake::

    with Shaper("127.0.0.1", fake_port, mbps_per_conn=8, latency=0.020) as link:
        client = boto3.client("s3", endpoint_url=link.endpoint, ...)   # http://127.0.0.1:<link.port>
        ...
        link.stats()      # connections, bytes and request/response bursts seen so far

The model (per accepted connection, each direction on its own; nothing is shared between
connections, as on a real path where each TCP flow gets its share):

- **Bandwidth: a token bucket.** Tokens (bytes) accrue at ``mbps_per_conn`` MiB/s
  (2**20 bytes/s) up to a depth of ``burst`` bytes (64 KiB). A chunk read from the
  sending side is released when the bucket holds enough tokens for it; a stream therefore
  moves at exactly the rate, and a short message after an idle spell goes out at once.
  64 MiB on one connection at 8 MiB/s takes 8 s, and 8 connections in parallel take 8 s
  each (see :func:`calibrate`), because each connection has its own buckets.
- **Latency: a propagation delay.** Every chunk is delivered ``latency`` seconds after
  the bucket released it (a time-stamped FIFO per direction; order kept). So the first
  byte of every request arrives ``latency`` late and the first byte of every response
  ``latency`` late again: each request/response exchange costs ``2 * latency`` more than
  on loopback (40 ms at the default, a same-region cloud round trip), whatever its size.
  A continuous stream pays the delay once, not per chunk (the delay is pipelined, as on
  a real link, where a TCP window large enough for the bandwidth-delay product keeps the
  pipe full).
  Delaying the first bytes of each burst, rather than adding a fixed delay per ``read()``,
  is what makes the cost per *exchange*: an HTTP client that sends a request and waits for
  the answer pays one round trip, one that pipelines many parts over many connections
  pays it once per part and connection, exactly the trade-off a real bucket rewards.
- **Buffering and back pressure.** At most ``buffer`` bytes (default: twice the
  bandwidth-delay product plus two chunks, at least 1 MiB) are in flight per direction
  (released by the bucket but not yet delivered, or waiting for tokens). Beyond that the
  proxy stops reading, the sender's socket buffer fills and the sender blocks, as with a
  real TCP window. A slow receiver likewise stalls its sender.
- **Not modelled:** TCP slow start and loss (a real connection needs a few round trips
  to reach its rate; here a new connection is at full rate at once, which flatters
  clients that open many short connections), TLS handshakes (the fakes speak plain HTTP),
  an aggregate limit over all connections (a VM's NIC; here only the fake server's CPU
  bounds the sum), and jitter.

The proxy runs in a process of its own (its own GIL, so it never steals time from the
fake server or the client being measured); :meth:`Shaper.stats` asks it for counters.
Connection setup (the TCP handshake with the proxy) is not delayed: a new connection
costs its first request's round trip only.

Calibration (``python benchmarks/shaper.py --calibrate``, :func:`calibrate`; this
project's machine, 2 cores, 2026-11-22; the model says 64 MiB / 8 MiB/s + one 40 ms
round trip = 8.040 s per transfer):

=========================================  ==========================================
1-byte request/response round trip          41.3–41.5 ms (model: 40 ms)
64 MiB up, one connection                   8.040 s
64 MiB up, 8 connections at once            8.048–8.068 s each (63.5 MiB/s in all)
64 MiB down, one connection                 8.035–8.037 s
64 MiB down, 8 connections at once          8.035–8.045 s each (63.6 MiB/s in all)
32 MiB on 32 connections at once            4.10–4.37 s each (model 4.04 s): ~240 MiB/s
                                            in all, where the proxy's own CPU starts
                                            to show (far above what the fakes serve)
=========================================  ==========================================

``python benchmarks/shaper.py --show FILE`` prints the requests of a saved
:meth:`Shaper.stats` (``benchmarks/cloud.py --stats-dir`` saves one per run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

MiB = 2**20
#: a direction counts as idle (the next data starts a new burst) after this many seconds
#: without bytes to send
IDLE_GAP = 0.010
_HTTP_LINE = re.compile(r"[A-Z]+ \S+ HTTP/\d\.\d$|HTTP/\d\.\d \d{3}")


# -- the proxy (runs in the shaper process) ---------------------------------------------------
class _Bucket:
    """A token bucket with debt: :meth:`reserve` returns when ``n`` bytes may leave."""

    def __init__(self, rate: float, depth: float) -> None:
        self.rate, self.depth = rate, depth
        self.level = depth
        self.stamp = time.monotonic()

    def reserve(self, n: int, now: float) -> float:
        self.level = min(self.depth, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        self.level -= n
        return now if self.level >= 0 else now - self.level / self.rate


class _Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting afresh; connections still open are kept (with zero counters)."""
        now = time.monotonic()
        self.epoch = getattr(self, "epoch", 0) + 1
        self.t0 = now
        live = [c for c in getattr(self, "conns", []) if c["closed"] is None]
        for c in live:
            c.update(opened=0.0, log=[], up={"bytes": 0, "bursts": 0}, down={"bytes": 0, "bursts": 0})
        self.connections = 0  # accepted since reset
        self.open = len(live)
        self.max_open = len(live)
        self.conns: list[dict[str, Any]] = live  # per connection: bytes and bursts each way

    def snapshot(self) -> dict[str, Any]:
        def dir_sum(key: str, d: str) -> int:
            return sum(c[d][key] for c in self.conns)

        return {
            "elapsed": time.monotonic() - self.t0,
            "connections": self.connections,
            "open": self.open,
            "max_open": self.max_open,
            "bytes_up": dir_sum("bytes", "up"),
            "bytes_down": dir_sum("bytes", "down"),
            "bursts_up": dir_sum("bursts", "up"),
            "bursts_down": dir_sum("bursts", "down"),
            # per connection: [opened (s since reset), closed or None,
            #                  [[t, dir, bytes, first line (HTTP request/status line)] per burst]]
            "conns": [[round(c["opened"], 4), None if c["closed"] is None else round(c["closed"], 4),
                       [[round(t, 4), d, n, h] for t, d, n, h in c["log"]]] for c in self.conns],
        }


class _Link:
    """One direction of one connection: read, wait for tokens, delay, write, in order."""

    def __init__(self, proxy: _Proxy, conn: dict[str, Any], name: str) -> None:
        self.proxy, self.conn, self.name = proxy, conn, name
        self.bucket = _Bucket(proxy.rate, proxy.burst)
        self.queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self.inflight = 0
        self.room = asyncio.Event()
        self.room.set()
        self.last = 0.0  # when the last released chunk had left the bucket
        self.burst: list[Any] | None = None  # [start, direction, bytes] of the current burst
        self.epoch = proxy.stats.epoch

    async def pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(src))
        try:
            await self._write(dst)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, src: asyncio.StreamReader) -> None:
        p, st = self.proxy, self.conn[self.name]
        try:
            while True:
                data = await src.read(p.chunk)
                if not data:
                    break
                while self.inflight >= p.buffer:
                    self.room.clear()
                    await self.room.wait()
                now = time.monotonic()
                if self.burst is None or now > self.last + IDLE_GAP or self.epoch != p.stats.epoch:
                    # the link was idle: a new request or response
                    self.epoch = p.stats.epoch
                    st["bursts"] += 1
                    # what it starts with: an HTTP request or status line, if it is one
                    head = data[:200].split(b"\r\n", 1)[0].decode("latin-1")
                    self.burst = [now - p.stats.t0, self.name, 0, head if _HTTP_LINE.match(head) else ""]
                    self.conn["log"].append(self.burst)  # the connection's log since the last reset
                self.burst[2] += len(data)
                st["bytes"] += len(data)
                leave = self.bucket.reserve(len(data), now)
                self.last = leave  # the link is busy until this chunk's tokens are paid
                self.inflight += len(data)
                self.queue.put_nowait((leave + p.latency, data))
        except (ConnectionError, OSError):
            pass
        finally:
            self.queue.put_nowait(None)

    async def _write(self, dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self.queue.get()
            if item is None:
                with contextlib.suppress(OSError, RuntimeError):
                    if dst.can_write_eof():
                        dst.write_eof()
                return
            due, data = item
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            dst.write(data)
            await dst.drain()
            self.inflight -= len(data)
            self.room.set()


class _Proxy:
    def __init__(self, upstream: tuple[str, int], mbps: float, latency: float, burst: int, chunk: int,
                 buffer: int | None) -> None:
        self.upstream = upstream
        self.rate = mbps * MiB
        self.latency = latency
        self.burst = burst
        self.chunk = chunk
        self.buffer = buffer or max(MiB, int(2 * self.rate * latency) + 2 * chunk)
        self.stats = _Stats()
        self.tasks: set[asyncio.Task[Any]] = set()

    async def handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        st = self.stats
        conn: dict[str, Any] = {"opened": time.monotonic() - st.t0, "closed": None, "log": [],
                                "up": {"bytes": 0, "bursts": 0}, "down": {"bytes": 0, "bursts": 0}}
        st.conns.append(conn)
        st.connections += 1
        st.open += 1
        st.max_open = max(st.max_open, st.open)
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        u_writer: asyncio.StreamWriter | None = None
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
            for w in (c_writer, u_writer):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up, down = _Link(self, conn, "up"), _Link(self, conn, "down")
            await asyncio.gather(up.pump(c_reader, u_writer), down.pump(u_reader, c_writer),
                                 return_exceptions=True)
        except OSError:
            pass
        finally:
            c_writer.close()
            if u_writer is not None:
                u_writer.close()
            if task is not None:
                self.tasks.discard(task)
            if any(c is conn for c in st.conns):
                st.open -= 1
            conn["closed"] = time.monotonic() - st.t0


async def _serve(args: argparse.Namespace) -> None:
    proxy = _Proxy((args.upstream_host, args.upstream_port), args.mbps, args.latency, args.burst, args.chunk,
                   args.buffer)
    server = await asyncio.start_server(proxy.handle, args.host, args.port, limit=4 * args.chunk, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    print(json.dumps({"port": port, "buffer": proxy.buffer}), flush=True)
    loop = asyncio.get_running_loop()
    # commands on stdin, one a line: "stats", "reset"; end of input stops the proxy
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        cmd = line.strip()
        if not line:
            break
        if cmd == "stats":
            print(json.dumps(proxy.stats.snapshot()), flush=True)
        elif cmd == "reset":
            proxy.stats.reset()
            print("{}", flush=True)
    server.close()
    for t in list(proxy.tasks):
        t.cancel()
    await asyncio.gather(*proxy.tasks, return_exceptions=True)


# -- the handle --------------------------------------------------------------------------------
class Shaper:
    """A shaped link to ``upstream_host:upstream_port`` on a local port (context manager).

    ``mbps_per_conn`` is in MiB/s per connection and direction, ``latency`` in seconds
    added to each request and to each response (see the module docstring for the model).
    The proxy runs in a child process; :attr:`port` and :attr:`endpoint` are set on enter.
    """

    def __init__(self, upstream_host: str, upstream_port: int, mbps_per_conn: float = 8, latency: float = 0.020,
                 *, host: str = "127.0.0.1", burst: int = 64 * 1024, chunk: int = 64 * 1024,
                 buffer: int | None = None) -> None:
        self.upstream = (upstream_host, int(upstream_port))
        self.mbps, self.latency, self.host = float(mbps_per_conn), float(latency), host
        self.burst, self.chunk, self.buffer = burst, chunk, buffer
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Shaper:
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", self.upstream[0], str(self.upstream[1]),
               "--mbps", repr(self.mbps), "--latency", repr(self.latency), "--host", self.host,
               "--burst", str(self.burst), "--chunk", str(self.chunk)]
        if self.buffer:
            cmd += ["--buffer", str(self.buffer)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the shaper did not start (exit code {self._proc.wait()})")
        self.port = json.loads(line)["port"]
        return self

    def _ask(self, cmd: str) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write(cmd + "\n")
            self._proc.stdin.flush()
            return json.loads(self._proc.stdout.readline())

    def stats(self) -> dict[str, Any]:
        """Counters since start or :meth:`reset_stats`: connections, ``max_open``, bytes and
        bursts each way (a burst: bytes after the direction was idle for 10 ms; roughly one
        per request or response, more when a slow receiver pauses a response), and per
        connection its bursts as ``[seconds since reset, "up"|"down", bytes, first line]``
        (the HTTP request or status line a burst starts with, else "")."""
        return self._ask("stats")

    def reset_stats(self) -> None:
        self._ask("reset")

    def stop(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError, ValueError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __enter__(self) -> Shaper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def summarize(stats: dict[str, Any]) -> str:
    """One line about a client's request pattern from :meth:`Shaper.stats`."""
    conns = stats["conns"]
    used = [c for c in conns if c[2]]
    per = sorted(sum(1 for b in c[2] if b[1] == "up" and b[3]) for c in used)
    return (f"{stats['connections']} connections ({len(used)} carried data, at most {stats['max_open']} open), "
            f"{stats['bursts_up']} request bursts / {stats['bursts_down']} response bursts, "
            f"{stats['bytes_up'] / MiB:.1f} MiB up / {stats['bytes_down'] / MiB:.1f} MiB down; "
            f"requests per connection {per[0] if per else 0}–{per[-1] if per else 0}")


def requests(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """The HTTP exchanges in :meth:`Shaper.stats`, in order of start: each request line
    with its connection, start, bytes sent, the status line and bytes of what came back,
    and when its first byte arrived (seconds since reset)."""
    out: list[dict[str, Any]] = []
    for i, (_o, _closed, bursts) in enumerate(stats["conns"]):
        cur: dict[str, Any] | None = None
        for t, d, n, head in bursts:
            if d == "up" and head:
                cur = {"t": t, "conn": i, "request": head, "up": n, "status": "", "down": 0, "first_byte": None}
                out.append(cur)
            elif cur is None:
                continue
            elif d == "up":
                cur["up"] += n
            else:
                if cur["first_byte"] is None:
                    cur["first_byte"] = t
                if head and (not cur["status"] or cur["status"].split()[1:2] == ["100"]):
                    cur["status"] = head
                cur["down"] += n
    return sorted(out, key=lambda r: r["t"])


def show(stats: dict[str, Any]) -> None:
    """Print :func:`requests` as a table (``python benchmarks/shaper.py --show FILE``)."""
    print(summarize(stats))
    print(f"{'start s':>8} {'conn':>4} {'wait s':>7} {'up':>10} {'down':>10}  request -> status")
    for r in requests(stats):
        wait = f"{r['first_byte'] - r['t']:.3f}" if r["first_byte"] is not None else "-"
        print(f"{r['t']:8.3f} {r['conn']:4d} {wait:>7} {r['up']:10d} {r['down']:10d}  {r['request'][:90]} -> "
              f"{r['status'][9:40]}")


def concurrency(stats: dict[str, Any], rate: float, step: float = 0.25) -> list[float]:
    """Connections busy sending bulk data, per ``step`` seconds: each burst's bytes are
    spread over ``bytes / rate`` seconds from its start (a sketch of how many streams a
    client keeps on the link, for reports)."""
    end = stats["elapsed"]
    bins = [0.0] * (int(end / step) + 1)
    for _o, _c, bursts in stats["conns"]:
        for t, _d, n, _h in bursts:
            dur = n / rate
            a = t
            while dur > 1e-9 and int(a / step) < len(bins):
                i = int(a / step)
                take = min(dur, (i + 1) * step - a)
                bins[i] += take / step
                a += take
                dur -= take
    return bins


# -- calibration -------------------------------------------------------------------------------
def _sink_server() -> tuple[socket.socket, threading.Thread]:
    """A TCP server: each connection reads a 12-byte header (b"up"/b"dn"/b"pi" + 10-digit
    size); "up": read that many bytes then answer b"k"; "dn": send that many bytes; "pi":
    answer b"p" to each of that many 1-byte pings."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def recv_exact(s: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            got = s.recv(n - len(buf))
            if not got:
                raise ConnectionError("closed")
            buf += got
        return bytes(buf)

    def serve(s: socket.socket) -> None:
        with s:
            head = recv_exact(s, 12)
            kind, n = head[:2], int(head[2:])
            if kind == b"up":
                left = n
                while left:
                    got = s.recv(min(left, MiB))
                    if not got:
                        return
                    left -= len(got)
                s.sendall(b"k")
            elif kind == b"dn":
                block = b"\0" * MiB
                left = n
                while left:
                    left -= s.send(block[:min(left, MiB)])
            else:
                for _ in range(n):
                    recv_exact(s, 1)
                    s.sendall(b"p")

    def accept() -> None:
        while True:
            try:
                s, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(s,), daemon=True).start()

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    return srv, th


def _transfer(port: int, kind: str, n: int) -> float:
    """Seconds to move ``n`` bytes through the shaper (``up``: until the server's ack;
    ``dn``: until the last byte arrived), or for ``n`` ping round trips (``pi``)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(kind.encode() + b"%010d" % n)
        if kind == "up":
            block = b"\0" * MiB
            left = n
            while left:
                left -= s.send(block[:min(left, MiB)])
            if s.recv(1) != b"k":
                raise RuntimeError("no ack")
        elif kind == "dn":
            left = n
            buf = bytearray(MiB)
            while left:
                got = s.recv_into(buf, min(left, MiB))
                if not got:
                    raise RuntimeError("short download")
                left -= got
        else:
            t0 = time.perf_counter()  # round trips only (the header went with the first)
            for _ in range(n):
                s.sendall(b"x")
                if s.recv(1) != b"p":
                    raise RuntimeError("no pong")
        return time.perf_counter() - t0


def calibrate(mbps: float = 8, latency: float = 0.020, size: int = 64 * MiB, parallel: int = 8,
              pings: int = 20) -> dict[str, Any]:
    """Measure the shaper against its model on loopback: ``size`` bytes up and down on one
    connection, then on ``parallel`` connections at once (each should take
    ``size / mbps`` plus a round trip), and the round trip of a 1-byte exchange
    (``2 * latency``). Returns seconds; prints a line per measurement."""
    from concurrent.futures import ThreadPoolExecutor

    srv, _ = _sink_server()
    out: dict[str, Any] = {"mbps": mbps, "latency": latency, "size_mib": size / MiB, "parallel": parallel,
                           "expected_s": size / (mbps * MiB) + 2 * latency}
    try:
        with Shaper("127.0.0.1", srv.getsockname()[1], mbps, latency) as link:
            rtt = _transfer(link.port, "pi", pings) / pings
            out["rtt_ms"] = rtt * 1000
            for kind in ("up", "dn"):
                out[f"one_{kind}_s"] = _transfer(link.port, kind, size)
                with ThreadPoolExecutor(parallel) as ex:
                    times = list(ex.map(lambda _, k=kind: _transfer(link.port, k, size), range(parallel)))
                out[f"par_{kind}_s"] = times
            out["stats"] = summarize(link.stats())
    finally:
        srv.close()
    exp = out["expected_s"]
    print(f"shaper calibration at {mbps:g} MiB/s per connection, +{latency * 1000:g} ms each way "
          f"(expected per transfer: {exp:.3f} s = {size / MiB:g} MiB / rate + one round trip):")
    print(f"  round trip of a 1-byte exchange: {out['rtt_ms']:.1f} ms (model: {2 * latency * 1000:g} ms)")
    for kind, what in (("up", "upload"), ("dn", "download")):
        par = out[f"par_{kind}_s"]
        print(f"  {what}: 1 connection {out[f'one_{kind}_s']:.3f} s; {parallel} in parallel "
              f"{min(par):.3f}–{max(par):.3f} s each "
              f"({parallel * size / MiB / max(par):.1f} MiB/s in all)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", nargs=2, metavar=("UPSTREAM_HOST", "UPSTREAM_PORT"))
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--show", metavar="STATS_JSON", help="print the requests in a saved Shaper.stats()")
    ap.add_argument("--mbps", type=float, default=8.0)
    ap.add_argument("--latency", type=float, default=0.020)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--burst", type=int, default=64 * 1024)
    ap.add_argument("--chunk", type=int, default=64 * 1024)
    ap.add_argument("--buffer", type=int, default=0)
    ap.add_argument("--size", type=int, default=64, help="calibration: MiB per transfer")
    ap.add_argument("--parallel", type=int, default=8, help="calibration: connections at once")
    args = ap.parse_args()
    if args.serve:
        args.upstream_host, args.upstream_port = args.serve[0], int(args.serve[1])
        asyncio.run(_serve(args))
    elif args.show:
        with open(args.show) as f:
            show(json.load(f))
    elif args.calibrate:
        calibrate(args.mbps, args.latency, args.size * MiB, args.parallel)
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
