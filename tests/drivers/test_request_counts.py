"""Metadata requests scale with checkpoints, not objects (issue 14).

Counted on the S3 and GCS fakes with the fault layer's request log
(:meth:`FaultInjector.recording`), never timed: ``list()`` of 1,000 checkpoints of 100
files each, a ``CheckpointManager`` save with those 1,000 kept, one recovery pass, and the
round trips of a small save that wait on each other (with latency injected, requests sent
together overlap in the log, so :meth:`RequestLog.depth` counts them once).

The 100,000 objects are written straight into the fakes' memory (moto's backend, the GCS
fake's dict): valid checkpoints (marker, manifest, files) in a few seconds. SeaweedFS, a
real server, takes its objects through S3 (~300 a second here): it runs the tests of a
few thousand objects, not those of 100,000 (its paged listings are checked in
tests/drivers/test_seaweed.py).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import make_backend

import atomicstore
from atomicstore import CheckpointManager
from atomicstore.commit.manifest import FileEntry, Manifest, Marker, crc32c
from atomicstore.commit.strategies import new_attempt_id
from atomicstore.drivers.parts import ABORT_WAIT
from atomicstore.testing.faults import FaultPlan, LoggedRequest, RequestLog

KEPT = 1000
FILES = 100


def tree(v: float) -> dict[str, Any]:
    return {"w": np.full(8, v, np.float32), "step": v}


def is_data(r: LoggedRequest) -> bool:
    """A write of a checkpoint's own file (not its manifest, marker or lease)."""
    return r.kind == "put" and "/attempt-" in (r.key or "") and not (r.key or "").endswith("/manifest.json")


def metadata(log: RequestLog) -> list[LoggedRequest]:
    return [r for r in log if not is_data(r)]


def where(backend: Any) -> tuple[str, str]:
    """(bucket, root prefix) of a backend's store."""
    bucket, _, root = backend.url.split("://", 1)[1].partition("/")
    return bucket, root


def inject(backend: Any, objects: dict[str, bytes]) -> None:
    """Put objects (keys relative to the store root) straight into the fake's memory (on
    SeaweedFS: through its own S3 endpoint, many requests at once)."""
    bucket, root = where(backend)
    if backend.server_name == "seaweed":
        import s3fs

        opts = {**backend.options, "endpoint_url": backend.server.direct_endpoint}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        fs.pipe({f"{bucket}/{root}/{key}": data for key, data in objects.items()}, batch_size=64)
    elif backend.kind == "s3":
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        s3 = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
        for key, data in objects.items():
            s3.put_object(bucket, f"{root}/{key}", data, disable_notification=True)
    else:
        from atomicstore.testing.gcsfake import _Object

        app = backend.server.app
        with app.lock:
            objs = app.buckets[bucket]
            for key, data in objects.items():
                objs[f"{root}/{key}"] = _Object(data, next(app._gen), time.time())


def populate(backend: Any, steps: range, files: int, *, prefix: str = "checkpoint_") -> None:
    """Committed checkpoints ``<prefix><step>`` as ``CheckpointManager.save`` writes them
    (state, index and metadata of a real save), each with ``files - 2`` more files."""
    src = backend.open()
    CheckpointManager(backend.url, storage_options=backend.options, store=src, recover=False,
                      keep=10**6).save(0, tree(0))
    ck = src.open(f"{prefix}0")
    blobs = {p: ck.read_bytes(p) for p in ck.files}
    src.delete(f"{prefix}0")
    extra = {f"shards/{i:03d}.bin": bytes([i % 256]) * 3 for i in range(files - len(blobs))}
    contents = {**blobs, **extra}
    entries = {p: FileEntry(len(b), crc32c(b)) for p, b in contents.items()}
    objects: dict[str, bytes] = {}
    for s in steps:
        name, attempt = f"{prefix}{s}", new_attempt_id()
        man = Manifest(name=name, attempt=attempt, writer="populate", created=time.time(), files=entries,
                       metadata={**ck.metadata, "step": s}, committed=time.time()).to_bytes()
        base = f"{name}/attempt-{attempt}"
        objects.update({f"{base}/{p}": b for p, b in contents.items()})
        objects[f"{base}/manifest.json"] = man
        objects[f"{name}/commit_success.txt"] = Marker.new(name, attempt, "populate", man).to_bytes()
    inject(backend, objects)


@pytest.fixture(params=["s3", "gcs"])  # 100,000 objects: in the fakes' memory only
def big(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """A store holding 1,000 committed checkpoints of 100 files each."""
    backend = make_backend(request.param, request, tmp_path)
    populate(backend, range(1, KEPT + 1), FILES)
    return backend


def test_list_of_1000_checkpoints_of_100_files_costs_a_few_requests(big):
    store = big.open()
    with big.server.injector.recording() as log:
        names = store.list()
    assert names == [f"checkpoint_{s}" for s in range(1, KEPT + 1)]
    # one listing with the delimiter "/attempt-": a marker and one rolled-up prefix per
    # checkpoint (2,000 entries: 2 pages), not 100,000 objects (100 pages)
    assert len(log) <= 5, log.describe()
    assert log.kinds() == {"list": len(log)}
    with big.server.injector.recording() as log:
        committed = store.committed()
    assert list(committed) == names and all(committed.values())  # each marker's generation
    assert len(log) <= 5


def test_manager_save_with_1000_kept_costs_a_bounded_number_of_requests(big):
    mgr = CheckpointManager(big.url, storage_options=big.options, keep=1, keep_every_n_steps=1,
                            recover=False)
    with big.server.injector.recording() as first:
        mgr.save(KEPT + 1, tree(KEPT + 1))  # reads the metadata of every kept step once
    # (each of those reads is one conditional GET of the marker and one of the manifest)
    assert len(metadata(first)) <= 2 * (KEPT + 1) + 20, first.kinds()
    for step in (KEPT + 2, KEPT + 3):
        with big.server.injector.recording() as log:
            mgr.save(step, tree(step))
        meta = metadata(log)
        assert len(meta) <= 20, log.describe()
        assert sum(1 for r in log if is_data(r)) == 2  # state.msgpack and index.msgpack
        assert sum(1 for r in meta if r.kind == "list") <= 6  # two listings of ~2,000 entries
        # not one per kept step (7: one is the HEAD of <name> under the name's claim)
        assert sum(1 for r in meta if r.kind in ("get", "head")) <= 7
    assert mgr.all_steps() == list(range(1, KEPT + 4))
    assert mgr.restore()["step"] == KEPT + 3
    assert mgr.restore(500)["step"] == 0  # a populated step (its state is step 0's)


def test_manager_rereads_a_step_another_process_overwrote(object_backend):
    """The manager reuses the metadata it verified only while the step's commit point is
    at the same generation: a milestone that another process re-saved as an ordinary
    checkpoint is then deleted by retention (a cache that ignored generations would keep
    it), and the step saved since is read afresh."""
    b = object_backend
    mgr = CheckpointManager(b.url, storage_options=b.options, keep=1, recover=False)
    mgr.save(1, tree(1), milestone=True)
    mgr.save(2, tree(2))
    assert mgr.all_steps() == [1, 2]  # the milestone is kept
    other = CheckpointManager(b.url, storage_options=b.options, keep=10, overwrite=True, recover=False)
    other.save(1, tree(10))  # replaces step 1 (a plain checkpoint now) and removes step 2
    assert other.all_steps() == [1]
    assert not mgr.metadata(1)["milestone"]
    mgr.save(3, tree(3))
    assert mgr.all_steps() == [3], "retention judged step 1 by stale metadata"


def test_recovery_is_one_pass_over_the_objects(object_backend):
    b = object_backend
    populate(b, range(1, 41), 40)  # 40 checkpoints x 40 files: 1,640 objects
    store = b.open()
    with store.transaction("checkpoint_41") as txn:
        txn.write_bytes("a", b"a")
    crashed = store.transaction("checkpoint_42")  # a dead save: its attempt is removed
    store.driver.put(f"{crashed.prefix}/b", b"b")
    crashed._lease.stop()
    keys = len(store.driver.find(""))
    assert 1000 < keys <= 2000
    _, root = where(b)
    with b.server.injector.recording() as log:
        report = store.recover(now=time.time() + 10**6)
    assert [a.target for a in report.actions if a.kind == "attempt"] == [crashed._prefix], report.summary()
    listings = [r for r in log if r.kind == "list"]
    of_root = [r for r in listings if f"prefix={root}%2F&" in r.query or f"prefix={root}/&" in r.query]
    assert len(of_root) == 2, log.describe()  # one pass: the two pages of one listing
    # other listings: of the attempt removed (what is under it, afresh) and of the
    # reserved directory (unfinished uploads), never of the checkpoints' objects again
    others = [r for r in listings if r not in of_root]
    assert all("checkpoint_42%2Fattempt-" in r.query or "checkpoint_42/attempt-" in r.query
               or ".atomicstore" in r.query for r in others), log.describe()
    # each marker read once, by one GET (recovery only nominates with it); one more
    # fresh read of the dead attempt's marker before its removal
    markers = [r for r in log if (r.key or "").endswith("/commit_success.txt")]
    assert sum(1 for r in markers if r.kind == "get") == 41, log.describe()
    assert len(markers) <= 41 + 2, log.describe()
    assert store.list() == [f"checkpoint_{s}" for s in range(1, 42)]


def test_small_save_round_trips(object_backend):
    b = object_backend
    store = b.open()
    b.faults(FaultPlan(latency=0.25))  # requests sent together overlap in the log
    with b.server.injector.recording() as log:
        with store.transaction("small") as txn:
            txn.write_bytes("a.bin", b"a")
            txn.write_bytes("b.bin", b"b")
    b.faults(None)
    data = [r for r in log if is_data(r)]
    assert len(data) == 2
    # HEAD of the marker with the lease PUT, manifest PUT, lease check, marker PUT,
    # manifest check, lease DELETE: 6 round trips that wait on each other, plus the data;
    # the name's claim (PUT with the manifest's, HEAD of <name> with the lease check,
    # DELETE with the manifest check) adds no round trip
    assert log.depth(lambda r: not is_data(r)) <= 6, log.describe()
    assert log.depth() <= 6 + len(data), log.describe()
    # (+1: HEAD of the object <name>, sent with the marker's; +3: the claim)
    assert len(log) == 13, log.describe()
    claim = [r.kind for r in log if "/.atomicstore/claims/" in (r.key or "")]
    assert claim == ["put", "delete"], log.describe()
    # the conflict check and the lease overlap; no data object exists before the lease
    lease = next(r for r in log if r.kind == "put" and "/.atomicstore/leases/" in (r.key or ""))
    head = next(r for r in log if r.kind == "head" and (r.key or "").endswith("small/commit_success.txt"))
    assert head.start < lease.end and lease.start < head.end, log.describe()
    assert all(lease.end <= r.start for r in data), log.describe()
    assert not [r for r in log if r.kind == "list"]  # no listing behind an existence check
    assert store.read_bytes("small", "a.bin") == b"a"


def test_conflict_found_early_still_leaves_no_lease(object_backend):
    """The early conflict check runs alongside the lease write: the lease of a save that
    is refused at once is removed again."""
    store = object_backend.open()
    with store.transaction("taken") as txn:
        txn.write_bytes("a", b"a")
    with pytest.raises(atomicstore.CommitConflictError):
        store.transaction("taken")
    assert not [k for k in store.driver.find("") if k.startswith(".atomicstore/")]


def test_a_store_that_cuts_the_delimiter_short_is_listed_object_by_object(object_backend, caplog):
    """A store that rolled keys up at the delimiter's first character would hide the
    markers: its answer is not used; the listing falls back to every object, and the
    delimiter is not tried again."""
    store = object_backend.open()
    for name in ("a", "b"):
        with store.transaction(name) as txn:
            txn.write_bytes("x", b"x")
    driver: Any = store.driver
    real = driver._list_page

    async def first_character_only(where: str, delimiter: str, token: str | None) -> Any:
        return await real(where, delimiter[0], token)

    driver._list_page = first_character_only
    with caplog.at_level("WARNING", logger="atomicstore.drivers"):
        assert store.list() == ["a", "b"]
    assert "does not list with the delimiter '/attempt-'" in caplog.text
    with object_backend.server.injector.recording() as log:
        assert store.list() == ["a", "b"]
    assert log.count("list") >= 1 and not [r for r in log if "attempt-" in r.query], log.describe()


def is_completion(r: LoggedRequest) -> bool:
    """An upload's completion: S3 ``CompleteMultipartUpload``, a GCS ``compose``."""
    return (r.method == "POST" and "uploadId=" in r.query) or (r.key or "").endswith("/compose")


def test_manifest_and_claim_go_out_with_the_last_completion(object_backend):
    """The manifest and the name's claim do not wait for the last file's upload to
    complete (their size and CRC32C are known when it is closed): they overlap its
    completion request, and nothing checked under the claim starts before it answered."""
    b = object_backend
    store = b.open(block_size=5 * 2**20)
    data = np.random.default_rng(0).integers(0, 256, 11 * 2**20, dtype=np.uint8).tobytes()
    b.faults(FaultPlan(latency=0.25))
    with b.server.injector.recording() as log:
        with store.transaction("big") as txn:
            f = txn.open("w.bin")
            f.write(data)
            f.close(wait=False)  # (as the pytree layer closes its files)
    b.faults(None)
    completion = [r for r in log if is_completion(r)]
    assert len(completion) == 1, log.describe()
    done = completion[0]
    manifest = next(r for r in log if r.kind == "put" and (r.key or "").endswith("/big/attempt-"
                    + txn.attempt + "/manifest.json"))
    claim = next(r for r in log if r.kind == "put" and "/.atomicstore/claims/" in (r.key or ""))
    marker = next(r for r in log if r.kind == "put" and (r.key or "").endswith("big/commit_success.txt"))
    assert manifest.start < done.end and claim.start < done.end, log.describe()
    # the lease check and the commit point wait for the completion
    lease_check = [r for r in log if r.kind == "head" and "/.atomicstore/leases/" in (r.key or "")]
    assert lease_check and all(done.end <= r.start for r in lease_check), log.describe()
    assert done.end <= marker.start, log.describe()
    assert store.read_bytes("big", "w.bin") == data


def _completes(env: dict[str, Any]) -> bool:
    q = env.get("QUERY_STRING", "")
    return (env.get("REQUEST_METHOD") == "POST" and "uploadId=" in q) or env.get("PATH_INFO", "").endswith("/compose")


def test_a_completion_that_fails_under_the_manifest_leaves_nothing(object_backend):
    """The last file's completion is refused while the manifest and the claim are on
    their way: the save raises the completion's error, nothing is committed, and the
    manifest, the claim, the lease and the upload are all gone (the transaction waits for
    the manifest's request to end before its abort removes the attempt)."""
    b = object_backend
    store = b.open(block_size=5 * 2**20)
    data = os.urandom(11 * 2**20)
    b.faults(FaultPlan(latency=0.05, stalls=[(_completes, 0.5)], deny=_completes))
    with b.server.injector.recording() as log, pytest.raises(atomicstore.StorageError):
        with store.transaction("big") as txn:
            f = txn.open("w.bin")
            f.write(data)
            f.close(wait=False)
    b.faults(None)
    done = [r for r in log if is_completion(r)]
    manifest = [r for r in log if r.kind == "put" and (r.key or "").endswith("/manifest.json")]
    assert done and manifest and manifest[0].start < done[0].end, log.describe()  # it was on its way
    assert not [r for r in log if (r.key or "").endswith("commit_success.txt") and r.kind == "put"]
    assert txn.attempt and not store.list()
    assert sorted(store.driver.find("")) == [], sorted(store.driver.find(""))
    assert store.driver.list_incomplete_uploads("") == []


def test_a_small_pytree_save_takes_six_round_trips_in_all(object_backend):
    """``atomicstore.save`` closes its files without waiting: their PUTs go out with the
    manifest and the claim, so the data adds no round trip to the six of the protocol."""
    b = object_backend
    store = b.open()
    b.faults(FaultPlan(latency=0.25))
    with b.server.injector.recording() as log:
        atomicstore.save(f"{b.url}/small", tree(1.0), store=store)
    b.faults(None)
    assert len([r for r in log if is_data(r)]) >= 2, log.describe()
    assert log.depth() == 6, log.describe()
    assert atomicstore.restore(f"{b.url}/small", store=store)["step"] == 1.0


def _claim_put(env: dict[str, Any]) -> bool:
    return env.get("REQUEST_METHOD") in ("PUT", "POST") and "claims" in (env.get("PATH_INFO", "")
                                                                         + env.get("QUERY_STRING", ""))


def test_a_claim_whose_reply_was_lost_is_released_when_an_upload_fails(object_backend):
    """The claim's PUT lands but its reply is lost (the retry is refused: 412), then the
    last file's completion is refused before the claim was ever looked at: the writer
    finds the claim naming its attempt and releases it, so nothing is left for the next
    writer to wait on or for recovery to remove. (Found by the attacker, 2026-11-27.)"""
    b = object_backend
    store = b.open(block_size=5 * 2**20)
    b.faults(FaultPlan(lost_reply_rate=1.0, applies_to=_claim_put, budget=1,
                       stalls=[(_completes, 0.6)], deny=_completes))
    with pytest.raises(atomicstore.StorageError):
        with store.transaction("big") as txn:
            f = txn.open("w.bin")
            f.write(os.urandom(11 * 2**20))
            f.close(wait=False)
    assert b.server.injector.counts["lost_reply"] == 1  # the claim's reply was lost
    b.faults(None)
    assert sorted(store.driver.find("")) == [], sorted(store.driver.find(""))


def _abort_while_commit_waits(store: atomicstore.Store, files: int = 1, size: int = 11 * 2**20
                              ) -> tuple[Any, list[BaseException], float]:
    """Commit a transaction of ``files`` files of ``size`` bytes (11 MiB), each closed with
    ``close(wait=False)``, on a thread of its own and, 0.7 s later (the commit waits for
    the files' completions, held at the server by the caller's plan), abort it from this
    thread. Returns the transaction, what the commit raised, and how long ``abort()``
    took."""
    txn = store.transaction("big")
    for i in range(files):
        f = txn.open(f"w{i}.bin")
        f.write(os.urandom(size))
        f.close(wait=False)
    errors: list[BaseException] = []

    def commit() -> None:
        try:
            txn.commit()
        except BaseException as exc:  # noqa: BLE001 - looked at by the caller
            errors.append(exc)

    t = threading.Thread(target=commit)
    t.start()
    time.sleep(0.7)  # the commit is waiting for the held completion
    began = time.monotonic()
    txn.abort()
    took = time.monotonic() - began
    t.join(60)
    assert not t.is_alive()
    return txn, errors, took


def test_an_abort_from_another_thread_wins_while_commit_waits_for_uploads(object_backend):
    """``abort()`` from another thread while ``commit`` waits for a held completion: the
    abort wins, as it did before the manifest went out with the completions: the commit
    raises TransactionError and nothing is committed. (Found by the attacker.)"""
    b = object_backend
    store = b.open(block_size=5 * 2**20)
    b.faults(FaultPlan(stalls=[(_completes, 3.0)]))
    txn, errors, _ = _abort_while_commit_waits(store)
    b.faults(None)
    assert len(errors) == 1 and isinstance(errors[0], atomicstore.TransactionError), errors
    assert not txn.committed and store.list() == []


def _abort_within_one_bound(request: Any, tmp_path: Any, files: int, size: int,
                            held: Any) -> None:
    """On moto (the bound is the writer's, not the server's), hold the requests ``held``
    selects ``ABORT_WAIT`` + 5 s while a transaction of ``files`` files of ``size`` bytes
    commits, and abort it from another thread: the abort returns in about ``ABORT_WAIT``,
    nothing is committed, and once the held requests reached the server (what they store
    lands under the attempt's prefix, which no marker names) recovery leaves nothing."""
    b = make_backend("s3", request, tmp_path)
    store = b.open(block_size=5 * 2**20)
    hold = ABORT_WAIT + 5
    b.faults(FaultPlan(stalls=[(held, hold)]))
    txn, errors, took = _abort_while_commit_waits(store, files=files, size=size)
    assert took < hold - 2, f"the abort of {files} files waited {took:.1f} s (their requests held {hold:.0f} s)"
    assert len(errors) == 1 and isinstance(errors[0], atomicstore.TransactionError), errors
    assert not txn.committed and store.list() == []
    time.sleep(max(0.0, hold - 0.7 - took) + 1.0)  # the held requests have reached the server
    b.faults(None)
    store.recover(grace=0)
    assert sorted(store.driver.find("")) == [] and store.driver.list_incomplete_uploads("") == []


def test_an_abort_waits_for_held_completions_no_longer_than_its_bound(request, tmp_path):
    """Three files' completions the server holds longer than ``ABORT_WAIT`` (the operation
    timeout is the default 120 s): an abort from another thread returns once
    ``ABORT_WAIT`` is up, for all three together, not when the server answers nor
    ``ABORT_WAIT`` per file (an interrupted commit, or a preemption's SIGTERM, stays
    prompt). (Found by the attacker: the abort waited the whole hold, then, bounded per
    file, 10 s per file.)"""
    _abort_within_one_bound(request, tmp_path, 3, 11 * 2**20, _completes)


def test_one_abort_bound_holds_for_forty_files(request, tmp_path):
    """Forty small files closed with ``close(wait=False)``, every data file's PUT held
    longer than ``ABORT_WAIT``: the abort ends them on at most 16 threads, and those
    queued behind the first 16 wait only what is left of one shared deadline, so the
    abort still returns in about ``ABORT_WAIT`` (it took ceil(40/16) x 10 s when each
    writer had a bound of its own). (Found by the attacker.)"""

    def data_put(env: dict[str, Any]) -> bool:
        path = env.get("PATH_INFO", "")
        return env.get("REQUEST_METHOD") == "PUT" and "/attempt-" in path and path.endswith(".bin")

    _abort_within_one_bound(request, tmp_path, 40, 64 * 2**10, data_put)
