"""Tiered checkpoints in a multi-host job (issue 25): two real ``jax.distributed``
processes (tests/system/mh_worker.py, 2 CPU devices each), each with its own local tier
(``<local_dir>/process-<i>``) holding the state, the index, the shard files it writes
and a copy of those it holds as replicas only.

Checked: process 0 commits the persistent copy once both processes uploaded their
shards (it verifies and lists every shard file with the CRC32Cs of the local copies);
with one process's local tier deleted every process restores the same step, process 1
reading the persistent copy; with that step gone from the persistent tier too, every
process agrees on the older step; a step that was never persisted is restored from the
two local tiers alone with the saved sharding; with another sharding (which needs the
other process's shards) every process raises NotFoundError.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_multihost import all_ok, one, run, shard_bytes, where

import atomicstore
from atomicstore.pytree.format import PARTS_FILE
from atomicstore.testing.faults import FaultPlan, is_mutation
from atomicstore.tiers import TIER_KEY

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_processes_restore_the_same_step_with_one_local_tier_lost(kind, request, tmp_path):
    url, opts, _ = where(kind, request, tmp_path)
    local = tmp_path / "local"
    mgr = {"op": "mgr", "kwargs": {"keep": 5, "local_keep": 5, "timeout": 60, "local_dir": str(local)}}
    res = run(2, url, opts, [mgr, {"op": "save", "step": 1, "val": 1.0}, {"op": "save", "step": 2, "val": 2.0},
                             {"op": "wait"}, {"op": "steps"}, {"op": "close"}], tmp_path, "save")
    all_ok(res)
    assert one(res[1], "steps")["value"] == [1, 2]
    store = atomicstore.open_store(url, **opts)
    assert store.list() == ["checkpoint_1", "checkpoint_2"]
    assert shard_bytes(store, "checkpoint_2") > 0  # every file verifies against its CRC32C
    parts = [atomicstore.open_store(str(local / f"process-{i}")) for i in (0, 1)]
    remote = store.manifest("checkpoint_2")
    own = []
    for part in parts:
        man = part.manifest("checkpoint_2")
        assert man.metadata[TIER_KEY]["save"] == remote.metadata[TIER_KEY]["save"]
        # its files are the persistent copy's (same CRC32Cs): its share, copies of the
        # shards it holds as replicas only (it can read the step back alone), the list of all
        assert {p: e for p, e in man.files.items() if p != PARTS_FILE}.items() <= remote.files.items()
        listed = json.loads(part.read_bytes("checkpoint_2", PARTS_FILE))["files"]
        own.append({f["file"] for f in listed if f["by"] == parts.index(part)})
        assert own[-1] < set(man.files)
    assert own[0] and own[1] and not own[0] & own[1]  # each shard written (and uploaded) by one process
    assert own[0] | own[1] == {p for p in remote.files if p.startswith("shards/")}

    shutil.rmtree(local / "process-1")  # process 1's machine is lost
    res = run(2, url, opts, [mgr, {"op": "restore", "step": None, "val": 2.0, "layout": "same"},
                             {"op": "restore", "step": None, "val": 2.0, "layout": "alt"},
                             {"op": "numpy", "step": 2, "val": 2.0}], tmp_path, "lost")
    all_ok(res, 4)

    store.delete("checkpoint_2")  # and step 2 is gone from the persistent tier: process 1 cannot read it
    res = run(2, url, opts, [mgr, {"op": "restore", "step": None, "val": 1.0, "layout": "same"}], tmp_path, "older")
    all_ok(res, 2)


def test_a_step_never_persisted_is_restored_from_the_local_tiers_alone(request, tmp_path):
    url, opts, _ = where("local", request, tmp_path)
    local = tmp_path / "local"
    mgr = {"op": "mgr", "kwargs": {"keep": 5, "local_keep": 5, "timeout": 60, "local_dir": str(local),
                                   "persist_every_n_steps": 10}}
    res = run(2, url, opts, [mgr, {"op": "save", "step": 3, "val": 3.0}, {"op": "save", "step": 4, "val": 4.0},
                             {"op": "wait"}, {"op": "close"}], tmp_path, "save")
    all_ok(res)
    assert atomicstore.open_store(url).list() == ["checkpoint_3"]  # 4 was not due
    res = run(2, url, opts, [mgr, {"op": "restore", "step": None, "val": 4.0, "layout": "same"},
                             {"op": "restore", "step": 4, "val": 4.0, "layout": "alt"},
                             {"op": "restore", "step": 3, "val": 3.0, "layout": "alt"}], tmp_path, "local")
    for r in res:
        assert r["rc"] == 0 and len(r["steps"]) == 4, r
        ok = [s["ok"] for s in r["steps"]]
        # another sharding needs the other process's shards: not in this local part, and
        # step 4 was never persisted: a clear error in every process, never other data
        assert ok == [True, True, False, True], r["steps"]
        assert r["steps"][2]["error"] == "NotFoundError", r["steps"][2]


def test_an_overwrite_and_a_resumed_upload_reach_every_process(request, tmp_path):
    """overwrite=True: saving step 5 again removes step 6 from both processes' local tiers
    and from the persistent tier; an upload the persistent tier refused (read-only
    credentials, then restored) is resumed by the next job, in both processes."""
    url, opts, backend = where("s3", request, tmp_path)
    local = tmp_path / "local"
    mgr = {"op": "mgr", "kwargs": {"keep": 5, "local_keep": 5, "timeout": 60, "local_dir": str(local),
                                   "overwrite": True}}
    res = run(2, url, opts, [mgr, {"op": "save", "step": 5, "val": 5.0}, {"op": "save", "step": 6, "val": 6.0},
                             {"op": "save", "step": 5, "val": 7.0}, {"op": "wait"}, {"op": "steps"},
                             {"op": "restore", "step": None, "val": 7.0, "layout": "same"}], tmp_path, "over")
    all_ok(res, 7)
    assert [one(r, "steps")["value"] for r in res] == [[5], [5]]
    store = atomicstore.open_store(url, **opts)
    assert store.list() == ["checkpoint_5"]
    for i in (0, 1):
        assert atomicstore.open_store(str(local / f"process-{i}")).list() == ["checkpoint_5"]

    backend.faults(FaultPlan(deny=is_mutation))  # the persistent tier refuses the next upload
    res = run(2, url, opts, [mgr, {"op": "save", "step": 8, "val": 8.0}, {"op": "wait"}], tmp_path, "refused")
    for r in res:
        assert r["rc"] == 0 and [s["ok"] for s in r["steps"]] == [True, True, False], r["steps"]
    backend.faults(None)
    assert store.list() == ["checkpoint_5"]
    res = run(2, url, opts, [mgr, {"op": "wait"}, {"op": "steps"}], tmp_path, "resumed")
    all_ok(res, 3)
    assert store.list() == ["checkpoint_5", "checkpoint_8"]
    assert shard_bytes(store, "checkpoint_8") > 0
    # a delete removes the step from the persistent tier and from every process's local part
    res = run(2, url, opts, [mgr, {"op": "delete", "step": 8}, {"op": "steps"}], tmp_path, "deleted")
    all_ok(res, 3)
    assert [one(r, "steps")["value"] for r in res] == [[5], [5]]
    assert store.list() == ["checkpoint_5"]
    for i in (0, 1):
        assert atomicstore.open_store(str(local / f"process-{i}")).list() == ["checkpoint_5"]
