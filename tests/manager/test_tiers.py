"""Tiered checkpoints (issue 25): ``CheckpointManager(url, local_dir=...)``.

The persistent tier is each backend of the suite (local disk, memory, S3 on moto and on
SeaweedFS, GCS on our fake); the local tier a temporary directory. What is checked: a
save commits locally and the due steps are persisted as commits of their own (same
CRC32Cs, same metadata); restore reads the newest copy that verifies and never returns a
damaged one; a flipped byte in the local copy never yields a persistent copy; local
retention never deletes a step whose upload is queued or running, nor a due step not
persisted yet; two jobs sharing the persistent tier keep one winner per step; the
manager's arguments are checked; a read-only local tier and a forked child.
Processes killed at random instants: tests/manager/test_tiers_crash.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import in_forked_child, make_backend

import atomicstore
from atomicstore import CheckpointManager
from atomicstore.errors import (
    ChecksumMismatchError,
    CommitConflictError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
)
from atomicstore.testing.faults import FaultPlan, is_mutation
from atomicstore.tiers import TIER_KEY, TierState

FUTURE = time.time() + 10**7


def tree(step: int, n: int = 4096) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(n, dtype=np.float32), "step": step}


def same(got: dict, step: int, n: int = 4096) -> bool:
    want = tree(step, n)
    return got["step"] == step and got["w"].tobytes() == want["w"].tobytes()


def manager(backend, local: Path, **kw) -> CheckpointManager:
    kw.setdefault("storage_options", dict(backend.options))
    kw["storage_options"].setdefault("retry", atomicstore.RetryPolicy(attempts=8, initial_wait=0.01,
                                                                       max_wait=0.2, deadline=30))
    if backend.kind in ("s3", "gcs"):
        backend.open().conformance()  # (once per bucket, before the test's own requests)
    return CheckpointManager(backend.url, local_dir=str(local), **kw)


def flip(path: Path, at: int = 200) -> None:
    os.chmod(path, 0o644)
    b = bytearray(path.read_bytes())
    b[at] ^= 1
    path.write_bytes(bytes(b))


def local_file(local: Path, step: int, name: str = "state.msgpack") -> Path:
    return local / f"checkpoint_{step}" / name


def test_save_commits_locally_and_persists_the_due_steps_with_the_same_crcs(backend, tmp_path):
    local = tmp_path / "local"
    with manager(backend, local, keep=5, local_keep=5, persist_every_n_steps=2) as m:
        for s in range(5):
            m.save(s, tree(s))
        m.wait_until_finished()
        assert m.all_steps() == [0, 1, 2, 3, 4]
        assert m.tier_state() == {0: TierState.PERSISTED, 1: TierState.LOCAL, 2: TierState.PERSISTED,
                                  3: TierState.LOCAL, 4: TierState.PERSISTED}
        remote, loc = m.store, atomicstore.open_store(str(local))
        assert remote.list() == ["checkpoint_0", "checkpoint_2", "checkpoint_4"]
        for s in (0, 2, 4):
            r, lo = remote.verify(f"checkpoint_{s}"), loc.manifest(f"checkpoint_{s}")
            assert r.files == lo.files  # every file, same sizes and CRC32Cs
            assert r.metadata[TIER_KEY]["save"] == lo.metadata[TIER_KEY]["save"]
            assert r.metadata["step"] == s and r.attempt != lo.attempt  # a commit of its own
        assert m.metadata(4)["step"] == 4
        assert same(m.restore(), 4) and same(m.restore(1), 1)


def test_restore_after_losing_the_machine_reads_the_persistent_copy(backend, tmp_path):
    local = tmp_path / "local"
    with manager(backend, local, keep=3) as m:
        for s in (1, 2):
            m.save(s, tree(s), metrics={"loss": float("nan")}, items={"it": {"pos": s}})
    shutil.rmtree(local)
    with manager(backend, local, keep=3) as m:
        assert m.tier_state() == {1: TierState.PERSISTED, 2: TierState.PERSISTED}
        got, items = m.restore(with_items=True)
        assert same(got, 2) and items == {"it": {"pos": 2}}
        assert np.isnan(m.metadata(2)["metrics"]["loss"])


def test_a_damaged_local_copy_falls_back_to_the_persistent_one_then_to_an_older_step(backend, tmp_path, caplog):
    local = tmp_path / "local"
    with manager(backend, local, keep=3, local_keep=3, persist_every_n_steps=2) as m:
        for s in (2, 3, 4):
            m.save(s, tree(s))
    flip(local_file(local, 4))  # persisted: the persistent copy serves
    flip(local_file(local, 3))  # local only: the next older step serves
    with manager(backend, local, keep=3, local_keep=3) as m:
        assert same(m.restore(4), 4)
        assert "local copy of step 4 cannot be restored" in caplog.text
        m.store.delete("checkpoint_4")
        assert same(m.restore(), 2)  # 4 is damaged here and gone there; 3 damaged, local only
        with pytest.raises(CorruptionError, match="checkpoint_3/state.msgpack: leaf w fails its CRC32C"):
            m.restore(3)  # asked for: its only copy is damaged, never returned


def test_a_flipped_byte_in_the_local_copy_never_yields_a_persistent_copy(backend, tmp_path):
    local = tmp_path / "local"
    with manager(backend, local, persist_every_n_steps=100) as m:
        m.save(0, tree(0))
        m.save(1, tree(1, 1 << 18))  # not due
        m.wait_until_finished()
        flip(local_file(local, 1), at=(1 << 19))  # in the middle of the big array
        m.persist(1)
        with pytest.raises(ChecksumMismatchError, match="state.msgpack"):
            m.wait_until_finished()
        assert m.store.list() == ["checkpoint_0"]
        report = m.store.recover(now=FUTURE)  # the aborted upload left nothing committed
        assert report.committed == ["checkpoint_0"]
        assert not m.store.recover(now=FUTURE).actions


def test_local_retention_keeps_steps_whose_upload_is_queued_or_running(backend, tmp_path):
    local = tmp_path / "local"
    with manager(backend, local, keep=5, local_keep=1, upload_rate=2e6) as m:  # ~0.5 s per upload
        for s in range(3):
            m.save(s, tree(s, 1 << 18))  # 1 MiB each
            # every step not yet persisted is still local (queued or uploading)
            here = set(atomicstore.open_store(str(local)).list())
            persisted = set(m.store.list())
            assert {f"checkpoint_{x}" for x in range(s + 1)} - persisted <= here
        assert TierState.PERSISTING in m.tier_state().values()
        m.wait_until_finished()
        assert m.store.list() == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
        m.save(3, tree(3))
        m.wait_until_finished()
        assert atomicstore.open_store(str(local)).list() == ["checkpoint_3"]  # local_keep applies again


def test_local_retention_keeps_the_newest_due_step_until_it_is_persisted(request, tmp_path):
    b = make_backend("s3", request, tmp_path)
    local = tmp_path / "local"
    with manager(b, local, keep=5, local_keep=1, persist_every_n_steps=10) as m:
        m.save(0, tree(0))
        m.wait_until_finished()
        b.faults(FaultPlan(deny=is_mutation))  # the persistent tier refuses writes (403)
        m.save(10, tree(10))  # due: its upload fails
        with pytest.raises(atomicstore.StorageError):
            m.wait_until_finished()
        m.save(11, tree(11))  # not due: local retention (local_keep=1) would drop 10
        m.wait_until_finished()
        assert atomicstore.open_store(str(local)).list() == ["checkpoint_10", "checkpoint_11"]
        b.faults(None)
    with manager(b, local, keep=5, local_keep=1) as m:  # a restart resumes the upload the last run left
        m.wait_until_finished()
        assert m.store.list() == ["checkpoint_0", "checkpoint_10"]
        m.save(12, tree(12))
        m.wait_until_finished()
        assert atomicstore.open_store(str(local)).list() == ["checkpoint_12"]


def test_two_jobs_sharing_the_persistent_tier_keep_one_winner_per_step(backend, tmp_path):
    jobs = {7: manager(backend, tmp_path / "a", keep=5, upload_rate=1e6),  # about a second per upload
            70: manager(backend, tmp_path / "b", keep=5, upload_rate=1e6)}
    for val, m in jobs.items():  # two jobs, two states, the same step: both upload it
        m.save(7, tree(val, 1 << 18))
    lost = []
    for val, m in jobs.items():
        try:
            m.wait_until_finished()
        except CommitConflictError:
            lost.append(val)
    assert len(lost) == 1, lost
    won = 7 + 70 - lost[0]
    store = backend.open()
    assert store.list() == ["checkpoint_7"]
    saved = store.manifest("checkpoint_7").metadata[TIER_KEY]["save"]
    winner = tmp_path / ("a" if won == 7 else "b")
    assert saved == atomicstore.open_store(str(winner)).manifest("checkpoint_7").metadata[TIER_KEY]["save"]
    # each job restores its own committed state; after losing its machine, the loser reads the winner's
    assert same(jobs[lost[0]].restore(7), lost[0], 1 << 18)
    loser = tmp_path / ("b" if won == 7 else "a")
    shutil.rmtree(loser)
    c = manager(backend, loser, keep=5)
    assert same(c.restore(7), won, 1 << 18)
    for m in (*jobs.values(), c):
        m.close()


def test_concurrent_uploads_of_one_step_from_two_threads_commit_once(backend, tmp_path):
    """Two managers on one local tier (a restarted job and its zombie) persist the same
    local save at once: one commit, the other is refused, the persistent copy verifies."""
    local = tmp_path / "local"
    with manager(backend, local, keep=5, persist_every_n_steps=100) as m:
        m.save(0, tree(0))
        m.save(1, tree(1, 1 << 18))
        m.wait_until_finished()
    ms = [manager(backend, local, keep=5, persist_every_n_steps=100) for _ in range(2)]
    for m in ms:
        m.wait_until_finished()  # (each resumed nothing: 1 was not due)
    barrier = threading.Barrier(2)
    errors: list[BaseException | None] = [None, None]

    def go(i: int) -> None:
        barrier.wait()
        ms[i].persist(1)
        try:
            ms[i].wait_until_finished()
        except BaseException as exc:  # noqa: BLE001
            errors[i] = exc

    ts = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sum(e is None for e in errors) >= 1
    assert all(e is None or isinstance(e, CommitConflictError) for e in errors), errors
    ms[0].store.verify("checkpoint_1")
    assert ms[0].store.list() == ["checkpoint_0", "checkpoint_1"]
    for m in ms:
        m.close()


def test_overwrite_replaces_the_step_in_both_tiers(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    with CheckpointManager(str(remote), local_dir=str(local), keep=5, local_keep=5, overwrite=True) as m:
        for s in (1, 2, 3):
            m.save(s, tree(s))
        m.wait_until_finished()
        m.save(2, tree(20))
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]
        assert same(m.restore(2), 20) and m.tier_state() == {1: TierState.PERSISTED, 2: TierState.PERSISTED}
        assert atomicstore.open_store(str(remote)).list() == ["checkpoint_1", "checkpoint_2"]


def test_delete_removes_a_step_from_both_tiers(tmp_path):
    with CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), keep=5, local_keep=5) as m:
        m.save(1, tree(1))
        m.save(2, tree(2))
        m.wait_until_finished()
        m.delete(1)
        assert m.all_steps() == [2]
        with pytest.raises(NotFoundError):
            m.delete(1)


@pytest.mark.parametrize("kwargs, match", [
    ({"local_dir": 3}, "local_dir"),
    ({"local_dir": "s3://bucket/x"}, "local_dir"),
    ({"local_dir": "L", "local_keep": 0}, "local_keep"),
    ({"local_dir": "L", "local_keep": True}, "local_keep"),
    ({"local_dir": "L", "persist_every_n_steps": 0}, "persist_every_n_steps"),
    ({"local_dir": "L", "persist_every_seconds": float("nan")}, "persist_every_seconds"),
    ({"local_dir": "L", "persist_every_seconds": float("inf")}, "persist_every_seconds"),
    ({"local_dir": "L", "upload_rate": -1}, "upload_rate"),
    ({"local_dir": "L", "upload_rate": "fast"}, "upload_rate"),
])
def test_hostile_tier_arguments_are_refused_by_name(tmp_path, kwargs, match):
    if kwargs.get("local_dir") == "L":
        kwargs["local_dir"] = str(tmp_path / "l")
    with pytest.raises(InvalidArgumentError, match=match):
        CheckpointManager(str(tmp_path / "r"), **kwargs)


@pytest.mark.parametrize("remote, local", [("r", "r"), ("r", "r/local"), ("r/persistent", "r"), ("r", "link")])
def test_the_tiers_cannot_hold_each_other(tmp_path, remote, local):
    (tmp_path / "r").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "r")
    with pytest.raises(InvalidArgumentError, match="one holds the other"):
        CheckpointManager(str(tmp_path / remote), local_dir=str(tmp_path / local))


def test_a_local_dir_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises((InvalidArgumentError, OSError)):
        CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "f"))


def test_tier_methods_need_a_local_tier(tmp_path):
    m = CheckpointManager(str(tmp_path / "r"))
    with pytest.raises(InvalidArgumentError, match="local tier"):
        m.tier_state()
    with pytest.raises(InvalidArgumentError, match="local tier"):
        m.persist(1)


READ_ONLY_CHILD = r"""
import sys, numpy as np, atomicstore
sys.path.insert(0, sys.argv[3])
from test_tiers import same, tree
m = atomicstore.CheckpointManager(sys.argv[2], local_dir=sys.argv[1])
assert same(m.restore(), 1)
try:
    m.save(2, tree(2))
    sys.exit("a save to a read-only local tier succeeded")
except atomicstore.StorageError as exc:
    print("REFUSED", type(exc).__name__)
assert m.store.list() == ["checkpoint_1"]  # nothing reached the persistent tier either
print("OK")
"""


def test_a_read_only_local_tier_still_restores(tmp_path):
    """The local tier through a read-only bind mount (a real EROFS, which root cannot
    bypass, in the child's own mount namespace): recovery of it is logged, restore reads
    it, a save raises StorageError and persists nothing."""
    remote, local, ro = tmp_path / "remote", tmp_path / "local", tmp_path / "ro"
    with CheckpointManager(str(remote), local_dir=str(local), persist_every_n_steps=100) as m:
        m.save(1, tree(1))
    ro.mkdir()
    script = 'mount --bind "$1" "$2" && mount -o remount,ro,bind "$2" && exec "$3" -c "$4" "$2" "$5" "$6"'
    out = subprocess.run(["unshare", "-rm", "--propagation", "private", "sh", "-c", script, "sh", str(local),
                          str(ro), sys.executable, READ_ONLY_CHILD, str(remote), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.endswith("OK\n"), out.stdout + out.stderr
    assert "REFUSED StorageError" in out.stdout


def _child_save(m: CheckpointManager, q) -> None:
    try:
        m.save(5, tree(5))
        out = "saved"
    except InvalidArgumentError as exc:
        out = f"refused: {exc}"
    read = "read" if same(m.restore(1), 1, 1 << 18) else "read other data"  # reads through it work
    t0 = time.monotonic()
    m.wait_until_finished()  # (the parent's upload does not exist here: returns at once)
    m.close()
    q.put(f"{out}; {read}; waited {time.monotonic() - t0:.2f}")


def test_a_forked_child_cannot_use_the_parents_tiered_manager(tmp_path):
    with CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), upload_rate=1e6) as m:
        m.save(1, tree(1, 1 << 18))  # an upload in flight while the child forks
        out, code = in_forked_child(_child_save, m)
        assert code == 0 and out.startswith("refused") and "forked child" in out and "; read;" in out, out
        assert float(out.rsplit("waited ", 1)[1]) < 1.0, out
        m.wait_until_finished()
        assert m.store.list() == ["checkpoint_1"]


def test_persist_every_seconds_and_milestones(tmp_path):
    with CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), keep=10, local_keep=10,
                           persist_every_seconds=3600) as m:
        m.save(1, tree(1))  # the first: due
        m.save(2, tree(2))
        m.save(3, tree(3), milestone=True)  # a milestone: due
        m.save(4, tree(4))
        m.wait_until_finished()
        assert m.store.list() == ["checkpoint_1", "checkpoint_3"]


def test_closing_on_an_exception_abandons_uploads_and_the_next_manager_resumes_them(backend, tmp_path):
    local = tmp_path / "local"
    with pytest.raises(RuntimeError):
        with manager(backend, local, upload_rate=1e6) as m:
            m.save(0, tree(0, 1 << 18))  # about a second to upload
            raise RuntimeError("training crashed")
    store = backend.open()
    assert store.list() == []  # abandoned: nothing visible
    with manager(backend, local) as m:
        m.wait_until_finished()  # resumed
        assert m.store.list() == ["checkpoint_0"]
        m.store.verify("checkpoint_0")
    store.recover(now=FUTURE)
    assert not store.recover(now=FUTURE).actions


def test_a_delete_during_an_upload_of_that_step_is_not_undone_by_the_upload(backend, tmp_path):
    with manager(backend, tmp_path / "local", keep=5, upload_rate=1e6) as m:  # about a second per upload
        m.save(1, tree(1, 1 << 18))
        assert m.tier_state() == {1: TierState.PERSISTING}
        time.sleep(0.2)  # (the upload is running now, or about to)
        m.delete(1)
        m.wait_until_finished()
        assert m.all_steps() == []
        assert backend.open().list() == []


def test_jax_monitoring_events_of_tiered_saves(tmp_path):
    import jax.monitoring

    from atomicstore.tiers import LOCAL_COMMIT_EVENT, UPLOAD_EVENT, UPLOAD_START_EVENT

    events: list[str] = []
    jax.monitoring.register_event_listener(lambda e, **kw: events.append(e))
    jax.monitoring.register_event_duration_secs_listener(lambda e, secs, **kw: events.append(e))
    with CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), persist_every_n_steps=2) as m:
        m.save(1, tree(1))
        m.save(2, tree(2))  # not due
    assert events.count(LOCAL_COMMIT_EVENT) == 2
    assert events.count(UPLOAD_START_EVENT) == 1 and events.count(UPLOAD_EVENT) == 1


def test_tiered_saves_never_import_jax_from_a_background_thread(tmp_path):
    """A first import of jax in the uploader thread while the main thread imports it
    deadlocks the import: the events are recorded only if the program imported jax."""
    code = (
        "import sys, numpy as np, atomicstore\n"
        f"m = atomicstore.CheckpointManager({str(tmp_path / 'r')!r}, local_dir={str(tmp_path / 'l')!r}, "
        "async_save=True)\n"
        "m.save(1, {'w': np.ones(3)}); m.close()\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
        "assert atomicstore.open_store(" + repr(str(tmp_path / "r")) + ").list() == ['checkpoint_1']\n"
        "print('OK')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "OK\n", out.stdout + out.stderr


def test_an_overwrite_while_the_step_uploads_persists_the_new_save_and_no_error(backend, tmp_path):
    local = tmp_path / "local"
    with manager(backend, local, keep=5, overwrite=True, upload_rate=1e6) as m:  # about a second per upload
        m.save(2, tree(2, 1 << 18))
        time.sleep(0.2)  # its upload runs
        m.save(2, tree(20, 1 << 18))  # replaces the local copy under the upload: that upload commits nothing
        m.wait_until_finished()  # no error: the replaced save's upload was superseded, not failed
        saved = atomicstore.open_store(str(local)).manifest("checkpoint_2").metadata[TIER_KEY]["save"]
        assert backend.open().manifest("checkpoint_2").metadata[TIER_KEY]["save"] == saved
        shutil.rmtree(local)
    with manager(backend, local, keep=5) as m:
        assert same(m.restore(2), 20, 1 << 18)


@pytest.mark.parametrize("doc", [b"not json", b"[]", b'{"files": 3}', b'{"files": [{"file": "s", "size": -1, '
                                 b'"crc32c": 0, "by": 0}]}', b'{"files": [{"file": "s", "size": 1, "crc32c": 4294967296, '
                                 b'"by": 0}]}', b'{"files": [{"file": 1, "size": 1, "crc32c": 1, "by": 0}]}',
                                 b'{"files": [{"file": "s", "size": 1, "crc32c": 1}]}'])
def test_a_hostile_parts_list_of_a_multihost_local_part_is_corruption_naming_it(tmp_path, doc):
    from atomicstore.pytree.format import PARTS_FILE
    from atomicstore.tiers import _parts  # (read by the tiered restore and upload)

    st = atomicstore.open_store(str(tmp_path / "part"))
    with st.transaction("checkpoint_1") as txn:
        txn.write_bytes(PARTS_FILE, doc)
    with pytest.raises(CorruptionError, match="checkpoint_1/parts.json"):
        _parts(st.open("checkpoint_1"))


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_partitioned_persistent_tier_does_not_stop_a_local_save(kind, request, tmp_path):
    """Every request to the bucket is refused (403) while the job saves: the save commits
    to the local tier; the upload's error is raised by wait_until_finished; once the bucket
    answers again the step is persisted."""
    b = make_backend(kind, request, tmp_path)
    local = tmp_path / "local"
    with manager(b, local, keep=5, local_keep=1) as m:
        m.save(1, tree(1))
        m.wait_until_finished()
        b.faults(FaultPlan(deny=lambda environ: True))
        m.save(2, tree(2))
        with pytest.raises(atomicstore.StorageError):
            m.wait_until_finished()
        # local_keep=1, but whether 1 is persisted cannot be seen now: it stays too
        assert atomicstore.open_store(str(local)).list() == ["checkpoint_1", "checkpoint_2"]
        b.faults(None)
        m.persist(2)
        m.wait_until_finished()
        assert b.open().list() == ["checkpoint_1", "checkpoint_2"]
        assert atomicstore.open_store(str(local)).list() == ["checkpoint_2"]


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_save_sends_no_request_to_the_bucket(kind, request, tmp_path):
    """The caller's stall is the local commit: a tiered save (uploads held back: not due)
    makes no request to the persistent tier; its upload and retention do, later."""
    b = make_backend(kind, request, tmp_path)
    with manager(b, tmp_path / "local", keep=5, local_keep=1, persist_every_n_steps=100) as m:
        m.save(1, tree(1))
        m.wait_until_finished()
        m.save(2, tree(2))  # not due
        m.wait_until_finished()  # (its local retention checked that 1 is persisted: a listing)
        with b.server.injector.recording() as log:
            m.save(3, tree(3))  # not due; local retention drops 2, which was not due either
            m.wait_until_finished()
        assert log.requests == [], [(r.method, r.key) for r in log.requests]
        m.wait_until_finished()
        assert atomicstore.open_store(str(tmp_path / "local")).list() == ["checkpoint_3"]


def test_a_local_tier_serves_one_persistent_tier(tmp_path):
    with CheckpointManager(str(tmp_path / "a"), local_dir=str(tmp_path / "l")) as m:
        m.save(1, tree(1))
    with pytest.raises(InvalidArgumentError, match="is the local tier of"):
        CheckpointManager(str(tmp_path / "b"), local_dir=str(tmp_path / "l"))  # would upload a's steps as b's
    with CheckpointManager(str(tmp_path / "a"), local_dir=str(tmp_path / "l")) as m:
        assert same(m.restore(), 1)


def test_a_rollback_to_a_step_that_is_not_due_is_persisted(tmp_path):
    """overwrite=True: re-saving step 2 over 3 removes 3 from both tiers, also when 2 is
    not due (else the persistent tier would keep 3, and a lost machine restore it)."""
    remote, local = tmp_path / "r", tmp_path / "l"
    with CheckpointManager(str(remote), local_dir=str(local), keep=5, local_keep=5, overwrite=True,
                           persist_every_n_steps=1000) as m:
        for s in (1, 2, 3):
            m.save(s, tree(s))
        m.persist(2)
        m.persist(3)
        m.wait_until_finished()
        m.save(2, tree(20))  # not due by the period: persisted, as it removes 3
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]
        assert atomicstore.open_store(str(remote)).list() == ["checkpoint_1", "checkpoint_2"]
    shutil.rmtree(local)
    with CheckpointManager(str(remote), local_dir=str(local)) as m:
        assert same(m.restore(), 20) and m.metadata(2)["step"] == 2


def test_an_async_save_does_not_wait_for_the_upload_before_it(tmp_path):
    with CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), keep=5, local_keep=5,
                           async_save=True, upload_rate=1e6) as m:  # about a second per upload
        m.save(1, tree(1, 1 << 18))
        m.wait_until_finished()
        m.save(2, tree(2, 1 << 18))
        t0 = time.monotonic()
        m.save(3, tree(3, 1 << 18))  # step 2's upload runs: this save waits for step 2's local commit only
        assert time.monotonic() - t0 < 0.5
        assert m.tier_state()[2] == TierState.PERSISTING
        m.wait_until_finished()
        assert m.store.list() == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]


def test_leaving_with_on_an_error_does_not_wait_for_a_slow_upload(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError), CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"),
                                                        upload_rate=2048) as m:  # hours for 1 MiB
        m.save(1, tree(1, 1 << 18))
        raise RuntimeError("training crashed")
    assert time.monotonic() - t0 < 10
    assert atomicstore.open_store(str(tmp_path / "r")).list() == []


def test_ephemeral_steps_go_from_both_tiers_once_a_newer_step_commits(tmp_path):
    with CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), keep=3, local_keep=3) as m:
        m.save(1, tree(1))
        m.save(2, tree(2), ephemeral=True)
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]
        m.save(3, tree(3))
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]
        assert atomicstore.open_store(str(tmp_path / "l")).list() == ["checkpoint_1", "checkpoint_3"]


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_restore_from_the_local_tier_while_the_bucket_is_down(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    with manager(b, tmp_path / "local", keep=5) as m:
        m.save(1, tree(1))
        m.save(2, tree(2))
        m.wait_until_finished()
        b.faults(FaultPlan(deny=lambda environ: True))
        assert same(m.restore(), 2) and same(m.restore(1), 1)
        b.faults(None)
