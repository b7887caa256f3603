"""Tiered checkpoints under SIGKILL (issue 25, acceptance 1).

A real training process (tests/manager/tier_worker.py) saves steps with tiers and is
killed at random instants: at a random delay after a save returned (a local commit, an
upload or retention in flight) and right after an upload started (``jax.monitoring``'s
upload-start event, logged by the worker). Between kills the machine is sometimes "lost"
(the local tier deleted). After every kill: each step listed in either tier verifies and
restores bit-identical to the state saved as that step (no partial step is ever listed);
a new run resumes from the newest step either tier holds, checking the state it
restores. At the end recovery of both tiers (as if everything in flight were dead)
leaves nothing but committed checkpoints, and a second recovery finds nothing.

A paused uploader (SIGSTOP: a zombie of the previous incarnation) is fenced: the next
incarnation persists the same step, and when the zombie wakes its commit is refused; one
persistent copy, which verifies.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_backend
from tier_worker import check

import atomicstore
from atomicstore.commit.strategy import KeyKind
from atomicstore.drivers.local import LOCK_KEY
from atomicstore.tiers import TIER_FILE

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("tier_worker.py")
FUTURE = time.time() + 10**7
LISTENER = (
    "import jax.monitoring, atomicstore.tiers as t\n"
    "jax.monitoring.register_event_listener(lambda e, **k: e == t.UPLOAD_START_EVENT and "
    "open(LOG, 'a').write('upload\\n'))\n"
)


def start(url: str, opts: dict, local: Path, kwargs: dict, log: Path, last: int = 10**6) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parents[2]), str(WORKER.parent)])}
    code = (f"import sys; LOG = {str(log)!r}\n{LISTENER}"
            f"sys.argv = ['tier_worker.py'] + {json.dumps([url, json.dumps(opts), str(local), json.dumps(kwargs), '0', str(last), str(log)])}\n"
            "import tier_worker; tier_worker.main()\n")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def wait_line(proc: subprocess.Popen, log: Path, want: str, after: int, timeout: float = 120) -> int:
    """Until the log has a line starting with ``want`` after its first ``after`` lines."""
    deadline = time.monotonic() + timeout
    while True:
        got = lines(log)
        for i in range(after, len(got)):
            if got[i].startswith(want):
                return i + 1
        if proc.poll() is not None:
            pytest.fail(f"the worker exited ({proc.returncode}): {proc.stdout.read() if proc.stdout else ''}")
        assert time.monotonic() < deadline, f"no {want!r} in {got[after:]}"
        time.sleep(0.005)


def check_tier(store: atomicstore.Store) -> list[int]:
    """Every listed step verifies and restores bit-identical; the steps."""
    steps = []
    for name in store.list():
        store.verify(name)
        tree = atomicstore.restore(name, store=store)
        step = int(name.removeprefix("checkpoint_"))
        assert tree["step"] == step
        check(tree, step)
        steps.append(step)
    return steps


def leftovers(store: atomicstore.Store) -> list[str]:
    """Keys that belong to no committed checkpoint (after recovery: none)."""
    committed = {n: store.open(n).manifest.attempt for n in store.list()}
    out = []
    for key in store.driver.find(""):
        c = store.strategy.classify(key)
        if (c.kind == KeyKind.ATTEMPT and committed.get(c.name) == c.attempt) or (
                c.kind == KeyKind.MARKER and c.name in committed) or (
                c.kind == KeyKind.FOREIGN and key.split("/", 1)[0] in committed) or c.kind == KeyKind.PROBE or (
                key in (LOCK_KEY, TIER_FILE)):  # (the store's lock; the local tier's record of its bucket)
            continue  # a committed checkpoint's (on rename backends its files are its own name's)
        out.append(f"{key} ({c.kind})")
    out += [k for k, _, _ in store.driver.list_incomplete_uploads("")]
    return out


@pytest.mark.parametrize("kind", ["local", "s3", "gcs", "seaweed"])
def test_sigkill_during_local_commits_and_uploads_loses_nothing_committed(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    if b.kind != "local":  # a killed commit's claim is taken over after ttl + grace: seconds, here
        b.options = {**b.options, "lease_ttl": 2.0, "grace": 1.5}
    rng = random.Random(f"tiers-{kind}")
    remote = b.open()
    local, log = tmp_path / "local", tmp_path / "log"
    kills = {"after a save": 0, "in an upload": 0, "machine lost": 0}
    newest = -1
    for rnd in range(8 if kind in ("local", "s3") else 5):
        kwargs = {"keep": 3, "local_keep": 2, "persist_every_n_steps": 2, "upload_rate": 24e6,
                  "async_save": rnd % 2 == 1}
        n = len(lines(log))
        proc = start(b.url, b.options, local, kwargs, log)
        first = wait_line(proc, log, "saved", n)
        restored = [x for x in lines(log)[n:first] if x.startswith("restored")]
        if newest >= 0:  # it resumed from the newest step a tier held (checked inside: bit-identical)
            assert restored and int(restored[0].split()[1]) == newest, (restored, newest)
        if rnd % 2:
            wait_line(proc, log, "upload", first)
            time.sleep(rng.uniform(0, 0.15))
            kills["in an upload"] += 1
        else:
            time.sleep(rng.uniform(0, 0.6))
            kills["after a save"] += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        loc = atomicstore.open_store(str(local)) if local.exists() else None
        held = check_tier(remote) + (check_tier(loc) if loc is not None else [])
        newest = max(held, default=-1)
        if rnd % 3 == 2:
            shutil.rmtree(local)  # the machine is lost: only the persistent tier is left
            newest = max(check_tier(remote), default=-1)
            kills["machine lost"] += 1
    print(kind, kills)
    assert all(kills.values())
    # the last incarnation runs to its end, then recovery of both tiers leaves no garbage
    n = len(lines(log))
    proc = start(b.url, b.options, local, {"keep": 3, "local_keep": 2, "persist_every_n_steps": 2},
                 log, last=newest + 3)
    assert proc.wait(120) == 0, proc.stdout.read() if proc.stdout else ""
    assert lines(log)[-1] == "done"
    loc = atomicstore.open_store(str(local))
    for st in (remote, loc):
        st.recover(now=FUTURE)
        assert not st.recover(now=FUTURE).actions
        assert leftovers(st) == []
    assert check_tier(remote)[-1] == newest + 3 or check_tier(loc)[-1] == newest + 3


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_paused_uploader_of_the_last_incarnation_is_fenced(kind, request, tmp_path):
    """SIGSTOP the job mid-upload (its process is a zombie now), restart the job on the
    same local tier (it resumes the upload and commits), then SIGCONT the zombie: its
    commit loses (it is told the save is persisted by another uploader); one persistent
    copy, the restarted job's commit, which verifies and is the saved state."""
    b = make_backend(kind, request, tmp_path)
    local, log = tmp_path / "local", tmp_path / "log"
    kwargs = {"keep": 3, "local_keep": 2, "upload_rate": 4e6}  # about 2 s per upload
    zombie = start(b.url, b.options, local, kwargs, log, last=0)
    wait_line(zombie, log, "upload", 0)
    time.sleep(0.3)
    zombie.send_signal(signal.SIGSTOP)
    try:
        n = len(lines(log))
        # the next incarnation: restores step 0 from the local tier, saves nothing new
        # (last=0), and on close finishes the upload it resumed
        fresh = start(b.url, b.options, local, {"keep": 3, "local_keep": 2}, log, last=0)
        assert fresh.wait(120) == 0, fresh.stdout.read() if fresh.stdout else ""
        assert [x for x in lines(log)[n:] if x != "upload"] == ["restored 0", "done"]  # (its resumed upload)
        store = b.open()
        assert store.list() == ["checkpoint_0"]
        won = store.manifest("checkpoint_0").attempt
    finally:
        zombie.send_signal(signal.SIGCONT)
    out = zombie.communicate(timeout=120)[0]
    # its upload of the same save lost the commit: it learns the save is persisted (exit 0),
    # or, had its own commit request been under way, that another writer committed
    assert (zombie.returncode == 0 and lines(log)[-1] == "done") or "committed by another writer" in out, out
    store = b.open()
    assert store.list() == ["checkpoint_0"] and store.manifest("checkpoint_0").attempt == won
    check(atomicstore.restore("checkpoint_0", store=store), 0)
    store.recover(now=FUTURE)
    assert leftovers(store) == []
    assert np.array_equal(atomicstore.restore("checkpoint_0", store=store)["b"], np.zeros(1000, np.int64))
