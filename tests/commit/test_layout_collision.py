"""One name holds one checkpoint: a directory-layout (native) save never lands on a name
that holds a one-file checkpoint (flax's layout), and a one-file save never lands on a
native checkpoint, on every backend (model-based test, finding F8).

Before the fix the memory driver took the flax file over as if it were an empty
directory (destroying it), and S3/GCS committed the native checkpoint *beside* the
object ``<name>`` (deleting it made the old flax file reappear).

And when the two saves overlap (issue 22, attacker finding F1): each checks the other
layout when it begins, so a save of the other layout that commits between that check and
its own commit point was not seen, and on object stores (whose two commit points are two
keys) both were told they committed. On object stores both now make their commit request
under the name's claim and check the other layout under it (``commit/claim.py``); on
rename backends a directory and a file cannot share a name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from conftest import Backend, make_backend
from test_concurrency import in_thread, outcome
from test_onefile_claim import Held

import atomicstore
from atomicstore.commit import conformance
from atomicstore.compat import flax as checkpoints
from atomicstore.errors import AlreadyExistsError, CommitConflictError, InvalidArgumentError
from atomicstore.testing.faults import FaultPlan, is_mutation, object_key


def user_keys(store: atomicstore.Store) -> dict[str, Any]:
    """Every object outside the reserved directory, with its generation."""
    return {k: i.generation for k, i in store.driver.find("").items() if not k.startswith(".atomicstore/")}


@pytest.mark.parametrize("overwrite", [False, True])
def test_native_save_over_a_one_file_checkpoint_is_refused(backend: Backend, overwrite: bool) -> None:
    o = backend.options
    checkpoints.save_checkpoint(backend.url, {"v": 1}, 1, prefix="tree_", storage_options=o)
    store = backend.open()
    before = user_keys(store)
    assert "tree_1" in before  # a single file/object at exactly <root>/tree_1
    with pytest.raises((AlreadyExistsError, InvalidArgumentError)) as exc:
        atomicstore.save(f"{backend.url}/tree_1", {"v": 2}, overwrite=overwrite, **o)
    assert not isinstance(exc.value, CommitConflictError)
    assert "single-file" in str(exc.value) and "tree_1" in str(exc.value), str(exc.value)
    assert user_keys(store) == before  # nothing written, nothing taken over
    assert not [k for k in store.driver.find("") if k.startswith(".atomicstore/leases/")]
    assert store.list() == []
    assert checkpoints.restore_checkpoint(backend.url, None, prefix="tree_", storage_options=o) == {"v": 1}


@pytest.mark.parametrize("overwrite", [False, True])
def test_one_file_save_over_a_native_checkpoint_is_refused(backend: Backend, overwrite: bool) -> None:
    o = backend.options
    atomicstore.save(f"{backend.url}/tree_1", {"v": 2}, **o)
    store = backend.open()
    before = user_keys(store)
    with pytest.raises((AlreadyExistsError, InvalidArgumentError)):
        with store.one_file("tree_1", overwrite=overwrite) as f:
            f.write(b"not a native checkpoint")
    assert user_keys(store) == before
    assert store.list() == ["tree_1"]
    assert atomicstore.restore(f"{backend.url}/tree_1", **o) == {"v": 2}


def test_an_empty_directory_is_still_taken_over(tmp_path: Any) -> None:
    """The take-over of a user's empty directory (``mkdir``) stays: only files are refused."""
    (tmp_path / "store" / "tree_1").mkdir(parents=True)
    atomicstore.save(str(tmp_path / "store" / "tree_1"), {"v": 3})
    assert atomicstore.restore(str(tmp_path / "store" / "tree_1")) == {"v": 3}


NAME = "tree_7"
NATIVE, ONE_FILE = {"v": 1}, b"one-file checkpoint"


def native_bytes(store: atomicstore.Store, name: str) -> bytes:
    return store.read_bytes(name, "a.bin")


def only_the_winner_is_left(store: atomicstore.Store, winner: str) -> None:
    """Exactly one checkpoint of NAME exists, of the winner's layout, and nothing of the
    loser (no attempt data, lease or claim)."""
    keys = set(store.driver.find(""))
    if winner == "native":
        assert store.list() == [NAME]
        assert native_bytes(store, NAME) == b"native"
        if not store.driver.capabilities.atomic_rename:
            assert not store.driver.exists(NAME), "the one-file object was committed beside it"
    else:
        assert store.list() == [], "a native checkpoint was committed beside the one-file one"
        assert store.driver.read(NAME) == ONE_FILE
    reserved = {k for k in keys if k.startswith(tuple(f".atomicstore/{d}/" for d in ("leases", "claims", "staging", "trash")))}
    assert not reserved, f"the loser left {reserved}"


def test_a_native_save_begun_first_never_commits_beside_a_one_file_save(backend: Backend) -> None:
    """The native save checks the name when it begins; a one-file save of that name
    commits meanwhile; the native commit is then refused, naming the single file."""
    store = backend.open()
    txn = store.transaction(NAME)  # begins: the name is free
    txn.write_bytes("a.bin", b"native")

    def one_file_save() -> None:
        with store.one_file(NAME) as f:
            f.write(ONE_FILE)

    if backend.server_name == "seaweed":
        # SeaweedFS's keys are a filesystem's: the object tree_7 cannot be created while
        # tree_7/attempt-…/a.bin exists, so the one-file save loses at once (412)
        assert outcome(one_file_save).startswith("CommitConflictError")
        txn.commit()
        only_the_winner_is_left(store, "native")
        return
    one_file_save()
    with pytest.raises(AlreadyExistsError) as exc:
        txn.commit()
    if backend.kind in ("s3", "gcs"):
        assert "single-file" in str(exc.value), str(exc.value)
    only_the_winner_is_left(store, "one-file")


def test_a_one_file_save_begun_first_never_commits_beside_a_native_save(backend: Backend) -> None:
    """The converse: a one-file save begun first, a native save of the name committed
    before the one-file commit request: the one-file commit is refused."""
    store = backend.open()
    f = store.one_file(NAME)  # begins: the name is free
    f.write(ONE_FILE)
    with store.transaction(NAME) as txn:
        txn.write_bytes("a.bin", b"native")
    with pytest.raises(AlreadyExistsError) as exc:
        f.commit()
    if backend.kind in ("s3", "gcs"):
        assert "directory-layout" in str(exc.value), str(exc.value)
    only_the_winner_is_left(store, "native")


def is_marker_put(environ: dict) -> bool:
    key = object_key(environ) or ""
    return is_mutation(environ) and environ.get("REQUEST_METHOD") != "DELETE" and key.endswith(
        f"/{NAME}/commit_success.txt")


def test_a_one_file_commit_waits_for_a_native_commit_in_flight(object_backend: Backend) -> None:
    """A scheduler point between the two commit points: the native save's marker PUT is
    held at the server (it holds the claim); the one-file save reaches its commit request
    meanwhile, waits for the claim, then sees the marker and is refused."""
    b = object_backend
    native, one = b.open(), b.open()
    held = Held(is_marker_put)
    b.faults(FaultPlan(stalls=[(held, 0.0)]))
    txn = native.transaction(NAME)
    txn.write_bytes("a.bin", b"native")
    f = one.one_file(NAME)
    f.write(ONE_FILE)
    tn, res_native = in_thread(txn.commit)
    assert held.fired.wait(30), f"the native commit never sent its marker: {res_native}"
    to, res_one = in_thread(f.commit)
    to.join(1.0)
    assert to.is_alive(), f"the one-file commit did not wait for the claim: {res_one}"
    held.release.set()
    tn.join(60)
    to.join(60)
    b.faults(None)
    assert res_native == ["committed"], res_native
    assert res_one and res_one[0].startswith("AlreadyExistsError") and "directory-layout" in res_one[0], res_one
    only_the_winner_is_left(native, "native")


@pytest.mark.parametrize("round_", range(8))
def test_racing_native_and_one_file_saves_of_one_name_one_commits(object_backend: Backend, round_: int) -> None:
    """Both saves stream their bytes, then commit at once (a barrier): exactly one is
    told it committed, and only its checkpoint is there (SeaweedFS passes racing requests
    through as they come)."""
    b = object_backend
    native, one = b.open(), b.open()
    txn = native.transaction(NAME)
    txn.write_bytes("a.bin", b"native")
    f = one.one_file(NAME)
    f.write(ONE_FILE)
    barrier = threading.Barrier(2)
    results: dict[str, str] = {}

    def run(who: str, fn: object) -> None:
        barrier.wait()
        results[who] = outcome(fn)  # type: ignore[arg-type]

    threads = [threading.Thread(target=run, args=("native", txn.commit)),
               threading.Thread(target=run, args=("one-file", f.commit))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [w for w, r in results.items() if r == "committed"]
    assert len(winners) == 1, results
    loser = next(r for w, r in results.items() if w not in winners)
    assert loser.startswith(("AlreadyExistsError", "CommitConflictError")), results
    only_the_winner_is_left(native, winners[0])


def test_a_commit_request_that_outlived_its_timeout_keeps_the_claim(object_backend: Backend) -> None:
    """Attacker finding G2: every try of the native save's marker PUT is delayed at the
    server past the request timeout; the save gives up (the PUT may still land: the
    outcome is unknown), and a one-file save of the name follows. The late marker lands
    while the one-file save waits for the claim, which stays with the failed save's lease
    (ttl + grace); the one-file save then sees the marker and is refused. Before, the claim
    was released at the failure: the one-file save committed, then the marker landed, and
    both layouts were there."""
    b = object_backend
    # the late PUT lands within ttl + grace; the short timeout (under the stall) cuts only
    # the stalled request (0.5 s was once too short for a loaded moto's HEAD: 1.0)
    ttl, grace, stall = 1.5, 1.5, 2.0
    # the waiter's own lease outlives a loaded server's slow renewals; the wait is bounded
    # by the failed save's ttl + grace, read from its lease
    one = b.open(lease_ttl=4 * ttl, grace=grace)
    # the conformance check, once per endpoint and bucket: not under the short timeout
    conformance.ensure(one.driver, conformance.ONE_FILE)
    native = atomicstore.open_store(
        b.url, **b.options, lease_ttl=ttl, grace=grace, operation_timeout=1.0,
        retry=atomicstore.RetryPolicy(attempts=2, initial_wait=0.01, max_wait=0.05, deadline=2))
    b.faults(FaultPlan(stalls=[(is_marker_put, stall)]))  # every try of it
    txn = native.transaction(NAME)
    txn.write_bytes("a.bin", b"native")
    with pytest.raises(atomicstore.StorageError):
        txn.commit()  # timed out: the outcome is unknown
    assert one.driver.exists(f".atomicstore/claims/{NAME}.json"), "the claim stays while the PUT may land"
    f = one.one_file(NAME)
    f.write(ONE_FILE)
    res = outcome(f.commit)
    b.faults(None)
    assert res.startswith("AlreadyExistsError") and "directory-layout" in res, res
    only_the_winner_is_left(native, "native")  # the "failed" save's late marker: its commit


def is_one_file_put(environ: dict) -> bool:
    key = object_key(environ) or ""
    return is_mutation(environ) and environ.get("REQUEST_METHOD") != "DELETE" and key.endswith(f"/{NAME}")


def test_a_one_file_commit_that_outlived_its_timeout_keeps_the_claim(object_backend: Backend) -> None:
    """G2 the other way round: the one-file save's commit request (one conditional PUT)
    is delayed past the request timeout, the save gives up, and a native save of the name
    follows: it waits for the claim (kept with the failed save's lease), and when the late
    object has landed it is refused. (On SeaweedFS the late PUT is refused instead, since
    the native save's objects under <name>/ are there: then the native save commits.)"""
    b = object_backend
    ttl, grace, stall = 1.5, 1.5, 2.0
    native = b.open(lease_ttl=4 * ttl, grace=grace)  # the waiter: as in the test above
    conformance.ensure(native.driver, conformance.ONE_FILE)
    one = atomicstore.open_store(
        b.url, **b.options, lease_ttl=ttl, grace=grace, operation_timeout=1.0,
        retry=atomicstore.RetryPolicy(attempts=2, initial_wait=0.01, max_wait=0.05, deadline=2))
    b.faults(FaultPlan(stalls=[(is_one_file_put, stall)]))
    f = one.one_file(NAME)
    f.write(ONE_FILE)
    with pytest.raises(atomicstore.StorageError):
        f.commit()  # timed out: the outcome is unknown
    assert native.driver.exists(f".atomicstore/claims/{NAME}.json"), "the claim stays while the PUT may land"
    txn = native.transaction(NAME)
    txn.write_bytes("a.bin", b"native")
    res = outcome(txn.commit)
    time.sleep(stall)  # every late try has landed or been refused
    b.faults(None)
    if res == "committed":
        assert b.server_name == "seaweed", "the native save committed while the late object could land"
        only_the_winner_is_left(native, "native")
    else:
        assert res.startswith("AlreadyExistsError") and "single-file" in res, res
        only_the_winner_is_left(native, "one-file")


_PAUSED_CHILD = """
import sys, atomicstore
url, opts, name = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
st = atomicstore.open_store(url, **opts, lease_ttl=1.0, grace=0.5)
try:
    with st.transaction(name) as txn:
        txn.write_bytes("a.bin", b"native")
    print("committed", flush=True)
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
"""


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_writer_paused_under_the_claim_never_commits_after_its_successor(
        kind: str, request: pytest.FixtureRequest, tmp_path: object) -> None:
    """Attacker finding G3: a native save (a child process) is stopped (SIGSTOP) right
    after its checks under the claim were answered, before its commit request; another
    writer takes the claim over once the child's lease is dead and commits a one-file
    save; then the child continues. Before, it sent its marker PUT (its lease check came a
    round trip earlier) and both were told they committed; now it checks its lease's clock
    right before the commit request (no request) and refuses with LeaseLostError."""
    b = make_backend(kind, request, tmp_path)
    parent = b.open(lease_ttl=60.0, grace=0.5)  # (the waiter: its own lease outlives a loaded server)
    parent.conformance()
    seen = {"claim": False}

    def head_of_name_under_claim(environ: dict) -> bool:
        key = object_key(environ) or ""
        if "/.atomicstore/claims/" in key and is_mutation(environ):
            seen["claim"] = True
            return False
        return seen["claim"] and not is_mutation(environ) and key.endswith(f"/{NAME}")

    held = Held(head_of_name_under_claim)
    b.faults(FaultPlan(stalls=[(held, 0.0)]))
    child = subprocess.Popen([sys.executable, "-c", _PAUSED_CHILD, b.url, repr(b.options), NAME],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert held.fired.wait(60), "the child never checked the name under the claim"
        os.kill(child.pid, signal.SIGSTOP)
        held.release.set()  # answered (404) while the child is stopped: the reply waits for it
        time.sleep(0.2)
        with parent.one_file(NAME) as f:  # waits until the child's lease is dead, takes over
            f.write(ONE_FILE)
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        b.faults(None)
    assert out.startswith("LeaseLostError"), out
    assert parent.driver.read(NAME) == ONE_FILE
    assert parent.list() == [], "the paused writer's marker landed beside the one-file checkpoint"
