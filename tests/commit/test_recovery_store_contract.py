"""Issue 21, the four questions for ``Store.recover()`` and the Store entry points
(``open_store``, ``list``, ``delete``, ``verify``): what if what it reads is overwritten or
deleted between two of its requests, what if it is given hostile or oversized input,
what if the store is read-only, what if the process forked (the last in
``tests/drivers/test_fork_drivers.py``), each answered by a test here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import make_backend
from crashsim import Crasher, CrashingDriver, SimulatedCrash

import atomicstore
from atomicstore.commit.manifest import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Marker
from atomicstore.drivers.local import LocalDriver
from atomicstore.testing.faults import FaultPlan, is_mutation, object_key, request_kind

FUTURE = time.time() + 10**7


def save(store: atomicstore.Store, name: str, data: bytes = b"x" * 100) -> None:
    with store.transaction(name) as txn:
        txn.write_bytes("a.bin", data)
        txn.write_bytes("b.bin", data[::-1])


def leftovers(store: atomicstore.Store) -> None:
    """A committed ``keep`` and the leftovers of a crashed save."""
    save(store, "keep")
    with pytest.raises(SimulatedCrash):
        save(atomicstore.Store(CrashingDriver(store.driver, Crasher(crash_at=4)), lease_ttl=1), "lost")


# -- 1. overwritten or deleted between two requests ------------------------------------------
class HeldLocal(LocalDriver):
    """Local disk whose streamed reads of a key ending with :attr:`held` wait, before their
    first chunk, until the test lets them go: the scheduler that puts a writer exactly
    between two of a reader's requests."""

    held = ""
    entered: threading.Event
    go: threading.Event

    def iter_read(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        if self.held and key.endswith(self.held) and not self.entered.is_set():
            self.entered.set()
            assert self.go.wait(30)
        yield from super().iter_read(key, chunk_size)


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
@pytest.mark.parametrize("then", ["overwritten", "deleted"])
def test_verify_of_a_checkpoint_changed_between_two_of_its_reads(kind, then, request, tmp_path):
    """``Store.verify`` has read ``a.bin`` of a checkpoint when another writer overwrites
    (or deletes) it, before ``b.bin`` is read: that is no damage. It says the checkpoint
    was replaced or deleted while it was verified (PreconditionFailedError, as restore
    does), never ChecksumMismatchError or a NotFoundError about one of its files; verified
    again, it checks the overwrite's checkpoint, or finds none."""
    entered, go = threading.Event(), threading.Event()
    if kind == "local":
        driver = HeldLocal(None, str(tmp_path / "store"), url=str(tmp_path / "store"))
        driver.held, driver.entered, driver.go = "/b.bin", entered, go
        store, other = atomicstore.Store(driver), atomicstore.open_store(tmp_path / "store")
    else:
        backend = make_backend(kind, request, tmp_path)
        store, other = backend.open(), backend.open()

        def hold(environ: dict[str, Any]) -> bool:
            if request_kind(environ) == "get" and (object_key(environ) or "").endswith("/b.bin") \
                    and not entered.is_set():
                entered.set()
                go.wait(30)
            return False

        backend.faults(FaultPlan(stalls=[(hold, 0.0)]))
    save(other, "c", b"1" * 100)
    result: dict[str, Any] = {}

    def verify() -> None:
        try:
            result["ok"] = store.verify("c")
        except Exception as exc:  # noqa: BLE001 - judged below
            result["error"] = exc

    th = threading.Thread(target=verify)
    th.start()
    assert entered.wait(30), "verify never read b.bin"
    try:
        if then == "overwritten":
            with other.transaction("c", overwrite=True) as txn:
                txn.write_bytes("a.bin", b"2" * 100)
                txn.write_bytes("b.bin", b"3" * 100)
        else:
            other.delete("c")
    finally:
        go.set()
        th.join(60)
    err = result.get("error")
    assert isinstance(err, atomicstore.PreconditionFailedError) and "verify it again" in str(err), repr(err)
    if then == "overwritten":
        assert store.verify("c").attempt == other.manifest("c").attempt
    else:
        with pytest.raises(atomicstore.NotFoundError, match="no committed checkpoint"):
            store.verify("c")


# -- 2. hostile or oversized input ------------------------------------------------------------
def test_recover_refuses_a_nan_clock_and_a_dry_run_that_is_not_a_bool(tmp_path):
    """``now=nan`` compares false with every lease time: every save in flight would look
    dead and be removed. It is refused, as is ``dry_run="no"`` (truthy: it would not clean),
    and the save in flight commits."""
    store = atomicstore.open_store(tmp_path, lease_ttl=3600)
    txn = store.transaction("busy")
    txn.write_bytes("a.bin", b"in flight")
    for kwargs in ({"now": float("nan")}, {"now": "1"}, {"now": True}, {"dry_run": "no"}):
        with pytest.raises(atomicstore.InvalidArgumentError):
            store.recover(grace=0, **kwargs)
    txn.commit()
    assert store.read_bytes("busy", "a.bin") == b"in flight"


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("name", ["", "a/b", "..", "../keep", ".atomicstore", "keep/a.bin", "x\x00y", 7, None])
def test_delete_verify_and_open_refuse_hostile_names(kind, name, request, tmp_path):
    """A name that could escape the root, reach the reserved directory or a file inside a
    checkpoint is refused before any request (InvalidArgumentError); nothing changes."""
    store = make_backend(kind, request, tmp_path).open()
    save(store, "keep")
    before = store.driver.find("")
    for call in (store.delete, store.verify, store.open):
        with pytest.raises(atomicstore.InvalidArgumentError):
            call(name)
    assert store.driver.find("") == before and store.list() == ["keep"]


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_oversized_markers_and_manifests_are_never_read_whole(kind, request, tmp_path):
    """A commit marker of 8 MiB (its limit is 64 KiB) and a marker naming a manifest over
    the 64 MiB manifest limit, put there by someone else: list, open, verify, recover and
    delete never read more than the limit of either (every GET of them is ranged, within
    limit + 1 bytes); open and verify refuse them (CorruptionError, 'larger than'),
    recovery leaves them (it never touches what it cannot read), delete removes them."""
    backend = make_backend(kind, request, tmp_path)
    store = backend.open()
    d = store.driver
    d.put("evil/commit_success.txt", b"{" * (8 * 2**20))
    manifest = b" " * (MAX_MANIFEST_BYTES + 1024)
    attempt = "20260101T000000-0123456789ab"
    d.put(f"huge/attempt-{attempt}/manifest.json", manifest)
    d.put("huge/commit_success.txt", Marker.new("huge", attempt, "someone", manifest).to_bytes())
    ranges: list[tuple[str, str]] = []

    def record(environ: dict[str, Any]) -> bool:
        key = object_key(environ) or ""
        if request_kind(environ) == "get" and key.endswith(("evil/commit_success.txt", "/manifest.json")):
            ranges.append((key, environ.get("HTTP_RANGE", "")))
        return False

    backend.faults(FaultPlan(stalls=[(record, 0.0)]))
    assert store.list() == ["evil", "huge"]
    for name in ("evil", "huge"):
        with pytest.raises(atomicstore.CorruptionError, match="larger than"):
            store.open(name)
        with pytest.raises(atomicstore.CorruptionError, match="larger than"):
            store.verify(name)
    report = store.recover(now=FUTURE)
    assert not report.actions and sorted(report.committed) == ["evil", "huge"], report.summary()
    assert ranges, "nothing was read"
    limits = {"commit_success.txt": MAX_MARKER_BYTES, "manifest.json": MAX_MANIFEST_BYTES}
    for key, rng in ranges:
        limit = limits[key.rsplit("/", 1)[1]]
        assert rng.startswith("bytes=0-") and int(rng[len("bytes=0-"):]) <= limit, (key, rng)
    for name in ("evil", "huge"):
        store.delete(name)
    assert store.list() == []


def test_an_oversized_manifest_on_local_disk_is_never_read_whole(tmp_path):
    """A 1 GiB (sparse) ``manifest.json`` in a checkpoint directory: open and verify refuse
    it and recovery passes, allocating about the 64 MiB limit at most, never the file."""
    store = atomicstore.open_store(tmp_path)
    save(store, "ok")
    (tmp_path / "huge").mkdir()
    with open(tmp_path / "huge" / "manifest.json", "wb") as f:
        f.truncate(2**30)
    tracemalloc.start()
    try:
        for call in (store.open, store.verify):
            with pytest.raises(atomicstore.CorruptionError, match="larger than"):
                call("huge")
        store.recover(now=FUTURE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_MANIFEST_BYTES * 4, f"{peak / 2**20:.0f} MiB allocated"  # (the file: 1 GiB)
    assert sorted(store.list()) == ["huge", "ok"]
    store.verify("ok")


# -- 3. a read-only store ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_read_only_credentials(kind, request, tmp_path):
    """Every mutating request answered 403 (read-only credentials): open_store, list,
    verify and a dry-run recovery work; a recovery with something to remove and a delete
    raise StorageError (403), nothing is changed."""
    backend = make_backend(kind, request, tmp_path)
    leftovers(backend.open())
    before = backend.open().driver.find("")
    backend.faults(FaultPlan(deny=is_mutation))
    store = backend.open()
    assert store.list() == ["keep"]
    store.verify("keep")
    assert store.recover(dry_run=True, now=FUTURE).actions
    with pytest.raises(atomicstore.StorageError, match="403|Forbidden|Access Denied|forbidden"):
        store.recover(now=FUTURE)
    with pytest.raises(atomicstore.StorageError, match="403|Forbidden|Access Denied|forbidden"):
        store.delete("keep")
    backend.faults(None)
    assert store.driver.find("") == before
    store.verify("keep")


RO_SCRIPT = textwrap.dedent("""
    import json, sys, atomicstore
    out = {}
    def step(what, fn):
        try:
            out[what] = ["ok", fn()]
        except atomicstore.AtomicStoreError as exc:
            out[what] = [type(exc).__name__, str(exc)]
    for root in sys.argv[1:]:
        st = atomicstore.open_store(root)
        step(root + " list", st.list)
        step(root + " verify", lambda: st.verify("keep").attempt)
        step(root + " dry-run", lambda: len(st.recover(dry_run=True, now=2e9).actions))
        step(root + " recover", lambda: len(st.recover(now=2e9).actions))
        step(root + " delete", lambda: st.delete("keep"))
    print(json.dumps(out))
""")


def test_a_read_only_mount(tmp_path):
    """A real read-only bind mount (an evaluation job's view), in a private mount
    namespace: open_store, list, verify, a dry-run recovery and a recovery with nothing to
    remove work; a recovery with leftovers and a delete raise StorageError naming the
    read-only filesystem; nothing is changed."""
    dirty, clean = tmp_path / "dirty", tmp_path / "clean"
    leftovers(atomicstore.open_store(dirty))
    save(atomicstore.open_store(clean), "keep")
    (tmp_path / "ro.py").write_text(RO_SCRIPT)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    r = subprocess.run(["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{tmp_path}" "{tmp_path}" && exec '
                        f'"{sys.executable}" "{tmp_path / "ro.py"}" "{dirty}" "{clean}"'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for root in (dirty, clean):
        assert got[f"{root} list"] == ["ok", ["keep"]]
        assert got[f"{root} verify"][0] == "ok"
        assert got[f"{root} delete"][0] == "StorageError" and "Read-only file system" in got[f"{root} delete"][1]
    assert got[f"{dirty} dry-run"][0] == "ok" and got[f"{dirty} dry-run"][1] > 0
    assert got[f"{dirty} recover"][0] == "StorageError" and "Read-only file system" in got[f"{dirty} recover"][1]
    assert got[f"{clean} dry-run"] == ["ok", 0] and got[f"{clean} recover"] == ["ok", 0]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    assert os.listdir(clean) and atomicstore.open_store(dirty).list() == ["keep"]
