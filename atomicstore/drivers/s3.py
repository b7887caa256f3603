"""Amazon S3 (and S3-compatible stores) through s3fs.

Facts: no rename (s3fs ``mv`` is copy + delete); put-if-absent is enforced by the server
with ``If-None-Match: *`` (s3fs ``mode="create"``; 412 PreconditionFailed for the loser);
no fsync; interrupted multipart uploads linger until aborted. Strategy: marker.

atomicstore owns retries: its private s3fs instance has s3fs's retry loop and botocore's
retries turned off (unless the caller configured botocore retries), and every request is
retried by the store's :class:`~atomicstore.retry.RetryPolicy` instead.
"""

from __future__ import annotations

import concurrent.futures
from datetime import datetime
from functools import partial
from typing import Any

import aiohttp
import botocore.exceptions
import s3fs

from ..errors import InvalidArgumentError
from .base import AsyncFsspecDriver, BufferedPartWriter, Capabilities, Writer

MIN_PART = 5 * 2**20
#: S3 checks every part against this checksum (computed by botocore with zlib, no extra
#: dependency); it also keeps servers from computing a full-object CRC64 at completion.
PART_CHECKSUM = "CRC32"


class _S3Writer(BufferedPartWriter):
    driver: S3Driver

    def __init__(self, driver: S3Driver, key: str, exclusive: bool = False) -> None:
        super().__init__(driver, key, exclusive)
        self.bucket, self.obj = driver.split(key)
        self.upload_id = ""
        self.parts: dict[int, tuple[str, str | None]] = {}

    def _start(self) -> None:
        out = self.driver.call(
            "create multipart upload",
            self.key,
            lambda: self.driver.s3call(
                "create_multipart_upload", Bucket=self.bucket, Key=self.obj, ChecksumAlgorithm=PART_CHECKSUM
            ),
        )
        self.upload_id = out["UploadId"]

    def _upload_part(self, data: bytearray, offset: int, final: bool) -> concurrent.futures.Future[Any]:
        number = len(self.parts) + 1
        self.parts[number] = ("", None)

        async def upload() -> None:
            out = await self.driver.s3call(
                "upload_part",
                Bucket=self.bucket,
                Key=self.obj,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=data,
                ChecksumAlgorithm=PART_CHECKSUM,
            )
            self.parts[number] = (out["ETag"], out.get(f"Checksum{PART_CHECKSUM}"))

        return self.driver.submit(f"upload part {number}", self.key, upload)

    def _complete(self) -> None:
        parts = []
        for n, (etag, checksum) in sorted(self.parts.items()):
            part = {"PartNumber": n, "ETag": etag}
            if checksum:
                part[f"Checksum{PART_CHECKSUM}"] = checksum
            parts.append(part)
        self.driver.call(
            "complete multipart upload",
            self.key,
            lambda: self.driver.s3call(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.obj,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
                # completing the same upload again succeeds, so a retry is safe
                **({"IfNoneMatch": "*"} if self.exclusive else {}),
            ),
        )

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
        multipart_uploads=True,
    )
    transient_types = (
        ConnectionError,
        botocore.exceptions.HTTPClientError,
        botocore.exceptions.ConnectionError,
        aiohttp.ClientError,
    )

    def __init__(self, fs: Any, root: str, **kwargs: Any) -> None:
        super().__init__(fs, root, **kwargs)
        if self.block_size < MIN_PART:
            raise InvalidArgumentError("S3 needs block_size >= 5 MiB (the minimum part size)")
        self.connect(self.fs.set_session)

    @classmethod
    def make_filesystem(cls, protocol: str, storage_options: dict[str, Any]) -> Any:
        opts = dict(storage_options)
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        opts["config_kwargs"] = config
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        fs.retries = 1  # one try per s3fs call: our retry policy is the only one
        return fs

    def split(self, key: str) -> tuple[str, str]:
        bucket, _, obj = self.path(key).partition("/")
        return bucket, obj

    async def s3call(self, method: str, **kwargs: Any) -> Any:
        return await self.fs._call_s3(method, **kwargs)

    def open_writer(self, key: str, *, exclusive: bool = False) -> Writer:
        return _S3Writer(self, key, exclusive)

    def put(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        bucket, obj = self.split(key)
        extra = {"IfNoneMatch": "*"} if exclusive else {}
        self.call(
            "put",
            key,
            lambda: self.s3call("put_object", Bucket=bucket, Key=obj, Body=data, **extra),
        )

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        bucket, obj = self.split(key)
        extra = {}
        if start is not None or end is not None:
            if end is not None and end <= (start or 0):
                return b""
            extra["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"

        async def get() -> bytes:
            resp = await self.s3call("get_object", Bucket=bucket, Key=obj, **extra)
            async with resp["Body"] as body:
                return await body.read()

        return self.call("read", key, get)

    def list_incomplete_uploads(self, prefix: str = "") -> list[tuple[str, str, float]]:
        bucket, obj = self.split(prefix)
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
        bucket, obj = self.split(key)
        self.call(
            "abort upload",
            key,
            lambda: self.s3call("abort_multipart_upload", Bucket=bucket, Key=obj, UploadId=upload_id),
        )
