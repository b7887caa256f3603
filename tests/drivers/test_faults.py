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
    # the endpoint's conformance check (once per process) first, with the default timeout:
    # a loaded SeaweedFS took over 2 s for a bucket's first multipart upload
    object_backend.open().conformance()
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


# -- what the fakes enforce, talked to over HTTP -----------------------------------------
def _s3_client(server):
    import boto3
    import botocore.config

    opts = server.storage_options()
    return boto3.client(
        "s3", endpoint_url=opts["endpoint_url"], aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"], region_name="us-east-1",
        config=botocore.config.Config(retries={"total_max_attempts": 1, "mode": "standard"}),
    )


def _s3_error(call, *args, **kwargs) -> tuple[int, str]:
    import botocore.exceptions

    try:
        call(*args, **kwargs)
    except botocore.exceptions.ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"], exc.response["Error"]["Code"]
    raise AssertionError("the request succeeded")


def _mpu(s3, bucket: str, key: str, data: bytes) -> tuple[str, list[dict]]:
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=data)["ETag"]
    return upload, [{"PartNumber": 1, "ETag": etag}]


def test_s3_409_rule_answers_409_unapplied_then_the_next_request_succeeds(s3_server):
    from atomicstore.testing.faults import writes_to

    s3, bucket = _s3_client(s3_server), s3_server.new_bucket()
    s3_server.faults(FaultPlan(conflicts=[(writes_to("marker"), 1)]))
    try:
        s3.put_object(Bucket=bucket, Key="other", Body=b"x", IfNoneMatch="*")  # no match
        s3.put_object(Bucket=bucket, Key="marker", Body=b"plain")  # not conditional: no 409
        s3.delete_object(Bucket=bucket, Key="marker")
        assert _s3_error(s3.put_object, Bucket=bucket, Key="marker", Body=b"1", IfNoneMatch="*") == (
            409, "ConditionalRequestConflict")
        assert _s3_error(s3.head_object, Bucket=bucket, Key="marker")[0] == 404  # not applied
        s3.put_object(Bucket=bucket, Key="marker", Body=b"2", IfNoneMatch="*")  # the retry wins
        assert s3.get_object(Bucket=bucket, Key="marker")["Body"].read() == b"2"
        assert s3_server.injector.counts["conflict"] == 1
    finally:
        s3_server.faults(None)


def test_s3_409_body_is_s3_error_xml(s3_server):
    import urllib.error
    import urllib.request

    bucket = s3_server.new_bucket()
    s3_server.faults(FaultPlan(conflicts=[(lambda env: True, 1)]))
    req = urllib.request.Request(f"{s3_server.endpoint}/{bucket}/k", data=b"x", method="PUT",
                                 headers={"If-None-Match": "*"})
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
    finally:
        s3_server.faults(None)
    body = info.value.read().decode()
    assert info.value.code == 409 and info.value.headers["Content-Type"] == "application/xml"
    assert body.startswith('<?xml version="1.0" encoding="UTF-8"?>')
    for part in ("<Code>ConditionalRequestConflict</Code>", "<Key>k</Key>", "<RequestId>",
                 "<Message>A conflicting conditional operation is currently in progress"):
        assert part in body, body


def test_s3_overlapping_conditional_writes_decided_one_after_the_other_or_409(s3_server):
    import threading

    from atomicstore.testing.faults import writes_to

    s3, bucket = _s3_client(s3_server), s3_server.new_bucket()
    for overlap in (False, True):
        key = f"k-{overlap}"
        first = threading.Event()

        def stall_first(env: dict, key: str = key, first: threading.Event = first) -> bool:
            if writes_to(key)(env) and not first.is_set():
                first.set()
                return True
            return False

        s3_server.faults(FaultPlan(conflict_on_overlap=overlap, stalls=[(stall_first, 1.0)]))
        outcome: dict[str, object] = {}

        def early(key: str = key, outcome: dict = outcome) -> None:
            try:
                outcome["A"] = s3.put_object(Bucket=bucket, Key=key, Body=b"A", IfNoneMatch="*")["ETag"]
            except Exception as exc:  # noqa: BLE001 - recorded
                outcome["A"] = exc.response["Error"]["Code"]  # type: ignore[attr-defined]

        t = threading.Thread(target=early)
        t.start()
        assert first.wait(10)
        time.sleep(0.1)  # A is in progress (held before it is decided)
        t0 = time.monotonic()
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=b"B", IfNoneMatch="*")
            late = (200, "OK")
        except Exception as exc:  # noqa: BLE001 - compared below
            late = (exc.response["ResponseMetadata"]["HTTPStatusCode"], exc.response["Error"]["Code"])  # type: ignore[attr-defined]
        waited = time.monotonic() - t0
        t.join()
        stored = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        if overlap:  # the later one is refused at once, unapplied; the first one goes on
            assert late == (409, "ConditionalRequestConflict") and waited < 0.5, (late, waited)
            assert outcome["A"] != "PreconditionFailed" and stored == b"A", outcome
        else:  # default: decided one after the other, B (not held) first; A then gets 412
            assert late == (200, "OK") and outcome["A"] == "PreconditionFailed", (late, outcome)
            assert stored == b"B"
    s3_server.faults(None)


def test_s3_delete_during_a_conditional_write_makes_it_409(s3_server):
    import threading

    from atomicstore.testing.faults import writes_to

    s3, bucket = _s3_client(s3_server), s3_server.new_bucket()
    etag = s3.put_object(Bucket=bucket, Key="k", Body=b"v1")["ETag"]
    held = threading.Event()

    def hold_the_put(env: dict) -> bool:
        if env["REQUEST_METHOD"] == "PUT" and writes_to("/k")(env) and not held.is_set():
            held.set()
            return True
        return False

    s3_server.faults(FaultPlan(conflict_on_overlap=True, stalls=[(hold_the_put, 1.0)]))
    try:
        got: list = []
        t = threading.Thread(target=lambda: got.append(
            _s3_error(s3.put_object, Bucket=bucket, Key="k", Body=b"v2", IfMatch=etag)))
        t.start()
        assert held.wait(10)
        s3.delete_object(Bucket=bucket, Key="k")  # succeeds while the write is in progress
        t.join()
        assert got == [(409, "ConditionalRequestConflict")]
        assert _s3_error(s3.head_object, Bucket=bucket, Key="k")[0] == 404  # not applied
    finally:
        s3_server.faults(None)


def test_s3_409_on_completion_ends_that_upload(s3_server):
    from atomicstore.testing.faults import is_multipart_completion

    s3, bucket = _s3_client(s3_server), s3_server.new_bucket()
    upload, parts = _mpu(s3, bucket, "obj", b"p" * 100)
    s3_server.faults(FaultPlan(conflicts=[(is_multipart_completion, 1)]))
    try:
        for _ in range(2):  # AWS: restart the upload; this one never completes
            assert _s3_error(s3.complete_multipart_upload, Bucket=bucket, Key="obj", UploadId=upload,
                             MultipartUpload={"Parts": parts}, IfNoneMatch="*") == (409, "ConditionalRequestConflict")
        assert _s3_error(s3.head_object, Bucket=bucket, Key="obj")[0] == 404
        listed = [u["UploadId"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
        assert listed == [upload]  # still there, until aborted
        s3.abort_multipart_upload(Bucket=bucket, Key="obj", UploadId=upload)
        upload2, parts2 = _mpu(s3, bucket, "obj", b"q" * 100)
        s3.complete_multipart_upload(Bucket=bucket, Key="obj", UploadId=upload2,
                                     MultipartUpload={"Parts": parts2}, IfNoneMatch="*")
        assert s3.get_object(Bucket=bucket, Key="obj")["Body"].read() == b"q" * 100
    finally:
        s3_server.faults(None)


def test_s3_if_match_on_complete_multipart_upload(s3_server):
    s3, bucket = _s3_client(s3_server), s3_server.new_bucket()
    stale = s3.put_object(Bucket=bucket, Key="obj", Body=b"v1")["ETag"]
    current = s3.put_object(Bucket=bucket, Key="obj", Body=b"v2")["ETag"]
    upload, parts = _mpu(s3, bucket, "obj", b"v3")
    done = {"Bucket": bucket, "Key": "obj", "UploadId": upload, "MultipartUpload": {"Parts": parts}}
    assert _s3_error(s3.complete_multipart_upload, **done, IfMatch=stale) == (412, "PreconditionFailed")
    assert s3.get_object(Bucket=bucket, Key="obj")["Body"].read() == b"v2"
    out = s3.complete_multipart_upload(**done, IfMatch=current)
    assert s3.get_object(Bucket=bucket, Key="obj")["Body"].read() == b"v3"
    # a retry of the applied completion (its reply lost) is answered as done, as moto does
    assert s3.complete_multipart_upload(**done, IfMatch=current)["ETag"] == out["ETag"]
    upload2, parts2 = _mpu(s3, bucket, "missing", b"x")
    assert _s3_error(s3.complete_multipart_upload, Bucket=bucket, Key="missing", UploadId=upload2,
                     MultipartUpload={"Parts": parts2}, IfMatch=current) == (404, "NoSuchKey")
    # moto itself honours If-Match on PutObject and DeleteObject
    assert _s3_error(s3.put_object, Bucket=bucket, Key="obj", Body=b"x", IfMatch=stale)[0] == 412
    assert _s3_error(s3.delete_object, Bucket=bucket, Key="obj", IfMatch=stale)[0] == 412
    s3.delete_object(Bucket=bucket, Key="obj", IfMatch=out["ETag"])
    assert _s3_error(s3.head_object, Bucket=bucket, Key="obj")[0] == 404


def _gcs(server, method: str, path: str, data: bytes | None = None, headers: dict | None = None):
    """(status, headers, body) of one request to the GCS fake."""
    import urllib.error
    import urllib.request

    url = path if path.startswith("http") else f"{server.endpoint}{path}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_gcs_fake_honours_preconditions_on_every_write_path(gcs_server):
    import json
    from urllib.parse import parse_qs, urlsplit

    from atomicstore.testing.faults import object_key

    b = gcs_server.new_bucket()
    up = f"/upload/storage/v1/b/{b}/o"

    def meta(name: str) -> dict:
        status, _, body = _gcs(gcs_server, "GET", f"/storage/v1/b/{b}/o/{name}")
        assert status == 200, body
        return json.loads(body)

    # simple (media) upload
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=media&name=a&ifGenerationMatch=0", b"1")[0] == 200
    gen = meta("a")["generation"]
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=media&name=a&ifGenerationMatch=0", b"2")[0] == 412
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=media&name=a&ifGenerationMatch=1", b"2")[0] == 412
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=media&name=a&ifMetagenerationMatch=2", b"2")[0] == 412
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=media&name=new&ifGenerationNotMatch=0", b"2")[0] == 412
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=media&name=a&ifGenerationMatch={gen}", b"2")[0] == 200
    gen2 = meta("a")["generation"]
    assert gen2 != gen
    # multipart upload (the name is in the metadata part)
    body = (b'--==0==\nContent-Type: application/json\n\n{"name": "a"}\n--==0==\n'
            b"Content-Type: application/octet-stream\n\n3\n--==0==--")
    hdrs = {"Content-Type": 'multipart/related; boundary="==0=="'}
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=multipart&ifGenerationMatch={gen}", body, hdrs)[0] == 412
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=multipart&ifGenerationMatch={gen2}", body, hdrs)[0] == 200
    gen3 = meta("a")["generation"]
    # resumable upload: the session's condition is checked by its final chunk
    status, h, _ = _gcs(gcs_server, "POST", f"{up}?uploadType=resumable&name=a&ifGenerationMatch={gen3}",
                        b'{"name": "a"}', {"Content-Type": "application/json"})
    assert status == 200
    loc = h["Location"]
    assert parse_qs(urlsplit(loc).query)["ifGenerationMatch"] == [gen3]  # as GCS's session URL
    env = {"REQUEST_METHOD": "POST", "PATH_INFO": urlsplit(loc).path, "QUERY_STRING": urlsplit(loc).query}
    assert not is_conditional({**env, "HTTP_CONTENT_RANGE": "bytes 0-0/*"})
    assert is_conditional({**env, "HTTP_CONTENT_RANGE": "bytes 0-0/1"})
    assert object_key(env) == f"{b}/a"
    assert _gcs(gcs_server, "POST", loc, b"4", {"Content-Range": "bytes 0-0/*"})[0] == 308
    assert _gcs(gcs_server, "POST", f"{up}?uploadType=media&name=a", b"5")[0] == 200  # moves on
    final = _gcs(gcs_server, "POST", loc, b"", {"Content-Range": "bytes */1"})
    assert final[0] == 412, final
    assert _gcs(gcs_server, "POST", loc, b"", {"Content-Range": "bytes */1"})[0] == 412  # replayed
    assert _gcs(gcs_server, "GET", f"/storage/v1/b/{b}/o/a?alt=media")[2] == b"5"
    gen5 = meta("a")["generation"]
    status, h, _ = _gcs(gcs_server, "POST", f"{up}?uploadType=resumable&name=a&ifGenerationMatch={gen5}",
                        b'{"name": "a"}', {"Content-Type": "application/json"})
    assert _gcs(gcs_server, "POST", h["Location"], b"6", {"Content-Range": "bytes 0-0/1"})[0] == 200
    gen6 = meta("a")["generation"]
    # conditional reads and deletes
    assert _gcs(gcs_server, "GET", f"/storage/v1/b/{b}/o/a?ifGenerationMatch={gen5}")[0] == 412
    assert _gcs(gcs_server, "DELETE", f"/storage/v1/b/{b}/o/a?ifGenerationMatch={gen5}")[0] == 412
    assert _gcs(gcs_server, "DELETE", f"/storage/v1/b/{b}/o/a?ifMetagenerationMatch=1&ifGenerationMatch={gen6}")[0] == 204
    assert _gcs(gcs_server, "GET", f"/storage/v1/b/{b}/o/a")[0] == 404


def test_is_conditional_covers_every_precondition():
    from atomicstore.testing.faults import is_conditional_write

    put = {"REQUEST_METHOD": "PUT", "PATH_INFO": "/b/k", "QUERY_STRING": ""}
    assert not is_conditional(put)
    assert is_conditional({**put, "HTTP_IF_NONE_MATCH": "*"})
    assert is_conditional({**put, "HTTP_IF_MATCH": '"abc"'})
    assert is_conditional({**put, "REQUEST_METHOD": "DELETE", "HTTP_IF_MATCH": '"abc"'})
    assert not is_conditional({**put, "REQUEST_METHOD": "GET", "HTTP_IF_NONE_MATCH": '"abc"'})
    assert is_conditional_write({**put, "HTTP_IF_MATCH": '"abc"'})
    complete = {**put, "REQUEST_METHOD": "POST", "QUERY_STRING": "uploadId=u", "HTTP_IF_NONE_MATCH": "*"}
    assert is_conditional_write(complete)
    assert not is_conditional_write({**complete, "REQUEST_METHOD": "DELETE", "HTTP_IF_MATCH": "e"})
    gcs = {"REQUEST_METHOD": "POST", "PATH_INFO": "/upload/storage/v1/b/b/o"}
    for q in ("ifGenerationMatch=0", "ifGenerationMatch=17", "ifMetagenerationMatch=1"):
        assert is_conditional({**gcs, "QUERY_STRING": f"uploadType=media&name=x&{q}"}), q
        assert not is_conditional_write({**gcs, "QUERY_STRING": f"uploadType=media&name=x&{q}"})
    assert not is_conditional({**gcs, "QUERY_STRING": "uploadType=media&name=x"})
    delete = {"REQUEST_METHOD": "DELETE", "PATH_INFO": "/storage/v1/b/b/o/x", "QUERY_STRING": "ifGenerationMatch=5"}
    assert is_conditional(delete)
