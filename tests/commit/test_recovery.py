"""Recovery: dry run, idempotence, in-flight protection, zombies, SIGKILL, multipart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from crashsim import Crasher, CrashingDriver, SimulatedCrash

import atomicstore

CHILD = str(Path(__file__).with_name("sigkill_child.py"))
FUTURE = time.time() + 10**7


def save(store, name, data=b"x" * 100):
    with store.transaction(name) as txn:
        txn.write_bytes("a.bin", data)
        txn.write_bytes("sub/b.bin", data[::-1])


def crashed_save(store, name, at):
    with pytest.raises(SimulatedCrash):
        save(atomicstore.Store(CrashingDriver(store.driver, Crasher(crash_at=at)), lease_ttl=3600), name)


def leftovers(store):
    save(store, "keep")
    crashed_save(store, "lost", at=4)
    save(store, "gone")
    try:
        atomicstore.Store(CrashingDriver(store.driver, Crasher(crash_at=3))).delete("gone")
    except SimulatedCrash:
        pass


def test_dry_run_changes_nothing_and_second_recovery_finds_nothing(backend):
    store = backend.open()
    leftovers(store)
    before = store.driver.find("")
    dry = store.recover(dry_run=True, now=FUTURE)
    assert dry.dry_run and dry.actions, "the leftovers must be reported"
    assert store.driver.find("") == before
    assert "would remove" in dry.summary()
    real = store.recover(now=FUTURE)
    assert [a.target for a in real.actions] == [a.target for a in dry.actions]
    assert store.driver.find("") != before
    assert store.list() == ["keep"]
    store.verify("keep")
    second = store.recover(now=FUTURE)
    assert not second.actions and not second
    assert second.committed == ["keep"]


def test_in_flight_saves_are_left_alone(backend):
    store = backend.open(lease_ttl=60)
    save(store, "done")
    txn = store.transaction("busy")  # in flight: lease fresh
    txn.write_bytes("a.bin", b"in flight")
    report = backend.open().recover(grace=0)
    assert not report.actions, report.summary()
    assert any("busy" in t for t in report.in_flight)
    txn.commit()  # the writer was not disturbed
    assert backend.open().read_bytes("busy", "a.bin") == b"in flight"
    assert not backend.open().recover(grace=0).actions


def test_grace_protects_unleased_recent_data(backend):
    store = backend.open()
    crashed_save(store, "recent", at=4)
    lease_keys = [k for k in store.driver.find("") if k.startswith(".atomicstore/leases/")]
    for k in lease_keys:  # as if the lease write itself had been lost
        store.driver.delete(k)
    assert not store.recover(grace=3600).actions
    assert store.recover(now=FUTURE).actions
    assert set(store.driver.find("")) == set()


def test_concurrent_recoveries_agree(backend):
    store = backend.open()
    leftovers(store)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            backend.open().recover(now=FUTURE)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.list() == ["keep"]
    assert not store.recover(now=FUTURE).actions


def test_recover_argument_validation(tmp_path):
    store = atomicstore.open_store(tmp_path)
    with pytest.raises(atomicstore.InvalidArgumentError):
        store.recover(grace=-1)
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.open_store(tmp_path, lease_ttl=0)


def test_stale_single_file_temporaries_are_removed(tmp_path):
    store = atomicstore.open_store(tmp_path)
    (tmp_path / ".trainer.json.put-123-abcdef012345").write_bytes(b"half")
    store.write_file("trainer.json", b"{}")
    assert not store.recover(grace=3600).actions  # recent: could be in flight
    assert not store.recover(grace=0).actions  # a temporary lives for one write: never this young
    report = store.recover(now=FUTURE)
    assert [a.kind for a in report.actions] == ["temp"]
    assert sorted(os.listdir(tmp_path)) == ["trainer.json"]


def test_files_of_a_save_that_look_like_temporaries_are_not_removed(backend):
    """A checkpoint may hold a file whose name looks like a single-file temporary: recovery
    must not treat it as one while the save is in flight, nor once it is committed."""
    store = backend.open(lease_ttl=3600)
    odd = ".tokenizer.put-2024-0123456789ab"
    with store.transaction("done") as txn:
        txn.write_bytes(odd, b"committed")
    txn = store.transaction("flying")
    txn.write_bytes(odd, b"in flight")
    report = backend.open().recover(now=time.time() + 1000, grace=0)
    assert not [a for a in report.actions if a.kind == "temp"], report.summary()
    txn.commit()
    assert store.read_bytes("flying", odd) == b"in flight"
    assert store.read_bytes("done", odd) == b"committed"


def test_s3_unfinished_multipart_uploads_are_aborted(s3_server):
    url = s3_server.url(s3_server.new_bucket(), "mp")
    store = atomicstore.open_store(url, block_size=5 * 2**20, lease_ttl=3600, **s3_server.storage_options())
    txn = store.transaction("big")
    f = txn.open("huge.bin")
    f.write(b"\0" * (11 * 2**20))  # two parts uploaded, the upload left open: the process "dies"
    uploads = store.driver.list_incomplete_uploads("")
    assert len(uploads) == 1 and uploads[0][0].startswith("big/attempt-")
    assert not store.recover().actions  # lease alive: in flight
    report = store.recover(now=FUTURE)
    assert "upload" in [a.kind for a in report.actions]
    assert store.driver.list_incomplete_uploads("") == []
    assert not store.recover(now=FUTURE).actions


# -- real processes ---------------------------------------------------------------------
def _child(*args: str, stdin: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE if stdin else None, text=True)


def _recover(url: str, opts: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, CHILD, "recover", url, json.dumps(opts or {})],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("point", ["during-write", "before-commit", "after-commit", "returned"])
def test_sigkill_on_local_disk(tmp_path, point):
    root = str(tmp_path / "store")
    first = _child("save", root, "step_1", "returned")
    assert first.stdout.readline().strip() == "AT returned"
    first.kill()
    first.wait()
    child = _child("save", root, "step_2", point)
    assert child.stdout.readline().strip() == f"AT {point}"
    child.send_signal(signal.SIGKILL)
    child.wait()
    time.sleep(1.2)  # the killed writer's 1 s lease runs out
    result = _recover(root)
    files = {"big.bin": 8 * 2**20, "small.json": len(json.dumps({"name": "step_2"}))}
    expected_after = point in ("after-commit", "returned")
    want = {"step_1": {**files, "small.json": len(json.dumps({"name": "step_1"}))}}
    if expected_after:
        want["step_2"] = files
    assert result["state"] == want
    assert result["again"] == 0
    if point in ("during-write", "before-commit"):
        assert result["removed"], "the killed save's staging must be cleaned"
    assert os.listdir(Path(root, ".atomicstore", "staging")) == []


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
@pytest.mark.parametrize("same_name", [True, False])
def test_zombie_cannot_commit_over_its_replacement(kind, same_name, request, tmp_path):
    from conftest import make_backend

    backend = make_backend(kind, request, tmp_path)
    zombie = _child("zombie", backend.url, "step_100", json.dumps(backend.options), stdin=True)
    assert zombie.stdout.readline().strip() == "READY"
    os.kill(zombie.pid, signal.SIGSTOP)  # frozen: no heartbeat, as in a long GC pause or a partition
    try:
        time.sleep(1.3)
        new_run = backend.open()
        report = new_run.recover(grace=0)  # the restarted job declares the old writer dead
        assert any("step_100" in a.target for a in report.actions), report.summary()
        name = "step_100" if same_name else "step_99"
        with new_run.transaction(name) as txn:
            txn.write_bytes("big.bin", b"the new run")
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    zombie.stdin.write("go\n")
    zombie.stdin.flush()
    outcome = zombie.stdout.readline().strip()
    zombie.wait(timeout=60)
    assert outcome.startswith("LEASE-LOST"), outcome
    assert new_run.list() == [name]
    new_run.verify(name)
    assert new_run.read_bytes(name, "big.bin") == b"the new run"
    assert not new_run.recover(now=FUTURE).actions  # the zombie cleaned up after itself


def test_flax_layout_leftovers(backend):
    """flax's legacy commit: write <prefix>tmp (and <prefix>tmp_gda), then rename to
    <prefix><step> (and <prefix><step>_gda). A crash between the renames leaves an
    orphaned _gda directory; recovery with flax_prefix removes it and the staging
    directory. A file named <prefix>tmp stays: it may as well be a one-file checkpoint of
    that name (issue 21, row 8), and flax overwrites its own on its next save; so does a
    _gda directory whose step is not a number (flax's steps are)."""
    store = backend.open()
    d = store.driver
    d.put("checkpoint_1", b"committed step 1")  # flax: one msgpack file per step
    d.put("checkpoint_1_gda/shard0", b"gda of step 1")  # belongs to a committed step
    d.put("checkpoint_2_gda/shard0", b"orphan")  # its checkpoint_2 never got renamed
    d.put("checkpoint_best_gda/shard0", b"not a step")
    d.put("checkpoint_tmp", b"half-written")
    d.put("checkpoint_tmp_gda/shard0", b"half")
    d.put("other_tmp", b"not ours: another prefix")
    assert not store.recover(flax_prefix="checkpoint_", grace=3600).actions  # could be in flight
    report = store.recover(flax_prefix="checkpoint_", now=FUTURE)
    assert sorted(a.target for a in report.actions if a.kind == "flax") == [
        "checkpoint_2_gda", "checkpoint_tmp_gda"]
    assert set(d.find("")) == {"checkpoint_1", "checkpoint_1_gda/shard0", "checkpoint_best_gda/shard0",
                               "checkpoint_tmp", "other_tmp"}
    assert not store.recover(flax_prefix="checkpoint_", now=FUTURE).actions
    with pytest.raises(atomicstore.InvalidArgumentError):
        store.recover(flax_prefix="a/b")


def test_a_hostile_lease_is_data(backend):
    """A lease object is read from storage: nesting deep enough to exhaust the JSON
    parser's recursion, garbage, or a huge document must not break recovery or a
    manager opening the directory (it is treated as expired)."""
    store = backend.open()
    for i, junk in enumerate([b"[" * 3000, b"\xff\xfe", b'{"ttl": ' + b"9" * 5000 + b"}"]):
        store.driver.put(f".atomicstore/leases/x{i}.20260101T000000-0123456789ab.json", junk)
    store.recover()
    atomicstore.CheckpointManager(backend.url, storage_options=backend.options).close()
    report = store.recover(now=FUTURE)
    assert sorted(a.kind for a in report.actions) == ["lease"] * 3, report.summary()
