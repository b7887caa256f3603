"""The read path of object stores on a cloud link (issue 22: restore behind boto3 on SeaweedFS).

Measured through the benchmark's link shaper (``benchmarks/cloud.py``), a restore kept 16
ranged GETs in flight where boto3 kept 32, waited one round trip more than it needed (a
HEAD before reading a file whose size the first ranged GET tells), and spent most of its
event-loop thread's CPU on the page faults of the fresh arrays it read into. These tests
observe each fix on the server or in the process, never by timing:

- ranged reads are half as large as the upload parts (4 MiB), so the store's in-flight
  budget holds twice as many reads as parts, each on a connection of its own;
- streaming a file on S3 (``iter_read``: the index, manifest-checked files) sends no HEAD;
- a large read's destination is populated (page tables faulted in) before its data comes,
  by another thread than the one that receives the data.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import Backend, make_backend

import atomicstore
from atomicstore.commit.manifest import MARKER_INLINE_BYTES, MAX_MARKER_BYTES, Marker
from atomicstore.commit.names import MANIFEST_FILE, MARKER_FILE
from atomicstore.drivers.asyncfs import OBJECT_BLOCK_SIZE

MiB = 2**20


@pytest.fixture(params=["s3", "seaweed"])
def s3_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    """S3 on moto and on a real SeaweedFS."""
    return make_backend(request.param, request, tmp_path)


def is_ranged_get(environ: dict[str, Any]) -> bool:
    return environ.get("REQUEST_METHOD") == "GET" and "HTTP_RANGE" in environ


class Gate:
    """WSGI middleware in front of a server (behind the fault injector): every ranged GET
    but the first ``free`` ones waits until ``ready(waiting)`` says so (or ``wait``
    seconds passed), counted while it waits; then the gate stays open."""

    def __init__(self, app: Callable[..., Iterable[bytes]], ready: Callable[[int], bool], wait: float,
                 free: int, match: Callable[[dict[str, Any]], bool] = is_ranged_get) -> None:
        self.app, self.ready, self.wait, self.free, self.match = app, ready, wait, free, match
        self.cond = threading.Condition()
        self.waiting = 0
        self.most = 0  # most ranged GETs waiting at once
        self.open = False
        self.timed_out = False

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not self.match(environ):
            return self.app(environ, start_response)
        with self.cond:
            if self.free > 0:
                self.free -= 1
                return self.app(environ, start_response)
            self.waiting += 1
            self.most = max(self.most, self.waiting)
            self.cond.notify_all()
            deadline = time.monotonic() + self.wait
            while not self.open:  # (polled: a page's residency notifies no one)
                if self.ready(self.waiting):
                    self.open = True  # from now on every request goes through
                elif time.monotonic() > deadline:
                    self.timed_out = self.open = True
                else:
                    self.cond.wait(0.01)
            self.cond.notify_all()
        try:
            return self.app(environ, start_response)
        finally:
            with self.cond:
                self.waiting -= 1


@pytest.fixture
def gate(request: pytest.FixtureRequest) -> Iterator[Callable[..., Gate]]:
    installed: list[tuple[Any, Any]] = []

    def install(backend: Backend, ready: Callable[[int], bool], wait: float = 5.0, free: int = 0,
                match: Callable[[dict[str, Any]], bool] = is_ranged_get) -> Gate:
        """A gate in front of ``backend``'s server (instead of the one installed before)."""
        injector = backend.server.injector
        if not installed:
            installed.append((injector, injector.app))
        g = Gate(installed[0][1], ready, wait, free, match)
        injector.app = g
        return g

    yield install
    for injector, app in reversed(installed):
        injector.app = app


def test_reads_fill_the_budget_with_half_part_ranges(s3_backend, gate):
    """A 32 MiB budget holds eight 4 MiB ranged GETs at once, where it holds four 8 MiB
    parts of an upload: twice the connections (S3 read in 16 MiB ranges once: two at
    once; then in 8 MiB ranges: four)."""
    object_backend = s3_backend
    store = object_backend.open(max_inflight_bytes=32 * MiB)
    data = np.random.default_rng(1).integers(0, 255, 32 * MiB, dtype=np.uint8)
    with store.transaction("step_1") as txn:
        txn.write_bytes("blob", data.tobytes())
    ckpt = store.open("step_1")
    assert store.driver.read_chunk == OBJECT_BLOCK_SIZE // 2
    want = 32 * MiB // store.driver.read_chunk
    g = gate(object_backend, lambda n: n >= want)  # let them go once four wait together
    out = np.empty_like(data)
    ckpt.read_into("blob", out)
    assert np.array_equal(out, data)
    assert not g.timed_out and g.most == want, f"{g.most} ranged GETs in flight at once, not {want}"
    # streaming the same file: the same ranges; once the first has told the size, the
    # other three go at once
    g = gate(object_backend, lambda n: n >= want - 1, free=1)
    with ckpt.open("blob") as f:
        assert f.readall() == data.tobytes()
    assert not g.timed_out and g.most == want - 1, f"{g.most} ranged GETs in flight at once, not {want - 1}"


def test_streaming_a_file_sends_no_head(s3_backend):
    """The first ranged GET tells the object's size (``Content-Range``): no HEAD first."""
    store = s3_backend.open()
    d = store.driver
    for size in (0, 1, d.read_chunk, d.read_chunk + 1, 2 * d.read_chunk + 5):
        blob = os.urandom(size)
        d.put(f"obj{size}", blob)
        with s3_backend.server.injector.recording() as log:
            got = list(d.iter_read(f"obj{size}"))
        assert b"".join(got) == blob and all(got), size
        assert log.kinds() == {"get": max(1, -(-size // d.read_chunk))}, log.describe()
    with pytest.raises(atomicstore.NotFoundError):
        list(d.iter_read("missing"))
    # a restore: the marker, the manifest, the index and the state, each by GETs only
    state = {"w": np.arange(3 * MiB, dtype=np.float32), "b": np.ones(7, np.float32)}
    atomicstore.save(f"{s3_backend.url}/step_1", state, store=store)
    with s3_backend.server.injector.recording() as log:
        back = atomicstore.restore(f"{s3_backend.url}/step_1", store=store)
    assert all(np.array_equal(back[k], state[k]) for k in state)
    assert set(log.kinds()) == {"get"}, log.describe()


def _resident(buf: mmap.mmap, size: int) -> bool:
    """Are all pages of ``buf`` in memory (``mincore``)?"""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return all(v & 1 for v in vec)


def test_a_restore_sends_every_large_leafs_reads_before_waiting_for_any(object_backend, gate):
    """A restore read each large leaf on a thread of its own, and on a loaded machine each
    thread sent its requests only when the event loop let go of the GIL: 16 leaves'
    requests went out over 0.6 s (boto3's 32 within 0.05 s). Now one thread sends every
    leaf's ranged GETs, in file order, before it waits for any: the server holds them all
    at once, however few reader threads the restore is given."""
    store = object_backend.open()
    rng = np.random.default_rng(7)
    tree = {f"w{i:02d}": rng.standard_normal(2 * MiB // 8 + 17 * i) for i in range(6)}  # 2 MiB+: one GET each
    tree["small"] = np.arange(10)
    atomicstore.save("state", tree, store=store)

    def is_state_get(environ: dict[str, Any]) -> bool:
        return is_ranged_get(environ) and environ.get("PATH_INFO", "").endswith("/state.msgpack")

    g = gate(object_backend, lambda n: n >= 6, match=is_state_get)
    # (with a target: a state this small would otherwise be read whole, by one streamed read)
    got = atomicstore.restore("state", {k: np.zeros_like(v) for k, v in tree.items()}, store=store, threads=1)
    assert not g.timed_out and g.most >= 6, f"only {g.most} of the 6 leaves' GETs were sent before one was answered"
    assert sorted(got) == sorted(tree)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())


def _vm_flags(addr: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``addr``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_NOHUGEPAGE is Linux's")
def test_a_restores_fresh_arrays_ask_for_small_pages(object_backend):
    """numpy asks for transparent huge pages on every large array; where the kernel
    defragments on that request, faulting in a fresh 256 MiB destination waited for
    compaction (0.04-0.6 s here, against 0.09-0.14 s on small pages). A restore from an
    object store gives its fresh arrays small pages (``nh`` in the mapping's flags)."""
    store = object_backend.open()
    tree = {"w": np.arange(4 * MiB, dtype=np.float32)}  # 16 MiB
    atomicstore.save("pages", tree, store=store)
    got = atomicstore.restore("pages", {"w": np.zeros(1, np.float32)}, store=store)["w"]
    assert np.array_equal(got, tree["w"])
    assert "nh" in _vm_flags(got.ctypes.data + got.nbytes // 2)
    mine = np.empty(4 * MiB, np.float32)  # (numpy's own large arrays do not say so)
    assert "nh" not in _vm_flags(mine.ctypes.data + mine.nbytes // 2)


def test_a_truncated_state_file_names_the_leaf_it_cuts(object_backend):
    """Every large leaf read at once still names the leaf a short read cuts."""
    store = object_backend.open()
    tree = {"a": np.ones(MiB // 4, np.float32), "b": np.full(MiB // 2, 2.0, np.float32)}
    atomicstore.save("cut", tree, store=store)
    ckpt = store.open("cut")
    key = ckpt.key("state.msgpack")
    whole = store.driver.read(key)
    store.driver.put(key, whole[: len(whole) - 4096])  # b's last bytes are gone
    with pytest.raises(atomicstore.CorruptionError) as info:
        atomicstore.restore("cut", store=store)
    assert info.value.leaf == "b" and "state.msgpack" in str(info.value), info.value


class CutOnce:
    """WSGI middleware: the first ranged GET of a state file is answered with half its
    bytes (and a Content-Length that says so): a reply cut short on its way."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app, self.cut = app, 0

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if self.cut or not (is_ranged_get(environ) and environ.get("PATH_INFO", "").endswith("/state.msgpack")):
            return self.app(environ, start_response)
        self.cut += 1
        got: dict[str, Any] = {}
        body = b"".join(self.app(environ, lambda status, headers, exc=None: got.update(status=status, headers=headers)))
        headers = [(k, v) for k, v in got["headers"] if k.lower() != "content-length"]
        start_response(got["status"], [*headers, ("Content-Length", str(len(body) // 2))])
        return [body[: len(body) // 2]]


def test_a_reply_cut_short_once_is_read_again_not_called_damage(object_backend):
    """A ranged GET answered short (the object holds the bytes: the reply lost them) made
    the batch of large leaves fail; each leaf is then read again into its own array, and
    the restore returns the intact checkpoint instead of calling it damaged."""
    store = object_backend.open()
    tree = {"w0": np.arange(3 * MiB // 8, dtype=np.float64), "w1": np.ones(3 * MiB // 8)}
    atomicstore.save("cut-reply", tree, store=store)
    injector = object_backend.server.injector
    real = injector.app
    injector.app = cut = CutOnce(real)
    try:
        got = atomicstore.restore("cut-reply", {k: np.zeros(1) for k in tree}, store=store)
    finally:
        injector.app = real
    assert cut.cut == 1
    assert all(np.array_equal(got[k], v) for k, v in tree.items())


TRUNCATED = """
import json, sys
import numpy as np
import atomicstore

def kib(field):  # VmHWM: the peak since clear_refs (ru_maxrss counts the parent's from before exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

url, options = sys.argv[1], json.loads(sys.argv[2])
store = atomicstore.open_store(url, **options)
store.open("big")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak starts again from here
before = kib("VmRSS")
try:
    atomicstore.restore("big", {"a": np.zeros(1), "b": np.zeros(1)}, store=store)
    print(json.dumps({"error": None}))
except atomicstore.CorruptionError as exc:
    print(json.dumps({"error": str(exc), "leaf": exc.leaf, "extra": kib("VmHWM") - before}))
"""


def test_a_truncated_state_is_named_without_a_second_copy_of_it(s3_backend, tmp_path):
    """Naming the leaf a truncation cuts reads the leaves again into the arrays already
    allocated: the restore's memory stays the state's, not twice it (measured in a fresh
    process by peak RSS, a space measure)."""
    b = s3_backend
    store = b.open()
    size = 96 * MiB
    atomicstore.save("big", {"a": np.ones(MiB // 8), "b": np.full(size // 8, 2.0)}, store=store)
    key = store.open("big").key("state.msgpack")
    whole = store.driver.read(key)
    store.driver.put(key, whole[: len(whole) - 4096])
    out = subprocess.run([sys.executable, "-c", TRUNCATED, b.url, json.dumps(b.options)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["error"] and r["leaf"] == "b", r
    print(f"\nrestore of a truncated {size // MiB} MiB state: peak grew by {r['extra'] / MiB:.0f} MiB")
    assert r["extra"] < size + 64 * MiB, f"the restore of a {size // MiB} MiB state took {r['extra'] / MiB:.0f} MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_a_large_read_populates_its_destination_before_the_data_comes(object_backend, gate):
    """The event-loop thread that receives every response spent most of its CPU on the
    page faults of fresh destination arrays (measured in a fresh process: 0.8 s of 1.0 s
    for 256 MiB), serialised with the receiving. Now another thread populates the
    destination (``MADV_POPULATE_WRITE``: no byte changes) while the requests are on
    their way: the server answers only once every page of a fresh mapping is resident."""
    store = object_backend.open()
    size = 24 * MiB
    data = os.urandom(size)
    store.driver.put("obj", data)
    buf = mmap.mmap(-1, size)  # fresh anonymous memory: no page is resident yet
    try:
        assert not _resident(buf, size)
        g = gate(object_backend, lambda n: _resident(buf, size))
        assert store.driver.read_into("obj", 0, memoryview(buf)) == size
        assert not g.timed_out, "the destination was not populated before the data came"
        assert buf[:] == data
    finally:
        buf.close()


def test_populating_pages_never_changes_them():
    """``populate_pages`` faults pages in without writing them: safe while another thread
    fills the same buffer."""
    from atomicstore.drivers.parts import populate_pages

    size = 8 * MiB + 123
    buf = mmap.mmap(-1, size)
    try:
        arr = np.frombuffer(buf, np.uint8)
        arr[::4096] = 7  # some pages hold data, others were never touched
        arr[-1] = 9
        populate_pages(memoryview(buf)[5:])  # not page-aligned at either end
        assert _resident(buf, size)
        assert (arr[::4096] == 7).all() and arr[-1] == 9 and int(arr.sum()) == 7 * len(arr[::4096]) + 9
        populate_pages(memoryview(b"read-only"))  # not writable: nothing to do, no error
        populate_pages(memoryview(bytearray()))
    finally:
        del arr
        buf.close()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_reading_ranges_into_hostile_buffers_is_refused(kind, tmp_path, request):
    """``Checkpoint.read_ranges_into``/``read_range_into``/``read_into`` take writable
    contiguous buffers and int starts inside the file: anything else is
    InvalidArgumentError, and no buffer is written."""
    store = make_backend(kind, request, tmp_path).open()
    data = bytes(range(256)) * 64
    with store.transaction("c") as txn:
        txn.write_bytes("f", data)
    ckpt = store.open("c")
    hostile: list[Any] = [
        [(0, b"\0" * 10)],  # read-only
        [(0, np.frombuffer(bytes(10), np.uint8))],  # read-only numpy
        [(0, np.zeros((4, 4), np.uint8)[:, ::2])],  # not contiguous
        [(0, "abc")],  # not a buffer
        [(0, bytearray(10), 1)],  # not (start, buffer)
        [(7.9, bytearray(10))], [(True, bytearray(10))], [(None, bytearray(10))], [(-1, bytearray(10))],
        [(len(data) - 5, bytearray(10))],  # past the end
        [(0, bytearray(4)), "x"],
    ]
    for ranges in hostile:
        with pytest.raises(atomicstore.InvalidArgumentError):
            ckpt.read_ranges_into("f", ranges)
    for start, buf in [(0, b"\0" * 10), (1.5, bytearray(3)), (0, "abc")]:
        with pytest.raises(atomicstore.InvalidArgumentError):
            ckpt.read_range_into("f", start, buf)
    for bad in (b"\0" * len(data), "x" * len(data), bytearray(3)):
        with pytest.raises(atomicstore.InvalidArgumentError):
            ckpt.read_into("f", bad)
    for threads in ("x", 0, True, 1.5):
        with pytest.raises(atomicstore.InvalidArgumentError):
            ckpt.read_ranges_into("f", [(0, bytearray(3))], threads=threads)
    a, b = bytearray(5), np.zeros(7, np.uint8)
    ckpt.read_ranges_into("f", [(3, a), (100, b), (9, bytearray())], threads=2)
    assert bytes(a) == data[3:8] and b.tobytes() == data[100:107]


def test_many_small_ranges_are_not_all_sent_at_once(object_backend, gate):
    """The budget counts bytes: 200 ranges of 16 bytes would all go at once and wait for a
    pooled connection inside their own timeouts. At most ``io_threads`` requests (what the
    budget holds of full-size reads) are in flight."""
    store = object_backend.open()
    store.driver.put("many", bytes(range(256)) * 64)
    most = store.driver.capabilities.io_threads
    full_since: list[float] = []

    def over_or_full_a_while(n: int) -> bool:
        """Open once over the cap, or once the cap has been full for 0.3 s (no deadline
        before it fills: a loaded machine may take a while to send them)."""
        if n < most:
            full_since.clear()
            return False
        full_since[:] = full_since or [time.monotonic()]
        return n > most or time.monotonic() - full_since[0] > 0.3

    g = gate(object_backend, over_or_full_a_while, wait=30.0)
    bufs = [bytearray(16) for _ in range(200)]
    counts = store.driver.read_ranges_into("many", [(17 * i, memoryview(b)) for i, b in enumerate(bufs)])
    assert counts == [16] * 200
    assert all(bytes(b) == (bytes(range(256)) * 64)[17 * i : 17 * i + 16] for i, b in enumerate(bufs))
    assert g.most == most, f"{g.most} ranged GETs at once, not {most}"


def _is_get_of(*names: str) -> Callable[[dict[str, Any]], bool]:
    def match(environ: dict[str, Any]) -> bool:
        return environ.get("REQUEST_METHOD") == "GET" and environ.get("PATH_INFO", "").endswith(names)
    return match


#: metadata too large for the commit marker to carry the manifest (as a checkpoint of a
#: writer before the marker carried it, or one with a large manifest)
NOT_CARRIED = {"pad": "x" * MARKER_INLINE_BYTES}


def test_a_restore_reads_the_index_beside_the_manifest(object_backend, gate):
    """A restore read the marker, then the manifest, then the index: three round trips
    before the first byte of data (boto3 sends one HEAD). The marker names the attempt, so
    the index is read together with the manifest: the server holds both at once. (Where
    the marker carries both, neither is read: the next test.)"""
    store = object_backend.open()
    tree = {"w": np.arange(1000.0), "b": {"c": np.ones(3, np.int8)}}
    atomicstore.save("ahead", tree, store=store, metadata=NOT_CARRIED)
    g = gate(object_backend, lambda n: n >= 2, match=_is_get_of("/manifest.json", "/index.msgpack"))
    got = atomicstore.restore("ahead", store=store)
    assert not g.timed_out and g.most == 2, f"{g.most} of the manifest and index GETs were in flight at once"
    assert np.array_equal(got["w"], tree["w"]) and np.array_equal(got["b"]["c"], tree["b"]["c"])


class Recorder:
    """WSGI middleware: records every request as (method, path)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app, self.seen = app, []

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        self.seen.append((environ.get("REQUEST_METHOD"), environ.get("PATH_INFO", "")))
        return self.app(environ, start_response)


@pytest.fixture
def recorded() -> Iterator[Callable[[Backend], Recorder]]:
    installed: list[tuple[Any, Any]] = []

    def install(backend: Backend) -> Recorder:
        injector = backend.server.injector
        installed.append((injector, injector.app))
        injector.app = r = Recorder(injector.app)
        return r

    yield install
    for injector, app in reversed(installed):
        injector.app = app


def test_a_restore_reads_only_the_commit_point_before_its_data(object_backend, recorded):
    """The commit marker carries the manifest and the index (small files of the attempt,
    checked by the reader against the digest the marker names and the manifest's CRC32C):
    a restore reads the marker, then the data. One round trip of metadata, as boto3's
    HEAD; it was three, then two."""
    store = object_backend.open()
    tree = {"w": np.arange(1000.0), "b": {"c": np.ones(3, np.int8)}}
    atomicstore.save("carried", tree, store=store)
    r = recorded(object_backend)
    got = atomicstore.restore("carried", store=store)
    assert np.array_equal(got["w"], tree["w"]) and np.array_equal(got["b"]["c"], tree["b"]["c"])
    reads = [p for m, p in r.seen if m == "GET"]
    assert [p for p in reads if p.endswith(("/" + MANIFEST_FILE, "/index.msgpack"))] == [], reads
    assert len([p for p in reads if p.endswith("/" + MARKER_FILE)]) == 1, reads
    assert all(m == "GET" for m, _ in r.seen), r.seen  # (and no HEAD, LIST or write)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_the_commit_marker_carries_what_fits_and_a_reader_checks_it(kind, tmp_path, request, recorded):
    """The marker carries the manifest, then small files whole, in the order they were
    closed, while they fit in MARKER_INLINE_BYTES; never a file of a part or more. A copy
    is used only if it checks out (the manifest: the digest the marker names; a file: its
    size and CRC32C in the manifest): a hostile or damaged copy is read from storage
    instead, and a malformed ``inline`` is ignored, as readers before it ignore it all."""
    b = make_backend(kind, request, tmp_path)
    store = b.open()
    small, mid, late = b"fine", os.urandom(20 * 1024), os.urandom(10 * 1024)
    with store.transaction("c") as txn:
        txn.write_bytes("small.bin", small)
        with txn.open("mid.bin") as f:  # (written in pieces: kept whole)
            f.write(mid[:5000])
            f.write(mid[5000:])
        txn.write_bytes("late.bin", late)  # (no room left for it)
        txn.write_bytes("big.bin", bytes(5 * MiB))
    key = f"c/{MARKER_FILE}"
    raw = store.driver.read(key)
    marker = Marker.from_bytes(raw, where=key)
    assert sorted(marker.inline) == [MANIFEST_FILE, "mid.bin", "small.bin"]
    assert marker.inline["small.bin"] == small and marker.inline["mid.bin"] == mid
    assert sum(len(v) for v in marker.inline.values()) <= MARKER_INLINE_BYTES < len(raw) < MAX_MARKER_BYTES

    def read_all(ahead: list[str]) -> list[tuple[str, str]]:
        r = recorded(b)
        ckpt = store.open("c", read_ahead=ahead)
        assert [ckpt.read_bytes(p) for p in ("small.bin", "mid.bin", "late.bin")] == [small, mid, late]
        return [(m, p.rsplit("/", 1)[-1]) for m, p in r.seen]

    # carried: the marker, then only late.bin (read ahead beside nothing: no manifest GET)
    assert read_all(["small.bin", "mid.bin", "late.bin"]) == [("GET", MARKER_FILE), ("GET", "late.bin")]
    doc = json.loads(raw)
    hostile = [
        dict(doc, inline=dict(doc["inline"], **{"small.bin": "RklORQ=="})),  # b"FINE": CRC mismatch
        dict(doc, inline=dict(doc["inline"], **{MANIFEST_FILE: "e30="})),  # b"{}": not the digest
        dict(doc, inline={"small.bin": 7, "mid.bin": "not base64!", MANIFEST_FILE: None, "x": [1]}),
        dict(doc, inline="everything"),
    ]
    for bad in hostile:
        store.driver.put(key, json.dumps(bad).encode())
        assert store.open("c").manifest.files["mid.bin"].size == len(mid)
        seen = read_all(["small.bin", "mid.bin"])
        assert ("GET", "small.bin") in seen or ("GET", MANIFEST_FILE) in seen, seen  # read from storage
    store.driver.put(key, json.dumps(dict(doc, inline={"pad": "A" * MAX_MARKER_BYTES})).encode())
    with pytest.raises(atomicstore.CorruptionError):  # (over the limit every reader has)
        store.open("c")
    store.driver.put(key, raw)
    # an overwrite records the marker it replaced without its copies
    with store.transaction("c", overwrite=True) as txn:
        txn.write_bytes("small.bin", b"new")
    now = Marker.from_bytes(store.driver.read(key), where=key)
    assert now.replaces is not None and now.replaces.attempt == marker.attempt and not now.replaces.inline
    assert "inline" not in json.loads(store.driver.read(key))["replaces"]
    assert store.read_bytes("c", "small.bin") == b"new"
    # verify compares the stored manifest byte for byte (attacker finding: it compared
    # the parsed manifests, and passed one that every reader without the copy refuses)
    prefix = store.open("c").prefix
    stored = store.driver.read(f"{prefix}/{MANIFEST_FILE}")
    store.driver.put(f"{prefix}/{MANIFEST_FILE}", stored + b"\n ")
    assert store.read_bytes("c", "small.bin") == b"new"  # (the copy: the data is intact)
    with pytest.raises(atomicstore.CorruptionError, match="manifest"):
        store.verify("c")


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_a_file_read_ahead_is_checked_and_read_once(kind, tmp_path, request):
    """What ``Store.open(read_ahead=...)`` read beside the manifest is used once and only
    if it matches the manifest: a damaged index is read again (and then named, as any
    damaged file); a second read goes to storage; one over the read-ahead limit, or gone
    meanwhile, is read (or missed) the usual way."""
    b = make_backend(kind, request, tmp_path)
    store = b.open()
    with store.transaction("c", metadata=NOT_CARRIED) as txn:  # (read ahead, not carried)
        txn.write_bytes("small.bin", b"fine")
        txn.write_bytes("big.bin", bytes(5 * MiB))
        txn.write_bytes("gone.bin", b"soon gone")
    ckpt = store.open("c", read_ahead=["small.bin", "big.bin", "gone.bin"])
    assert ckpt.read_bytes("small.bin") == b"fine" and ckpt.read_bytes("big.bin") == bytes(5 * MiB)
    store.driver.delete(ckpt.key("gone.bin"))
    if kind != "local":  # (a local read has no round trip to save: nothing is read ahead)
        assert ckpt.read_bytes("gone.bin") == b"soon gone"  # read ahead, checked: no request
    with pytest.raises(atomicstore.AtomicStoreError):
        ckpt.read_bytes("gone.bin")  # (again:) from storage, where it is gone
    store.driver.put(ckpt.key("small.bin"), b"FINE")  # damaged after the commit
    with pytest.raises(atomicstore.ChecksumMismatchError) as info:
        store.open("c", read_ahead=["small.bin"]).read_bytes("small.bin")
    assert info.value.path == "small.bin", info.value
    class Lying(list):  # (attacker finding: the cap was checked on len(), then iterated whole)
        def __len__(self) -> int:
            return 0

    for hostile in ("small.bin", ["../x"], ["a"] * 9, [b"small.bin"], 7, None, Lying(["small.bin"] * 40)):
        with pytest.raises(atomicstore.InvalidArgumentError):
            store.open("c", read_ahead=hostile)
    with pytest.raises(atomicstore.InvalidArgumentError):  # (was a TypeError once read ahead)
        store.open("c", read_ahead=["small.bin"]).read_bytes(["small.bin"])


@pytest.mark.parametrize("kind", ["s3", "gcs"])
@pytest.mark.parametrize("action", ["overwrite", "delete"])
def test_a_checkpoint_replaced_while_its_manifest_is_read_is_not_called_damage(kind, action, request, tmp_path,
                                                                              gate):
    """Attacker finding: another writer overwrites or deletes the checkpoint while a
    restore's manifest GET is held at the server. The marker it read names an attempt
    that is gone, and restore called that damage (CorruptionError: the manifest is
    missing). Now it opens again: the checkpoint that is there now, or NotFoundError."""
    b = make_backend(kind, request, tmp_path)
    store, other = b.open(), b.open()
    old, new = {"w": np.full(100, 1.0)}, {"w": np.full(100, 2.0), "x": np.ones(3)}
    atomicstore.save("c", old, store=store, metadata=NOT_CARRIED)  # (its manifest is read)
    release, out = threading.Event(), {}
    armed = [True]

    def first_manifest_get(environ: dict[str, Any]) -> bool:
        if _is_get_of("/manifest.json")(environ) and armed[0]:
            armed[0] = False
            return True
        return False

    g = gate(b, lambda n: release.is_set(), wait=20.0, match=first_manifest_get)

    def read() -> None:
        try:
            out["tree"] = atomicstore.restore("c", store=store)
        except Exception as exc:  # noqa: BLE001 - asserted below
            out["error"] = exc

    t = threading.Thread(target=read)
    t.start()
    deadline = time.monotonic() + 10
    while g.waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert g.waiting == 1, "the manifest GET never reached the gate"
    if action == "overwrite":
        atomicstore.save("c", new, store=other, overwrite=True)
    else:
        other.delete("c")
    release.set()
    t.join(30)
    assert not g.timed_out
    if action == "overwrite":
        assert "tree" in out, out
        assert sorted(out["tree"]) == ["w", "x"] and np.array_equal(out["tree"]["w"], new["w"])
    else:
        assert isinstance(out.get("error"), atomicstore.NotFoundError), out
