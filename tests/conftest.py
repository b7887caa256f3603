"""Fixtures: one protocol suite over local disk, memory, S3 (moto) and GCS (our fake).

The object-store fakes are real HTTP servers on 127.0.0.1 started by the tests, each
behind atomicstore's fault injector (which starts with no faults for every test).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

# gcsfs reads this once, when it is first imported: set before anything imports it. Its
# experimental subclass asks the GCS control plane (gRPC) for a bucket's layout on e.g.
# ``makedirs``, and against the fake that RPC is retried for minutes. atomicstore's own
# driver never uses the subclass, but Orbax's epath (tests/test_integration_orbax.py)
# makes plain ``fsspec.filesystem("gs")`` instances, which hung on it whenever an earlier
# test of the same process had imported gcsfs first.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import atomicstore  # noqa: E402
from atomicstore.testing.servers import FakeGCS, FakeS3  # noqa: E402

BACKENDS = ["local", "memory", "s3", "gcs"]
OBJECT_BACKENDS = ["s3", "gcs"]

FAST_RETRY = atomicstore.RetryPolicy(attempts=8, initial_wait=0.01, max_wait=0.2, deadline=30)


@dataclass
class Backend:
    """Where a test's store lives, and how to open more handles on it."""

    kind: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)
    server: Any = None

    def open(self, **kwargs: Any) -> atomicstore.Store:
        kwargs.setdefault("retry", FAST_RETRY)
        return atomicstore.open_store(self.url, **self.options, **kwargs)

    def faults(self, plan: Any) -> None:
        assert self.server is not None, "faults need an object-store backend"
        self.server.faults(plan)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[FakeS3]:
    srv = FakeS3()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGCS]:
    srv = FakeGCS()
    yield srv
    srv.stop()


def make_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    if kind == "local":
        return Backend("local", str(tmp_path / "store"))
    if kind == "memory":
        return Backend("memory", f"memory://t-{secrets.token_hex(6)}")
    server = request.getfixturevalue(f"{kind}_server")
    server.faults(None)
    request.addfinalizer(lambda: server.faults(None))
    bucket = server.new_bucket()
    return Backend(kind, server.url(bucket, "ckpts"), server.storage_options(), server)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    return make_backend(request.param, request, tmp_path)


@pytest.fixture(params=OBJECT_BACKENDS)
def object_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    return make_backend(request.param, request, tmp_path)


def in_forked_child(target: Any, *args: Any, timeout: float = 60) -> tuple[Any, int | None]:
    """Run ``target(*args, queue)`` in a child made by ``fork`` (a data-loader worker
    inheriting the parent's objects) and return what it put on the queue and its exit
    code; the child is killed if it outlives ``timeout``."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        got = q.get(timeout=timeout)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    return got, p.exitcode
