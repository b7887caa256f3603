"""Acceptance 4 and 5: transient faults, lost replies, an exhausted retry budget, and
stalls past the operation timeout, injected by the HTTP layer in front of the fakes."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import atomicstore
from atomicstore.testing.faults import FaultPlan, is_conditional, is_mutation

MiB = 2**20


def _blob(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_commits_survive_20_percent_transient_faults(object_backend):
    store = object_backend.open(block_size=5 * MiB)
    object_backend.faults(FaultPlan(seed=42, error_rate=0.10, reset_rate=0.05, lost_reply_rate=0.05))
    written = {}
    for i in range(50):
        size = 6 * MiB if i % 10 == 0 else 2000 + i  # every tenth is a multi-part upload
        data = _blob(i, size)
        with store.transaction(f"step_{i}", metadata={"i": i}) as txn:
            txn.write_bytes("state.bin", data)
            txn.write_bytes("extra/meta.json", b'{"i": %d}' % i)
        written[f"step_{i}"] = data
    counts = dict(object_backend.server.injector.counts)
    assert counts.get("error", 0) > 20 and counts.get("reset", 0) > 5 and counts.get("lost_reply", 0) > 5, counts
    # still under faults: list, verify and read back everything
    assert store.list() == [f"step_{i}" for i in range(50)]
    for name, data in written.items():
        store.verify(name)
        assert store.read_bytes(name, "state.bin") == data
    print(f"\n{object_backend.kind}: 50 commits under faults {counts}")


def test_lost_reply_of_the_marker_is_reconciled(object_backend):
    store = object_backend.open()
    object_backend.faults(FaultPlan(lost_reply_rate=1.0, budget=1, applies_to=is_conditional))
    with store.transaction("mine") as txn:
        txn.write_bytes("a", b"payload")
    assert object_backend.server.injector.counts["lost_reply"] == 1
    assert txn.committed
    assert store.list() == ["mine"]
    assert store.read_bytes("mine", "a") == b"payload"
    marker = store.strategy.read_marker("mine")
    assert marker.writer == store.writer_id and marker.attempt == txn.attempt


def test_exhausted_retry_budget_is_a_clear_error_and_commits_nothing(object_backend):
    store = object_backend.open(retry=atomicstore.RetryPolicy(attempts=3, initial_wait=0.01))
    txn = store.transaction("doomed")
    txn.write_bytes("a", b"1")
    object_backend.faults(FaultPlan(error_rate=1.0, applies_to=is_mutation))
    with pytest.raises(atomicstore.StorageError) as info:
        with txn.open("b") as f:
            f.write(b"2")
        txn.commit()
    msg = str(info.value)
    assert "doomed" in msg and object_backend.url.split("://")[0] in msg
    assert not isinstance(info.value, atomicstore.StorageTimeoutError)
    assert object_backend.server.injector.counts["error"] == 3  # exactly the budget
    txn.abort()
    object_backend.faults(None)
    assert store.list() == []
    assert not store.exists("doomed")


def test_failing_marker_write_commits_nothing(object_backend):
    store = object_backend.open(retry=atomicstore.RetryPolicy(attempts=2, initial_wait=0.01))
    object_backend.faults(FaultPlan(error_rate=1.0, applies_to=is_conditional))
    with pytest.raises(atomicstore.StorageError):
        with store.transaction("nope") as txn:
            txn.write_bytes("a", b"1")
    object_backend.faults(None)
    assert store.list() == []
    assert not store.exists("nope")


def test_stalled_data_upload_times_out_and_commits_nothing(object_backend):
    timeout = 2.0
    store = object_backend.open(operation_timeout=timeout)
    def big_upload(env: dict) -> bool:  # the data file, not the manifest or the marker
        return is_mutation(env) and int(env.get("CONTENT_LENGTH") or 0) > 4000

    object_backend.faults(FaultPlan(stalls=[(big_upload, 6.0)]))
    txn = store.transaction("slow")
    t0 = time.monotonic()  # the stalled operation starts here
    with pytest.raises(atomicstore.StorageTimeoutError, match="did not finish within 2.0s") as info:
        txn.write_bytes("stall.bin", b"x" * 5000)
    elapsed = time.monotonic() - t0
    txn.abort()
    assert isinstance(info.value, TimeoutError)
    assert elapsed < timeout + 1.5, elapsed
    object_backend.faults(None)
    assert store.list() == []


def test_stalled_marker_times_out_in_time_and_store_stays_consistent(object_backend):
    timeout = 2.0
    store = object_backend.open(operation_timeout=timeout)
    object_backend.faults(FaultPlan(stalls=[(is_conditional, 5.0)]))
    txn = store.transaction("late")
    txn.write_bytes("a", b"data")
    t0 = time.monotonic()  # the commit's stalled marker write starts here
    with pytest.raises(atomicstore.StorageTimeoutError):
        txn.commit()
    assert time.monotonic() - t0 < timeout + 1.5
    object_backend.faults(None)
    time.sleep(4.0)  # the stalled request reaches the server after all
    # the data was kept for exactly this case: the late marker must not point at nothing
    if store.list() == ["late"]:
        assert store.read_bytes("late", "a") == b"data"
        store.verify("late")
    else:
        assert store.list() == []


def test_credentials_never_in_errors_or_logs(caplog, s3_server):
    secret = "SUPER-secret-value-4242"
    caplog.set_level(logging.DEBUG)
    store = atomicstore.open_store(
        "s3://no-such-bucket-xyz/p",
        endpoint_url=s3_server.endpoint,
        key="AKIDTESTTESTTEST",
        secret=secret,
        client_kwargs={"region_name": "us-east-1"},
        retry=atomicstore.RetryPolicy(attempts=1),
    )
    with pytest.raises(atomicstore.AtomicStoreError) as info:
        with store.transaction("x") as txn:
            txn.write_bytes("a", b"1")
    text = repr(info.value) + str(info.value) + str(info.value.__cause__) + caplog.text
    assert secret not in text
    assert "no-such-bucket-xyz" in str(info.value)
    # and with an unreachable endpoint
    dead = atomicstore.open_store(
        "s3://b/p", endpoint_url="http://127.0.0.1:9", key="AKIDTESTTESTTEST", secret=secret,
        retry=atomicstore.RetryPolicy(attempts=1),
    )
    with pytest.raises(atomicstore.StorageError) as info2:
        dead.list()
    assert secret not in str(info2.value) + caplog.text


def test_redaction_of_error_text():
    from atomicstore.drivers import secrets_of

    opts = {"key": "AKIDXXXXXXXX", "secret": "s3cr3t-value", "endpoint_url": "http://x",
            "client_kwargs": {"aws_session_token": "tok-123456"}}
    assert set(secrets_of(opts)) == {"AKIDXXXXXXXX", "s3cr3t-value", "tok-123456"}
