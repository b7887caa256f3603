"""CheckpointManager: steps, retention, overwrite, metadata, async saves."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    (tmp_path / "checkpoint_tmp").write_bytes(b"flax staging left by a crash")
    import os
    os.utime(tmp_path / "checkpoint_tmp", (1, 1))  # long ago
    CheckpointManager(tmp_path)
    assert not (tmp_path / "checkpoint_tmp").exists()


@pytest.mark.parametrize("kwargs", [{"keep": 0}, {"prefix": ""}, {"prefix": "a/b"}, {"best_mode": "mid"},
                                    {"keep_every_n_steps": 0}, {"max_pending": 0}])
def test_bad_manager_arguments(tmp_path, kwargs):
    with pytest.raises(atomicstore.InvalidArgumentError):
        CheckpointManager(tmp_path, **kwargs)


@pytest.mark.parametrize("step", ["1", None, float("nan"), True])
def test_bad_steps(tmp_path, step):
    with pytest.raises(atomicstore.InvalidArgumentError):
        CheckpointManager(tmp_path).save(step, tree(1))
