"""Acceptance 2: two writers racing on one name, 50 rounds per backend, with threads and
with processes. Both writers stage their data first, meet at a barrier, then commit, so
every round is decided at the commit point itself (rename or conditional marker)."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import pytest

import atomicstore
from atomicstore import CommitConflictError

ROUNDS = 50


def _data(writer: int, rnd: int) -> bytes:
    return f"writer {writer} round {rnd};".encode() * 200


def _one_round(store: atomicstore.Store, writer: int, rnd: int, barrier: Any) -> bool:
    txn = store.transaction(f"round_{rnd}")
    txn.write_bytes("data.bin", _data(writer, rnd))
    barrier.wait()
    try:
        txn.commit()
        return True
    except CommitConflictError:
        return False


def _check_rounds(store: atomicstore.Store, results: dict[int, list[tuple[int, bool]]]) -> None:
    for rnd in range(ROUNDS):
        outcome = results[rnd]
        winners = [w for w, won in outcome if won]
        assert len(outcome) == 2 and len(winners) == 1, f"round {rnd}: {outcome}"
        ckpt = store.open(f"round_{rnd}")
        assert ckpt.read_bytes("data.bin") == _data(winners[0], rnd)
        # none of the loser's bytes under the committed name
        keys = [k for k in store.driver.find(f"round_{rnd}")]
        allowed = {ckpt.key("data.bin"), ckpt.key("manifest.json"), f"round_{rnd}/commit_success.txt"}
        assert set(keys) <= allowed, keys
    assert store.list() == [f"round_{r}" for r in range(ROUNDS)]


def test_race_threads(backend):
    barrier = threading.Barrier(2)
    results: dict[int, list[tuple[int, bool]]] = {r: [] for r in range(ROUNDS)}
    lock = threading.Lock()

    def writer(w: int) -> None:
        store = backend.open()
        for rnd in range(ROUNDS):
            won = _one_round(store, w, rnd, barrier)
            with lock:
                results[rnd].append((w, won))

    threads = [threading.Thread(target=writer, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads)
    _check_rounds(backend.open(), results)


def _process_writer(url: str, options: dict, w: int, barrier: Any, queue: Any) -> None:
    store = atomicstore.open_store(url, retry=atomicstore.RetryPolicy(initial_wait=0.01), **options)
    for rnd in range(ROUNDS):
        queue.put((rnd, w, _one_round(store, w, rnd, barrier)))


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])  # memory is per process
def test_race_processes(kind, request, tmp_path):
    from conftest import make_backend

    backend = make_backend(kind, request, tmp_path)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_process_writer, args=(backend.url, backend.options, w, barrier, queue))
        for w in (0, 1)
    ]
    for p in procs:
        p.start()
    results: dict[int, list[tuple[int, bool]]] = {r: [] for r in range(ROUNDS)}
    for _ in range(2 * ROUNDS):
        rnd, w, won = queue.get(timeout=240)
        results[rnd].append((w, won))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    _check_rounds(backend.open(), results)
