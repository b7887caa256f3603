"""CheckpointManager: steps, retention, overwrite, metadata, async saves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import uncarried

import atomicstore
from atomicstore import CheckpointManager


def tree(v: float) -> dict:
    return {"w": np.full(8, v, np.float32), "step": v}


def test_save_restore_latest_and_metadata(backend):
    with CheckpointManager(backend.url, storage_options=backend.options, keep=3) as mgr:
        assert mgr.latest_step() is None
        with pytest.raises(atomicstore.NotFoundError):
            mgr.restore()
        for s in (1, 2, 3):
            mgr.save(s, tree(s), metadata={"lr": 0.1 * s}, metrics={"loss": 1.0 / s})
        assert mgr.all_steps() == [1, 2, 3]
        assert mgr.restore()["step"] == 3
        assert mgr.restore(2)["w"][0] == 2
        meta = mgr.metadata(2)
        assert meta["user"] == {"lr": 0.2} and meta["metrics"] == {"loss": 0.5}
        assert meta["version"].startswith("atomicstore ") and meta["step"] == 2
    # a new manager discovers the steps from storage
    again = CheckpointManager(backend.url, storage_options=backend.options, keep=3)
    assert again.all_steps() == [1, 2, 3]


def test_keep_and_keep_every_n_steps(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, keep_every_n_steps=3)
    for s in range(1, 11):
        mgr.save(s, tree(s))
    # newest two, plus one every 3 steps among the older ones (flax's rule)
    assert mgr.all_steps() == [1, 4, 7, 9, 10]


def test_float_and_negative_steps_sort_naturally(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=10)
    for s in (-0.2, 0.1, 9, 1e1 + 0.5, 100):
        mgr.save(s, tree(s))
    assert mgr.all_steps() == [-0.2, 0.1, 9, 10.5, 100]
    assert mgr.restore(0.1)["step"] == 0.1


def test_not_newer_is_refused_unless_overwrite(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=5)
    for s in (1, 2, 3):
        mgr.save(s, tree(s))
    with pytest.raises(atomicstore.InvalidArgumentError, match="not newer"):
        mgr.save(2, tree(20))
    with pytest.raises(atomicstore.InvalidArgumentError, match="not newer"):
        mgr.save(3, tree(30))
    mgr.save(2, tree(20), force=True)  # flax: overwriting removes newer checkpoints
    assert mgr.all_steps() == [1, 2]
    assert mgr.restore(2)["step"] == 20
    over = CheckpointManager(tmp_path, keep=5, overwrite=True)
    over.save(2, tree(21))
    assert over.all_steps() == [1, 2] and over.restore()["step"] == 21


def test_best_fn_keeps_the_best(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, best_fn=lambda m: m["acc"], best_mode="max")
    for s, acc in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.7), (5, 0.2)]:
        mgr.save(s, tree(s), metrics={"acc": acc})
    assert mgr.all_steps() == [2, 4]
    low = CheckpointManager(tmp_path / "min", keep=1, best_fn=lambda m: m["loss"], best_mode="min")
    for s, loss in [(1, 3.0), (2, 1.0), (3, 2.0)]:
        low.save(s, tree(s), metrics={"loss": loss})
    assert low.all_steps() == [2]


def test_milestones_and_ephemeral(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1)
    mgr.save(1, tree(1), milestone=True)
    mgr.save(2, tree(2))
    mgr.save(3, tree(3), ephemeral=True)
    assert mgr.all_steps() == [1, 2, 3]  # ephemeral kept until a newer regular one
    mgr.save(4, tree(4))
    assert mgr.all_steps() == [1, 4]  # milestone survives retention, ephemeral is gone
    with pytest.raises(atomicstore.InvalidArgumentError):
        mgr.save(5, tree(5), milestone=True, ephemeral=True)


def test_durations_are_recorded_through_jax_monitoring(tmp_path):
    events = []
    jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: events.append(name))
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, tree(1))
    mgr.restore()
    assert "/jax/checkpoint/write/durations_sec" in events
    assert "/jax/checkpoint/read/durations_sec" in events


def test_async_saves_are_ordered_and_snapshot_the_state(tmp_path):
    with CheckpointManager(tmp_path, keep=5, async_save=True) as mgr:
        state = {"w": np.zeros(1000, np.float32), "j": jnp.arange(4.0)}
        for s in range(1, 5):
            state["w"][:] = s
            mgr.save(s, state)
            state["w"][:] = -1  # mutation after save() returned must not leak into the checkpoint
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3, 4]
        for s in range(1, 5):
            assert np.all(mgr.restore(s)["w"] == s)
        assert np.array_equal(mgr.restore(4)["j"], np.arange(4.0))


def test_async_error_surfaces_on_the_next_call(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=5, async_save=True)
    mgr.save(1, {"bad": object()})  # fails in the background
    with pytest.raises(atomicstore.AtomicStoreError, match="background save failed") as info:
        mgr.wait_until_finished()
    assert isinstance(info.value.__cause__, atomicstore.InvalidArgumentError)
    mgr.save(2, tree(2))
    mgr.close()
    assert mgr.all_steps() == [2]
    with pytest.raises(atomicstore.InvalidArgumentError, match="closed"):
        mgr.save(3, tree(3))


def test_async_error_is_raised_by_next_save(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=5, async_save=True)
    mgr.save(1, {"bad": object()})
    for t in threading.enumerate():  # let the background save fail first
        if t.name == "atomicstore-save-1":
            t.join()
    with pytest.raises(atomicstore.AtomicStoreError, match="background save failed"):
        mgr.save(2, tree(2))


def test_opening_runs_recovery(tmp_path):
    """A save that crashed a day ago (its lease and staged data untouched since) is
    removed when a manager opens the directory."""
    from crashsim import Crasher, CrashingDriver, SimulatedCrash

    store = atomicstore.open_store(tmp_path)
    crashing = atomicstore.Store(CrashingDriver(store.driver, Crasher(crash_at=4)), lease_ttl=3600)
    with pytest.raises(SimulatedCrash):
        with crashing.transaction("checkpoint_1") as txn:
            txn.write_bytes("a.bin", b"x" * 100)
            txn.write_bytes("b.bin", b"y" * 100)
    day_ago = time.time() - 86400
    for p in (tmp_path / ".atomicstore").rglob("*"):
        os.utime(p, (day_ago, day_ago))
    assert store.recover(dry_run=True).actions
    CheckpointManager(tmp_path)
    assert not store.recover(dry_run=True).actions


@pytest.mark.parametrize("kwargs", [{"keep": 0}, {"prefix": ""}, {"prefix": "a/b"}, {"best_mode": "mid"},
                                    {"keep_every_n_steps": 0}, {"max_pending": 0}])
def test_bad_manager_arguments(tmp_path, kwargs):
    with pytest.raises(atomicstore.InvalidArgumentError):
        CheckpointManager(tmp_path, **kwargs)


@pytest.mark.parametrize("step", ["1", None, float("nan"), True])
def test_bad_steps(tmp_path, step):
    with pytest.raises(atomicstore.InvalidArgumentError):
        CheckpointManager(tmp_path).save(step, tree(1))


def test_items_and_commit_time_are_saved_with_the_step(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    t0 = time.time()
    mgr.save(1, tree(1), items={"data_iter": {"epoch": 2, "offset": 1234}, "config": {"lr": 0.1}})
    got, items = mgr.restore(1, with_items=True)
    assert items == {"data_iter": {"epoch": 2, "offset": 1234}, "config": {"lr": 0.1}}
    assert got["step"] == 1
    meta = mgr.metadata(1)
    assert t0 <= meta["started"] <= meta["committed"] <= time.time()
    with pytest.raises(atomicstore.InvalidArgumentError, match="JSON"):
        mgr.save(2, tree(2), items={"fn": print})  # nothing executable is stored
    with pytest.raises(atomicstore.InvalidArgumentError):
        mgr.save(2, tree(2), items={"": 1})
    assert mgr.all_steps() == [1]


ASYNC_CHILD = textwrap.dedent("""
    import resource, sys, time
    import jax.monitoring  # imported by the first save otherwise: not state memory
    import numpy as np
    from atomicstore import CheckpointManager
    mode, root = sys.argv[1], sys.argv[2]
    MiB = 2**20
    state = {"w": np.ones(256 * MiB // 4, np.float32)}
    mgr = CheckpointManager(root, keep=2, async_save=True)
    if mode == "memory":
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        for step in range(1, 6):  # quick saves: each waits for the previous one
            state["w"][0] = step
            mgr.save(step, state)
        mgr.close()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(peak - before, flush=True)
    else:
        mgr.save(1, {"w": np.arange(10)})
        mgr.wait_until_finished()
        big = {"w": np.ones(768 * MiB // 4, np.float32)}
        mgr.save(2, big)
        print("SAVING", flush=True)
        time.sleep(600)
""")


def test_async_memory_stays_bounded_with_several_quick_saves(tmp_path):
    out = subprocess.run([sys.executable, "-c", ASYNC_CHILD, "memory", str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    grew = int(out.stdout.split()[-1])
    state = 256 * 2**20
    print(f"\n5 quick async saves of 256 MiB: peak RSS grew by {grew / 2**20:.0f} MiB")
    # one snapshot being written plus the next one waiting, plus buffers; never one per save
    assert grew < 2 * state + 64 * 2**20, grew
    assert CheckpointManager(tmp_path / "s").all_steps() == [4, 5]


def test_process_killed_during_async_save_leaves_only_committed_steps(tmp_path):
    root = tmp_path / "s"
    p = subprocess.Popen([sys.executable, "-c", ASYNC_CHILD, "crash", str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "SAVING"
        staging = root / ".atomicstore" / "staging"
        deadline = time.monotonic() + 60
        while not any(f.stat().st_size > 0 for f in staging.rglob("*") if f.is_file()):
            assert time.monotonic() < deadline, "the background save never started writing"
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)  # mid-write of the 768 MiB state
    finally:
        p.kill()
        p.wait()
    store = atomicstore.open_store(str(root))
    assert store.list() == ["checkpoint_1"]
    for name in store.list():
        store.verify(name)  # whatever is committed is whole
    report = store.recover(now=time.time() + 10**7)
    mgr = CheckpointManager(root)
    assert np.array_equal(mgr.restore(1)["w"], np.arange(10))
    assert any(a.kind == "attempt" for a in report.actions), report.summary()  # the half-written save
    assert not store.recover(now=time.time() + 10**7).actions


# -- issue 11, rows 7 and 8 -------------------------------------------------------------------
@pytest.mark.parametrize("how", ["force", "overwrite", "async"])
def test_failed_overwrite_keeps_the_newer_steps(backend, how):
    """Row 7: newer steps are removed only after the new step committed."""
    mgr = CheckpointManager(backend.url, storage_options=backend.options, keep=5,
                            overwrite=how == "overwrite", async_save=how == "async")
    for s in (1, 2, 3):
        mgr.save(s, tree(s))
    mgr.wait_until_finished()
    force = how != "overwrite"
    for step, bad in ((2, {"w": np.array([object()])}), (1.5, {"w": object()})):  # unsupported leaves
        with pytest.raises(atomicstore.AtomicStoreError):
            mgr.save(step, bad, force=force)
            mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3]
        assert mgr.restore(3)["step"] == 3 and mgr.restore(2)["step"] == 2
    mgr.save(2, tree(20), force=force)  # a save that commits does remove the newer ones
    mgr.close()
    assert mgr.all_steps() == [1, 2] and mgr.restore(2)["step"] == 20


def _garble_manifest(store: atomicstore.Store, name: str) -> None:
    """Write garbage over the committed manifest of ``name`` (the attempt's, on object
    stores, whose commit marker then carries no copy of it)."""
    prefix, _ = store.strategy.resolve(name)
    store.driver.put(f"{prefix}/manifest.json", b"\x00not a manifest")
    uncarried(store, name)


def test_unreadable_step_is_kept_uncounted_and_warned_about(backend, caplog):
    """Row 8: later saves succeed; retention never deletes a step it cannot read, does not
    count it towards keep, and names it in a warning each time."""
    mgr = CheckpointManager(backend.url, storage_options=backend.options, keep=2)
    for s in (1, 2, 3):
        mgr.save(s, tree(s))
    assert mgr.all_steps() == [2, 3]
    _garble_manifest(mgr.store, "checkpoint_2")
    with pytest.raises(atomicstore.CorruptionError):
        mgr.metadata(2)
    with caplog.at_level("WARNING", logger="atomicstore.manager"):
        mgr.save(4, tree(4))  # keeps 3 and 4 (2 is not counted)
        mgr.save(5, tree(5))  # keeps 4 and 5; 2 is still never deleted
    assert mgr.all_steps() == [2, 4, 5]
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "checkpoint_2" in r.getMessage()]
    assert len(warned) == 2, caplog.text
    assert mgr.restore()["step"] == 5


def test_step_deleted_during_retention_is_skipped(backend):
    """Row 8: a checkpoint another process deletes between the listing and the read. (A
    manager reads the metadata of a step once, while its commit marker is unchanged: the
    saves are made by one manager, retention after step 4 by a new one, which reads every
    step.)"""
    other = backend.open()
    store = backend.open()
    armed = []
    listing = store.committed

    def committed() -> dict:
        found = listing()
        if armed:
            armed.clear()
            other.delete("checkpoint_2")  # another process, just after our listing
        return found

    store.committed = committed  # type: ignore[method-assign]
    mgr = CheckpointManager(backend.url, store=store, keep=3)
    for s in (1, 2, 3):
        mgr.save(s, tree(s))
    armed.append(True)
    mgr = CheckpointManager(backend.url, store=store, keep=3, recover=False)
    mgr.save(4, tree(4))  # retention lists 1..4; 2 vanishes before it is read
    assert not armed and mgr.all_steps() == [1, 3, 4]
    assert mgr.restore()["step"] == 4


def test_overwrite_removes_only_the_newer_steps_it_saw(tmp_path):
    """Issue 11: ``save(5)`` with overwrite removes the newer steps that were there when it
    was called, and only those: a step 6 that another writer saved again while step 5 was
    being written is kept. A's background write is held at its first file (through a
    driver subclass) while B saves."""
    gate, entered = threading.Event(), threading.Event()
    base = atomicstore.open_store(tmp_path).driver

    class Gated(type(base)):  # type: ignore[misc]
        def open_writer(self, key, **kwargs):
            if "checkpoint_5." in key and not entered.is_set():
                entered.set()
                gate.wait(30)
            return super().open_writer(key, **kwargs)

    b = atomicstore.CheckpointManager(str(tmp_path), keep=10, overwrite=True)
    b.save(5, {"x": np.zeros(3)})
    b.save(6, {"x": np.zeros(3)})
    a = atomicstore.CheckpointManager(
        str(tmp_path),
        keep=10,
        overwrite=True,
        async_save=True,
        store=atomicstore.Store(Gated(base.fs, base.root, url=base.url)),
    )
    a.save(5, {"x": np.ones(3)})
    assert entered.wait(30)
    b.save(6, {"x": np.full(3, 2.0)}, force=True)  # saved again while A writes step 5
    gate.set()
    a.wait_until_finished()
    assert a.all_steps() == [5, 6], "a step saved after the overwrite began must not be removed"
    assert b.restore(6)["x"][0] == 2.0 and a.restore(5)["x"][0] == 1.0


def test_async_save_raises_the_error_of_the_save_it_waited_for(request, tmp_path):
    """With one save in flight, the next ``save`` waits for it; if that one fails while
    it waits, this ``save`` raises its error (and saves nothing) instead of committing and
    leaving the error to a later call."""
    from conftest import make_backend

    from atomicstore.testing.faults import FaultPlan, object_key

    def state_of_step_2(env):
        k = object_key(env) if env.get("REQUEST_METHOD") in ("PUT", "POST") else None
        return k is not None and "/checkpoint_2/" in k and k.endswith("state.msgpack")

    b = make_backend("s3", request, tmp_path)
    opts = dict(b.options, retry=atomicstore.RetryPolicy(attempts=2, initial_wait=0.01, max_wait=0.01, deadline=5))
    b.server.faults(FaultPlan(error_rate=1.0, applies_to=state_of_step_2, stalls=[(state_of_step_2, 0.5)]))
    mgr = CheckpointManager(b.url, async_save=True, keep=10, storage_options=opts)
    mgr.save(1, {"x": np.ones(3)})
    mgr.save(2, {"x": np.ones(3) * 2})  # fails in the background, slowly
    with pytest.raises(atomicstore.AtomicStoreError, match="background save failed.*checkpoint_2"):
        mgr.save(3, {"x": np.ones(3) * 3})
    mgr.wait_until_finished()  # the error was raised once, not again
    assert mgr.all_steps() == [1]
    mgr.save(3, {"x": np.ones(3) * 3})
    mgr.close()
    assert mgr.all_steps() == [1, 3]


def test_async_overwrites_of_a_step_in_flight_replace_it_in_order(tmp_path):
    """With overwrite=True and async saves, saving a step again while its first save is
    still in flight replaces it (the step rules are applied again once the save waited
    for has committed), instead of failing with a commit conflict and losing the save."""
    mgr = CheckpointManager(str(tmp_path / "ow"), overwrite=True, async_save=True, keep=3)
    for i in range(6):
        mgr.save(5, {"v": np.full(1 << 20, i, np.float32)})
    mgr.save(6, {"v": np.zeros(3, np.float32)})
    mgr.save(5, {"v": np.full(3, 7, np.float32)})  # removes 6 once committed
    mgr.close()
    assert mgr.all_steps() == [5]
    assert (mgr.restore(5)["v"] == 7).all()

    plain = CheckpointManager(str(tmp_path / "plain"), async_save=True)
    plain.save(1, {"v": np.ones(1 << 20, np.float32)})
    with pytest.raises(atomicstore.InvalidArgumentError, match="not newer"):
        plain.save(1, {"v": np.ones(3, np.float32)})  # the first may not have committed yet
    plain.close()
    assert plain.all_steps() == [1] and plain.restore(1)["v"].shape == (1 << 20,)
