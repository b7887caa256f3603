"""What a driver is: facts about a backend plus primitive operations.

A driver does no protocol work. It states what the backend guarantees
(:class:`Capabilities`) and performs primitive operations on keys relative to its root.
The commit layer reads the capabilities and picks a commit strategy.

Keys are ``/``-separated relative paths, already validated by the commit layer; a driver
never sees ``..`` or an absolute key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from ..errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    StorageTimeoutError,
)
from ..retry import RetryPolicy

log = logging.getLogger("atomicstore.drivers")
T = TypeVar("T")

#: Default chunk size for streamed reads and writes (bytes).
DEFAULT_BLOCK_SIZE = 16 * 2**20
#: Default per-request timeout on object stores (seconds).
DEFAULT_OPERATION_TIMEOUT = 120.0


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees. The commit layer chooses its strategy from these facts.

    Attributes:
        atomic_rename: renaming a whole directory is one atomic step that either happens
            or not, and refuses to replace an existing target (POSIX ``rename``).
        atomic_create: an exclusive create ("put if absent") is enforced by the backend, so
            of two concurrent creators exactly one wins.
        durable_fsync: data and directory entries are durable only after ``fsync``; the
            driver's writers fsync files on close and ``fsync_dir`` is meaningful.
        directories: the backend has real directories (which can be empty, renamed,
            fsynced); object stores only have key prefixes.
        native_crc32c: ``info`` returns the backend's own CRC32C of an object.
        multipart_uploads: interrupted uploads can leave invisible parts that cost money
            until aborted (S3); recovery lists and aborts them.
        pinned_reads: ``iter_read`` reads one version of an object from start to end
            even if the key is replaced meanwhile (one open POSIX file descriptor);
            object stores read in ranges, each of which may see a newer object.
    """

    atomic_rename: bool
    atomic_create: bool
    durable_fsync: bool
    directories: bool
    native_crc32c: bool = False
    multipart_uploads: bool = False
    pinned_reads: bool = False


@dataclass(frozen=True)
class FileInfo:
    """Size (and the backend's CRC32C, if it keeps one) of a stored object.

    ``generation`` is an opaque token that changes with every write of the key (S3 ETag,
    GCS generation, POSIX inode and change time, a counter in memory); conditional
    writes and deletes take it as ``if_generation``.
    """

    key: str
    size: int
    crc32c: int | None = None
    mtime: float | None = None
    generation: str | None = None


@dataclass(frozen=True)
class Entry:
    """One child of a listed prefix: a file or a directory/prefix."""

    name: str
    is_dir: bool


class Writer(ABC):
    """A streamed write of one object. Nothing is visible at the key before ``close``.

    ``close`` makes the object complete at its key (on POSIX: written and fsynced);
    ``abort`` discards whatever was written, best effort.
    """

    @abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class Driver(ABC):
    """Base class of every driver.

    Subclasses set ``protocols`` and ``capabilities`` and implement the primitives.
    A driver is created by :func:`atomicstore.drivers.get_driver` from a URL.
    """

    #: URL protocols this driver serves (the first one is the canonical name).
    protocols: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[Capabilities]
    #: rename backends: :meth:`exchange` can swap whole directories atomically (a fact
    #: some filesystems lack, found when the driver opens; overwrites are refused then)
    replaces_directories: bool = True

    def __init__(
        self,
        fs: Any,
        root: str,
        *,
        url: str,
        retry: RetryPolicy | None = None,
        operation_timeout: float | None = DEFAULT_OPERATION_TIMEOUT,
        block_size: int = DEFAULT_BLOCK_SIZE,
        secrets: tuple[str, ...] = (),
    ) -> None:
        if operation_timeout is not None and operation_timeout <= 0:
            raise InvalidArgumentError("operation_timeout must be > 0 or None")
        if block_size < 2**18:
            raise InvalidArgumentError("block_size must be at least 256 KiB")
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.retry = retry or RetryPolicy()
        self.operation_timeout = operation_timeout
        self.block_size = block_size
        self._secrets = tuple(s for s in secrets if s)

    @classmethod
    def from_url(
        cls, protocol: str, path: str, storage_options: dict[str, Any], **kwargs: Any
    ) -> Driver:
        """Build the driver for ``protocol://path``; ``storage_options`` go to fsspec."""
        try:
            fs = cls.make_filesystem(protocol, storage_options)
        except (TypeError, ValueError, ImportError) as exc:
            raise InvalidArgumentError(
                f"cannot open {protocol}:// with the storage options given "
                f"({sorted(storage_options)}): {type(exc).__name__}: {exc}"
            ) from None
        root = fs._strip_protocol(f"{protocol}://{path}").rstrip("/")
        if not root:
            raise InvalidArgumentError(f"{protocol}:// needs a bucket or root path")
        return cls(fs, root, url=f"{protocol}://{root}", **kwargs)

    @classmethod
    def make_filesystem(cls, protocol: str, storage_options: dict[str, Any]) -> Any:
        import fsspec

        return fsspec.filesystem(protocol, **storage_options)

    # -- naming -------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The backend path of ``key``."""
        return f"{self.root}/{key}" if key else self.root

    def describe(self, key: str = "") -> str:
        """``key`` as a URL for messages (never with credentials)."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def redact(self, text: str) -> str:
        """Remove every credential this driver was given from ``text``."""
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def wrap_error(
        self, op: str, key: str, exc: BaseException, conditional: str | None = None
    ) -> Exception:
        """Translate a backend error into the library's hierarchy (credentials redacted).
        ``conditional`` says what a 412 means: ``"generation"`` (an ``if_generation``
        request: :class:`PreconditionFailedError`) or anything else (the object exists)."""
        if isinstance(exc, StorageError | NotFoundError | AlreadyExistsError):
            return exc
        where = self.describe(key)
        detail = self.redact(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, FileNotFoundError):
            return NotFoundError(f"{op}: not found: {where}")
        if isinstance(exc, FileExistsError) or http_status_of(exc) == 412:
            if conditional == "generation":
                return PreconditionFailedError(f"{op}: {where} changed since it was read")
            return AlreadyExistsError(f"{op}: already exists: {where}")
        if isinstance(exc, TimeoutError):
            return StorageTimeoutError(
                f"{op} {where} did not finish within {self.operation_timeout}s"
            )
        return StorageError(f"{op} {where} failed: {detail}")

    # -- facts --------------------------------------------------------------------------
    def is_transient(self, exc: BaseException) -> bool:
        """True if ``exc`` is worth retrying (throttling, 5xx, connection reset)."""
        return False

    # -- primitives ---------------------------------------------------------------------
    @abstractmethod
    def open_writer(
        self, key: str, *, exclusive: bool = False, if_generation: str | None = None
    ) -> Writer:
        """Start a streamed write of ``key`` (nothing visible before close). With
        ``exclusive``, ``close`` raises :class:`AlreadyExistsError` if ``key`` exists by
        then; with ``if_generation``, :class:`PreconditionFailedError` unless ``key`` is
        still at that generation (atomically where the backend can; rename-based backends
        stage and rename instead, see :mod:`atomicstore.commit.onefile`)."""

    @abstractmethod
    def put(
        self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None
    ) -> str | None:
        """Write a small object in one step and return its new generation (None where the
        backend does not say). With ``exclusive``, raise
        :class:`AlreadyExistsError` if ``key`` exists; with ``if_generation``, raise
        :class:`PreconditionFailedError` unless ``key`` exists at that generation
        (atomically where the backend can). Either error carries ``retried=True`` when an
        earlier try of this request may have been applied (lost reply)."""

    def put_volatile(self, key: str, data: bytes, *, if_generation: str | None = None) -> str | None:
        """Like :meth:`put` (atomic replace), but need not be durable across a power cut
        (no fsync): for leases, whose loss after a crash is harmless."""
        return self.put(key, data, if_generation=if_generation)

    @abstractmethod
    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (the whole object by default)."""

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` with bytes from ``offset`` of ``key``; return how many were read
        (fewer only at the end of the object)."""
        data = self.read(key, offset, offset + out.nbytes)
        out[: len(data)] = data
        return len(data)

    def iter_read(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        """Stream ``key`` in chunks (range reads by default)."""
        chunk = chunk_size or self.block_size
        size = self.info(key).size
        pos = 0
        while pos < size:
            data = self.read(key, pos, min(size, pos + chunk))
            if not data:
                raise StorageError(f"read {self.describe(key)}: unexpected end at byte {pos}")
            pos += len(data)
            yield data

    @abstractmethod
    def info(self, key: str) -> FileInfo:
        """Size (and native checksum) of ``key``; :class:`NotFoundError` if absent."""

    def exists(self, key: str) -> bool:
        try:
            self.info(key)
        except NotFoundError:
            return False
        return True

    @abstractmethod
    def listdir(self, prefix: str = "") -> list[Entry]:
        """Immediate children of ``prefix`` (empty if it does not exist)."""

    @abstractmethod
    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        """Every object below ``prefix``, keyed by key relative to the root."""

    @abstractmethod
    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        """Delete one object; a missing one is not an error. With ``if_generation``, raise
        :class:`PreconditionFailedError` if the object is at another generation."""

    def delete_tree(self, prefix: str) -> None:
        """Delete everything below ``prefix``; missing is not an error."""
        for key in sorted(self.find(prefix), reverse=True):
            self.delete(key)

    def rename(self, src: str, dst: str) -> None:
        """Atomically rename the tree ``src`` to ``dst``, refusing to replace ``dst``
        (:class:`AlreadyExistsError`). Only drivers with ``atomic_rename`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no atomic rename")

    def exchange(self, a: str, b: str) -> None:
        """Atomically swap the trees ``a`` and ``b`` (both must exist). Only drivers with
        ``atomic_rename`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no atomic exchange")

    def fsync_dir(self, key: str) -> None:
        """Make the entries of directory ``key`` durable (no-op without directories)."""

    def lock(self, timeout: float = 60.0) -> contextlib.AbstractContextManager[None]:
        """Mutual exclusion between every process and thread using this root, for the
        few compare-and-swap steps of rename backends (overwrite, delete). Held for a
        rename and an fsync, never for data. :class:`StorageTimeoutError` if it cannot be
        had within ``timeout`` seconds. Default: a lock shared within this process."""
        return _process_lock(self.root, timeout)

    def makedirs(self, key: str) -> None:
        """Create directory ``key`` and its parents (no-op on object stores)."""

    # -- multipart housekeeping (object stores with multipart_uploads) -----------------
    def list_incomplete_uploads(self, prefix: str = "") -> list[tuple[str, str, float]]:
        """(key, upload id, start time) of unfinished multipart uploads below ``prefix``."""
        return []

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one unfinished multipart upload."""

    def close(self) -> None:
        """Release resources held by the driver."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


_PROCESS_LOCKS: dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def held(lock: threading.Lock | threading.RLock, timeout: float, what: str) -> Iterator[None]:
    """Hold ``lock``, or raise :class:`StorageTimeoutError` after ``timeout`` seconds."""
    if not lock.acquire(timeout=timeout):
        raise StorageTimeoutError(f"could not take {what} within {timeout}s")
    try:
        yield
    finally:
        lock.release()


def _process_lock(root: str, timeout: float) -> contextlib.AbstractContextManager[None]:
    with _PROCESS_LOCKS_GUARD:
        lk = _PROCESS_LOCKS.setdefault(root, threading.Lock())
    return held(lk, timeout, f"the store lock of {root}")


def _swallow(task: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of an abandoned request so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


def _mtime(raw: Mapping[str, Any]) -> float | None:
    """Modification time (Unix seconds) from an fsspec info dict, if it has one."""
    for k in ("LastModified", "mtime", "updated", "last_modified"):
        v = raw.get(k)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, int | float):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _walk_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


# Fallback when an error carries no HTTP status: names of throttling and server faults.
_TRANSIENT_TEXT = re.compile(
    r"SlowDown|Throttl|TooManyRequests|RequestTimeout|InternalError|ServiceUnavailable|"
    r"Connection reset|Server disconnected|ConnectionReset|reduce your request rate",
    re.IGNORECASE,
)


def error_code_of(exc: BaseException) -> str | None:
    """The service's error code (``"SlowDown"``, ``"ConditionalRequestConflict"``...)
    carried by a botocore error in ``exc``'s chain, if any."""
    for e in _walk_chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, Mapping):
            code = resp.get("Error", {}).get("Code")
            if code:
                return str(code)
    return None


def http_status_of(exc: BaseException) -> int | None:
    """The HTTP status carried by a botocore/gcsfs/aiohttp error, if any."""
    for e in _walk_chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, Mapping):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return int(status)
        for attr in ("code", "status"):
            val = getattr(e, attr, None)
            if isinstance(val, int) and 100 <= val < 600:
                return val
    return None


class AsyncFsspecDriver(Driver):
    """Helpers for drivers over fsspec's async filesystems (s3fs, gcsfs, ...).

    Every request runs as a coroutine on the filesystem's own event loop under the
    operation timeout and the retry policy, so a stalled request is abandoned (cancelled
    in the background) and fails with :class:`StorageTimeoutError` instead of hanging the
    caller.
    A timeout is not retried: the caller learns within the timeout plus a small margin.
    """

    #: exception types (besides HTTP 429/5xx) that are transient for this backend
    transient_types: ClassVar[tuple[type[BaseException], ...]] = (ConnectionError,)

    def is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, TimeoutError | FileNotFoundError | FileExistsError | PermissionError):
            # timeouts are final by design; 404/412/403 are answers, not faults
            return False
        status = http_status_of(exc)
        if status is not None:
            return status == 429 or status >= 500
        for e in _walk_chain(exc):
            if isinstance(e, self.transient_types):
                return True
        return bool(_TRANSIENT_TEXT.search(str(exc)))

    def _loop(self) -> asyncio.AbstractEventLoop:
        return self.fs.loop

    def connect(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Create the backend client now (loading service models, credentials), so that
        this one-off cost is never charged to the timeout of the first request."""
        try:
            asyncio.run_coroutine_threadsafe(make(), self._loop()).result()
        except Exception as exc:
            raise self.wrap_error("connect", "", exc) from exc

    def submit(
        self, op: str, key: str, make: Callable[[], Awaitable[T]], conditional: str | None = None
    ) -> concurrent.futures.Future[T]:
        """Run ``make()`` on the filesystem loop with timeout and retries; a future."""

        async def once() -> T:
            # Not asyncio.wait_for: it waits for the cancelled request to wind down, which
            # an HTTP client may delay until the server answers. Give up on time instead.
            task = asyncio.ensure_future(make())
            done, _ = await asyncio.wait({task}, timeout=self.operation_timeout)
            if not done:
                task.cancel()
                task.add_done_callback(_swallow)
                raise TimeoutError(f"{op} timed out")
            return task.result()

        async def run() -> T:
            tries = 0
            try:
                async for attempt in self.retry.async_retrying(self.is_transient):
                    with attempt:
                        tries += 1
                        return await once()
            except BaseException as exc:  # noqa: BLE001 - translated below
                if isinstance(exc, asyncio.CancelledError):
                    raise
                err = self.wrap_error(op, key, exc, conditional)
                if isinstance(err, AlreadyExistsError) and tries > 1:
                    err.retried = True  # an earlier try may have been applied: reconcile
                raise err from exc
            raise AssertionError("unreachable")  # pragma: no cover

        return asyncio.run_coroutine_threadsafe(run(), self._loop())

    def call(
        self, op: str, key: str, make: Callable[[], Awaitable[T]], conditional: str | None = None
    ) -> T:
        """Like :meth:`submit`, waiting for the result."""
        return self.submit(op, key, make, conditional).result()

    # Generic primitives through fsspec's async API --------------------------------------
    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.call("read", key, lambda: self.fs._cat_file(self.path(key), start=start, end=end))

    def info(self, key: str) -> FileInfo:
        raw = self.call("info", key, lambda: self.fs._info(self.path(key)))
        if raw.get("type") == "directory":
            raise NotFoundError(f"info: not a file: {self.describe(key)}")
        return self._file_info(key, raw)

    def _file_info(self, key: str, raw: Mapping[str, Any]) -> FileInfo:
        return FileInfo(
            key, int(raw.get("size") or 0), self._native_crc32c(raw), _mtime(raw), self._generation(raw)
        )

    def _native_crc32c(self, raw: Mapping[str, Any]) -> int | None:
        return None

    def _generation(self, raw: Mapping[str, Any]) -> str | None:
        return None

    def _rel(self, path: str) -> str:
        path = path.rstrip("/")
        root = self.root + "/"
        return path[len(root):] if path.startswith(root) else path

    def listdir(self, prefix: str = "") -> list[Entry]:
        async def ls() -> list[dict]:
            try:
                return await self.fs._ls(self.path(prefix), detail=True, refresh=True)
            except FileNotFoundError:
                return []

        out = self.call("list", prefix, ls)
        base = self.path(prefix).rstrip("/") + "/"
        entries = []
        for item in out:
            name = item["name"].rstrip("/")
            if not name.startswith(base):
                continue
            entries.append(Entry(name[len(base):], item.get("type") == "directory"))
        return entries

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        async def find() -> dict:
            self.fs.invalidate_cache()
            try:
                return await self.fs._find(self.path(prefix), detail=True)
            except FileNotFoundError:
                return {}

        out = self.call("find", prefix, find)
        return {
            self._rel(name): self._file_info(self._rel(name), v)
            for name, v in out.items()
            if v.get("type") != "directory"
        }

    def split(self, key: str) -> tuple[str, str]:
        """(bucket, object name) of ``key``."""
        bucket, _, obj = self.path(key).partition("/")
        return bucket, obj

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        if if_generation is None:
            return self.call("delete", key, self._rm_one(key))

        async def rm() -> None:
            try:
                await self._delete_if(key, if_generation)
            except FileNotFoundError:
                pass  # gone already (a retry of our own delete, or another deleter)

        self.call("delete", key, rm, "generation")

    async def _delete_if(self, key: str, generation: str) -> None:
        """Delete ``key`` only at ``generation`` (the backend's precondition)."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional delete")

    def delete_tree(self, prefix: str) -> None:
        keys = sorted(self.find(prefix), reverse=True)
        futures = [self.submit("delete", k, self._rm_one(k)) for k in keys]
        for f in futures:
            f.result()

    def _rm_one(self, key: str) -> Callable[[], Awaitable[None]]:
        async def rm() -> None:
            try:
                await self.fs._rm_file(self.path(key))
            except FileNotFoundError:
                pass

        return rm


class BufferedPartWriter(Writer):
    """A streamed object upload: small objects go in one request, large ones in parts.

    Holds at most ``block_size`` bytes plus the parts in flight (``max_in_flight``), so
    memory stays bounded whatever the object's size. Subclasses implement the backend's
    multipart calls.
    """

    max_in_flight = 4

    def __init__(
        self,
        driver: AsyncFsspecDriver,
        key: str,
        exclusive: bool = False,
        if_generation: str | None = None,
    ) -> None:
        self.driver = driver
        self.key = key
        self.exclusive = exclusive
        self.if_generation = if_generation
        self.buf = bytearray()
        self.offset = 0  # bytes handed to the backend so far
        self.started = False
        self.inflight: list[concurrent.futures.Future[Any]] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        bs = self.driver.block_size
        while len(mv):
            take = min(bs - len(self.buf), len(mv))
            self.buf += mv[:take]
            mv = mv[take:]
            if len(self.buf) >= bs:
                self._flush_part(final=False)

    def _flush_part(self, *, final: bool) -> None:
        if not self.started:
            self._start()
            self.started = True
        data = self.buf  # handed over, not copied: the next part gets a fresh buffer
        self.buf = bytearray()
        fut = self._upload_part(data, self.offset, final)
        self.offset += len(data)
        self.inflight.append(fut)
        if len(self.inflight) >= self.max_in_flight or final:
            self._drain(all_=final)

    def _drain(self, *, all_: bool) -> None:
        while self.inflight and (all_ or len(self.inflight) >= self.max_in_flight):
            self.inflight.pop(0).result()

    def close(self) -> None:
        if self.closed:
            return
        if not self.started:
            data = bytes(self.buf)
            try:
                self.driver.put(
                    self.key, data, exclusive=self.exclusive, if_generation=self.if_generation
                )
            except (AlreadyExistsError, StorageError):
                # A retried put whose first try landed answers 412, and the retry may be
                # invisible (aiohttp re-sends a PUT on a dropped keep-alive connection);
                # or the retries ran out with the outcome unknown: ours if the bytes match.
                if not self._bytes_landed(data):
                    raise
            self.buf = bytearray()
        else:
            self._flush_part(final=True)
            self._complete()
        self.closed = True

    def _bytes_landed(self, data: bytes) -> bool:
        try:
            return self.driver.read(self.key) == data
        except (NotFoundError, StorageError):
            return False

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        for f in self.inflight:
            f.cancel()
        self.inflight.clear()
        if self.started:
            try:
                self._abort()
            except Exception as exc:  # noqa: BLE001 - best effort; recovery cleans up
                log.warning("could not abort upload of %s: %s", self.driver.describe(self.key), exc)

    # backend hooks
    @abstractmethod
    def _start(self) -> None: ...

    @abstractmethod
    def _upload_part(self, data: bytearray, offset: int, final: bool) -> concurrent.futures.Future[Any]: ...

    @abstractmethod
    def _complete(self) -> None: ...

    @abstractmethod
    def _abort(self) -> None: ...
