"""Native checkpoints (``atomicstore.save``/``restore``, ``CheckpointManager``) of trees
holding ``jax.Array``s sharded across the processes of a real ``jax.distributed`` job
(issue 12).

Each job is 2 or 4 processes of tests/system/mh_worker.py on 127.0.0.1, 2 CPU devices each
(gloo collectives). The worker runs a list of steps and reports the outcome of each;
several checks share one launch to keep the suite fast.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import make_backend
from mh_worker import distinct_array_bytes, expected

import atomicstore
from atomicstore.drivers.local import LOCK_KEY
from atomicstore.testing.faults import FaultPlan, is_mutation, object_key

# exhaustive or multi-process: run in full once, on the oldest Python (noxfile `tests`)
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("mh_worker.py")
FUTURE = time.time() + 10**7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Job:
    procs: list[subprocess.Popen]
    outs: list[Path]


def start(n: int, url: str, opts: dict, actions: list[dict], tmp_path: Path, tag: str) -> Job:
    port = free_port()
    outs = [tmp_path / f"out-{tag}-{i}.json" for i in range(n)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parents[2]), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(n), str(i), url, json.dumps(opts),
                               json.dumps(actions), str(outs[i])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(n)]
    return Job(procs, outs)


def finish(job: Job, timeout: float = 150) -> list[dict]:
    logs = []
    deadline = time.monotonic() + timeout
    try:
        for p in job.procs:
            logs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
    finally:
        for p in job.procs:
            p.kill()
    results = []
    for i, o in enumerate(job.outs):
        r = json.loads(o.read_text()) if o.exists() else {"pid": i, "steps": []}
        results.append(r | {"rc": job.procs[i].returncode, "log": (logs[i] if i < len(logs) else "")[-3000:]})
    return results


def run(n: int, url: str, opts: dict, actions: list[dict], tmp_path: Path, tag: str) -> list[dict]:
    return finish(start(n, url, opts, actions, tmp_path, tag))


def steps(res: dict, op: str, step=None) -> list[dict]:
    return [s for s in res["steps"] if s["op"] == op and (step is None or s.get("step") == step)]


def one(res: dict, op: str, step=None) -> dict:
    found = steps(res, op, step)
    assert len(found) == 1, (op, step, res)
    return found[0]


def all_ok(results: list[dict], n_ops: int | None = None) -> None:
    for r in results:
        assert r["rc"] == 0, r
        for s in r["steps"]:
            assert s["ok"], (r["pid"], s)
        if n_ops is not None:
            assert len(r["steps"]) == n_ops, r


def shard_bytes(st: atomicstore.Store, name: str) -> int:
    man = st.verify(name)  # re-reads every file against its CRC32C
    return sum(e.size for p, e in man.files.items() if p.startswith("shards/"))


def check_numpy(tree: dict, val: float) -> None:
    e = expected(val)
    for a, b in (("params", "w"), ("params", "m"), ("params", "b"), ("opt", "r")):
        assert isinstance(tree[a][b], np.ndarray), (a, b, type(tree[a][b]))
        assert tree[a][b].dtype == e[a][b].dtype and np.array_equal(tree[a][b], e[a][b]), (a, b)
    assert tree["opt"]["count"] == e["opt"]["count"] and tree["opt"]["lr"] == e["opt"]["lr"]


def where(kind: str, request, tmp_path) -> tuple[str, dict, object]:
    b = make_backend(kind, request, tmp_path)
    return b.url, b.options, b


# -- 1 + 5: save with 2 and 4 processes, restore with 2, 4 and 1, other meshes, subtrees ------
def restore_checks(step: int, val: float) -> list[dict]:
    return [
        {"op": "restore", "step": step, "val": val, "layout": "same"},
        {"op": "restore", "step": step, "val": val, "layout": "alt"},
        {"op": "subtree", "step": step, "val": val, "layout": "alt"},
        {"op": "partial", "step": step, "val": val, "layout": "alt"},
    ]


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_save_restore_across_process_counts_meshes_subtrees_and_partial_targets(kind, request, tmp_path):
    url, opts, _ = where(kind, request, tmp_path)
    mgr = [{"op": "mgr", "kwargs": {"keep": 5, "timeout": 60}}]
    # saved by 2 processes; restored by the same 2, as saved and onto other meshes
    res = run(2, url, opts, [*mgr, {"op": "save", "step": 1, "val": 1.5}, *restore_checks(1, 1.5),
                             {"op": "numpy", "step": 1, "val": 1.5},
                             # and without a manager
                             {"op": "save_fn", "name": "direct", "val": 0.5},
                             {"op": "restore_fn", "name": "direct", "val": 0.5, "layout": "alt"}], tmp_path, "a")
    all_ok(res, 9)
    for r in res:
        assert [s["checked"] for s in steps(r, "restore")] == [8, 8] and one(r, "restore_fn")["checked"] == 8
    # saved by 2, restored by 4 (latest: collective); then saved by 4
    res = run(4, url, opts, [*mgr, {"op": "restore", "step": None, "val": 1.5, "layout": "same"},
                             *restore_checks(1, 1.5), {"op": "save", "step": 2, "val": 2.5},
                             {"op": "steps"}], tmp_path, "b")
    all_ok(res, 8)
    for r in res:
        assert one(r, "steps")["value"] == [1, 2]
        # every device shard of the four sharded arrays was checked (2 devices per process)
        assert [s["checked"] for s in steps(r, "restore")] == [8, 8, 8]
        assert one(r, "subtree")["checked"] == 4 and one(r, "partial")["checked"] == 4
    if kind == "local":  # saved by 4, restored by 2
        all_ok(run(2, url, opts, [*mgr, *restore_checks(2, 2.5)], tmp_path, "c"), 5)

    st = atomicstore.open_store(url, **opts)
    assert st.list() == ["checkpoint_1", "checkpoint_2", "direct"]
    check_numpy(atomicstore.restore(f"{url}/direct", **opts), 0.5)
    for name in ("checkpoint_1", "checkpoint_2", "direct"):
        # one file per distinct shard: the replicated array is written once, not per device
        assert shard_bytes(st, name) == distinct_array_bytes(), name
        state = st.read_bytes(name, "state.msgpack")
        assert b"//atomicstore.sharded:params/w" in state and b"//atomicstore.sharded:opt/r" in state
        assert len(state) < 1000  # the sharded arrays' bytes are not in it
    files2 = {p for p in st.manifest("checkpoint_2").files if p.startswith("shards/")}
    files1 = {p for p in st.manifest("checkpoint_1").files if p.startswith("shards/")}
    assert len(files1) == 4 + 4 + 1 + 1 and len(files2) == 8 + 8 + 1 + 1, (files1, files2)

    # and in this process, no jax.distributed: whole numpy arrays
    check_numpy(atomicstore.restore(f"{url}/checkpoint_2", **opts), 2.5)
    check_numpy(atomicstore.CheckpointManager(url, storage_options=opts).restore(1), 1.5)
    params = atomicstore.restore(f"{url}/checkpoint_1", subtree="params", **opts)
    assert set(params) == {"w", "m", "b"} and np.array_equal(params["w"], expected(1.5)["params"]["w"])
    part = atomicstore.restore(f"{url}/checkpoint_2", {"opt": {"r": np.zeros((4, 5), np.int32)}}, **opts)
    assert np.array_equal(part["opt"]["r"], expected(2.5)["opt"]["r"])


# -- 2: async saves ----------------------------------------------------------------------------
def shard_write_of(step: int, *suffixes: str):
    """A fault predicate: an upload of one of the shard files ``suffixes`` of
    ``checkpoint_<step>`` (files named by where the shard starts, i.e. those of one chosen
    process); not a delete."""

    def pred(environ: dict) -> bool:
        write = is_mutation(environ) and environ.get("REQUEST_METHOD") != "DELETE"
        key = object_key(environ) if write else None
        return key is not None and f"/checkpoint_{step}/" in key and "/shards/" in key and key.endswith(suffixes)

    return pred


def shard_delete_of(step: int):
    """A fault predicate: a delete of a shard file of ``checkpoint_<step>``."""

    def pred(environ: dict) -> bool:
        key = object_key(environ) if environ.get("REQUEST_METHOD") == "DELETE" else None
        return key is not None and f"/checkpoint_{step}/" in key and "/shards/" in key

    return pred


def test_async_saves_and_a_background_error_of_one_process_surfaces_everywhere(request, tmp_path):
    url, opts, backend = where("s3", request, tmp_path)
    # process 1 holds rows 32.. and 48.. of params/w: its uploads of step 4 fail (and only them)
    backend.faults(FaultPlan(error_rate=1.0, applies_to=shard_write_of(4, "/32_0.bin", "/48_0.bin")))
    res = run(2, url, opts, [
        {"op": "mgr", "kwargs": {"keep": 3, "timeout": 30, "async_save": True}, "fast_retry": True},
        {"op": "save", "step": 1, "val": 1.0, "mutate": True},
        {"op": "save", "step": 2, "val": 2.0, "mutate": True},
        {"op": "save", "step": 3, "val": 3.0, "mutate": True},
        {"op": "restore", "step": None, "val": 3.0, "layout": "same"},  # waits, then the latest
        {"op": "restore", "step": 1, "val": 1.0, "layout": "alt"},
        {"op": "save", "step": 4, "val": 4.0},  # returns; fails in the background, in process 1
        {"op": "sleep", "seconds": 6},  # the background saves have failed by now
        {"op": "save", "step": 5, "val": 5.0},  # raises the error, in every process
        {"op": "save", "step": 5, "val": 5.0},  # the job goes on
        {"op": "wait"},
        {"op": "steps"},  # retention (keep=3) ran in process 0 before any process returned
        {"op": "delete", "step": 2},  # collective
        {"op": "steps"},
        {"op": "close"},
    ], tmp_path, "async")
    for r in res:
        assert r["rc"] == 0, r
        ss = r["steps"]
        assert len(ss) == 15, r
        bad = ss[8]
        # the class of the background error: process 0 was told by process 1 (coordination),
        # process 1's own upload failed (storage)
        want = "CoordinationError" if r["pid"] == 0 else "StorageError"
        assert not bad["ok"] and bad["error"] == want, (r["pid"], bad)
        assert "a background save failed" in bad["message"], bad
        for s in ss[:8] + ss[9:]:
            assert s["ok"], (r["pid"], s)
        assert [s["value"] for s in steps(r, "steps")] == [[2, 3, 5], [3, 5]]
    # process 0 learned of process 1's failure through the coordination service
    assert res[0]["steps"][8]["cause"] == "CoordinationError", res[0]["steps"][8]
    assert "process 1" in res[0]["steps"][8]["message"]
    assert res[1]["steps"][8]["cause"] is not None  # its own storage error

    backend.faults(None)
    st = atomicstore.open_store(url, **opts)
    assert st.list() == ["checkpoint_3", "checkpoint_5"]
    for step in (3, 5):  # the numpy leaf as it was when save returned
        check_numpy(atomicstore.restore(f"{url}/checkpoint_{step}", **opts), float(step))
        assert shard_bytes(st, f"checkpoint_{step}") == distinct_array_bytes()
    st.recover(now=FUTURE)
    left = sorted(st.driver.find(""))
    assert all(k.startswith(("checkpoint_3/", "checkpoint_5/")) for k in left), left


# -- 3: a process killed mid-save, a process hanging past the timeout --------------------------
def test_lost_or_hanging_process_commits_nothing_and_every_survivor_raises_in_time(request, tmp_path):
    url, opts, backend = where("s3", request, tmp_path)
    T = 6.0
    margin = min(30.0, T / 4)
    # 4 processes, 8 devices: process 1 holds rows 16.. and 24.. of params/w and row 2.. of
    # params/m; its uploads of step 3 are held 3 s, and it is killed while they are
    # and deleting step 2's staged shards is slow: process 0's clean-up of the failed save
    # must delay neither the others' learning of the failure nor its own error
    backend.faults(FaultPlan(stalls=[(shard_write_of(3, "/16_0.bin", "/24_0.bin", "/2_0.bin", "/2_3.bin"), 3.0),
                                     (shard_delete_of(2), 4.0)]))
    res = run(4, url, opts, [
        {"op": "mgr", "kwargs": {"keep": 5, "timeout": T}},
        {"op": "save", "step": 1, "val": 1.0},
        {"op": "barrier", "name": "one"},
        # step 2: process 3 hangs past the timeout before it calls save
        {"op": "sleep", "seconds": T + 3, "pids": [3]},
        {"op": "save", "step": 2, "val": 2.0},
        {"op": "barrier", "name": "two"},
        # step 3: process 1 is lost in the middle of its save
        {"op": "die_after", "seconds": 2.0, "pids": [1]},
        {"op": "hard_exit"},
        {"op": "save", "step": 3, "val": 3.0},
    ], tmp_path, "lost")
    backend.faults(None)
    for r in res:
        assert one(r, "save", 1)["ok"], r
        s2 = one(r, "save", 2)
        assert not s2["ok"] and s2["error"] == "CoordinationError", (r["pid"], s2)
    assert "process 3" in one(res[0], "save", 2)["message"]
    for pid in (1, 2):  # told by process 0 that the save failed, not left guessing
        assert "was not committed" in one(res[pid], "save", 2)["message"], res[pid]
    for pid in (0, 1, 2):  # waited for the hanging process up to the timeout, not forever
        took = one(res[pid], "save", 2)["seconds"]
        assert T - 0.5 < took < T + (0 if pid == 0 else margin) + 3, (pid, took)

    assert res[1]["rc"] == 17 and not steps(res[1], "save", 3), res[1]
    for pid in (0, 2, 3):
        s3 = one(res[pid], "save", 3)
        assert not s3["ok"] and s3["error"] == "CoordinationError", (pid, s3)
        assert s3["seconds"] < T + (0 if pid == 0 else margin) + 3, (pid, s3)
        assert res[pid]["rc"] == 0, res[pid]
    assert "process 1" in one(res[0], "save", 3)["message"]

    st = atomicstore.open_store(url, **opts)
    assert st.list() == ["checkpoint_1"]
    time.sleep(1.0)  # (the held uploads of the lost process have landed by now)
    st.recover(now=FUTURE)
    left = sorted(st.driver.find(""))
    assert left and all(k.startswith("checkpoint_1/") for k in left), left
    check_numpy(atomicstore.CheckpointManager(url, storage_options=opts).restore(), 1.0)
    assert shard_bytes(st, "checkpoint_1") == distinct_array_bytes()


# -- a process holding other shards, a process skipping a call, a paused process 0 ------------
def test_mismatched_shardings_a_skipped_call_and_a_paused_process_0(request, tmp_path):
    """Three ways the processes of one job can disagree, on local disk, 2 processes:

    * process 1 shards ``params/w`` by columns, process 0 by rows (same shape, dtype and
      volume): the shards overlap and leave holes, so process 0 refuses to commit (it
      used to commit a checkpoint no restore could read);
    * process 1 skips ``save(3)`` (it raised before making the call): that save fails in
      process 0 only, and once both make the same call again, saves work (sessions used
      to stay out of step forever);
    * process 0 is paused (SIGSTOP, a stopped VM) longer than the timeout: process 1
      raises within the timeout plus the margin (its error publish used to block on the
      coordination service, which lives in the paused process, until it resumed); nothing
      is committed."""
    url, opts, _ = where("local", request, tmp_path)
    T = 6.0
    margin = min(30.0, T / 4)
    res = run(2, url, opts, [
        {"op": "mgr", "kwargs": {"keep": 10, "timeout": T}},
        {"op": "save", "step": 1, "val": 1.0},
        {"op": "barrier", "name": "one"},
        {"op": "save", "step": 2, "val": 2.0, "pids": [0]},
        {"op": "save", "step": 2, "val": 2.0, "spec": "cols", "pids": [1]},
        {"op": "barrier", "name": "two"},
        {"op": "save", "step": 3, "val": 3.0, "pids": [0]},
        {"op": "barrier", "name": "three"},  # (process 1 would otherwise time out waiting in save 4)
        {"op": "save", "step": 4, "val": 4.0},
        {"op": "barrier", "name": "four"},
        {"op": "pause_self", "seconds": T + margin + 6, "pids": [0]},
        {"op": "save", "step": 5, "val": 5.0},
        {"op": "barrier", "name": "five"},
        {"op": "steps"},
        {"op": "restore", "step": None, "val": 4.0, "layout": "alt"},
    ], tmp_path, "disagree")
    p0, p1 = res
    for r in res:
        assert r["rc"] == 0, r
        assert one(r, "save", 1)["ok"] and one(r, "save", 4)["ok"], r
        s2 = one(r, "save", 2)
        assert not s2["ok"] and s2["error"] == "CoordinationError", (r["pid"], s2)
        s5 = one(r, "save", 5)
        assert not s5["ok"] and s5["error"] == "CoordinationError", (r["pid"], s5)
        assert one(r, "steps")["value"] == [1, 4]
        assert one(r, "restore")["ok"], r
    assert "do not tile" in one(p0, "save", 2)["message"], p0
    s3 = one(p0, "save", 3)
    assert not s3["ok"] and s3["error"] == "CoordinationError" and "process 1" in s3["message"], s3
    assert not steps(p1, "save", 3)
    assert one(p1, "save", 5)["seconds"] < T + margin + 3, one(p1, "save", 5)
    st = atomicstore.open_store(url, **opts)
    st.recover(now=FUTURE)
    assert sorted({k.split("/")[0] for k in st.driver.find("")}) == ["checkpoint_1", "checkpoint_4"]


# -- 4: two jobs (a zombie and its restart) save the same step at once --------------------------
@pytest.mark.parametrize("kind", ["local", "s3", "seaweed"])
def test_two_jobs_saving_one_step_at_once_one_commits_whole(kind, request, tmp_path):
    url, opts, _ = where(kind, request, tmp_path)
    meet = str(tmp_path / "meet")
    vals = {"A": 10.0, "B": 20.0}
    jobs = {j: start(2, url, opts, [
        {"op": "mgr", "kwargs": {"keep": 5, "timeout": 30}},
        {"op": "rendezvous", "dir": meet, "count": 4, "job": j},
        {"op": "save", "step": 7, "val": v},
    ], tmp_path, f"job{j}") for j, v in vals.items()}
    res = {j: finish(job) for j, job in jobs.items()}
    won = {j for j, r in res.items() if all(one(p, "save", 7)["ok"] for p in r)}
    assert len(won) == 1, res
    winner = won.pop()
    loser = "B" if winner == "A" else "A"
    for p in res[winner] + res[loser]:
        assert p["rc"] == 0 and one(p, "rendezvous")["ok"], p
    lost0, lost1 = (one(p, "save", 7) for p in res[loser])
    assert lost0["error"] in ("CommitConflictError", "InvalidArgumentError"), lost0
    assert lost1["error"] == "CoordinationError", lost1

    st = atomicstore.open_store(url, **opts)
    assert st.list() == ["checkpoint_7"]
    # every leaf of the winner's, sharded ones included: none of the loser's bytes
    check_numpy(atomicstore.restore(f"{url}/checkpoint_7", **opts), vals[winner])
    assert shard_bytes(st, "checkpoint_7") == distinct_array_bytes()
    st.recover(now=FUTURE)
    # (local disk: the store's lock file, made by whatever took the store lock, stays)
    assert all(k.startswith("checkpoint_7/") or k == LOCK_KEY for k in st.driver.find(""))
    check_numpy(atomicstore.restore(f"{url}/checkpoint_7", **opts), vals[winner])
