"""Issue 21, row 12: every process of a ``jax.distributed`` job restores the same save.

Two real processes (tests/system/mh_worker.py, 2 CPU devices each) restore step 1 (through
``CheckpointManager.restore``) and then a checkpoint ``direct`` (through
``atomicstore.restore``) while another job (this test) overwrites it exactly after process
0 has read everything it reads and before process 1's first read: process 1's first
storage read of the checkpoint waits (a gate in the worker) until process 0 has read all
it reads (it returned, or it waits on the coordination service) and the overwrite is
done. Every process must raise ``PreconditionFailedError`` (nobody may keep a global
array mixing two saves, or host values other processes do not have); restoring again
gives every process the new save (on S3 with read-only credentials: a restore writes
nothing). A forked child of a process of the job restores on its own (no coordination, no
hang).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mh_worker import expected
from test_multihost import Job, finish, one, start, steps, where

import atomicstore
from atomicstore.testing.faults import FaultPlan, is_mutation

# exhaustive or multi-process: run in full once, on the oldest Python (noxfile `tests`)
pytestmark = pytest.mark.slow


def wait_files(job: Job, *paths: Path, timeout: float = 120) -> None:
    """Until every path exists (the job's processes touched them); fail early if a
    process exited."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p.returncode for p in job.procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, (dead, [p for p in paths if not p.exists()],
                                                          finish(job, 5))
        time.sleep(0.01)


def overwrite_between(job: Job, d: Path, tag: str, url: str, name: str, opts: dict,
                      then: Callable[[], None] | None = None) -> None:
    """Once process 0 has read and process 1 waits before its first read: overwrite (and
    run ``then``)."""
    wait_files(job, d / f"{tag}-p0", d / f"{tag}-ready")
    atomicstore.save(f"{url}/{name}", expected(9.0), overwrite=True, **opts)  # another job
    if then is not None:
        then()
    (d / f"{tag}-go").touch()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_row12_an_overwrite_between_two_processes_reads_fails_every_process(kind, request, tmp_path):
    url, opts, backend = where(kind, request, tmp_path)
    d = tmp_path / "sync"
    d.mkdir()

    def round_(tag: str, name: str, restore: dict) -> list[dict]:
        return [
            {"op": "gate", "pids": [1], "name": name, "ready": str(d / f"{tag}-ready"), "go": str(d / f"{tag}-go")},
            {"op": "arm", "pids": [0], "path": str(d / f"{tag}-p0")},
            restore,
            {"op": "touch", "pids": [0], "path": str(d / f"{tag}-p0")},  # (if it returned)
            {"op": "rendezvous", "dir": str(d / f"meet-{tag}"), "count": 2},  # (no device collective)
        ]

    job = start(2, url, opts, [
        {"op": "mgr", "kwargs": {"keep": 5, "timeout": 60}},
        {"op": "save", "step": 1, "val": 1.0},
        {"op": "save_fn", "name": "direct", "val": 1.0},
        {"op": "rendezvous", "dir": str(d / "meet-saved"), "count": 2},
        *round_("r1", "checkpoint_1", {"op": "restore", "step": 1, "val": 1.0, "layout": "same"}),
        *round_("r2", "direct", {"op": "restore_fn", "name": "direct", "val": 1.0, "layout": "alt"}),
        # again, now that nobody overwrites: the new save, in every process
        {"op": "restore", "step": 1, "val": 9.0, "layout": "alt"},
        {"op": "restore_fn", "name": "direct", "val": 9.0, "layout": "same"},
        {"op": "numpy", "step": 1, "val": 9.0},
        # a forked child (a data-loader worker) restores alone: no session, no hang
        {"op": "fork_restore", "pids": [1], "name": "checkpoint_1", "val": 9.0, "out": str(d / "fork")},
    ], tmp_path, "row12")
    overwrite_between(job, d, "r1", url, "checkpoint_1", opts)
    # from then on (S3) the credentials are read-only: restoring writes nothing
    read_only = (lambda: backend.faults(FaultPlan(deny=is_mutation))) if kind == "s3" else None
    overwrite_between(job, d, "r2", url, "direct", opts, then=read_only)
    res = finish(job)
    for r in res:
        assert r["rc"] == 0, r
        first = [s for s in r["steps"] if s["op"] in ("restore", "restore_fn")][:2]
        for s in first:
            assert not s["ok"] and s["error"] == "PreconditionFailedError", (r["pid"], s)
        assert "replaced" in first[0]["message"] or "deleted" in first[0]["message"], first[0]
        later = [s for s in r["steps"] if s["op"] in ("restore", "restore_fn", "numpy")][2:]
        assert len(later) == 3 and all(s["ok"] for s in later), (r["pid"], later)
        assert [s["checked"] for s in later[:2]] == [8, 8], later
    assert one(res[1], "fork_restore")["value"] == "ok", one(res[1], "fork_restore")
    assert not steps(res[0], "fork_restore")
    # process 1 found the checkpoint replaced; process 0 learned it from process 1
    assert "process 1" in [s for s in res[0]["steps"] if s["op"] == "restore"][0]["message"]
