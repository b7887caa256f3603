"""Where SeaweedFS (a real S3 implementation) deviates from what AWS documents, atomicstore
stays correct: each test runs on every object backend (moto, SeaweedFS, the GCS fake), so
the same check holds where the server follows the documentation and where it does not.
``docs/drivers.md`` lists the deviations measured (the SeaweedFS section).
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any

import pytest
from conftest import Backend, in_forked_child

import atomicstore
from atomicstore.testing.faults import FaultInjector, FaultPlan
from atomicstore.testing.servers import SeaweedS3


@pytest.mark.parametrize("page_size", [1, 2, 3])
def test_every_checkpoint_is_listed_whatever_the_page_boundaries(object_backend: Backend, page_size: int) -> None:
    """``list()`` is one listing with the delimiter ``/attempt-``: per checkpoint a rolled-up
    prefix ``<name>/attempt-`` and then its marker ``<name>/commit_success.txt``. SeaweedFS
    4.48 answers a page that ends with a rolled-up prefix with that prefix as the
    continuation token, and resumes after the whole directory ``<name>/``: the marker was
    skipped, the checkpoint missing from the list. With pages of 1 to 3 entries every
    boundary is met."""
    store = object_backend.open()
    names = ["n1", "n1.5", "n10", "n2"]  # "." sorts before "/": SeaweedFS lists n1/... first
    for name in names:
        with store.transaction(name) as txn:
            txn.write_bytes("a", name.encode())
    store.driver.page_size = page_size  # (S3 MaxKeys, GCS maxResults)
    assert sorted(store.list()) == sorted(names)
    assert set(store.committed()) == set(names)
    for name in names:
        assert store.read_bytes(name, "a") == name.encode()


def test_a_deleted_checkpoint_leaves_nothing_listed(object_backend: Backend) -> None:
    """SeaweedFS keeps the directories of deleted keys (HEAD ``<name>/`` answers 200; a
    listing with the delimiter ``/`` rolls them up): a deleted checkpoint must not come
    back in any listing atomicstore makes, and its name can be saved again."""
    store = object_backend.open()
    with store.transaction("gone") as txn:
        txn.write_bytes("a", b"a")
    with store.transaction("kept") as txn:
        txn.write_bytes("a", b"b")
    store.delete("gone")
    assert store.list() == ["kept"]
    with store.transaction("gone") as txn:
        txn.write_bytes("a", b"again")
    assert store.read_bytes("gone", "a") == b"again"
    assert sorted(store.list()) == ["gone", "kept"]


def test_the_directory_of_a_deleted_checkpoint_is_not_a_flax_step(object_backend: Backend) -> None:
    """flax's layout is found by listing the directory (a step is a file or a directory
    ``checkpoint_<step>``). On SeaweedFS the empty directory of a deleted native checkpoint
    stayed in that listing: ``latest_checkpoint`` named the deleted step and the restore
    failed."""
    from atomicstore.compat import flax as checkpoints

    b, o = object_backend, object_backend.options
    checkpoints.save_checkpoint(b.url, {"v": 1}, 1, storage_options=o)
    store = b.open()
    with store.transaction("checkpoint_5") as txn:
        txn.write_bytes("a", b"a")
    store.delete("checkpoint_5")
    assert checkpoints.latest_checkpoint(b.url, storage_options=o) == f"{b.url}/checkpoint_1"
    assert checkpoints.restore_checkpoint(b.url, None, storage_options=o) == {"v": 1}
    assert {e.name for e in store.driver.listdir("")} - {".atomicstore"} == {"checkpoint_1"}


def test_a_one_file_checkpoint_can_take_the_name_of_a_deleted_native_one(object_backend: Backend) -> None:
    """On SeaweedFS the empty directory ``<name>/`` left by a deleted native checkpoint
    makes ``PUT <name>`` with ``If-None-Match: *`` answer 412 (AWS: keys and prefixes are
    independent). A one-file save of that name is not a conflict: nothing is committed
    there."""
    store = object_backend.open()
    with store.transaction("ck") as txn:
        txn.write_bytes("a", b"a")
    store.delete("ck")
    with store.one_file("ck") as f:
        f.write(b"one file")
    assert store.driver.read("ck") == b"one file"


def test_a_conditional_delete_of_a_missing_object_is_not_an_error(object_backend: Backend) -> None:
    """A conditional delete of an object that is gone already (a retry after a lost reply,
    or another deleter): AWS documents 204, moto answers 404 and SeaweedFS 412
    PreconditionFailed. The driver's contract is one answer: nothing to delete, no error;
    a delete at a stale generation of an object that is there is still refused."""
    d = object_backend.open().driver
    gen = d.put("x", b"1")
    assert gen is not None
    d.delete("x", if_generation=gen)
    d.delete("x", if_generation=gen)  # gone: no error
    assert not d.exists("x")
    new = d.put("x", b"2")
    with pytest.raises(atomicstore.errors.PreconditionFailedError):
        d.delete("x", if_generation=gen)
    assert d.info("x").generation == new


# -- the server and the fault layer in front of it -------------------------------------------

def test_the_session_server_takes_as_many_buckets_as_the_suite_makes(seaweed_server: Any) -> None:
    """Every bucket is a SeaweedFS collection with volumes of its own: with the volume
    server's default limit (free disk / volume size, ~45 here) the 46th bucket of a session
    answered 500 InternalError to every write."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **seaweed_server.storage_options())
    buckets = [seaweed_server.new_bucket() for _ in range(50)]
    fs.pipe({f"{b}/k": b.encode() for b in buckets}, batch_size=16)
    assert all(fs.cat(f"{b}/k") == b.encode() for b in buckets[-3:])


def _stop_in_child(srv: SeaweedS3, q: Any) -> None:
    srv.stop()  # a forked child (a data-loader worker, say) holding the server object
    q.put("stopped")


def test_stop_leaves_no_process_and_no_data() -> None:
    """``stop`` kills the server and removes its data; in a forked child it does nothing
    (nor does the exit hook), so a child cannot take the session's server down."""
    srv = SeaweedS3()
    proc, data = srv._proc, srv._dir
    assert proc is not None and proc.poll() is None and os.path.isdir(data)
    assert in_forked_child(_stop_in_child, srv) == ("stopped", 0)
    assert proc.poll() is None and os.path.isdir(data)
    bucket = srv.new_bucket()
    srv.client(direct=False).put_object(Bucket=bucket, Key="k", Body=b"through the proxy")
    assert srv.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"through the proxy"
    srv.stop()
    assert proc.poll() is not None and not os.path.exists(data)
    srv.stop()  # twice: nothing left to do


class _Backend:
    """A WSGI application standing for a real server: it records what reaches it, and
    can hold a request until another one has arrived."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        self.first_inside = threading.Event()
        self.second_arrived = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with self.lock:
            self.seen.append((environ["REQUEST_METHOD"], environ.get("QUERY_STRING", ""),
                              environ.get("HTTP_IF_MATCH") or environ.get("HTTP_IF_NONE_MATCH")))
            first = len(self.seen) == 1
        if first:
            self.first_inside.set()
            together = self.second_arrived.wait(10)
        else:
            self.second_arrived.set()
            together = True
        body = b"<CompleteMultipartUploadResult><ETag>&quot;e&quot;</ETag></CompleteMultipartUploadResult>"
        start_response("200 OK" if together else "500 Internal Server Error",
                       [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]


def _environ(method: str, path: str, query: str = "", **headers: str) -> dict[str, Any]:
    env: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query,
                           "CONTENT_LENGTH": "0", "wsgi.input": io.BytesIO(b"")}
    env.update({f"HTTP_{k.upper()}": v for k, v in headers.items()})
    return env


def _call(app: Any, environ: dict[str, Any]) -> str:
    status: list[str] = []
    b"".join(app(environ, lambda s, h, *a: status.append(s)))
    return status[0]


def test_in_front_of_a_real_server_conditional_requests_race_there() -> None:
    """``real_server=True``: two conditional completions of one key reach the server
    together (serialised, as the injector does for moto, SeaweedFS's racing completions
    would look atomic), and ``If-Match`` on a completion is the server's to judge (no HEAD
    is sent first, no answer made up)."""
    backend = _Backend()
    injector = FaultInjector(backend, real_server=True)
    results: list[str] = []

    def complete(tag: str) -> None:
        results.append(_call(injector, _environ("POST", "/bkt/key", "uploadId=u1", if_match=tag)))

    first = threading.Thread(target=complete, args=('"a"',))
    first.start()
    assert backend.first_inside.wait(10)
    complete('"b"')  # the first is still inside the server
    first.join(10)
    assert results == ["200 OK", "200 OK"]
    assert backend.seen == [("POST", "uploadId=u1", '"a"'), ("POST", "uploadId=u1", '"b"')]


def test_faults_work_the_same_in_front_of_a_real_server() -> None:
    backend = _Backend()
    injector = FaultInjector(backend, real_server=True)
    injector.set_plan(FaultPlan(deny=lambda env: env["REQUEST_METHOD"] == "PUT",
                                conflicts=[(lambda env: True, 1)]))
    assert _call(injector, _environ("PUT", "/bkt/k")).startswith("403")
    injector.set_plan(FaultPlan(conflicts=[(lambda env: True, 1)]))
    assert _call(injector, _environ("PUT", "/bkt/k", if_none_match="*")).startswith("409")
    assert backend.seen == []  # neither reached the server
