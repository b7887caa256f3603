"""A commit interrupted by a signal while the server holds its last requests (a preempted
job's SIGTERM): the abort stays prompt, the process exits, and nothing is committed or
left behind once recovery ran.

On moto behind the fault layer: the completion of a file's upload (``POST
<key>?uploadId=...``) is held longer than ``ABORT_WAIT`` (or, for the signal handler, a few
seconds); the bound and the lock are the writer's and the transaction's, not the server's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from conftest import make_backend

import atomicstore
from atomicstore.drivers.parts import ABORT_WAIT
from atomicstore.testing.faults import FaultPlan, is_multipart_completion

MiB = 2**20


def _held_once(seen: threading.Event) -> Any:
    """Every completion; ``seen`` is set once one reached the server."""

    def pred(environ: dict[str, Any]) -> bool:
        if is_multipart_completion(environ):
            seen.set()
            return True
        return False

    return pred


def _left(store: atomicstore.Store) -> tuple[list[str], list[Any]]:
    return sorted(store.driver.find("")), store.driver.list_incomplete_uploads("")


def test_a_signal_handler_that_aborts_during_commit_does_not_deadlock(request, tmp_path):
    """A signal handler calls ``txn.abort()`` while this very thread is in ``commit()``,
    waiting for a held completion. It used to wait for the lock the commit holds further
    up the same stack: the process hung. Now the abort is noted and returns; the commit
    gives up with TransactionError, carries out the abort itself, and nothing is
    committed or, once the held request ended and recovery ran, left behind.
    (Found by the attacker.)"""
    b = make_backend("s3", request, tmp_path)
    store = b.open(block_size=5 * MiB)
    seen = threading.Event()
    b.faults(FaultPlan(stalls=[(_held_once(seen), 3.0)]))
    txn = store.transaction("big")
    f = txn.open("w.bin")
    f.write(os.urandom(11 * MiB))
    f.close(wait=False)
    returned: list[float] = []

    def handler(signum: int, frame: Any) -> None:
        txn.abort()
        returned.append(time.monotonic())

    old = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.7, lambda: (seen.wait(10), os.kill(os.getpid(), signal.SIGUSR1)))
    timer.start()
    try:
        began = time.monotonic()
        with pytest.raises(atomicstore.TransactionError, match="aborted while it committed"):
            txn.commit()
        took = time.monotonic() - began
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, old)
    assert returned, "the handler never returned"
    assert took < 3.0 + ABORT_WAIT, took
    assert not txn.committed and store.list() == []
    time.sleep(3.5)  # the held completion has reached the server
    b.faults(None)
    store.recover(grace=0)
    assert _left(store) == ([], [])


_CHILD = textwrap.dedent("""
    import json, signal, sys, time
    import numpy as np
    import atomicstore

    def on_term(*_):
        raise KeyboardInterrupt  # as a training loop's preemption handler may
    signal.signal(signal.SIGTERM, on_term)
    store = atomicstore.open_store(sys.argv[1], block_size=5 * 2**20, **json.loads(sys.argv[2]))
    store.conformance()
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        atomicstore.save("ck", {"a": np.random.rand(3 * 2**20), "b": np.arange(10)}, store=store)
        print("SAVED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    store.close()
""")


def test_a_process_interrupted_during_commit_exits_promptly(request, tmp_path):
    """A process saving a 24 MiB pytree gets SIGTERM (its handler raises
    KeyboardInterrupt) while the server holds the completion of ``state.msgpack`` far
    longer than ``ABORT_WAIT``. The save raises within ``ABORT_WAIT`` and the process
    exits then: the request still held is the server's, not a thread the interpreter
    waits for at exit. It used to exit only once the server answered (up to the operation
    timeout, 120 s: beyond a preemption's grace period). (Found by the attacker.)"""
    hold = ABORT_WAIT + 15
    b = make_backend("s3", request, tmp_path)
    b.open()  # (the endpoint's conformance check, outside the held window)
    seen = threading.Event()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, b.url, json.dumps(b.options)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=tmp_path)
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "READY", child.stderr.read() if child.stderr else ""
        b.faults(FaultPlan(stalls=[(_held_once(seen), hold)]))
        child.stdin.write("go\n")
        child.stdin.flush()
        assert seen.wait(60), "the save never reached its completion"
        time.sleep(0.5)
        began = time.monotonic()
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=hold + 60)
        exited = time.monotonic() - began
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "INTERRUPTED" in out, (out, err[-2000:])
    assert exited < ABORT_WAIT + 5, f"the process exited {exited:.1f} s after SIGTERM (completion held {hold:.0f} s)"
    store = b.open()
    assert store.list() == []
    time.sleep(max(0.0, hold - 0.5 - exited) + 1.0)  # the held completion has reached the server
    b.faults(None)
    store.recover(grace=0)
    assert _left(store) == ([], [])
