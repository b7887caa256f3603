"""Arrays sharded across real JAX processes (jax.distributed on localhost, gloo).

Each test starts 2 or 4 processes of tests/system/mp_worker.py with 2 CPU devices each.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_backend
from mp_worker import ROWS, expected

import atomicstore
from atomicstore.compat import flax as ck

# exhaustive or multi-process: run in full once, on the oldest Python (noxfile `tests`)
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("mp_worker.py")
FUTURE = time.time() + 10**7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(n: int, mode: str, arg: str, url: str, opts: dict, tmp_path: Path, timeout: float = 150) -> list[dict]:
    port = free_port()
    outs = [tmp_path / f"out-{mode}-{arg}-{n}-{i}.json" for i in range(n)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parents[2]), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(n), str(i), mode, arg, url,
                               json.dumps(opts), str(outs[i])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(n)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    results = []
    for i, o in enumerate(outs):
        if not o.exists():
            results.append({"pid": i, "missing": True, "rc": procs[i].returncode, "log": logs[i][-3000:]})
        else:
            results.append(json.loads(o.read_text()) | {"rc": procs[i].returncode})
    return results


def where(kind: str, request, tmp_path) -> tuple[str, dict]:
    b = make_backend(kind, request, tmp_path)
    return b.url, b.options


def ok(results: list[dict]) -> None:
    for r in results:
        assert "error" not in r and not r.get("missing"), r


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_processes_save_then_restore_with_2_4_and_1_processes(kind, request, tmp_path):
    url, opts = where(kind, request, tmp_path)
    ok(run(2, "save", "1", url, opts, tmp_path))
    ok(run(2, "save", "2", url, opts, tmp_path))
    st = atomicstore.open_store(url, **opts)
    # layout: the main file per step, its _gda checkpoint; shards written once
    names = {e.name.rstrip("/") for e in st.driver.listdir("")} - {atomicstore.commit.names.RESERVED_DIR}
    assert names == {"checkpoint_1.0", "checkpoint_1.0_gda", "checkpoint_2.0", "checkpoint_2.0_gda"}
    man = st.verify("checkpoint_2.0_gda")
    shard_bytes = sum(e.size for p, e in man.files.items() if p.endswith(".bin"))
    e = expected(2.0)
    assert shard_bytes == e["w"].nbytes + e["r"].nbytes  # no replica written twice
    state = ck.restore_checkpoint(url, None, step=2.0, storage_options=opts)  # this process: numpy
    for k, v in e.items():
        assert np.array_equal(np.asarray(state[k]), v), k
    main = st.driver.read("checkpoint_2.0")
    assert ck.MP_ARRAY_PH.encode() + b"w" in main
    # same and different process counts
    res = run(2, "restore", "2.0", url, opts, tmp_path)
    ok(res)
    assert all(r["shards_checked"] == 4 for r in res)
    ok(run(4, "restore", "1.0", url, opts, tmp_path))


def test_a_corrupt_shard_is_named(tmp_path, request):
    url, opts = where("local", request, tmp_path)
    ok(run(2, "save", "3", url, opts, tmp_path))
    st = atomicstore.open_store(url)
    ckpt = st.open("checkpoint_3.0_gda")
    shard = next(p for p in ckpt.files if p.startswith("a0/"))
    path = Path(url) / "checkpoint_3.0_gda" / shard
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(atomicstore.ChecksumMismatchError, match=shard):
        ck.restore_checkpoint(url, None, step=3.0)


@pytest.mark.parametrize("kind", ["local", "s3", "seaweed"])
def test_a_process_lost_mid_save_means_no_commit_and_recovery_cleans(kind, request, tmp_path):
    url, opts = where(kind, request, tmp_path)
    ok(run(2, "save", "1", url, opts, tmp_path))
    res = run(2, "die_in_save", "2", url, opts, tmp_path)
    assert res[1]["rc"] == 17
    survivor = res[0]
    assert "CoordinationError" in (survivor["error"] or ""), survivor
    assert survivor["seconds"] < 8 + 10  # the timeout plus a margin, never a hang
    assert ck.available_steps(url, step_type=float, storage_options=opts) == [1.0]
    st = atomicstore.open_store(url, **opts)
    st.recover(now=FUTURE, flax_prefix="checkpoint_")  # process 0 aborted; anything left goes here
    left = set(st.driver.find(""))
    assert all(k.startswith(("checkpoint_1.0", )) for k in left), sorted(left)
    ok(run(2, "restore", "1.0", url, opts, tmp_path))


def test_losing_process_0_fails_the_others_and_commits_nothing(tmp_path, request):
    """Process 0 hosts jax.distributed's coordination service: when it dies, JAX itself
    terminates the other processes (a fatal error in its C++ agent, not something a
    library can catch). What atomicstore guarantees still holds: nothing is committed and
    recovery leaves the earlier step intact."""
    url, opts = where("local", request, tmp_path)
    ok(run(2, "save", "1", url, opts, tmp_path))
    t0 = time.monotonic()
    res = run(2, "die0_in_save", "2", url, opts, tmp_path)
    assert res[0]["rc"] == 17
    other = res[1]
    # either it raised CoordinationError, or JAX aborted it (when process 0 dies before the
    # other finished jax.distributed.initialize, the abort comes from backend set-up, with
    # another message): never a reported success
    assert "CoordinationError" in (other.get("error") or "") or (
        other["rc"] != 0 and other.get("missing")
    ), other
    assert time.monotonic() - t0 < 120  # no hang
    assert ck.available_steps(url, step_type=float) == [1.0]
    st = atomicstore.open_store(url)
    st.recover(now=FUTURE, flax_prefix="checkpoint_")
    assert all(k.startswith("checkpoint_1.0") for k in st.driver.find("")), sorted(st.driver.find(""))


def test_async_multiprocess_saves(tmp_path, request):
    url, opts = where("local", request, tmp_path)
    ok(run(2, "save_async", "1,2,3", url, opts, tmp_path))
    assert ck.available_steps(url, step_type=float) == [1.0, 2.0, 3.0]
    for s in (1.0, 3.0):
        state = ck.restore_checkpoint(url, None, step=s)
        assert np.array_equal(state["w"], expected(s)["w"])


def test_orphaned_gda_is_removed_by_recovery(tmp_path, request):
    url, opts = where("local", request, tmp_path)
    ok(run(2, "save", "4", url, opts, tmp_path))
    st = atomicstore.open_store(url)
    st.driver.delete("checkpoint_4.0")  # as if the crash came between the two commits
    report = st.recover(now=FUTURE, flax_prefix="checkpoint_")
    assert any("_gda" in a.target for a in report.actions), report.summary()
    assert not st.driver.exists("checkpoint_4.0_gda")
    assert ROWS == 64


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_a_second_job_on_a_step_being_committed_conflicts(kind, request, tmp_path):
    """Issue 11, row 3: job A is between its two commits (its _gda committed, its main
    file not yet) when job B saves the same step without overwrite: B must get a conflict
    and leave A's arrays alone (it used to switch to overwrite silently)."""
    url, opts = where(kind, request, tmp_path)
    st = atomicstore.open_store(url, **opts)
    with st.transaction("checkpoint_5.0_gda") as txn:
        txn.write_bytes("arrays.json", b'{"format": "atomicstore.gda/1", "arrays": []}')
    first = st.manifest("checkpoint_5.0_gda").attempt
    res = run(2, "save", "5", url, opts, tmp_path)
    assert "CommitConflictError" in (res[0].get("error") or ""), res[0]
    assert "CoordinationError" in (res[1].get("error") or ""), res[1]
    assert st.manifest("checkpoint_5.0_gda").attempt == first  # job A's arrays untouched
    assert not st.driver.exists("checkpoint_5.0")


def test_restore_refuses_arrays_of_another_attempt(tmp_path, request):
    """Issue 11, row 3: a main file and the arrays it restores come from the same attempt.
    Another job replaced the _gda (overwrite) and died before its main file: restoring
    must refuse, naming both attempts, instead of mixing two saves."""
    url, opts = where("local", request, tmp_path)
    ok(run(2, "save", "6", url, opts, tmp_path))
    st = atomicstore.open_store(url)
    old = st.open("checkpoint_6.0_gda")
    with st.transaction("checkpoint_6.0_gda", overwrite=True) as txn:
        for p in old.files:
            txn.write_bytes(p, old.read_bytes(p))
    with pytest.raises(atomicstore.CorruptionError, match="another job replaced"):
        ck.restore_checkpoint(url, None, step=6.0)
