"""Google Cloud Storage through gcsfs.

Facts: no atomic rename (gcsfs ``mv`` may fall back to copy + delete); put-if-absent is
enforced by the server with ``ifGenerationMatch=0`` (412 for the loser); no fsync; every
object carries its CRC32C, which ``info`` reports. Strategy: marker.

Large objects are written by parallel composite upload (components uploaded at once,
then ``compose``d into the object with the writer's precondition, then deleted): see
``docs/drivers.md`` for why. Components of an upload that did not finish are listed by
:meth:`GCSDriver.list_incomplete_uploads` and removed by recovery once no live lease
protects the save.

atomicstore uses ``gcsfs.core.GCSFileSystem`` directly (not the experimental subclass,
whose bucket probe over gRPC stalls against emulators) with gcsfs's request retry loop
turned off: the store's :class:`~atomicstore.retry.RetryPolicy` is the only one.
"""

from __future__ import annotations

import base64
import concurrent.futures
import logging
import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import gcsfs.core
import gcsfs.retry
import requests.exceptions
from fsspec.dircache import DirCache

from ..errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)
from .asyncfs import AsyncFsspecDriver
from .parts import BufferedPartWriter, PartBody
from .payload import register as _send_parts_as_views
from .spec import Capabilities, FileInfo, Writer

CHUNK_MULTIPLE = 256 * 2**10
log = logging.getLogger("atomicstore.drivers")
_send_parts_as_views()  # (drivers/payload.py)


class _NoRetryGCSFileSystem(gcsfs.core.GCSFileSystem):  # type: ignore[misc]  # gcsfs is untyped
    """gcsfs with one try per request: retries belong to atomicstore's policy."""

    async def _request(self, *args: Any, **kwargs: Any) -> Any:
        return await gcsfs.core.GCSFileSystem._request.__wrapped__(self, *args, **kwargs)


#: where the components of parallel composite uploads live, below the store root: inside
#: the directory the commit layer reserves (``.atomicstore``), which no checkpoint name or
#: file path can reach; ``<COMPONENTS>/<key>/<upload id>/<part number>``
COMPONENTS = ".atomicstore/uploads"
#: the most source objects one ``compose`` request takes
MAX_COMPOSE = 32
#: custom metadata on a composed object naming the upload that made it (a compose whose
#: reply was lost and whose retry was refused is recognised by it)
UPLOAD_TAG = "atomicstore-upload"


def component_prefix(key: str, upload_id: str) -> str:
    """The key prefix of the components of upload ``upload_id`` of ``key``."""
    return f"{COMPONENTS}/{key}/{upload_id}"


class _GCSWriter(BufferedPartWriter):
    """Parallel composite upload. Each part is uploaded as an object of its own (a
    component, one media upload, all of them at once within the store's in-flight
    budget); then one ``compose`` creates the object at ``key`` from them, with the
    writer's precondition on the destination (``ifGenerationMatch=0`` or the generation
    read) and, on every source, the generation its upload returned. Then the components
    are deleted. Over 32 components, groups of 32 are first composed into intermediate
    components (a tree). A crash leaves components, which recovery deletes
    (:meth:`GCSDriver.list_incomplete_uploads`) once no live lease protects the save."""

    driver: GCSDriver

    def __init__(
        self, driver: GCSDriver, key: str, exclusive: bool = False, if_generation: str | None = None
    ) -> None:
        super().__init__(driver, key, exclusive, if_generation)
        self.upload_id = ""
        #: part number -> (object name, generation) of each uploaded component
        self.components: dict[int, tuple[str, str]] = {}
        #: keys of every object this upload made or may have made (removed at the end)
        self.made: list[str] = []

    def _start(self) -> None:
        self.upload_id = secrets.token_hex(8)

    def _upload_part(
        self, pieces: list[memoryview], number: int, offset: int, final: bool
    ) -> concurrent.futures.Future[Any]:
        key = f"{component_prefix(self.key, self.upload_id)}/{number:06d}"
        self.made.append(key)
        size = sum(p.nbytes for p in pieces)
        bucket, obj = self.driver.split(key)

        body = PartBody(pieces)

        async def upload() -> None:
            body.seek(0)  # (each try sends it whole)
            out = await self.driver.upload(bucket, obj, body, size)
            self.components[number] = (obj, str(out["generation"]))

        return self._submit_part(f"upload component {number}", upload, body)

    def _complete(self) -> None:
        d = self.driver
        sources = [self.components[n] for n in sorted(self.components)]
        level = 0
        while len(sources) > MAX_COMPOSE:  # a tree of intermediate components
            level += 1
            futures = []
            # threads of its own: this runs on a completion thread, whose pool it must
            # not wait on
            with concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="atomicstore-compose") as pool:
                for i in range(0, len(sources), MAX_COMPOSE):
                    key = f"{component_prefix(self.key, self.upload_id)}/c{level}-{i // MAX_COMPOSE:06d}"
                    self.made.append(key)
                    futures.append((key, pool.submit(
                        d.compose, key, sources[i : i + MAX_COMPOSE], {"ifGenerationMatch": "0"}, self.upload_id)))
            # (every compose has ended here, so an error leaves none running)
            sources = [(d.split(key)[1], str(f.result()["generation"])) for key, f in futures]
        out = d.compose(self.key, sources, d.condition(self.exclusive, self.if_generation), self.upload_id)
        self.generation = d._generation(out)
        self._abort()  # the components are not needed any more

    def _abort(self) -> None:
        """Delete every component (best effort: recovery removes what is left)."""
        d = self.driver
        futures = [(k, d.submit("delete", k, d._rm_one(k))) for k in self.made]
        self.made = []
        for k, f in futures:
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - recovery removes leftover components
                log.warning("could not delete upload component %s: %s", d.describe(k), exc)


class GCSDriver(AsyncFsspecDriver):
    """GCS via gcsfs. Commit strategy: conditional success marker."""

    protocols = ("gs", "gcs")
    capabilities = Capabilities(
        atomic_rename=False,
        atomic_create=True,
        durable_fsync=False,
        directories=False,
        native_generation_reads=True,  # ranged GETs take ifGenerationMatch
        multipart_uploads=True,  # components of parallel composite uploads
        # GCS evaluates ifGenerationMatch atomically with the write that completes an
        # object (documented: "Request preconditions"); the conformance check verifies it
        exclusive_completion=True,
    )
    own_uploads = True  # components live in the store's reserved directory
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
        self._prepare_filesystem(self.fs)

    def _prepare_filesystem(self, fs: Any) -> None:
        self.connect(fs._set_session, fs.loop)

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
            retriable: bool = gcsfs.retry.is_retriable(exc)
            return retriable
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
        return self._file_info(key, self._metadata(key))

    def _metadata(self, key: str) -> dict[str, Any]:
        bucket, obj = self.split(key)
        return self.call(
            "info", key, lambda: self.fs._call("GET", "b/{}/o/{}", bucket, obj, json_out=True)
        )

    async def upload(self, bucket: str, obj: str, body: Any, size: int, **conditions: str) -> dict[str, Any]:
        """One media upload of ``body`` (``size`` bytes) to ``bucket/obj``; its metadata."""
        fs = self.fs
        return await fs._call(  # type: ignore[no-any-return]
            "POST",
            f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
            uploadType="media",
            name=obj,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            data=body,
            json_out=True,
            **conditions,
        )

    def compose(
        self, key: str, sources: list[tuple[str, str]], conditions: dict[str, str], upload_id: str
    ) -> dict[str, Any]:
        """``compose`` the objects ``sources`` ((name, generation), each required at that
        generation) into ``key`` under ``conditions`` (the destination's precondition),
        tagged with ``upload_id``; the new object's metadata. A refused compose is
        reconciled by reading ``key`` back: a reply lost after the compose landed makes
        its retry fail the precondition, and the object then names this upload."""
        bucket, obj = self.split(key)
        body = {
            "sourceObjects": [{"name": n, "objectPreconditions": {"ifGenerationMatch": g}} for n, g in sources],
            "destination": {"contentType": "application/octet-stream", "metadata": {UPLOAD_TAG: upload_id}},
        }
        kind = "generation" if conditions.get("ifGenerationMatch", "0") != "0" else None
        try:
            return self.call(
                "compose", key,
                lambda: self.fs._call("POST", "b/{}/o/{}/compose", bucket, obj, json=body, json_out=True, **conditions),
                kind,
            )
        except (AlreadyExistsError, PreconditionFailedError, NotFoundError) as exc:
            try:
                raw = self._metadata(key)
            except NotFoundError:
                raw = {}
            if (raw.get("metadata") or {}).get(UPLOAD_TAG) == upload_id:
                return raw  # ours: the first try landed
            if isinstance(exc, NotFoundError) or not raw or not conditions:
                raise StorageError(
                    f"compose {self.describe(key)}: a component of the upload changed or was "
                    f"removed (by recovery, if this save was declared dead): {exc}") from exc
            raise

    def list_incomplete_uploads(self, prefix: str = "") -> list[tuple[str, str, float]]:
        """Parallel composite uploads whose components are still stored, below ``prefix``:
        (key, upload id, time the newest of them was written; a crashed upload, or one
        that finished but was cut off before it deleted them)."""
        newest: dict[tuple[str, str], float] = {}
        for k, info in self.find(COMPONENTS).items():
            dest, _, _part = k[len(COMPONENTS) + 1 :].rpartition("/")
            dest, _, upload_id = dest.rpartition("/")
            if dest and upload_id and dest.startswith(prefix):
                t = info.mtime or 0.0
                newest[(dest, upload_id)] = max(newest.get((dest, upload_id), t), t)
        return [(k, u, t) for (k, u), t in sorted(newest.items())]

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Delete the components of one parallel composite upload."""
        self.delete_tree(component_prefix(key, upload_id))

    async def _get_into(self, key: str, start: int, out: memoryview, *, generation: str | None = None) -> int:
        """A ranged media GET streamed into ``out`` (``ifGenerationMatch`` with
        ``generation``)."""
        fs = self.fs
        await fs._set_session()
        bucket, obj = self.split(key)
        url = f"{fs._location}/download/storage/v1/b/{quote(bucket)}/o/{gcsfs.core.quote(obj)}?alt=media"
        if generation is not None:
            url += f"&ifGenerationMatch={quote(generation)}"
        headers = fs._get_headers({"Range": f"bytes={start}-{start + out.nbytes - 1}"})
        async with fs.session.get(url, headers=headers, timeout=fs.requests_timeout) as r:
            if r.status >= 400:
                gcsfs.retry.validate_response(r.status, await r.read(), self.path(key))
            pos = 0
            async for chunk in r.content.iter_any():
                n = min(len(chunk), out.nbytes - pos)
                out[pos : pos + n] = chunk[:n]
                pos += n
                if pos >= out.nbytes:
                    break
        return pos

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

    async def _list_page(
        self, prefix_path: str, delimiter: str, token: str | None
    ) -> tuple[list[tuple[str, Mapping[str, Any]]], list[str], str | None]:
        """One page of ``objects.list`` with a delimiter (up to 1,000 items and prefixes)."""
        bucket, _, obj = prefix_path.partition("/")
        out = await self.fs._call("GET", "b/{}/o", bucket, prefix=obj or None, delimiter=delimiter,
                                  maxResults=self.page_size, pageToken=token, json_out=True)
        objects = [(f"{bucket}/{i['name']}", i) for i in out.get("items", [])]
        rolled = [f"{bucket}/{p}" for p in out.get("prefixes", [])]
        return objects, rolled, out.get("nextPageToken") or None

    def read_if(self, key: str, generation: str) -> bytes:
        """One media GET with ``ifGenerationMatch``."""
        bucket, obj = self.split(key)

        async def get() -> bytes:
            _, data = await self.fs._call("GET", "b/{}/o/{}", bucket, obj, alt="media",
                                          ifGenerationMatch=generation)
            return bytes(data)

        return self.call("read", key, get, "generation")
