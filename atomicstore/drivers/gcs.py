"""Google Cloud Storage through gcsfs.

Facts: no atomic rename (gcsfs ``mv`` may fall back to copy + delete); put-if-absent is
enforced by the server with ``ifGenerationMatch=0`` (412 for the loser); no fsync; every
object carries its CRC32C, which ``info`` reports. Strategy: marker.

Interrupted resumable uploads hold no visible object and expire on the server (GCS drops
an unfinished session after a week); there is no API to list them, so recovery has
nothing to abort on GCS.

atomicstore uses ``gcsfs.core.GCSFileSystem`` directly (not the experimental subclass,
whose bucket probe over gRPC stalls against emulators) with gcsfs's request retry loop
turned off: the store's :class:`~atomicstore.retry.RetryPolicy` is the only one.
"""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import gcsfs.core
import gcsfs.retry
import requests.exceptions
from fsspec.dircache import DirCache

from ..errors import InvalidArgumentError
from .base import AsyncFsspecDriver, BufferedPartWriter, Capabilities, FileInfo, Writer

CHUNK_MULTIPLE = 256 * 2**10


class _NoRetryGCSFileSystem(gcsfs.core.GCSFileSystem):
    """gcsfs with one try per request: retries belong to atomicstore's policy."""

    async def _request(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return await gcsfs.core.GCSFileSystem._request.__wrapped__(self, *args, **kwargs)


class _GCSWriter(BufferedPartWriter):
    """Resumable upload: chunks in order (GCS accepts no parallel chunks of one session)."""

    driver: GCSDriver
    max_in_flight = 1

    def __init__(
        self, driver: GCSDriver, key: str, exclusive: bool = False, if_generation: str | None = None
    ) -> None:
        super().__init__(driver, key, exclusive, if_generation)
        self.location = ""

    def _start(self) -> None:
        bucket, obj = self.driver.split(self.key)
        fs = self.driver.fs

        async def start() -> str:
            headers, _ = await fs._call(
                "POST",
                f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o?name={quote(obj)}",
                uploadType="resumable",
                json={"name": obj},
                headers={"X-Upload-Content-Type": "application/octet-stream"},
                **self.driver.condition(self.exclusive, self.if_generation),
            )
            loc = headers["Location"]
            return str(loc[0] if isinstance(loc, list) else loc)

        self.location = self.driver.call("start upload", self.key, start)

    def _upload_part(self, data: bytearray, offset: int, final: bool) -> concurrent.futures.Future[Any]:
        total = str(offset + len(data)) if final else "*"
        rng = f"bytes {offset}-{offset + len(data) - 1}/{total}" if data else f"bytes */{total}"
        headers = {"Content-Range": rng, "Content-Type": "application/octet-stream"}
        return self.driver.submit(
            "upload chunk",
            self.key,
            lambda: self.driver.fs._call("POST", self.location, headers=headers, data=data),
            "generation" if final and self.if_generation is not None else None,
        )

    def _complete(self) -> None:
        pass  # the final chunk completes the upload

    def _abort(self) -> None:
        self.driver.call("cancel upload", self.key, lambda: self.driver.fs._call("DELETE", self.location))


class GCSDriver(AsyncFsspecDriver):
    """GCS via gcsfs. Commit strategy: conditional success marker."""

    protocols = ("gs", "gcs")
    capabilities = Capabilities(
        atomic_rename=False,
        atomic_create=True,
        durable_fsync=False,
        directories=False,
        native_crc32c=True,
    )
    transient_types = (
        ConnectionError,
        aiohttp.ClientError,
        requests.exceptions.ConnectionError,
        gcsfs.retry.ChecksumError,
    )

    def __init__(self, fs: Any, root: str, **kwargs: Any) -> None:
        super().__init__(fs, root, **kwargs)
        if self.block_size % CHUNK_MULTIPLE:
            raise InvalidArgumentError("GCS needs a block_size that is a multiple of 256 KiB")
        self.connect(self.fs._set_session)

    @classmethod
    def make_filesystem(cls, protocol: str, storage_options: dict[str, Any]) -> Any:
        fs = _NoRetryGCSFileSystem(skip_instance_cache=True, **storage_options)
        fs.dircache = DirCache(use_listings_cache=False)  # no cache answers a protocol question
        return fs

    @staticmethod
    def condition(exclusive: bool, if_generation: str | None) -> dict[str, str]:
        """The GCS precondition query parameters of a conditional write."""
        if if_generation is not None:
            return {"ifGenerationMatch": if_generation}
        return {"ifGenerationMatch": "0"} if exclusive else {}

    def is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, gcsfs.retry.HttpError):
            return gcsfs.retry.is_retriable(exc)
        return super().is_transient(exc)

    def _native_crc32c(self, raw: Mapping[str, Any]) -> int | None:
        val = raw.get("crc32c")
        if not isinstance(val, str):
            return None
        try:
            return int.from_bytes(base64.b64decode(val), "big")
        except ValueError:
            return None

    def _generation(self, raw: Mapping[str, Any]) -> str | None:
        gen = raw.get("generation")
        return str(gen) if gen not in (None, "") else None

    def info(self, key: str) -> FileInfo:
        """A GET of the object's metadata: never a listing, never a cache."""
        bucket, obj = self.split(key)
        raw = self.call(
            "info", key, lambda: self.fs._call("GET", "b/{}/o/{}", bucket, obj, json_out=True)
        )
        return self._file_info(key, raw)

    def open_writer(
        self, key: str, *, exclusive: bool = False, if_generation: str | None = None
    ) -> Writer:
        return _GCSWriter(self, key, exclusive, if_generation)

    def put(
        self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None
    ) -> str | None:
        """One media upload (no ``100 Continue`` dance, no multipart framing)."""
        bucket, obj = self.split(key)
        fs = self.fs
        out = self.call(
            "put",
            key,
            lambda: fs._call(
                "POST",
                f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                uploadType="media",
                name=obj,
                headers={"Content-Type": "application/octet-stream"},
                data=data,
                json_out=True,
                **self.condition(exclusive, if_generation),
            ),
            "generation" if if_generation is not None else None,
        )
        return self._generation(out)

    async def _delete_if(self, key: str, generation: str) -> None:
        bucket, obj = self.split(key)
        await self.fs._call("DELETE", "b/{}/o/{}", bucket, obj, ifGenerationMatch=generation)
