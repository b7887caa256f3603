"""Issue 11: one regression test per row of the concurrency table (rows 1, 2, 4, 6, 9, 10,
12 and 13; rows 3, 5, 7, 8 and 11 live next to the code they exercise).

Every test drives the interleaving it needs deterministically, with the public API, the
driver primitives, the fault layer in front of the object-store fakes (stalls, lost
replies, 409 conflicts, each aimed at one request by a predicate), a paused child process
or an injected clock; nothing is monkeypatched. Each assertion message says what the
table's last column requires.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import Backend, make_backend

import atomicstore
from atomicstore.testing.faults import (
    FaultPlan,
    Predicate,
    is_conditional_write,
    is_multipart_completion,
    is_mutation,
    object_key,
    query,
)

MiB = 2**20
FUTURE = time.time() + 10**7  # a recovery clock past every lease's ttl + grace
MARKER = "commit_success.txt"
LEASES = ".atomicstore/leases/"


# -- helpers -------------------------------------------------------------------------------
class Once:
    """A request predicate true for the first request matching ``pred`` only; ``fired``
    is set when that request arrived (a stall on it has begun)."""

    def __init__(self, pred: Predicate) -> None:
        self.pred = pred
        self.fired = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any]) -> bool:
        with self._lock:
            if self.fired.is_set() or not self.pred(environ):
                return False
            self.fired.set()
            return True


class Held(Once):
    """As :class:`Once`, and that first request is held at the server until ``release``
    is set (a scheduler point the test controls: no stall length that load can outlast)."""

    def __init__(self, pred: Predicate) -> None:
        super().__init__(pred)
        self.release = threading.Event()

    def __call__(self, environ: dict[str, Any]) -> bool:
        if super().__call__(environ):
            self.release.wait(60)
        return False


def writes_object(suffix: str) -> Predicate:
    """A write (PUT/POST, not a delete) of an object whose key ends with ``suffix``."""

    def pred(environ: dict[str, Any]) -> bool:
        if environ.get("REQUEST_METHOD") not in ("PUT", "POST"):
            return False
        key = object_key(environ)
        return key is not None and key.endswith(suffix)

    return pred


def touches(environ: dict[str, Any], suffix: str) -> bool:
    """Any request (read, write or delete) of an object whose key ends with ``suffix``."""
    key = object_key(environ)
    return key is not None and key.endswith(suffix)


def reads_lease(environ: dict[str, Any]) -> bool:
    """A read (HEAD/GET of data or metadata) of a lease object."""
    key = object_key(environ)
    return not is_mutation(environ) and key is not None and f"/{LEASES}" in key


def save(store: atomicstore.Store, name: str, data: bytes, *, overwrite: bool = False) -> None:
    with store.transaction(name, overwrite=overwrite) as txn:
        txn.write_bytes("state.bin", data)


def outcome(fn: Callable[[], Any]) -> str:
    """"committed", or the name of the exception ``fn`` raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is compared by the caller
        return f"{type(exc).__name__}: {exc}"
    return "committed"


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[str]]:
    """Start ``fn`` in a thread; its outcome is appended to the returned list."""
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(outcome(fn)), daemon=True)
    t.start()
    return t, out


def raw_keys(store: atomicstore.Store) -> set[str]:
    return set(store.driver.find(""))


def verifies(store: atomicstore.Store, name: str) -> str:
    """"" if ``name`` opens and verifies, else why not."""
    try:
        store.verify(name)
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        return f"{type(exc).__name__}: {exc}"
    return ""


# -- row 1: no listing cache answers a lease question --------------------------------------
def test_row1_leases_are_read_afresh_after_a_listing(object_backend: Backend) -> None:
    other = object_backend.open()
    crashed = other.transaction("crashed")  # a lease another run left behind
    store = object_backend.open()
    assert store.list() == []  # a listing (fsspec fills its listing cache here)
    txn = store.transaction("fresh")  # its lease is written after the listing
    txn.write_bytes("state.bin", b"fresh")
    got = outcome(txn.commit)
    assert got == "committed", (
        "row 1: a lease written after a listing must be read afresh, not reported missing "
        f"by a listing cache; the commit gave {got}")

    doomed = store.transaction("doomed")
    doomed.write_bytes("state.bin", b"doomed")
    store.list()
    report = other.recover(now=FUTURE)  # another process declares the writer dead
    assert any("doomed" in a.target and a.kind == "lease" for a in report.actions), report.summary()
    got = outcome(doomed.commit)
    assert got.startswith("LeaseLostError"), (
        "row 1: a lease deleted by another process after a listing must not look present "
        f"(every lease decision reads the backend afresh): the zombie's commit gave {got}")
    assert store.list() == ["fresh"] and not verifies(store, "fresh")
    crashed.abort()


# -- row 2: what commits between recovery's listing and its deletes is never removed --------
def test_row2_recovery_spares_an_attempt_committed_after_its_listing(
    object_backend: Backend,
) -> None:
    writer = object_backend.open()
    txn = writer.transaction("long_save")
    txn.write_bytes("state.bin", b"long save " * 1000)
    first_lease_read = Once(reads_lease)  # recovery's, right after its listing
    object_backend.faults(FaultPlan(stalls=[(first_lease_read, 1.0)]))
    recovery = object_backend.open()
    # grace 0: the save's files are older than grace, only its lease protects it
    t, report = in_thread(lambda: recovery.recover(grace=0))
    assert first_lease_read.fired.wait(20), "recovery never read a lease"
    committed = outcome(txn.commit)  # commits and releases its lease meanwhile
    t.join(60)
    object_backend.faults(None)
    assert committed == "committed" and report == ["committed"], (committed, report)
    assert writer.list() == ["long_save"]
    why = verifies(writer, "long_save")
    assert not why, (
        "row 2: recovery must never remove data that a committed checkpoint references, "
        "whatever commits between its listing and its deletes (it re-reads the lease and "
        f"then the marker just before removing an attempt); now: {why}")


# -- row 4: a writer paused past ttl + grace cannot commit ---------------------------------
PAUSED_WRITER = r"""
import json, sys
import atomicstore
url, opts, ttl = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
store = atomicstore.open_store(url, lease_ttl=ttl, **opts)
txn = store.transaction("paused")
txn.write_bytes("state.bin", b"written before the pause" * 100)
print(json.dumps({"prefix": txn.prefix}), flush=True)
sys.stdin.readline()
try:
    txn.commit()
    print("committed", flush=True)
except Exception as exc:
    print(type(exc).__name__ + ": " + str(exc), flush=True)
"""


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])  # memory: see the next test
def test_row4_writer_paused_past_its_lease_cannot_commit(
    kind: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    backend = make_backend(kind, request, tmp_path)
    ttl = 0.6
    child = subprocess.Popen(
        [sys.executable, "-c", PAUSED_WRITER, backend.url, json.dumps(backend.options), str(ttl)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, child.kill)
    watchdog.start()
    try:
        assert child.stdout is not None and child.stdin is not None
        prefix = json.loads(child.stdout.readline())["prefix"]
        os.kill(child.pid, signal.SIGSTOP)  # frozen: a long GC pause, a suspended VM
        try:
            time.sleep(ttl + 0.4)  # its lease has expired, by its own clock too
            store = backend.open()
            # recovery has removed the dead attempt's data and not yet its lease
            store.driver.delete_tree(prefix)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.5)  # the resumed heartbeat runs (every ttl / 3)
        got, _ = child.communicate("go\n", timeout=60)
    finally:
        watchdog.cancel()
        child.kill()
    got = got.strip()
    assert got.startswith("LeaseLostError"), (
        "row 4: a lease that has expired is never renewed, and that writer's commit is "
        f"refused with LeaseLostError; the resumed writer's commit gave {got!r}")
    assert "paused" not in store.list(), "row 4: nothing the paused writer wrote may be listed"


def test_row4_expired_lease_is_never_renewed_injected_clock(
    request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    backend = make_backend("memory", request, tmp_path)
    now = [time.time()]
    store = backend.open(lease_ttl=0.6, clock=lambda: now[0])
    txn = store.transaction("paused")
    txn.write_bytes("state.bin", b"written before the pause")
    now[0] += 0.6 + store.grace + 1  # the writer's clock jumps past ttl + grace (a pause)
    store.driver.delete_tree(txn.prefix)  # recovery removed its data, not yet its lease
    time.sleep(0.5)  # heartbeats run meanwhile
    got = outcome(txn.commit)
    assert got.startswith("LeaseLostError"), (
        "row 4: a lease that expired by the writer's own clock is never renewed and its "
        f"commit is refused with LeaseLostError; the commit gave {got}")
    assert "paused" not in backend.open().list()


# -- row 6: recovery never touches a one-file save in flight -------------------------------
def test_row6_recovery_leaves_an_in_flight_one_file_upload_alone(
    request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    backend = make_backend("s3", request, tmp_path)
    store = backend.open(block_size=5 * MiB)
    data = os.urandom(6 * MiB)  # two parts: a multipart upload
    first_part = Once(lambda env: env.get("REQUEST_METHOD") == "PUT" and "partNumber" in query(env))
    backend.faults(FaultPlan(stalls=[(first_part, 1.5)]))

    def flax_style_save() -> None:
        with store.one_file("checkpoint_7") as f:
            f.write(data)

    t, result = in_thread(flax_style_save)
    assert first_part.fired.wait(20), "the upload never started"
    time.sleep(0.2)
    report = backend.open().recover(grace=0)  # the upload is older than grace
    t.join(60)
    backend.faults(None)
    assert result == ["committed"], (
        "row 6: a save in flight is never touched by recovery, in every layout (a one-file "
        f"save holds a lease, recovery does not abort its upload); the save gave {result}; "
        f"recovery: {report.summary()}")
    assert store.driver.read("checkpoint_7") == data


def test_row6_recovery_leaves_a_committed_gda_alone_while_its_main_file_is_in_flight(
    backend: Backend,
) -> None:
    """The multi-process layout: the step's ``_gda`` is committed, its main file is being
    written (a one-file save under a lease) when recovery runs with every file older than
    grace. The ``_gda`` looks orphaned in the listing but must survive."""
    store = backend.open()
    with store.transaction("checkpoint_8_gda") as txn:
        txn.write_bytes("arrays.json", b'{"format": "atomicstore.gda/1", "arrays": []}')
    main = store.one_file("checkpoint_8")  # the main file's save, in flight
    main.write(b"main state")
    report = backend.open().recover(grace=0, flax_prefix="checkpoint_")
    assert store.exists("checkpoint_8_gda"), (
        "row 6: a save in flight is never touched by recovery, in every layout (a committed "
        f"_gda whose main file is being written is not an orphan); recovery: {report.summary()}")
    main.commit()
    assert store.driver.read("checkpoint_8") == b"main state"
    store.verify("checkpoint_8_gda")
    after = backend.open().recover(now=FUTURE, flax_prefix="checkpoint_")
    assert store.exists("checkpoint_8_gda"), after.summary()


@pytest.mark.parametrize("lost", [False, True], ids=["reply", "lost-reply"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["create", "overwrite"])
def test_row4_a_commit_landing_after_recovery_removed_its_data_is_taken_back(
    object_backend: Backend, overwrite: bool, lost: bool
) -> None:
    """The writer passed its lease check, then its marker PUT was held in flight (a paused
    VM, a slow network) while the restarted job recovered and removed its data. When the
    PUT lands, the writer finds its manifest gone, takes the marker back (puts the
    replaced one back for an overwrite) and raises LeaseLostError; the store holds exactly
    what it held before."""
    store = object_backend.open(lease_ttl=60, grace=120)
    if overwrite:
        save(store, "ck", b"previous good checkpoint")
    # held until recovery is done (a 2 s stall landed before recovery ran, under load)
    marker_put = Held(writes_object(f"ck/{MARKER}"))
    object_backend.faults(FaultPlan(stalls=[(marker_put, 0.0)], lost_reply_rate=1.0 if lost else 0.0,
                                    budget=1, applies_to=writes_object(f"ck/{MARKER}")))
    txn = store.transaction("ck", overwrite=overwrite)
    txn.write_bytes("state.bin", b"zombie")
    t, result = in_thread(txn.commit)
    assert marker_put.fired.wait(20), "the marker PUT never came"
    try:
        report = object_backend.open().recover(now=FUTURE)  # the frozen writer is declared dead
    finally:
        marker_put.release.set()
    t.join(60)
    object_backend.faults(None)
    assert result and result[0].startswith("LeaseLostError"), (
        f"row 4: a writer declared dead must not commit; it was told {result}; recovery: "
        f"{report.summary()}"
    )
    if overwrite:
        assert store.list() == ["ck"] and verifies(store, "ck") == "", verifies(store, "ck")
        assert store.read_bytes("ck", "state.bin") == b"previous good checkpoint"
    else:
        assert store.list() == []


def test_a_committed_overwrite_is_reported_committed_when_cleanup_fails(
    object_backend: Backend,
) -> None:
    """Deleting the replaced checkpoint's data comes after the commit point: its failure
    must not turn a commit into a reported failure (recovery removes the data later)."""
    store = object_backend.open(retry=atomicstore.RetryPolicy(attempts=2, initial_wait=0.01))
    save(store, "ck", b"old")
    old = store.manifest("ck").attempt
    object_backend.faults(
        FaultPlan(
            error_rate=1.0,
            applies_to=lambda env: (
                env.get("REQUEST_METHOD") == "DELETE"
                and f"attempt-{old}" in (object_key(env) or "")
            ),
        )
    )
    txn = store.transaction("ck", overwrite=True)
    txn.write_bytes("state.bin", b"new")
    txn.commit()
    object_backend.faults(None)
    assert txn.committed and store.read_bytes("ck", "state.bin") == b"new"
    store.recover(now=FUTURE)
    assert not any(f"attempt-{old}" in k for k in raw_keys(store))


def test_recovery_rolls_a_dangling_overwrite_marker_back(object_backend: Backend) -> None:
    """An overwriter declared dead whose marker PUT landed after recovery removed its data,
    and which died before taking it back, leaves a marker naming nothing. The marker
    records the one it replaced: recovery puts that back (its data was never removed)."""
    from atomicstore.commit.manifest import Marker

    store = object_backend.open()
    save(store, "ck", b"previous good checkpoint")
    base = store.strategy.read_marker("ck")  # type: ignore[attr-defined]
    dangling = Marker.new("ck", "20260101T000000-0123456789ab", "zombie", b"{}", replaces=base)
    store.driver.put(f"ck/{MARKER}", dangling.to_bytes())
    assert verifies(store, "ck") != ""
    report = store.recover(now=FUTURE)
    assert [a.kind for a in report.actions] == ["marker"], report.summary()
    assert verifies(store, "ck") == "" and store.read_bytes("ck", "state.bin") == b"previous good checkpoint"
    assert not store.recover(now=FUTURE).actions


def test_an_overwrite_and_its_lease_heartbeat_never_deadlock_on_the_store_lock(
    tmp_path: Any,
) -> None:
    """Local disk: while another holder keeps the store lock, an overwrite waits for it and
    its lease heartbeat (which renews under the same lock) fires: neither may wait for the
    other (the lease check is made before the store lock is taken)."""
    for i in range(3):
        store = atomicstore.open_store(tmp_path / "s", lease_ttl=0.6)
        save(store, "ck", b"old %d" % i, overwrite=i > 0)
        txn = store.transaction("ck", overwrite=True)
        txn.write_bytes("state.bin", b"new %d" % i)
        held = threading.Event()

        def hold(held: threading.Event = held) -> None:
            with atomicstore.open_store(tmp_path / "s").driver.lock():
                held.set()
                time.sleep(0.5)  # a heartbeat (every 0.2 s) comes due meanwhile

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(5)
        t, result = in_thread(txn.commit)
        t.join(15)
        holder.join()
        assert result == ["committed"], f"round {i}: {result or 'still waiting after 15 s'}"


# -- row 9: overwrite is a compare-and-swap ------------------------------------------------
def test_row9_of_two_overwriters_from_one_checkpoint_exactly_one_wins(backend: Backend) -> None:
    store = backend.open()
    save(store, "model", b"v0" * 100)
    first, second = store, backend.open()
    a = first.transaction("model", overwrite=True)
    a.write_bytes("state.bin", b"A" * 300)
    b = second.transaction("model", overwrite=True)
    b.write_bytes("state.bin", b"B" * 300)
    if backend.server is not None:
        # A's marker write is applied and its reply lost; A's retry is held while B
        # overwrites; then A's retry goes through
        injector = backend.server.injector
        marker = f"/model/{MARKER}"
        after_loss = Once(lambda env: injector.counts["lost_reply"] >= 1 and touches(env, marker))
        backend.faults(FaultPlan(lost_reply_rate=1.0, budget=1, applies_to=writes_object(marker),
                                 stalls=[(after_loss, 1.0)]))
        t, res_a = in_thread(a.commit)
        assert after_loss.fired.wait(20), "A neither retried nor read back its marker write"
        res_b = outcome(b.commit)
        t.join(60)
        backend.faults(None)
        got = {"A": res_a[0], "B": res_b}
    else:
        got = {"A": outcome(a.commit), "B": outcome(b.commit)}
    winners = [w for w, r in got.items() if r == "committed"]
    assert len(winners) == 1 and all(
        r.startswith("CommitConflictError") for w, r in got.items() if w not in winners), (
        "row 9: overwrite is a compare-and-swap on the generation read when the transaction "
        "began: of two overwriters starting from the same checkpoint exactly one succeeds, "
        f"the other gets CommitConflictError; got {got}")
    reader = backend.open()
    assert reader.list() == ["model"]
    why = verifies(reader, "model")
    assert not why, f"row 9: the name must resolve to a checkpoint that verifies: {why}"
    assert reader.read_bytes("model", "state.bin") == winners[0].encode() * 300


# -- row 10: a conditional write reconciles its lost reply ---------------------------------
def test_row10_write_file_without_overwrite_survives_a_lost_reply(object_backend: Backend) -> None:
    store = object_backend.open()
    object_backend.faults(
        FaultPlan(lost_reply_rate=1.0, budget=1, applies_to=writes_object("/x.json")))
    got = outcome(lambda: store.write_file("x.json", b'{"v": 1}', overwrite=False))
    lost = object_backend.server.injector.counts["lost_reply"]
    object_backend.faults(None)
    assert lost == 1
    assert got == "committed", (
        "row 10: every conditional write reconciles a lost reply by reading back what it "
        f"wrote: write_file(..., overwrite=False) whose reply was lost must succeed; got {got}")
    assert store.read_file("x.json") == b'{"v": 1}'
    other = object_backend.open()
    got = outcome(functools.partial(other.write_file, "x.json", b'{"v": 2}', overwrite=False))
    assert got.startswith(("AlreadyExistsError", "PreconditionFailedError")), (
        f"row 10: a second writer of the file must still get AlreadyExistsError; got {got}")
    assert store.read_file("x.json") == b'{"v": 1}'


# -- row 12: every accepted name works on every backend ------------------------------------
def test_row12_names_of_200_characters_work_everywhere(backend: Backend) -> None:
    store = backend.open()
    name, one, dangling = "s" * 200, "f" * 200, "d" * 199 + "9"
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("save", lambda: save(store, name, b"1" * 100)),
        ("overwrite", lambda: save(store, name, b"2" * 100, overwrite=True)),
        ("one_file", lambda: _one_file(store, one, b"one", overwrite=False)),
        ("one_file overwrite", lambda: _one_file(store, one, b"two", overwrite=True)),
    ]
    for what, step in steps:
        got = outcome(step)
        assert got == "committed", (
            f"row 12: every accepted name (up to 200 characters) works on every backend: "
            f"{what} of a {len(name)}-character name gave {got}")
    assert store.list() == [name] and store.read_bytes(name, "state.bin") == b"2" * 100
    assert store.driver.read(one) == b"two"
    txn = store.transaction(dangling)  # a crashed save of a long name, for recovery
    txn.write_bytes("state.bin", b"lost")
    report = store.recover(now=FUTURE)
    assert any(dangling in a.target for a in report.actions), report.summary()
    txn.abort()
    got = outcome(lambda: store.delete(name))
    assert got == "committed", f"row 12: delete of a 200-character name gave {got}"
    assert store.list() == []
    assert not store.recover(now=FUTURE).actions


def _one_file(store: atomicstore.Store, name: str, data: bytes, *, overwrite: bool) -> None:
    with store.one_file(name, overwrite=overwrite) as f:
        f.write(data)


# -- row 13: S3's 409 ConditionalRequestConflict -------------------------------------------
PATIENT = atomicstore.RetryPolicy(attempts=40, initial_wait=0.05, max_wait=0.2, deadline=30)


def _no_leftovers(store: atomicstore.Store, expected: set[str]) -> None:
    keys = raw_keys(store)
    assert keys == expected, (
        "row 13: the loser leaks neither attempt nor lease: raw keys beyond the winner's "
        f"checkpoint: {sorted(keys - expected)} (missing: {sorted(expected - keys)})")
    assert store.driver.list_incomplete_uploads("") == [], "row 13: a multipart upload leaked"
    report = store.recover(now=FUTURE)  # past every ttl + grace
    assert not report.actions, f"row 13: recovery found leftovers: {report.summary()}"


def _committed_keys(store: atomicstore.Store, name: str) -> set[str]:
    ckpt = store.open(name)
    return {f"{name}/{MARKER}", ckpt.key("manifest.json")} | {ckpt.key(p) for p in ckpt.files}


def test_row13_a_409_on_the_marker_put_is_retried(
    request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    backend = make_backend("s3", request, tmp_path)
    store = backend.open(retry=PATIENT)
    txn = store.transaction("step_1")
    txn.write_bytes("state.bin", b"x" * 100)
    backend.faults(FaultPlan(conflicts=[(writes_object(MARKER), 1)]))
    got = outcome(txn.commit)
    conflicts = backend.server.injector.counts["conflict"]
    backend.faults(None)
    assert conflicts == 1
    assert got == "committed", (
        "row 13: a 409 ConditionalRequestConflict on the marker PUT is retried as AWS "
        f"documents for PutObject, ending in a commit; got {got}")
    _no_leftovers(store, _committed_keys(store, "step_1"))


def test_row13_racing_marker_puts_with_409_one_wins_the_loser_leaks_nothing(
    request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    backend = make_backend("s3", request, tmp_path)
    # B's retries of its 409 must outlast A's stall (40 tries of <= 0.2 s did not always,
    # under load): a budget bounded by time, not by a count that load shortens
    outlasting = atomicstore.RetryPolicy(attempts=1000, initial_wait=0.05, max_wait=0.2, deadline=30)
    first, second = backend.open(retry=PATIENT), backend.open(retry=outlasting)
    b = second.transaction("step_2")
    b.write_bytes("state.bin", b"B" * 100)
    # Two commits of one name on S3 never overlap their commit requests any more (each is
    # made under the name's claim, issue 22), so the conditional write B's marker PUT
    # overlaps is another client's conditional PUT of the same key (A), in progress a while.
    a_marker = Once(lambda env: is_conditional_write(env) and (object_key(env) or "").endswith(f"/step_2/{MARKER}"))
    backend.faults(FaultPlan(conflict_on_overlap=True, stalls=[(a_marker, 1.5)]))
    a_bytes = b'{"written by": "another client"}'
    t, res_a = in_thread(lambda: first.driver.put(f"step_2/{MARKER}", a_bytes, exclusive=True))
    assert a_marker.fired.wait(20)
    res_b = outcome(b.commit)  # its marker PUT overlaps A's: 409
    t.join(60)
    conflicts = backend.server.injector.counts["conflict"]
    backend.faults(None)
    assert conflicts >= 1, "the scenario needs B's marker PUT to get 409"
    got = {"A": res_a[0], "B": res_b}
    assert got["A"] == "committed" and got["B"].startswith("CommitConflictError"), (
        "row 13: racing conditional writes answered 409 end in a commit or "
        f"CommitConflictError; got {got}")
    assert first.driver.read(f"step_2/{MARKER}") == a_bytes
    _no_leftovers(first, {f"step_2/{MARKER}"})


def test_row13_racing_one_file_completions_with_409_one_wins_the_loser_leaks_nothing(
    request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    backend = make_backend("s3", request, tmp_path)
    first, second = backend.open(block_size=5 * MiB), backend.open(block_size=5 * MiB)
    data_a, data_b = b"A" * (6 * MiB), b"B" * (6 * MiB)  # B: a multipart upload
    b = second.one_file("checkpoint_3")
    b.write(data_b)
    # Two one-file commits on S3 never overlap their commit requests any more (each makes
    # it under a claim, issue 22), so the conditional write B's completion overlaps is
    # another client's conditional PUT of the same key (A), in progress a while.
    a_put = Once(lambda env: is_conditional_write(env) and not is_multipart_completion(env)
                 and (object_key(env) or "").endswith("/checkpoint_3"))
    backend.faults(FaultPlan(conflict_on_overlap=True, stalls=[(a_put, 1.5)]))
    t, res_a = in_thread(lambda: first.driver.put("checkpoint_3", data_a, exclusive=True))
    assert a_put.fired.wait(20)
    res_b = outcome(b.commit)  # its completion overlaps A's PUT: 409
    t.join(60)
    conflicts = backend.server.injector.counts["conflict"]
    backend.faults(None)
    assert conflicts >= 1, "the scenario needs B's completion to get 409"
    got = {"A": res_a[0], "B": res_b}
    assert got["A"] == "committed" and got["B"].startswith("CommitConflictError"), (
        "row 13: a 409 on a one-file completion is handled as AWS documents (this upload "
        f"cannot complete), ending in a commit or CommitConflictError; got {got}")
    assert first.driver.read("checkpoint_3") == data_a
    _no_leftovers(first, {"checkpoint_3"})
