"""A multi-node store under faults (issue 22): a SeaweedFS cluster on loopback (one master,
three volume servers, a filer, the S3 gateway; :mod:`atomicstore.testing.seaweed_cluster`),
and one volume server killed with SIGKILL in the middle of a save and of a restore.

The kill happens at a point the test controls: the cluster's request hook runs it when a
given part upload (or ranged GET) reaches the gateway, before the gateway sees it. Two
clusters: replication ``001`` (two copies of every volume, so two servers still hold a
writable copy: SeaweedFS re-assigns what was in flight) and ``002`` (three copies: with a
server gone no volume is writable, every write waits ~30 s in the gateway, and the save
must fail). Either way a save commits a checkpoint that verifies, or raises atomicstore's
own error and leaves nothing visible; recovery cleans up what it left (attempts,
multipart uploads, the requests it gave up on that SeaweedFS applied after the restart),
and a retry commits. A restore returns the bytes saved or raises atomicstore's own error,
and a restore after the restart returns them. The 256 MiB version is
``benchmarks/cluster.py`` (results in docs/benchmarks.md).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

import atomicstore
from atomicstore.testing.seaweed_cluster import SeaweedCluster

MiB = 2**20
BLOCK = 5 * MiB  # S3's smallest part: 32 MiB of state is 7 parts
OP_TIMEOUT = 4.0  # seconds one request may take (a write waits ~30 s in SeaweedFS's gateway when no volume is writable)
RETRY = atomicstore.RetryPolicy(attempts=4, initial_wait=0.05, max_wait=0.5, deadline=10)
HANG = 60.0  # an operation that has not returned after this long is a hang
PREFIX = "ckpts"
T = TypeVar("T")

# real processes (a six-process cluster per replication, ~35 s for the file): once per CI run
pytestmark = pytest.mark.slow


def tree(seed: int) -> dict[str, np.ndarray]:
    """32 MiB: 8 float32 leaves of 4 MiB (one ``state.msgpack`` object of 7 parts)."""
    rng = np.random.default_rng(seed)
    return {f"layer{i}": rng.standard_normal(MiB, dtype=np.float32) for i in range(8)}


def assert_identical(got: Any, want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), f"{k} differs"


def returns(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, failing the test if it does not return (or raise) within ``HANG`` s."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        fut = pool.submit(fn)
        if not concurrent.futures.wait([fut], timeout=HANG).done:
            pytest.fail(f"{what} hung: no answer after {HANG:.0f} s")
        return fut.result()  # (its own TimeoutError, e.g. StorageTimeoutError, is raised as is)
    finally:
        pool.shutdown(wait=False)


@pytest.fixture(scope="module", params=["001", "002"])
def cluster(request: pytest.FixtureRequest) -> Iterator[SeaweedCluster]:
    c = SeaweedCluster(replication=request.param)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def bucket(cluster: SeaweedCluster) -> Iterator[str]:
    cluster.before_request = None
    for i, v in enumerate(cluster.volumes):
        if not v.alive:
            cluster.restart_volume(i)
    yield cluster.new_bucket()
    cluster.before_request = None
    for i, v in enumerate(cluster.volumes):  # a failed test leaves the cluster whole for the next
        if not v.alive:
            cluster.restart_volume(i)


def open_store(cluster: SeaweedCluster, bucket: str) -> atomicstore.Store:
    return atomicstore.open_store(cluster.url(bucket, PREFIX), retry=RETRY, operation_timeout=OP_TIMEOUT,
                                  block_size=BLOCK, **cluster.storage_options())


def kill_at(cluster: SeaweedCluster, victim: int, matches: Callable[[dict[str, Any]], bool],
            after: Callable[[int, int], bool]) -> threading.Event:
    """Arm the cluster's request hook: the first request ``matches`` selects for which
    ``after(requests, bytes)`` holds (the requests and body bytes it selected before it)
    SIGKILLs volume server ``victim`` before it is forwarded. The event is set once done."""
    done = threading.Event()
    lock = threading.Lock()
    seen = [0, 0]

    def hook(environ: dict[str, Any]) -> None:
        if not matches(environ):
            return
        with lock:
            if not done.is_set() and after(seen[0], seen[1]):
                cluster.kill_volume(victim)
                done.set()
            seen[0] += 1
            seen[1] += int(environ.get("CONTENT_LENGTH") or 0)

    cluster.before_request = hook
    return done


def is_part_upload(environ: dict[str, Any]) -> bool:
    return environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in environ.get("QUERY_STRING", "")


def assert_clean(cluster: SeaweedCluster, store: atomicstore.Store, bucket: str) -> None:
    """No multipart upload, lease or attempt is left: every object under the store is a
    committed checkpoint's marker or part of the attempt that marker names."""
    uploads = cluster.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == [], f"multipart uploads left: {uploads}"
    keep = {f"{name}/commit_success.txt" for name in store.list()}
    prefixes = {f"{name}/{store.open(name).key('manifest.json').split('/')[1]}/" for name in store.list()}
    files = cluster.filer_listing(f"/buckets/{bucket}")
    assert not [f for f in files if f.startswith(".uploads/")], files  # SeaweedFS's parts of uploads
    left = [f for f in files if f.startswith(f"{PREFIX}/")]
    stray = [f for f in left
             if f[len(PREFIX) + 1:] not in keep and not any(f[len(PREFIX) + 1:].startswith(p) for p in prefixes)
             and not f.startswith(f"{PREFIX}/.atomicstore/conformance/")]
    assert stray == [], f"left behind: {stray}"


def test_save_with_a_volume_server_killed(cluster: SeaweedCluster, bucket: str) -> None:
    """A volume server is SIGKILLed once 10 MiB of parts were sent (at the arrival of the
    next part): the save commits a checkpoint that verifies and restores bit-identical,
    or raises atomicstore's own error and leaves nothing visible. After the restart,
    recovery leaves nothing behind and a retry commits."""
    store = open_store(cluster, bucket)
    state = tree(1)
    returns("the first save", lambda: atomicstore.save("step_1", state, store=store))
    holders = cluster.holders(bucket, f"{PREFIX}/{store.open('step_1').key('state.msgpack')}")
    victim = max(holders, key=lambda i: holders[i])  # the server with most of a save's chunks
    killed = kill_at(cluster, victim, is_part_upload, lambda _n, sent: sent >= 10 * MiB)
    t0 = time.monotonic()
    try:
        returns("the save", lambda: atomicstore.save("step_2", state, store=store))
        outcome = "committed"
    except atomicstore.AtomicStoreError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    cluster.before_request = None
    assert killed.is_set(), "the volume server was not killed during the save"
    if cluster.replication == "002":
        # a write needs three servers: none is writable until the restart, so it must fail,
        # within the request timeout (the gateway keeps such a write ~30 s)
        assert outcome.startswith("StorageTimeoutError"), outcome
        assert took < 3 * OP_TIMEOUT, took
    if outcome == "committed":
        store.verify("step_2")
        assert_identical(returns("a restore", lambda: atomicstore.restore("step_2", store=store)), state)
    else:
        assert store.list() == ["step_1"]
        with pytest.raises(atomicstore.NotFoundError):
            returns("a restore", lambda: atomicstore.restore("step_2", store=store))
    cluster.restart_volume(victim)
    # Requests the save gave up on (its parts, a small PUT) are still in the gateway: wait
    # for SeaweedFS to answer them (some are applied after the restart), then recover.
    cluster.wait_idle()
    assert store.list() == (["step_1", "step_2"] if outcome == "committed" else ["step_1"])
    store.recover(now=time.time() + store.lease_ttl + store.grace + 1)
    assert_clean(cluster, store, bucket)
    if outcome != "committed":
        returns("the retried save", lambda: atomicstore.save("step_2", state, store=store))
    store.verify("step_2")
    assert store.list() == ["step_1", "step_2"]
    assert_identical(returns("a restore", lambda: atomicstore.restore("step_2", store=store)), state)
    assert_clean(cluster, store, bucket)


def test_restore_with_a_volume_server_killed(cluster: SeaweedCluster, bucket: str) -> None:
    """The volume server holding most of the checkpoint's chunks is SIGKILLed when the
    second ranged GET of its data arrives: the restore returns the saved bytes or raises
    atomicstore's own error; after the restart a restore returns them, and verify
    passes."""
    store = open_store(cluster, bucket)
    state = tree(2)
    returns("the save", lambda: atomicstore.save("step_1", state, store=store))
    data = store.open("step_1").key("state.msgpack")
    holders = cluster.holders(bucket, f"{PREFIX}/{data}")
    victim = max(holders, key=lambda i: holders[i])

    def is_data_read(environ: dict[str, Any]) -> bool:
        return (environ["REQUEST_METHOD"] == "GET" and "HTTP_RANGE" in environ
                and environ.get("PATH_INFO", "").endswith(data))

    killed = kill_at(cluster, victim, is_data_read, lambda n, _b: n >= 1)
    try:
        got = returns("the restore", lambda: atomicstore.restore("step_1", store=store))
    except atomicstore.AtomicStoreError:
        pass  # a clear error is allowed; raw exceptions and hangs fail the test
    else:
        assert_identical(got, state)
    cluster.before_request = None
    assert killed.is_set(), "the volume server was not killed during the restore"
    cluster.restart_volume(victim)
    assert_identical(returns("the restore after the restart", lambda: atomicstore.restore("step_1", store=store)),
                     state)
    store.verify("step_1")
