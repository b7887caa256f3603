"""The parallel data path of object stores (S3 multipart, GCS parallel composite upload).

Parts of every file of a save draw from one in-flight budget per store, so several files'
parts fly at once and a stalled part never holds back the others; a failed part aborts
the upload and recovery removes whatever is left (never the components of an upload in
flight); the leaves' own buffers are uploaded without copies, so a save's extra memory
stays within the bound; restores read ranges in parallel and check every leaf.

Concurrency is observed on the server: :class:`Tracker` wraps the fake behind the fault
injector and holds every part upload for a moment, recording which are in flight at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import FAST_RETRY, Backend

import atomicstore
from atomicstore.drivers.gcs import COMPONENTS, MAX_COMPOSE
from atomicstore.drivers.parts import PartBody
from atomicstore.testing.faults import FaultPlan, is_gcs, object_key, query

MiB = 2**20


# -- observing the server ---------------------------------------------------------------------
def part_of(environ: dict[str, Any]) -> tuple[str, int] | None:
    """(file key, part number) of a part upload: an S3 UploadPart, or the media upload of a
    GCS composite component (``<root>/.atomicstore/uploads/<key>/<upload>/<n>``)."""
    q = query(environ)
    if is_gcs(environ):
        name = q.get("name", "")
        if environ.get("PATH_INFO", "").startswith("/upload/") and f"/{COMPONENTS}/" in f"/{name}":
            rest = name.split(f"{COMPONENTS}/", 1)[1]
            key, _upload, n = rest.rsplit("/", 2)
            return key, int(n) if n.isdigit() else 0
        return None
    if environ.get("REQUEST_METHOD") == "PUT" and "partNumber" in q:
        return (object_key(environ) or "").partition("/")[2], int(q["partNumber"])
    return None


def is_ranged_get(environ: dict[str, Any]) -> bool:
    return environ.get("REQUEST_METHOD") == "GET" and "HTTP_RANGE" in environ


def range_length(environ: dict[str, Any]) -> int:
    """Bytes a ``Range: bytes=a-b`` header asks for (0 for any other form)."""
    first, _, last = environ.get("HTTP_RANGE", "").removeprefix("bytes=").partition("-")
    return int(last) - int(first) + 1 if first.isdigit() and last.isdigit() else 0


class Tracker:
    """WSGI middleware in front of a fake (behind the fault injector): every request
    ``watch`` selects is held ``hold`` seconds and recorded while in flight. With
    ``gather``, a request is held only until ``gather`` of them are in flight at once (at
    most ``hold``; from then on none is held): a count of concurrent requests that does not
    depend on how fast a loaded machine sends them."""

    def __init__(self, app: Callable[..., Iterable[bytes]], watch: Callable[[dict], Any], hold: float,
                 gather: int | None = None) -> None:
        self.app, self.watch, self.hold, self.gather = app, watch, hold, gather
        self.gathered = threading.Event()
        self.lock = threading.Lock()
        self.now: dict[int, tuple[Any, int]] = {}  # in flight: id -> (what, bytes)
        self.max_count = 0
        self.max_bytes = 0
        self.max_files = 0  # most distinct files with a part in flight at once
        self.seen: list[Any] = []

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        what = self.watch(environ)
        if not what:
            return self.app(environ, start_response)
        size = int(environ.get("CONTENT_LENGTH") or 0)
        me = id(environ)
        with self.lock:
            self.now[me] = (what, size)
            self.seen.append(what)
            self.max_count = max(self.max_count, len(self.now))
            self.max_bytes = max(self.max_bytes, sum(n for _, n in self.now.values()))
            files = {w[0] for w, _ in self.now.values() if isinstance(w, tuple)}
            self.max_files = max(self.max_files, len(files))
            if self.gather is not None and len(self.now) >= self.gather:
                self.gathered.set()
        try:
            if self.gather is None:
                time.sleep(self.hold)
            else:
                self.gathered.wait(self.hold)
            return self.app(environ, start_response)
        finally:
            with self.lock:
                del self.now[me]


@pytest.fixture
def tracked(object_backend: Backend) -> Iterator[Callable[..., Tracker]]:
    injector = object_backend.server.injector
    inner = injector.app

    def install(watch: Callable[[dict], Any], hold: float = 0.3, gather: int | None = None) -> Tracker:
        t = Tracker(inner, watch, hold, gather)
        injector.app = t
        return t

    yield install
    injector.app = inner


def big_state(n: int, size: int) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    return {f"w{i}": rng.integers(0, 2**31, size // 4, dtype=np.int32) for i in range(n)} | {
        "small": {f"s{i}": np.full(64, i, np.float32) for i in range(20)}}


def leftovers(store: atomicstore.Store) -> dict[str, Any]:
    return {"objects": sorted(store.driver.find("")), "uploads": store.driver.list_incomplete_uploads("")}


# -- the write path ---------------------------------------------------------------------------
def test_parts_of_several_files_fly_at_once_within_one_budget(object_backend, tracked):
    budget = 20 * MiB  # four parts of 5 MiB for the whole store
    store = object_backend.open(block_size=5 * MiB, max_inflight_bytes=budget)
    t = tracked(part_of, hold=1.5)  # long enough that file a's parts are still held under load
    # a's three parts (12 MiB) leave room in the budget for b's first part, which must fly
    # while a's are held (with 17 MiB of a, b waited for a's parts, and whether any of them
    # was still in flight when b's arrived was a race: seen failing on Python 3.13)
    a, b = os.urandom(12 * MiB), os.urandom(18 * MiB)
    with store.transaction("step_1") as txn:
        for path, data in (("a.bin", a), ("b.bin", b)):
            f = txn.open(path)
            f.write(data)
            f.close(wait=False)  # completes in the background: the next file starts now
    assert store.read_bytes("step_1", "a.bin") == a and store.read_bytes("step_1", "b.bin") == b
    assert len(t.seen) == 3 + 4, t.seen  # 5 MiB parts (the last ones shorter)
    assert t.max_files == 2, "parts of both files must have been in flight at once"
    assert t.max_count >= 4, f"the budget holds four parts of 5 MiB, saw at most {t.max_count}"
    assert t.max_bytes <= budget and store.driver.inflight.peak <= budget
    assert store.driver.inflight.used == 0
    assert leftovers(store)["uploads"] == []


def test_a_stalled_part_does_not_hold_back_the_next_ones(object_backend, tracked):
    """The old writer waited for its oldest part before preparing the next one; now any
    finished part makes room, so the others go on while one part is stalled."""
    store = object_backend.open(block_size=5 * MiB, max_inflight_bytes=20 * MiB)
    t = tracked(part_of, hold=0.05)

    def first_part(env: dict) -> bool:
        p = part_of(env)
        return p is not None and p[1] == 1

    object_backend.faults(FaultPlan(stalls=[(first_part, 4.0)]))
    data = os.urandom(40 * MiB)  # eight parts
    with store.transaction("step_1") as txn:
        txn.write_bytes("a.bin", data)
    assert sorted(n for _, n in t.seen) == list(range(1, 9))
    # while part 1 was held 4 s (before the tracker, which records each part as it
    # reaches the server), parts 2..8 (more than the budget's four) all went through: part
    # 1 arrived last. (Was a time bound, 3.5 s with a 2 s stall: SeaweedFS on a loaded CI
    # once took 3.6 s in all.)
    assert [n for _, n in t.seen][-1] == 1, t.seen
    assert store.read_bytes("step_1", "a.bin") == data


def test_a_failed_part_aborts_the_upload_and_leaves_nothing(object_backend):
    store = object_backend.open(block_size=5 * MiB, max_inflight_bytes=20 * MiB,
                                retry=atomicstore.RetryPolicy(attempts=2, initial_wait=0.01, max_wait=0.01))

    def third_part(env: dict) -> bool:
        p = part_of(env)
        return p is not None and p[1] == 3

    object_backend.faults(FaultPlan(error_rate=1.0, applies_to=third_part))
    with pytest.raises(atomicstore.StorageError):
        atomicstore.save(f"{object_backend.url}/step_1", big_state(4, 8 * MiB), store=store)
    object_backend.faults(None)
    assert store.list() == []
    assert store.driver.inflight.used == 0
    # the upload was aborted (S3) or its components deleted (GCS); the attempt discarded
    assert leftovers(store) == {"objects": [], "uploads": []}


def test_a_part_sent_whole_when_the_upload_fails_is_not_left_behind(object_backend, tracked):
    """A part whose body the server has whole when the upload is given up may still be
    stored: cancelling its request does not stop the server (a closing connection flushes
    what it holds). The abort waits for it before it discards the upload, so nothing is
    left. It used to cancel it, and a GCS component could be stored after the discard."""
    store = object_backend.open(block_size=5 * MiB, max_inflight_bytes=20 * MiB,
                                retry=atomicstore.RetryPolicy(attempts=1))

    def second_part(env: dict) -> bool:
        p = part_of(env)
        return p is not None and p[1] == 2

    def third_part(env: dict) -> bool:
        p = part_of(env)
        return p is not None and p[1] == 3

    # part 2 is held at the server, after its request arrived and before its body is
    # read (the client has handed it all to the connection), until after part 3 failed
    t = tracked(lambda env: second_part(env) and part_of(env), hold=1.0)
    object_backend.faults(FaultPlan(error_rate=1.0, applies_to=third_part))
    with pytest.raises(atomicstore.StorageError):
        atomicstore.save(f"{object_backend.url}/step_1", {"w": np.ones(5 * MiB, np.int32)}, store=store)
    object_backend.faults(None)
    assert [p[1] for p in t.seen] == [2]
    time.sleep(1.5)  # (were it still on its way, it would have landed by now)
    assert store.list() == []
    assert store.driver.inflight.used == 0
    assert leftovers(store) == {"objects": [], "uploads": []}


def test_an_abort_waits_for_a_stalled_part_no_longer_than_its_bound(object_backend, tracked):
    """The abort lets a part the server has whole finish, but a stalled server does not
    hold it: after the operation timeout (here shorter than ABORT_WAIT, 10 s) the part is
    cancelled and the save's error raised; what the part may still store is recovery's."""
    store = object_backend.open(block_size=5 * MiB, max_inflight_bytes=20 * MiB, operation_timeout=1.5,
                                retry=atomicstore.RetryPolicy(attempts=1))

    def third_part(env: dict) -> bool:
        p = part_of(env)
        return p is not None and p[1] == 3

    t = tracked(lambda env: (p := part_of(env)) is not None and p[1] == 2 and p, hold=6.0)
    object_backend.faults(FaultPlan(error_rate=1.0, applies_to=third_part))
    began = time.monotonic()
    with pytest.raises(atomicstore.StorageError):
        atomicstore.save(f"{object_backend.url}/step_1", {"w": np.ones(5 * MiB, np.int32)}, store=store)
    took = time.monotonic() - began
    object_backend.faults(None)
    assert [p[1] for p in t.seen] == [2]
    assert took < 5.0, f"the abort waited {took:.1f} s for a part held 6 s"
    assert store.list() == [] and store.driver.inflight.used == 0
    time.sleep(6.5 - took)  # (the held request ends before the server stops)


def test_recovery_removes_the_parts_of_a_crashed_upload_but_not_of_one_in_flight(object_backend):
    store = object_backend.open(block_size=5 * MiB, lease_ttl=30)
    txn = store.transaction("step_1")
    f = txn.open("a.bin")
    f.write(os.urandom(12 * MiB))  # two parts uploaded; then the writer "dies"
    deadline = time.monotonic() + 20
    while store.driver.inflight.used and time.monotonic() < deadline:
        time.sleep(0.05)
    other = object_backend.open()
    report = other.recover(grace=0)  # the upload is older than grace, but its lease is alive
    assert not [a for a in report.actions if a.kind == "upload"], report.summary()
    uploads = other.driver.list_incomplete_uploads("")
    assert len(uploads) == 1 and uploads[0][0] == f"{txn.prefix}/a.bin"
    if object_backend.kind == "gcs":  # its components are objects in the reserved directory
        assert len([k for k in other.driver.find(COMPONENTS)]) == 2
    txn._lease.stop()  # the process is gone: no more renewals
    report = other.recover(now=time.time() + 30 + other.grace + 1)
    assert [a.kind for a in report.actions if a.kind == "upload"] == ["upload"], report.summary()
    assert leftovers(other) == {"objects": [], "uploads": []}


def test_lent_buffers_are_uploaded_unchanged_and_copies_are_made_of_the_rest(object_backend):
    """``write_borrowed`` pieces and copied bytes interleave within parts."""
    store = object_backend.open(block_size=5 * MiB)
    big = np.arange(3 * MiB, dtype=np.int32)  # 12 MiB, lent
    head, tail = os.urandom(1000), os.urandom(7 * MiB + 3)
    with store.transaction("step_1") as txn:
        f = txn.open("x")
        f.write(head)
        f.write(memoryview(big).cast("B"), borrow=True)
        f.write(tail)
        f.close()
    assert store.read_bytes("step_1", "x") == head + big.tobytes() + tail


@pytest.mark.parametrize("size", [0, 1, 5 * MiB, 10 * MiB, 10 * MiB + 1])
def test_boundary_sizes_round_trip(object_backend, size):
    store = object_backend.open(block_size=5 * MiB)
    data = os.urandom(size)
    with store.transaction("step_1") as txn:
        txn.write_bytes("x", data)
    assert store.read_bytes("step_1", "x") == data
    assert store.verify("step_1").files["x"].size == size
    assert leftovers(store)["uploads"] == []


def test_max_inflight_bytes_is_checked():
    with pytest.raises(atomicstore.InvalidArgumentError, match="max_inflight_bytes"):
        atomicstore.open_store("memory://x", max_inflight_bytes=1000)


def test_part_body_reads_across_pieces_and_seeks():
    a, b, c = b"abc", bytearray(b"defgh"), memoryview(b"ij")
    body = PartBody([memoryview(a), memoryview(b), c])
    assert len(body) == 10 and body.read(4) == b"abcd" and body.read() == b"efghij"
    body.seek(2)
    assert body.read(5) == b"cdefg" and body.tell() == 7
    body.seek(-1, os.SEEK_END)
    assert body.read() == b"j" and body.read() == b""


# -- GCS: compose -------------------------------------------------------------------------------
@pytest.fixture
def gcs_backend(request, tmp_path) -> Backend:
    from conftest import make_backend

    return make_backend("gcs", request, tmp_path)


def test_gcs_object_over_32_components_is_composed_in_a_tree(gcs_backend):
    store = gcs_backend.open(block_size=256 * 1024)
    data = os.urandom((MAX_COMPOSE + 5) * 256 * 1024 + 17)  # 38 components
    with store.one_file("checkpoint_1") as f:
        f.write(data)
    assert store.driver.read("checkpoint_1") == data
    raw = store.driver._metadata("checkpoint_1")
    assert raw["componentCount"] == 38 and "md5Hash" not in raw
    assert store.driver.info("checkpoint_1").crc32c is not None
    assert leftovers(store) == {"objects": ["checkpoint_1"], "uploads": []}


def test_gcs_compose_refused_for_an_existing_object_is_a_conflict(gcs_backend):
    store = gcs_backend.open(block_size=5 * MiB)
    w = store.driver.open_writer("k", exclusive=True)
    w.write(os.urandom(6 * MiB))  # one component uploaded
    store.driver.put("k", b"someone else's")  # the name is taken meanwhile
    with pytest.raises(atomicstore.AlreadyExistsError):
        w.close()
    assert store.driver.read("k") == b"someone else's"
    assert store.driver.list_incomplete_uploads("") == []  # components deleted


def test_gcs_compose_whose_reply_is_lost_is_recognised_as_ours(gcs_backend):
    store = gcs_backend.open(block_size=5 * MiB)

    def compose(env: dict) -> bool:
        return env.get("REQUEST_METHOD") == "POST" and env.get("PATH_INFO", "").endswith("/compose")

    data = os.urandom(11 * MiB)
    gcs_backend.faults(FaultPlan(lost_reply_rate=1.0, applies_to=compose, budget=1))
    with store.one_file("checkpoint_2") as f:  # ifGenerationMatch=0: the retry gets 412
        f.write(data)
    assert gcs_backend.server.injector.counts["lost_reply"] == 1
    assert store.driver.read("checkpoint_2") == data


def test_gcs_fake_compose_checks_sources_and_destination(gcs_backend):
    d = gcs_backend.open().driver
    g1 = d.put("c1", b"hello ")
    g2 = d.put("c2", b"world")
    bucket, o1 = d.split("c1")
    _, o2 = d.split("c2")
    out = d.compose("dest", [(o1, g1), (o2, g2)], {"ifGenerationMatch": "0"}, "u1")
    assert d.read("dest") == b"hello world" and out["componentCount"] == 2
    assert out["metadata"] == {"atomicstore-upload": "u1"}
    with pytest.raises(atomicstore.AlreadyExistsError):  # exists now
        d.compose("dest", [(o1, g1)], {"ifGenerationMatch": "0"}, "u2")
    with pytest.raises(atomicstore.StorageError, match="component"):  # a source at another generation
        d.compose("dest2", [(o1, str(int(g1) + 1))], {"ifGenerationMatch": "0"}, "u3")
    with pytest.raises(atomicstore.StorageError, match="component"):  # a missing source
        d.compose("dest2", [(o1 + "-gone", "1")], {}, "u4")
    # a composite of composites counts every component
    out = d.compose("dest3", [(d.split("dest")[1], out["generation"]), (o1, g1)], {}, "u5")
    assert out["componentCount"] == 3 and d.read("dest3") == b"hello worldhello "
    assert d.info("dest3").crc32c is not None


# -- the read path ------------------------------------------------------------------------------
def test_restore_reads_ranges_in_parallel_and_checks_every_leaf(object_backend, tracked):
    store = object_backend.open()
    # over 64 MiB: restored leaf by leaf, each leaf in ranges read at once
    state = {"big": np.arange(16 * MiB, dtype=np.int32), "mid": np.ones(3 * MiB, np.float32)}
    atomicstore.save(f"{object_backend.url}/step_1", state, store=store)
    chunk = store.driver.read_chunk  # 8 MiB (S3: 4 MiB)
    ranges = -(-64 * MiB // chunk) + -(-12 * MiB // chunk)
    # the leaves' ranges (not the small reads before them), held until all are in flight
    # (a fixed 0.2 s hold saw 18 of 19 on a loaded machine)
    t = tracked(lambda env: is_ranged_get(env) and range_length(env) >= MiB, hold=10.0, gather=ranges)
    back = atomicstore.restore(f"{object_backend.url}/step_1", store=store)
    assert all(np.array_equal(back[k], state[k]) for k in state)
    assert t.max_count == ranges, f"64 MiB + 12 MiB in {chunk // MiB} MiB ranges: saw {t.max_count} at once"
    # whole files too (read_into: ranges in parallel, CRC32C combined)
    ckpt = store.open("step_1")
    size = ckpt.files["state.msgpack"].size
    buf = bytearray(size)
    ckpt.read_into("state.msgpack", buf)

    # damage one byte in the middle of the big leaf: the restore names it
    key = ckpt.key("state.msgpack")
    raw = bytearray(store.driver.read(key))
    raw[len(raw) // 3] ^= 0xFF
    store.driver.put(key, bytes(raw))
    with pytest.raises(atomicstore.CorruptionError, match="big"):
        atomicstore.restore(f"{object_backend.url}/step_1", store=store)
    with pytest.raises(atomicstore.ChecksumMismatchError):
        store.open("step_1").read_into("state.msgpack", bytearray(size))
    with pytest.raises(atomicstore.ChecksumMismatchError):
        store.verify("step_1")


def test_ranged_read_past_the_end_is_short(object_backend):
    store = object_backend.open()
    store.driver.put("obj", os.urandom(20 * MiB + 5))
    buf = bytearray(30 * MiB)
    assert store.driver.read_into("obj", 0, memoryview(buf)) == 20 * MiB + 5
    assert store.driver.read_into("obj", 20 * MiB + 5, memoryview(buf)[:10]) == 0


# -- memory -------------------------------------------------------------------------------------
MEMORY_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import atomicstore

    url, opts, copies = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "copies"
    store = atomicstore.open_store(url, max_inflight_bytes=128 * 2**20, **opts)
    atomicstore.save(url + "/warm", {"x": np.ones(6 * 2**20, np.float32)}, store=store)  # clients, pools
    if copies:  # leaves under 64 KiB are packed into copied buffers
        state = {f"l{i}": np.full(16000, i, dtype=np.float32) for i in range(4096)}  # 256 MiB
    else:
        state = {f"layer_{i}": np.full(16 * 2**20, i, dtype=np.float32) for i in range(8)}  # 512 MiB
        state["small"] = {f"s{i}": np.ones(256, np.float32) for i in range(1000)}
    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    # ru_maxrss would be the parent's (it survives fork and exec, and the parent holds the
    # fakes' data): reset this process's high-water mark instead
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    atomicstore.save(url + "/step_1", state, store=store)
    print(json.dumps({"before": before, "peak_before": before, "peak": status("VmHWM"),
                      "inflight_peak": store.driver.inflight.peak}))
""")


@pytest.mark.parametrize("copies", [False, True], ids=["lent", "copies"])
def test_save_memory_stays_within_the_bound(object_backend, copies):
    """Lent leaves (big arrays): extra memory ≤ 64 MiB + one buffer, whatever the budget
    (128 MiB here). Copied parts (a state of small leaves): ≤ 64 MiB + the budget."""
    opts = dict(object_backend.options)
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, object_backend.url, json.dumps(opts),
                          "copies" if copies else "lent"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    extra = r["peak"] - max(r["before"], r["peak_before"])
    print(f"\n{object_backend.kind} save ({'copies' if copies else 'lent'}): peak RSS grew by "
          f"{extra / MiB:.1f} MiB, in flight at most {r['inflight_peak'] / MiB:.0f} MiB")
    bound = 64 * MiB + (128 * MiB if copies else 16 * MiB)
    assert extra < bound, f"save added {extra / MiB:.0f} MiB"
    store = object_backend.open()
    assert store.list() == ["step_1", "warm"]
    assert leftovers(store)["uploads"] == []


def test_retry_of_a_part_after_a_reset_sends_the_same_bytes(object_backend):
    """A part body is re-read from its pieces on every try."""
    store = object_backend.open(block_size=5 * MiB, retry=FAST_RETRY)

    def part(env: dict) -> bool:
        return part_of(env) is not None

    object_backend.faults(FaultPlan(reset_rate=1.0, applies_to=part, budget=2))
    data = np.arange(4 * MiB, dtype=np.int32)  # 16 MiB, lent
    with store.transaction("step_1") as txn:
        f = txn.open("x")
        f.write(memoryview(data).cast("B"), borrow=True)
        f.close()
    assert object_backend.server.injector.counts["reset"] >= 1
    assert store.read_bytes("step_1", "x") == data.tobytes()


# -- found by a black-box attacker (issue 14) -------------------------------------------------
class Gate:
    """WSGI middleware: the first request ``pred`` selects waits until :attr:`release`
    is set (a scheduler for one interleaving; later matches pass)."""

    def __init__(self, app: Callable[..., Iterable[bytes]], pred: Callable[[dict], bool]) -> None:
        self.app, self.pred = app, pred
        self.arrived, self.release = threading.Event(), threading.Event()
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with self.lock:
            hold = not self.arrived.is_set() and self.pred(environ)
            if hold:
                self.arrived.set()
        if hold:
            self.release.wait(60)
        return self.app(environ, start_response)


@pytest.fixture
def gated(object_backend: Backend) -> Iterator[Callable[[Callable[[dict], bool]], Gate]]:
    injector = object_backend.server.injector
    inner = injector.app

    def install(pred: Callable[[dict], bool]) -> Gate:
        g = Gate(inner, pred)
        injector.app = g
        return g

    yield install
    injector.app = inner


def _wait_for_upload(store: atomicstore.Store) -> list[tuple[str, str, float]]:
    deadline = time.monotonic() + 30
    while not (found := store.driver.list_incomplete_uploads("")):
        assert time.monotonic() < deadline, "the upload never started"
        time.sleep(0.05)
    return found


def test_recovery_never_touches_uploads_of_a_sibling_root(object_backend):
    """``s3://b/ckpts`` and ``s3://b/ckpts2`` are two stores: recovering the first (even
    with ``grace=0``, as opening a manager does with its default) must not list, let alone
    abort, a live upload of the second (S3 listed uploads by the bare key prefix)."""
    srv = object_backend.server
    bucket = object_backend.url.split("://", 1)[1].split("/", 1)[0]
    sibling = atomicstore.open_store(srv.url(bucket, "ckpts2"), retry=FAST_RETRY, **object_backend.options)
    store = atomicstore.open_store(object_backend.url, retry=FAST_RETRY, **object_backend.options)
    payload = os.urandom(20 * MiB)
    with sibling.transaction("step_1") as txn:
        f = txn.open("big.bin")
        f.write(payload)  # parts start flying; the upload stays open until close
        _wait_for_upload(sibling)
        report = store.recover(grace=0)
        assert report.actions == [], report.actions
        f.close()
    assert sibling.open("step_1").read_bytes("big.bin") == payload


def test_abort_of_an_upload_that_is_gone_is_not_an_error(object_backend):
    """Recovery lists an unfinished upload, then the save completes it (or a concurrent
    recovery aborts it) before the abort: the abort finds nothing and must not fail."""
    store = atomicstore.open_store(object_backend.url, retry=FAST_RETRY, **object_backend.options)
    with store.transaction("step_1") as txn:
        f = txn.open("big.bin")
        f.write(os.urandom(20 * MiB))
        (key, upload_id, _), = _wait_for_upload(store)
        f.close()
    assert store.driver.list_incomplete_uploads("") == []
    store.driver.abort_upload(key, upload_id)  # completed meanwhile: nothing to abort
    store.driver.abort_upload(key, upload_id)  # and again, as a second recovery would
    assert len(store.open("step_1").read_bytes("big.bin")) == 20 * MiB


def test_one_file_restore_never_mixes_two_versions(object_backend, gated):
    """A one-file (flax-layout) checkpoint is replaced in place by an overwrite. A restore
    reading it in parallel ranges, with the overwrite landing between its ranges, must
    not return leaves of both versions: every range is conditional on the generation it
    first saw, so it fails with PreconditionFailedError ("read it again")."""
    from atomicstore.compat import flax as checkpoints

    so = dict(object_backend.options, retry=FAST_RETRY)
    n = 2 * MiB
    old = {"a": np.zeros(n // 4, np.int32), "b": np.zeros(n // 4, np.int32)}
    new = {"a": np.ones(n // 4, np.int32), "b": np.ones(n // 4, np.int32)}
    checkpoints.save_checkpoint(object_backend.url, old, step=1, storage_options=so)

    def leaf_b(environ: dict) -> bool:  # the ranged GET of leaf b's data (past leaf a)
        if not is_ranged_get(environ) or not (object_key(environ) or "").endswith("checkpoint_1"):
            return False
        start, end = map(int, environ["HTTP_RANGE"].split("=")[1].split("-"))
        return start > n and end - start + 1 >= n

    gate = gated(leaf_b)
    out: dict[str, Any] = {}

    def reader() -> None:
        try:
            out["v"] = checkpoints.restore_checkpoint(object_backend.url, target=None, step=1,
                                                      storage_options=so)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            out["e"] = exc

    t = threading.Thread(target=reader)
    t.start()
    assert gate.arrived.wait(60), "the restore never read leaf b by a ranged GET"
    checkpoints.save_checkpoint(object_backend.url, new, step=1, overwrite=True, storage_options=so)
    gate.release.set()
    t.join(120)
    assert isinstance(out.get("e"), atomicstore.PreconditionFailedError), out
    again = checkpoints.restore_checkpoint(object_backend.url, target=None, step=1, storage_options=so)
    assert all((np.asarray(v) == 1).all() for v in again.values())
