"""Issue 22, acceptance 2 (first half): one-file saves on S3 never double commit.

A one-file (flax layout) save on S3 commits with a conditional CompleteMultipartUpload
(or, below one part, a conditional PutObject). SeaweedFS decides racing conditional
completions of one key without exclusion: several are told they won (measured: 4
concurrent completions with ``If-None-Match: *``, 11 of 20 rounds had two or more
winners; one PutObject racing one completion, 1 of 30). Racing single-request conditional
PUTs are exclusive there. So on S3 a one-file commit first takes a claim
(``.atomicstore/claims/<name>.json``, one conditional PUT) and holds it only around its
commit request (:mod:`atomicstore.commit.onefile`).

The races run against the real SeaweedFS (``seaweed_server``, through the fault layer in
its ``real_server`` mode, which passes racing requests through as they come); the
scenarios with a paused or crashed claim holder run on moto and SeaweedFS, each actor put
between two requests by a held request at the fault layer (no sleeps hoping for a race).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import Backend, make_backend
from test_concurrency import in_thread, outcome

import atomicstore
from atomicstore.testing.faults import (
    FaultPlan,
    Predicate,
    is_multipart_completion,
    is_mutation,
    object_key,
)

MiB = 2**20
PART = 5 * MiB  # the smallest S3 part: a one-file save of PART + 1 bytes is a multipart upload
FUTURE = time.time() + 10**7
CLAIMS = ".atomicstore/claims/"
LEASES = ".atomicstore/leases/"
WRITERS = 4
ROUNDS = 20


# -- helpers -------------------------------------------------------------------------------
def payload(tag: int, size: int = PART + 1024) -> bytes:
    """``size`` bytes that differ per ``tag`` (each writer's object is recognisable, and
    no two have one ETag)."""
    head = f"writer {tag}:".encode()
    return head + bytes([65 + tag % 26]) * (size - len(head))


def is_claim(environ: dict[str, Any]) -> bool:
    key = object_key(environ)
    return key is not None and f"/{CLAIMS}" in key


def reads_claim(environ: dict[str, Any]) -> bool:
    return is_claim(environ) and not is_mutation(environ)


def reads_lease(environ: dict[str, Any]) -> bool:
    key = object_key(environ)
    return key is not None and f"/{LEASES}" in key and not is_mutation(environ)


class Held:
    """A request predicate that holds the first request matching ``pred`` at the server
    until ``release`` is set: a scheduler point the test controls. ``fired`` is set when
    that request arrived."""

    def __init__(self, pred: Predicate) -> None:
        self.pred = pred
        self.fired = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any]) -> bool:
        with self._lock:
            if self.fired.is_set() or not self.pred(environ):
                return False
            self.fired.set()
        self.release.wait(60)
        return False


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait until ``cond()`` holds (a state another actor reaches: a request in flight
    lands), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} never appeared"
        time.sleep(0.01)


def leftovers(store: atomicstore.Store) -> set[str]:
    """Every key below the store's root, and every unfinished upload."""
    return set(store.driver.find("")) | {f"upload:{k}" for k, _, _ in store.driver.list_incomplete_uploads("")}


def race(stores: list[atomicstore.Store], name: str, data: list[bytes], *, overwrite: bool) -> list[str]:
    """Every store saves ``data[i]`` as the one-file checkpoint ``name`` at once: all of
    them stream their bytes first, then commit together (a barrier), so the commit
    requests race. Returns each writer's outcome."""
    commits = [s.one_file(name, overwrite=overwrite) for s in stores]
    for c, d in zip(commits, data, strict=True):
        c.write(d)
    barrier = threading.Barrier(len(commits))
    results = [""] * len(commits)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = outcome(commits[i].commit)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(commits))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.fixture
def seaweed(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    """A bucket on the real SeaweedFS, reached at its own S3 port: the races need no
    fault, and 400 MiB of parts pass the proxy slowly."""
    backend = make_backend("seaweed", request, tmp_path)
    backend.options = {**backend.options, "endpoint_url": backend.server.direct_endpoint}
    return backend


@pytest.fixture(params=["s3", "seaweed"])
def s3_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    """moto and the real SeaweedFS (both S3: one-file commits take a claim there)."""
    return make_backend(request.param, request, tmp_path)


# -- acceptance 2: racing one-file saves of one name, exactly one success ------------------
@pytest.mark.slow  # 4 writers x 20 rounds of 5 MiB: ~25 s (runs on the oldest Python)
def test_racing_one_file_saves_of_one_name_have_exactly_one_winner_on_seaweedfs(seaweed: Backend) -> None:
    stores = [seaweed.open(block_size=PART) for _ in range(WRITERS)]
    data = [payload(i) for i in range(WRITERS)]
    bad: list[str] = []
    for r in range(ROUNDS):
        name = f"checkpoint_{r}"
        results = race(stores, name, data, overwrite=False)
        winners = [i for i, res in enumerate(results) if res == "committed"]
        losers_ok = all(res.startswith("CommitConflictError") for res in results if res != "committed")
        stored = stores[0].driver.read(name) if winners else b""
        if len(winners) != 1 or not losers_ok or stored != data[winners[0]]:
            bad.append(f"round {r}: winners {winners}, outcomes {[res[:60] for res in results]}")
    assert not bad, (
        f"acceptance 2: racing one-file saves (overwrite=False, {WRITERS} writers) must give exactly "
        f"one success per round, the others CommitConflictError, and the object must be the "
        f"winner's bytes; {len(bad)} of {ROUNDS} rounds did not:\n" + "\n".join(bad))
    for s in stores:
        assert not [k for k in s.driver.find("") if k.startswith(".atomicstore/")], "claims and leases are released"
        assert not s.driver.list_incomplete_uploads(""), "the losers' uploads are aborted"


@pytest.mark.slow
def test_racing_one_file_overwrites_have_exactly_one_cas_winner_per_generation_on_seaweedfs(
    seaweed: Backend,
) -> None:
    stores = [seaweed.open(block_size=PART) for _ in range(WRITERS)]
    name = "checkpoint_1"
    with stores[0].one_file(name) as f:
        f.write(b"generation 0")
    bad: list[str] = []
    rounds = 8
    for r in range(rounds):
        data = [payload(r * WRITERS + i) for i in range(WRITERS)]  # distinct per round and writer
        before = stores[0].driver.info(name).generation
        results = race(stores, name, data, overwrite=True)
        winners = [i for i, res in enumerate(results) if res == "committed"]
        losers_ok = all(res.startswith("CommitConflictError") for res in results if res != "committed")
        stored = stores[0].driver.read(name)
        if len(winners) != 1 or not losers_ok or stored != data[winners[0]]:
            bad.append(f"round {r} (replacing generation {before}): winners {winners}, "
                       f"outcomes {[res[:60] for res in results]}")
    assert not bad, (
        f"racing one-file overwrites ({WRITERS} writers, each a compare-and-swap on the generation it "
        f"read) must give exactly one winner per generation; {len(bad)} of {rounds} rounds did not:\n"
        + "\n".join(bad))


# -- a claim held by a paused, crashed or live writer --------------------------------------
def save_one(store: atomicstore.Store, name: str, data: bytes, *, overwrite: bool = False) -> None:
    with store.one_file(name, overwrite=overwrite) as f:
        f.write(data)


def completes(name: str) -> Predicate:
    """The CompleteMultipartUpload of the one-file checkpoint ``name``."""
    return lambda env: is_multipart_completion(env) and (object_key(env) or "").endswith(f"/{name}")


class ReadsFor:
    """A request predicate that never matches; ``done`` is set once a request matching
    ``pred`` arrives ``seconds`` or more after the first one did (a writer has been
    looking at something for that long)."""

    def __init__(self, pred: Predicate, seconds: float) -> None:
        self.pred, self.seconds = pred, seconds
        self.first: float | None = None
        self.count = 0
        self.done = threading.Event()

    def __call__(self, environ: dict[str, Any]) -> bool:
        if self.pred(environ):
            now = time.monotonic()
            self.count += 1
            self.first = self.first if self.first is not None else now
            if now - self.first >= self.seconds:
                self.done.set()
        return False


def claim_mutations(log: Any, name: str) -> list[str]:
    """The writes and deletes of ``name``'s claim, in order of arrival."""
    key = f"{CLAIMS}{name}.json"
    return [r.kind for r in sorted(log, key=lambda r: r.start)
            if r.kind in ("put", "delete") and (r.key or "").endswith(key)]


def test_a_live_holders_claim_is_never_taken_over(s3_backend: Backend) -> None:
    """A holds the claim while its completion is held at the server; its lease stays
    alive (renewed every ttl / 3). B waits on the claim for longer than A's ttl + grace
    (so neither the claim's age nor a fixed timeout decides), recovery with grace=0 runs
    meanwhile; then A's completion goes through. A commits, B loses with
    CommitConflictError, and the claim was never written by anyone but its holder."""
    name = "checkpoint_5"
    # A's renewals (every ttl / 3) may each be late by up to 2 ttl / 3 before A's own
    # heartbeat gives up, and by ttl + grace - ttl / 3 before A looks dead to B: room for a
    # loaded machine (1.5 + 1.5 once failed at load 8; with 3 + 3, a renewal PUT to a
    # loaded SeaweedFS took over 2 s in a full CI run and A's lease lapsed). B's own lease
    # is long: B only waits, and a renewal of it late by more than its ttl would fail B for
    # the wrong reason (seen in a loaded CI run with B's ttl 2 s).
    ttl, grace = 10.0, 3.0
    a_store = s3_backend.open(block_size=PART, lease_ttl=ttl)
    b_store = s3_backend.open(block_size=PART, lease_ttl=60.0, grace=grace)
    a_done = Held(completes(name))
    b_waited = ReadsFor(reads_claim, ttl + grace + 0.5)
    s3_backend.faults(FaultPlan(stalls=[(a_done, 0.0), (b_waited, 0.0)]))
    data_a, data_b = payload(1), payload(2)
    with s3_backend.server.injector.recording() as log:
        ta, res_a = in_thread(lambda: save_one(a_store, name, data_a))
        assert a_done.fired.wait(30), "A never completed"
        tb, res_b = in_thread(lambda: save_one(b_store, name, data_b))
        assert b_waited.done.wait(30), f"B did not keep waiting on the claim ({b_waited.count} reads): {res_b}"
        during = s3_backend.open().recover(grace=0)
        held_by = json.loads(a_store.driver.read(f"{CLAIMS}{name}.json"))
        a_done.release.set()
        ta.join(60)
        tb.join(60)
    assert held_by["writer"] == a_store.writer_id, f"while A commits, the claim is A's: {held_by}"
    assert f"{CLAIMS}{name}.json" in during.in_flight and not during.actions, (
        f"recovery leaves a claim whose holder's lease is alive: {during.summary()}")
    assert res_a == ["committed"] and res_b and res_b[0].startswith("CommitConflictError"), (
        f"a live holder's claim is never taken over: A commits, B loses; got A {res_a}, B {res_b}")
    assert a_store.driver.read(name) == data_a
    assert claim_mutations(log, name) == ["put", "put", "delete", "put", "delete"], (
        "the claim is created by A (B's first PUT is refused), deleted by A, then created "
        f"and deleted by B; no takeover: {claim_mutations(log, name)}\n{log.describe()}")
    assert leftovers(a_store) == {name}


def test_a_paused_holder_is_fenced_and_its_claim_taken_over_after_ttl_plus_grace(s3_backend: Backend) -> None:
    """A took the claim and was paused right after (its lease check is held at the
    server, and with it its heartbeat: the lease ages on storage). B waits until A's
    lease is older than ttl + grace, removes it, takes the claim over (one conditional
    PUT) and commits. When A resumes, its lease is gone: LeaseLostError, nothing of A's
    is committed, and A's release of its claim does not remove B's."""
    name = "checkpoint_6"
    ttl, grace = 1.0, 0.5
    a_store = s3_backend.open(block_size=PART, lease_ttl=ttl)
    b_store = s3_backend.open(block_size=PART, lease_ttl=60.0, grace=grace)  # (the waiter: its own lease outlives a loaded server)
    a_paused = Held(reads_lease)  # A's lease check, sent with its claim PUT
    s3_backend.faults(FaultPlan(stalls=[(a_paused, 0.0)]))
    data_a, data_b = payload(1), payload(2)
    ta, res_a = in_thread(lambda: save_one(a_store, name, data_a))
    assert a_paused.fired.wait(30), "A never checked its lease"
    wait_for(lambda: a_store.driver.exists(f"{CLAIMS}{name}.json"), "A's claim")
    res_b = outcome(lambda: save_one(b_store, name, data_b))
    a_paused.release.set()
    ta.join(60)
    assert res_b == "committed", f"a paused holder blocks B only until its lease is dead: {res_b}"
    assert res_a and res_a[0].startswith("LeaseLostError"), (
        f"a holder fenced while paused refuses to commit: {res_a}")
    assert b_store.driver.read(name) == data_b
    assert leftovers(b_store) == {name}, "A's lease, claim and upload are gone, B's released"


def _crash_holding_claim(url: str, options: dict[str, Any], name: str, q: Any) -> None:
    """Child: a one-file save that is SIGKILLed while it holds the claim."""
    store = atomicstore.open_store(url, **options, block_size=PART, lease_ttl=1.0)
    c = store.one_file(name)
    c.write(payload(9))
    q.put("committing")
    c.commit()  # held at the server after its claim PUT, until the parent kills it
    q.put("committed")


def crash_holding_claim(backend: Backend, name: str) -> None:
    """Run a child whose one-file save of ``name`` is killed (SIGKILL) while it holds the
    claim: right after the claim PUT, before its lease check. It leaves the claim, its
    lease (no longer renewed: lease_ttl 1 s) and its multipart upload."""
    paused = Held(reads_lease)  # its lease check, sent with its claim PUT
    backend.faults(FaultPlan(stalls=[(paused, 0.0)]))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_crash_holding_claim, args=(backend.url, backend.options, name, q))
    child.start()
    try:
        assert paused.fired.wait(60), "the child never checked its lease"
        wait_for(lambda: backend.open().driver.exists(f"{CLAIMS}{name}.json"), "the child's claim")
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        paused.release.set()
        if child.is_alive():
            child.kill()
            child.join(30)
    backend.faults(None)
    assert child.exitcode == -signal.SIGKILL


def test_a_crashed_holder_blocks_the_next_save_only_until_its_lease_is_dead(s3_backend: Backend) -> None:
    name = "checkpoint_7"
    crash_holding_claim(s3_backend, name)
    store = s3_backend.open(block_size=PART, lease_ttl=60.0, grace=0.5)  # (the waiter: as above)
    assert store.driver.exists(f"{CLAIMS}{name}.json"), "the crashed save left its claim"
    data = payload(3)
    got = outcome(lambda: save_one(store, name, data))  # waits ttl + grace (1.5 s) at most
    assert got == "committed", f"a claim of a crashed writer does not block the next save: {got}"
    assert store.driver.read(name) == data
    report = store.recover(now=FUTURE)
    assert leftovers(store) == {name}, (
        f"recovery aborts the crashed save's upload; nothing else is left: {report.summary()}")


def test_recovery_removes_a_dead_writers_claim_and_leaves_a_recent_one(s3_backend: Backend) -> None:
    name = "checkpoint_8"
    crash_holding_claim(s3_backend, name)
    store = s3_backend.open(block_size=PART)
    claim = f"{CLAIMS}{name}.json"
    recent = store.recover()  # its lease and the claim are younger than ttl + grace (120 s)
    assert store.driver.exists(claim) and claim in recent.in_flight, recent.summary()
    dry = store.recover(now=FUTURE, dry_run=True)
    assert store.driver.exists(claim) and ("claim", claim) in [(a.kind, a.target) for a in dry.actions], dry.summary()
    report = store.recover(now=FUTURE)
    assert ("claim", claim) in [(a.kind, a.target) for a in report.actions], report.summary()
    assert leftovers(store) == set(), f"claim, lease and upload of the dead save are gone: {report.summary()}"
    with s3_backend.server.injector.recording() as log:
        save_one(store, name, b"next")  # takes a fresh claim at once
    assert store.driver.read(name) == b"next"
    assert claim_mutations(log, name) == ["put", "delete"], log.describe()


def test_a_malformed_claim_is_data(s3_backend: Backend) -> None:
    """Bytes at a claim's key that are not a claim (damaged, hostile, oversized) name no
    live writer: a save takes the claim over and commits; recovery removes such a claim
    once it is older than the store's ttl + grace."""
    store = s3_backend.open(lease_ttl=1.0, grace=0.5)
    for i, junk in enumerate([b"\xff" * 10_000, b'{"attempt": "../../x", "ttl": 1e300}', b"[]"]):
        name = f"checkpoint_{i}"
        store.driver.put(f"{CLAIMS}{name}.json", junk)
        got = outcome(lambda name=name: save_one(store, name, b"state"))
        assert got == "committed" and store.driver.read(name) == b"state", got
        assert not store.driver.exists(f"{CLAIMS}{name}.json"), "taken over, then released"
    store.driver.put(f"{CLAIMS}checkpoint_9.json", b"not json")
    assert store.recover().in_flight == [f"{CLAIMS}checkpoint_9.json"], "younger than ttl + grace"
    report = store.recover(now=FUTURE)
    assert [(a.kind, a.target) for a in report.actions] == [("claim", f"{CLAIMS}checkpoint_9.json")], report.summary()
