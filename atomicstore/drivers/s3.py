"""Amazon S3 (and S3-compatible stores) through s3fs.

Facts: no rename (s3fs ``mv`` is copy + delete); put-if-absent is enforced by the server
with ``If-None-Match: *`` (s3fs ``mode="create"``; 412 PreconditionFailed for the loser);
no fsync; interrupted multipart uploads linger until aborted. Strategy: marker.

atomicstore owns retries: its private s3fs instance has s3fs's retry loop and botocore's
retries turned off (unless the caller configured botocore retries), and every request is
retried by the store's :class:`~atomicstore.retry.RetryPolicy` instead.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from functools import partial
from typing import Any

import aiohttp
import botocore.config
import botocore.exceptions
import botocore.handlers
import botocore.utils
import s3fs
from fsspec.dircache import DirCache

from ..errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)
from .asyncfs import AsyncFsspecDriver
from .classify import error_code_of, http_status_of
from .crc import crc32
from .parts import BufferedPartWriter, PartBody
from .payload import register as _send_parts_as_views
from .s3session import new_session
from .spec import Capabilities, Entry, FileInfo, Writer, refusals_final

log = logging.getLogger("atomicstore.drivers")
_send_parts_as_views()  # (drivers/payload.py)

MIN_PART = 5 * 2**20
#: sorts after every character a key may hold: ``<prefix>`` + this is past every key
#: below ``<prefix>`` (where a listing resumes after a rolled-up prefix, see _list_page)
_PAST_PREFIX = "\U0010ffff"
#: the Content-Type with which SeaweedFS answers a HEAD of a directory it made implicitly
_IMPLICIT_DIRECTORY = "application/x-directory"
#: servers (their ``Server`` header) that store keys as a filesystem: they keep the
#: directories of deleted keys, which then refuse a put-if-absent of the key itself (see
#: S3Driver.remove_empty_directory), and refuse a conditional delete of a missing key
#: (412; AWS: 204). atomicstore spends a request to tell those cases apart only for them.
_FILESYSTEM_SERVERS = ("SeaweedFS",)
#: at most this many directories are walked to remove an empty directory tree
_MAX_EMPTY_DIRS = 64
#: S3 takes at most this many parts per upload; parts grow past every
#: ``PARTS_PER_SIZE`` of them (block_size, then twice, three times...), so an object of
#: up to 55,000 blocks fits
MAX_PARTS = 10_000
PARTS_PER_SIZE = 1_000
#: S3 checks every part against this checksum, which the writer computes (:func:`.crc.crc32`,
#: ISA-L's: 0.03 s of CPU per 256 MiB, zlib's took 0.11-0.17); it also keeps servers from
#: computing a full-object CRC64 at completion. Not the manifest's CRC32C: two polynomials,
#: so damage that keeps one checksum is caught by the other (:mod:`.crc`).
PART_CHECKSUM = "CRC32"
#: most parts of one upload in flight at once (the store's in-flight budget, 32 parts of
#: the default size, still lets several uploads fly together). A server may store the
#: parts of one upload more slowly with more at once: SeaweedFS 4.48, on the cloud-link
#: benchmark, answered some of 32 parts sent together seconds after their bytes had
#: arrived. One 256 MiB object, interleaved runs on one server, median of 3: 51 MiB/s
#: before (32 at once), 65 with 16, 74 with 24 (the AWS CRT: 25 connections, 74); 16
#: leaves: 65 with 16, 48 with 24 (median of 2). 16 and 24 are within the noise; 16 kept
PARTS_IN_FLIGHT = 16


def _is_409(exc: BaseException) -> bool:
    """S3's ``409 ConditionalRequestConflict`` (racing conditional writes of one key)."""
    return error_code_of(exc) == "ConditionalRequestConflict" or (
        http_status_of(exc) == 409 and "ConditionalRequestConflict" in str(exc)
    )


class _S3Writer(BufferedPartWriter):
    driver: S3Driver
    max_parts_in_flight = PARTS_IN_FLIGHT

    def __init__(
        self, driver: S3Driver, key: str, exclusive: bool = False, if_generation: str | None = None
    ) -> None:
        super().__init__(driver, key, exclusive, if_generation)
        self.bucket, self.obj = driver.split(key)
        self.upload_id = ""
        self.etags: dict[int, tuple[str, str | None]] = {}

    def _part_size(self) -> int:
        return self.driver.block_size * (1 + self.parts // PARTS_PER_SIZE)

    def _start(self) -> None:
        _send_parts_at_once(self.driver.fs.s3)
        out = self.driver.call(
            "create multipart upload",
            self.key,
            lambda: self.driver.s3call(
                "create_multipart_upload", Bucket=self.bucket, Key=self.obj, ChecksumAlgorithm=PART_CHECKSUM
            ),
        )
        self.upload_id = out["UploadId"]

    def _upload_part(
        self, pieces: list[memoryview], number: int, offset: int, final: bool
    ) -> concurrent.futures.Future[Any]:
        if number > MAX_PARTS:
            raise StorageError(f"upload {self.driver.describe(self.key)}: more than {MAX_PARTS} parts")
        crc = 0
        for p in pieces:  # here, not on the event loop that carries every request
            crc = crc32(p, crc)
        checksum = base64.b64encode(crc.to_bytes(4, "big")).decode()
        self.etags[number] = ("", None)
        body = PartBody(pieces)  # streamed from the pieces, not copied whole

        async def upload() -> None:
            body.seek(0)  # (each try sends it whole)
            out = await self.driver.s3call(
                "upload_part",
                Bucket=self.bucket,
                Key=self.obj,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=body,
                ChecksumAlgorithm=PART_CHECKSUM,
                **{f"Checksum{PART_CHECKSUM}": checksum},
            )
            self.etags[number] = (out["ETag"], out.get(f"Checksum{PART_CHECKSUM}"))

        return self._submit_part(f"upload part {number}", upload, body)

    def _complete(self) -> None:
        parts = []
        for n, (etag, checksum) in sorted(self.etags.items()):
            part = {"PartNumber": n, "ETag": etag}
            if checksum:
                part[f"Checksum{PART_CHECKSUM}"] = checksum
            parts.append(part)
        cond = self.driver.condition(self.exclusive, self.if_generation)

        def complete() -> Any:
            return self.driver.call(
                "complete multipart upload",
                self.key,
                lambda: self.driver.s3call(
                    "complete_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.obj,
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts},
                    # completing the same upload again succeeds, so a retry is safe
                    **cond,
                ),
                "generation" if self.if_generation is not None else None,
            )

        try:
            try:
                out = complete()
            except AlreadyExistsError as refused:
                if not (self.exclusive and self.driver.remove_empty_directory(self.key, refused)):
                    raise
                out = complete()
            self.generation = self.driver._generation(out)
        except (AlreadyExistsError, StorageError) as exc:
            # A retry after a lost reply may be refused (412), and a 409
            # ConditionalRequestConflict ends this upload (AWS: start it again, which a
            # stream cannot): either way the object may be ours. Read it back.
            if not cond or not (getattr(exc, "retried", False) or _is_409(exc)):
                raise
            if self._landed(parts):
                return
            if isinstance(exc, AlreadyExistsError):
                raise
            raise (PreconditionFailedError if self.if_generation else AlreadyExistsError)(
                f"complete {self.driver.describe(self.key)}: a concurrent conditional write "
                "of the same key won (409 ConditionalRequestConflict)"
            ) from exc

    def _landed(self, parts: list[dict[str, Any]]) -> bool:
        """True if the object now at the key is this upload (its multipart ETag)."""
        try:
            etag = self.driver.info(self.key).generation
        except NotFoundError:
            return False
        digests = b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts)
        if etag != f"{hashlib.md5(digests).hexdigest()}-{len(parts)}":
            return False
        self.generation = etag
        return True

    def _abort(self) -> None:
        self.driver.abort_upload(self.key, self.upload_id)


class S3Driver(AsyncFsspecDriver):
    """S3 via s3fs. Commit strategy: conditional success marker."""

    protocols = ("s3", "s3a")
    capabilities = Capabilities(
        atomic_rename=False,
        atomic_create=True,
        durable_fsync=False,
        directories=False,
        native_generation_reads=True,  # ranged GETs take If-Match
        multipart_uploads=True,
        # AWS documents conditional CompleteMultipartUpload as atomic, but S3-compatible
        # stores differ (SeaweedFS 4.48: of racing conditional completions several succeed),
        # and a small race cannot prove it: not relied upon (one-file commits take a claim)
        exclusive_completion=False,
    )
    #: 4 MiB: half an upload part, so the in-flight budget holds twice as many ranged
    #: reads as parts (64 by default), each on a connection of its own. A restore is bound
    #: by how many connections carry it (a connection's throughput is limited; AWS: scale
    #: across connections), not by the size of the ranges. Measured on SeaweedFS through
    #: the cloud-link shaper (8 MiB/s per connection), 256 MiB, interleaved, median of 3
    #: (docs/benchmarks.md): 8 -> 4 MiB took 16 leaves from 138 to 177 MiB/s, one object
    #: from 149 to 172, a torch DCP load from 87 to 100 (16 MiB ranges had been 0.6 x
    #: boto3's 8 MiB ones). The price: twice the GETs ($0.0001 more per GiB on AWS), and
    #: twice the client's per-request CPU (~2 ms each here, on the event loop's thread).
    read_chunk = 4 * 2**20
    transient_types = (
        ConnectionError,
        botocore.exceptions.HTTPClientError,
        botocore.exceptions.ConnectionError,
        aiohttp.ClientError,
    )

    def is_transient(self, exc: BaseException) -> bool:
        # 409 ConditionalRequestConflict: another conditional write of the key was in
        # progress; AWS says retry (a multipart completion is reconciled by its writer)
        return _is_409(exc) or super().is_transient(exc)

    def __init__(self, fs: Any, root: str, **kwargs: Any) -> None:
        super().__init__(fs, root, **kwargs)
        if self.block_size < MIN_PART:
            raise InvalidArgumentError("S3 needs block_size >= 5 MiB (the minimum part size)")
        self._prepare_filesystem(self.fs)

    def _prepare_filesystem(self, fs: Any) -> None:
        # one connection per request the in-flight budget allows (botocore's default: 10):
        # parts of at least MIN_PART, ranged reads of read_chunk
        fs.config_kwargs.setdefault("max_pool_connections",
                                    max(64, self.max_inflight_bytes // min(MIN_PART, self.read_chunk) + 16))
        # s3fs's own socket read timeout (15 s) would cut a request that the server holds
        # before our operation_timeout: a stalled PUT was retried every 15 s and gave up
        # after operation_timeout + 15 s. Ours is the one deadline: the socket's is longer.
        read_timeout = 3600.0 if self.operation_timeout is None else self.operation_timeout + 30.0
        fs.config_kwargs["read_timeout"] = max(float(fs.config_kwargs.get("read_timeout") or 0), read_timeout)
        if getattr(fs, "session", None) is None:  # (never a session the caller passed in)
            # the session s3fs would make, with our timestamp parser and shared loader
            try:
                session = new_session(getattr(fs, "kwargs", {}))
            except Exception as exc:  # noqa: BLE001 - s3fs makes its own (and says what is wrong)
                log.debug("%s: s3fs makes the session: %s", self.describe(), exc)
            else:
                fs.session = session
        self.connect(fs.set_session, fs.loop)

    @classmethod
    def make_filesystem(cls, protocol: str, storage_options: dict[str, Any]) -> Any:
        opts = dict(storage_options)
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        opts["config_kwargs"] = config
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        fs.retries = 1  # one try per s3fs call: our retry policy is the only one
        fs.dircache = DirCache(use_listings_cache=False)  # no cache answers a protocol question
        return fs

    @staticmethod
    def condition(exclusive: bool, if_generation: str | None) -> dict[str, str]:
        """The S3 precondition headers of a conditional write."""
        if if_generation is not None:
            return {"IfMatch": if_generation}
        return {"IfNoneMatch": "*"} if exclusive else {}

    async def s3call(self, method: str, **kwargs: Any) -> Any:
        return await self.fs._call_s3(method, **kwargs)

    def open_writer(
        self, key: str, *, exclusive: bool = False, if_generation: str | None = None
    ) -> Writer:
        return _S3Writer(self, key, exclusive, if_generation)

    def put(
        self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None
    ) -> str | None:
        bucket, obj = self.split(key)
        extra = self.condition(exclusive, if_generation)

        def put() -> Any:
            return self.call(
                "put",
                key,
                lambda: self.s3call("put_object", Bucket=bucket, Key=obj, Body=data, **extra),
                "generation" if if_generation is not None else None,
            )

        try:
            try:
                out = put()
            except AlreadyExistsError as refused:
                if not (exclusive and self.remove_empty_directory(key, refused)):
                    raise
                out = put()
        except NotFoundError:
            if if_generation is None:
                raise
            raise PreconditionFailedError(f"put: {self.describe(key)} is gone") from None
        return self._generation(out)

    def remove_empty_directory(self, key: str, refusal: BaseException) -> bool:
        """After ``key`` was refused to a put-if-absent (``refusal``): remove the empty
        directory ``<key>/`` that refused it, if that is what happened, and say so (True:
        send the request again).

        SeaweedFS keeps the directories of the keys it deleted (measured on 4.48: still
        there after 90 s), and refuses ``PUT <key>`` with ``If-None-Match: *`` (412) while
        ``<key>/`` exists, empty or not; AWS keys and prefixes are independent. Only an
        implicit directory (HEAD ``<key>/`` answers Content-Type
        ``application/x-directory``, which no AWS object of atomicstore's has) below which
        no object is listed is removed, deepest first, each with a DELETE of
        ``<dir>/``, which SeaweedFS refuses for a directory that is not empty: a real
        object, or a directory that holds one, is never touched. Runs only for a refusal
        from such a server (its ``Server`` header): no request is added elsewhere."""
        final = refusals_final() and not getattr(refusal, "retried", False)  # (spec.refusals_are_final)
        if final or not _server_of(refusal).startswith(_FILESYSTEM_SERVERS):
            return False
        bucket, obj = self.split(key)
        try:
            self.info(key)
            return False  # the object exists: a genuine refusal
        except NotFoundError:
            pass

        async def head_dir() -> Any:
            return await self.s3call("head_object", Bucket=bucket, Key=obj + "/")

        try:
            head = self.call("info", key + "/", head_dir)
        except NotFoundError:
            return False
        if not str(head.get("ContentType", "")).startswith(_IMPLICIT_DIRECTORY):
            return False
        dirs, todo = [obj + "/"], [obj + "/"]
        while todo:
            where = todo.pop()
            token: str | None = None
            while True:
                kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": where, "Delimiter": "/"}
                if token:
                    kwargs["ContinuationToken"] = token
                page = self.call("list", key, partial(self.s3call, "list_objects_v2", **kwargs))
                if any(c["Key"] != where for c in page.get("Contents", [])):
                    return False  # an object below: not empty
                for p in page.get("CommonPrefixes", []):
                    dirs.append(p["Prefix"])
                    todo.append(p["Prefix"])
                if len(dirs) > _MAX_EMPTY_DIRS:
                    return False
                token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
                if not token:
                    break
        for where in sorted(dirs, key=len, reverse=True):
            self.call("delete", key, partial(self.s3call, "delete_object", Bucket=bucket, Key=where))
        log.info("%s: removed the empty directory %s/ that refused a put-if-absent of the key "
                 "(a store that keeps the directories of deleted keys, e.g. SeaweedFS)",
                 self.describe(), key)
        return True

    def info(self, key: str) -> FileInfo:
        """A HEAD of the object itself: never a listing, never a cache."""
        bucket, obj = self.split(key)
        head = self.call("info", key, lambda: self.s3call("head_object", Bucket=bucket, Key=obj))
        modified = head.get("LastModified")
        return FileInfo(
            key,
            int(head.get("ContentLength") or 0),
            None,
            modified.timestamp() if isinstance(modified, datetime) else None,
            str(head.get("ETag", "")).strip('"') or None,
        )

    def _generation(self, raw: Mapping[str, Any]) -> str | None:
        etag = raw.get("ETag") or raw.get("etag")
        return str(etag).strip('"') if etag else None

    async def _delete_if(self, key: str, generation: str) -> None:
        bucket, obj = self.split(key)
        try:
            await self.s3call("delete_object", Bucket=bucket, Key=obj, IfMatch=generation)
        except Exception as exc:
            # AWS answers 204 to a conditional delete of an object that is gone; SeaweedFS
            # (4.48) answers 412: a 412 for an object that is not there means it is gone
            if (http_status_of(exc) != 412 or not _server_of(exc).startswith(_FILESYSTEM_SERVERS)
                    or refusals_final()):
                raise
            try:
                await self.s3call("head_object", Bucket=bucket, Key=obj)
            except FileNotFoundError:
                return
            except Exception as head_exc:  # noqa: BLE001 - the 412 is the answer
                if http_status_of(head_exc) == 404:
                    return
            raise

    def _read_range(self, key: str, start: int | None, end: int | None) -> Awaitable[bytes]:
        bucket, obj = self.split(key)
        extra = {}
        if start is not None or end is not None:
            if end is not None and end <= (start or 0):
                return _empty()
            extra["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"

        async def get() -> bytes:
            try:
                resp = await self.s3call("get_object", Bucket=bucket, Key=obj, **extra)
            except Exception as exc:
                if extra and http_status_of(exc) == 416:
                    return b""  # the range starts at or past the end (as on every other backend)
                raise
            async with resp["Body"] as body:
                return await body.read()  # type: ignore[no-any-return]

        return get()

    async def _read_sized(self, key: str, start: int, end: int, sized: Callable[[int], None]) -> bytes:
        """One ranged GET; the object's size from its ``Content-Range`` (``bytes a-b/size``)."""
        bucket, obj = self.split(key)
        try:
            resp = await self.s3call("get_object", Bucket=bucket, Key=obj, Range=f"bytes={start}-{end - 1}")
        except Exception as exc:
            if http_status_of(exc) != 416:
                raise
            # the range starts at or past the end: from 0, the object is empty
            if start == 0:
                sized(0)
            else:
                head = await self.s3call("head_object", Bucket=bucket, Key=obj)
                sized(int(head.get("ContentLength") or 0))
            return b""
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        if total.isdigit():
            sized(int(total))
        elif not resp.get("ContentRange"):  # the whole object (a server that ignored the range)
            sized(int(resp.get("ContentLength") or 0))
        else:  # "bytes a-b/*": the size unknown to the server (S3 never says so)
            head = await self.s3call("head_object", Bucket=bucket, Key=obj)
            sized(int(head.get("ContentLength") or 0))
        async with resp["Body"] as body:
            return await body.read()  # type: ignore[no-any-return]

    async def _get_into(self, key: str, start: int, out: memoryview, *, generation: str | None = None) -> int:
        bucket, obj = self.split(key)
        cond = {"IfMatch": generation} if generation is not None else {}
        resp = await self.s3call("get_object", Bucket=bucket, Key=obj,
                                 Range=f"bytes={start}-{start + out.nbytes - 1}", **cond)
        pos = 0
        stream = resp["Body"]
        async with stream as body:
            readinto = getattr(body, "readinto", None)  # aiobotocore >= 2.23
            while pos < out.nbytes:
                if readinto is not None:
                    n = await readinto(out[pos:])
                else:  # an older aiobotocore (its body is aiohttp's response): read, then copy
                    chunk = await stream.read(out.nbytes - pos)
                    n = len(chunk)
                    out[pos:pos + n] = chunk
                if not n:
                    break
                pos += n
        return pos

    def listdir(self, prefix: str = "") -> list[Entry]:
        """Immediate children of ``prefix``: a ListObjectsV2 with the delimiter ``/`` per
        1,000 entries (what s3fs's ``ls`` sends, without its cache). A server that keeps
        the directories of deleted keys (SeaweedFS: see ``_FILESYSTEM_SERVERS``) rolls
        those up too, where AWS rolls up only prefixes of objects: there a directory is
        reported only if an object is below it (one more small listing per directory, sent
        at once)."""
        where = self.path(prefix).rstrip("/") + "/"
        bucket, _, obj = where.partition("/")

        async def has_objects(sem: asyncio.Semaphore, under: str) -> bool:
            async with sem:
                out = await self.s3call("list_objects_v2", Bucket=bucket, Prefix=under, MaxKeys=2)
            return any(c["Key"] != under for c in out.get("Contents", []))

        async def ls() -> tuple[list[str], list[str]]:
            files: list[str] = []
            dirs: list[str] = []
            token: str | None = None
            server = ""
            while True:
                kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": obj, "Delimiter": "/"}
                if token:
                    kwargs["ContinuationToken"] = token
                try:
                    out = await self.s3call("list_objects_v2", **kwargs)
                except FileNotFoundError:  # no such bucket
                    return [], []
                server = server or str(out.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("server", ""))
                files += [str(c["Key"]) for c in out.get("Contents", [])]
                dirs += [str(p["Prefix"]) for p in out.get("CommonPrefixes", [])]
                token = out.get("NextContinuationToken") if out.get("IsTruncated") else None
                if not token:
                    break
            if dirs and server.startswith(_FILESYSTEM_SERVERS):
                sem = asyncio.Semaphore(32)
                held = await asyncio.gather(*(has_objects(sem, d) for d in dirs))
                dirs = [d for d, h in zip(dirs, held, strict=True) if h]
            return files, dirs

        files, dirs = self.call("list", prefix, ls)
        entries = [Entry(k[len(obj):], False) for k in files if k.startswith(obj) and len(k) > len(obj)]
        entries += [Entry(d[len(obj):].rstrip("/"), True) for d in dirs if d.startswith(obj) and len(d) > len(obj)]
        return entries

    def list_incomplete_uploads(self, prefix: str = "") -> list[tuple[str, str, float]]:
        bucket, obj = self.split(prefix)
        if not prefix and obj:
            obj += "/"  # the store's own keys: not those of a sibling root ``<root>2/...``
        out: list[tuple[str, str, float]] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": obj}
        while True:
            page: dict[str, Any] = self.call(
                "list uploads", prefix, partial(self.s3call, "list_multipart_uploads", **kwargs)
            )
            for u in page.get("Uploads", []):
                started = u.get("Initiated")
                ts = started.timestamp() if isinstance(started, datetime) else 0.0
                out.append((self._rel(f"{bucket}/{u['Key']}"), u["UploadId"], ts))
            if not page.get("IsTruncated"):
                return out
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one unfinished multipart upload; one that is gone already (completed or
        aborted meanwhile, e.g. by a concurrent recovery: ``NoSuchUpload``) is not an error."""
        bucket, obj = self.split(key)
        try:
            self.call(
                "abort upload",
                key,
                lambda: self.s3call("abort_multipart_upload", Bucket=bucket, Key=obj, UploadId=upload_id),
            )
        except NotFoundError:
            pass

    async def _list_page(
        self, prefix_path: str, delimiter: str, token: str | None
    ) -> tuple[list[tuple[str, Mapping[str, Any]]], list[str], str | None]:
        """One ListObjectsV2 page with a delimiter (up to 1,000 keys and prefixes)."""
        bucket, _, obj = prefix_path.partition("/")
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": obj, "Delimiter": delimiter,
                                  "MaxKeys": self.page_size}
        if token:
            kwargs["ContinuationToken"] = token
        out = await self.s3call("list_objects_v2", **kwargs)
        objects: list[tuple[str, Mapping[str, Any]]] = [
            (f"{bucket}/{c['Key']}", {"size": c.get("Size"), "LastModified": c.get("LastModified"),
                                      "ETag": c.get("ETag")})
            for c in out.get("Contents", [])
        ]
        prefixes = [str(p["Prefix"]) for p in out.get("CommonPrefixes", [])]
        rolled = [f"{bucket}/{p}" for p in prefixes]
        token = out.get("NextContinuationToken") if out.get("IsTruncated") else None
        if token and token in prefixes and not token.endswith("/"):
            # SeaweedFS (4.48) ends a page that ends with a rolled-up prefix with that prefix
            # as its token, and resumes after the whole directory that holds it: the keys of
            # that directory after the prefix (a checkpoint's marker after its
            # "<name>/attempt-") were never listed. Resume past the prefix instead (what the
            # server's token means on AWS, where tokens are opaque and never a prefix).
            token = token + _PAST_PREFIX
        return objects, rolled, str(token) if token else None

    def read_if(self, key: str, generation: str) -> bytes:
        """One GET with ``If-Match: <etag>``."""
        bucket, obj = self.split(key)

        async def get() -> bytes:
            resp = await self.s3call("get_object", Bucket=bucket, Key=obj, IfMatch=generation)
            async with resp["Body"] as body:
                return bytes(await body.read())

        return self.call("read", key, get, "generation")


def _send_parts_at_once(client: Any) -> None:
    """Send part bodies right after their headers, and without hashing them on the event
    loop. Idempotent (the client may be remade).

    * botocore asks for ``Expect: 100-continue`` on every body it streams (a part is
      streamed from the caller's buffers), so each part waited a round trip (and the
      server's ``100 Continue``: up to 0.2 s on a busy SeaweedFS) before its first byte;
      obstore and s3torchconnector's client send at once (boto3 and the CRT transfer
      manager wait too). What this gives up: a part the server refuses (an aborted
      upload) is sent whole before the refusal.
    * A part carries its CRC32 (``x-amz-checksum-crc32``, a signed header, computed off
      the loop by the writer), which the server checks, so its body is sent with
      ``UNSIGNED-PAYLOAD`` (:func:`_unsigned_part_payload`), as botocore itself does on
      HTTPS. On plain HTTP botocore would hash every part's SHA-256 for the signature
      on the event loop that carries every request (~5 ms per 8 MiB part, in front of
      every request behind it)."""
    events = getattr(getattr(client, "meta", None), "events", None)
    if events is not None:
        events.unregister("before-call.s3", botocore.handlers.add_expect_header)
        events.register("before-call.s3.UploadPart", _unsigned_part_payload,
                        unique_id="atomicstore-unsigned-part-payload")


def _unsigned_part_payload(params: Any = None, context: Any = None, **_: Any) -> None:
    """``before-call`` handler of ``UploadPart``: sign the part's headers, its checksum
    among them, but not its body (botocore's documented ``payload_signing_enabled`` of
    the client's ``s3`` config, for this request only). A client whose config sets
    ``payload_signing_enabled`` itself keeps it; a part without a checksum is signed."""
    if not isinstance(context, dict) or not isinstance(params, dict):
        return
    headers = params.get("headers") or {}
    if not any(str(h).lower().startswith("x-amz-checksum-") for h in headers):
        return
    config = context.get("client_config")
    s3 = dict(getattr(config, "s3", None) or {})
    if config is None or s3.get("payload_signing_enabled") is not None:
        return
    context["client_config"] = config.merge(botocore.config.Config(s3={**s3, "payload_signing_enabled": False}))


def _server_of(exc: BaseException) -> str:
    """The ``Server`` header of the S3 error answer behind ``exc`` ("" if none)."""
    cur: BaseException | None = exc
    seen: set[int] = set()
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        resp = getattr(cur, "response", None)
        if isinstance(resp, Mapping):
            headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            if isinstance(headers, Mapping) and headers.get("server"):
                return str(headers["server"])
        cur = cur.__cause__ or cur.__context__
    return ""


async def _empty() -> bytes:
    return b""
