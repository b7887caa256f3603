"""What a driver is: facts about a backend plus primitive operations.

A driver does no protocol work. It states what the backend guarantees
(:class:`Capabilities`) and performs primitive operations on keys relative to its root.
The commit layer reads the capabilities and picks a commit strategy.

Keys are ``/``-separated relative paths, already validated by the commit layer; a driver
never sees ``..`` or an absolute key.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import concurrent.futures.thread  # (lazily imported by the package: not in a first save)
import contextlib
import errno
import io
import itertools
import logging
import mmap
import os
import re
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
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
#: Default budget of bytes in flight at once on one object store: every part upload and
#: ranged read of every file of the store counts against it (a whole save, not a file)
DEFAULT_MAX_INFLIGHT_BYTES = 256 * 2**20
#: Object-store reads are split into ranged requests of this size, run in parallel
READ_CHUNK = 8 * 2**20
#: Default part size of object-store uploads (as boto3's and the AWS CRT's): with the
#: default budget, 32 parts in flight
OBJECT_BLOCK_SIZE = 8 * 2**20


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
        exclusive_completion: of two concurrent conditional completions of an upload
            (S3 ``CompleteMultipartUpload`` with ``If-None-Match``/``If-Match``, GCS's final
            request with ``ifGenerationMatch``) on one key, at most one succeeds. Where it is
            not declared, atomicstore does not rely on it (S3-compatible stores differ here:
            SeaweedFS lets both win); either way the commit requests of a name are made under
            the name's claim (``commit/claim.py``).
        exclusive_names: the store itself keeps the commit requests of one name exclusive
            (of a directory-layout checkpoint's marker and of a one-file checkpoint's
            object, and of racing completions), so commits take no claim. No real object
            store does (two keys); rename backends need no claim anyway. The interleaving
            model declares it (its scenarios never commit two layouts of one name, and a
            claim's wait for a live holder is a polling loop, an unbounded branch for its
            exhaustive search); claims are tested on the real servers.
    """

    atomic_rename: bool
    atomic_create: bool
    durable_fsync: bool
    directories: bool
    native_crc32c: bool = False
    multipart_uploads: bool = False
    pinned_reads: bool = False
    exclusive_completion: bool = False
    exclusive_names: bool = False


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

    #: once ``close`` returned: the generation of the object this write completed, as the
    #: completing request answered it (None where the backend did not say)
    generation: str | None = None

    @abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` (copied, or written before this returns)."""

    def write_borrowed(self, data: memoryview) -> None:
        """Append ``data`` without copying it where the writer can: it may keep a
        reference to ``data`` until the upload is over (``close`` returned, the future of
        ``close_async`` is done, or ``abort`` returned), so the caller must not change
        those bytes until then. Default: :meth:`write` (which copies or writes now)."""
        self.write(data)

    @abstractmethod
    def close(self) -> None:
        """Complete the object at its key (on POSIX: written and fsynced)."""

    def close_async(self) -> concurrent.futures.Future[None]:
        """Like :meth:`close`, but the object may be completed in the background: the
        future is done once it is complete at its key, or failed (then the caller still
        calls :meth:`abort`). Default: :meth:`close` now."""
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(exc)
        else:
            fut.set_result(None)
        return fut

    @abstractmethod
    def abort(self) -> None:
        """Discard whatever was written, best effort; nothing appears at the key."""


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
    #: how many reads a reader of this backend should run at once (object stores: as many
    #: ranged requests as the in-flight budget holds)
    io_threads: int = 8
    #: ``block_size`` when the caller gives none
    default_block_size: ClassVar[int] = DEFAULT_BLOCK_SIZE

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
        max_inflight_bytes: int | None = None,
    ) -> None:
        if operation_timeout is not None and operation_timeout <= 0:
            raise InvalidArgumentError("operation_timeout must be > 0 or None")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2**18:
            raise InvalidArgumentError("block_size must be an int of at least 256 KiB")
        if max_inflight_bytes is not None and (
            not isinstance(max_inflight_bytes, int) or isinstance(max_inflight_bytes, bool)
            or max_inflight_bytes < 2**20
        ):
            raise InvalidArgumentError("max_inflight_bytes must be an int of at least 1 MiB")
        #: bytes of requests in flight at once on this store (object stores)
        self.max_inflight_bytes = max_inflight_bytes or DEFAULT_MAX_INFLIGHT_BYTES
        self._fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.retry = retry or RetryPolicy()
        self.operation_timeout = operation_timeout
        self.block_size = block_size
        self._secrets = tuple(s for s in secrets if s)
        #: makes the filesystem again (set by :meth:`from_url`): a forked child cannot use
        #: its parent's (see :meth:`_after_fork`)
        self._remake: Callable[[], Any] | None = None
        self._fs_lock = threading.Lock()
        #: why this process cannot make the filesystem again (a forked child of a driver
        #: given a filesystem object it cannot re-create)
        self._fs_refused: str | None = None
        self._pid = os.getpid()
        _LIVE_DRIVERS.add(self)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem underneath (made on first use where the driver was
        given none: the local driver calls the OS directly and never needs it; made
        again in a forked child, see :meth:`_after_fork`)."""
        fs = self._fs
        if fs is not None:
            return fs
        with self._fs_lock:
            if self._fs is None:
                if self._fs_refused is not None:
                    raise StorageError(self._fs_refused)
                fs = self._remake() if self._remake is not None else self.make_filesystem(self.protocols[0], {})
                self._prepare_filesystem(fs)
                self._fs = fs
            return self._fs

    def _prepare_filesystem(self, fs: Any) -> None:
        """Configure a filesystem made for this driver before its first use (when the
        driver is built, and again when a forked child makes its own). Default: nothing."""

    def _after_fork(self) -> None:
        """In a forked child, before anything else runs: an async fsspec filesystem (s3fs,
        gcsfs) belongs to its event loop's thread, which does not exist in the child
        (fsspec refuses every call), and its connections, sessions and locks are the
        parent's. The child makes its own filesystem on first use (from the storage options
        the driver was opened with) and never touches the parent's: closing those objects
        here could unregister the parent's sockets from the event-loop selector both
        processes share. A driver given a filesystem object it cannot re-create raises
        :class:`StorageError` saying to open the store again in the child."""
        self._fs_lock = threading.Lock()
        fs = self._fs
        if fs is None or not getattr(fs, "async_impl", False):
            return  # nothing of a thread or loop (local, memory): usable as it is
        _INHERITED.append(fs)  # the parent's: kept alive, never closed from the child
        _keep_unclosed(fs)
        self._fs = None
        if self._remake is None:
            self._fs_refused = (
                f"{self.describe()}: this store was opened in process {self._pid} "
                "with a filesystem object atomicstore cannot re-create, and this is a forked child "
                "(fsspec's async filesystems cannot be used across a fork): open the store again "
                "in the child (atomicstore.open_store with the URL and storage options)")
        self._pid = os.getpid()

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
        driver = cls(fs, root, url=f"{protocol}://{root}", **kwargs)
        driver._remake = partial(cls.make_filesystem, protocol, dict(storage_options))
        return driver

    @classmethod
    def make_filesystem(cls, protocol: str, storage_options: dict[str, Any]) -> Any:
        """The fsspec filesystem for ``protocol`` given ``storage_options`` (drivers override
        it to set options of their own)."""
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

    def read_into(self, key: str, offset: int, out: memoryview, *, generation: str | None = None) -> int:
        """Fill ``out`` with bytes from ``offset`` of ``key``; return how many were read
        (fewer only at the end of the object). With ``generation`` (from :meth:`info`),
        every byte comes from that version of the object, or
        :class:`PreconditionFailedError` says it was replaced meanwhile (a reader of an
        object that is overwritten in place, e.g. a one-file checkpoint, then never
        mixes two versions)."""
        data = self.read(key, offset, offset + out.nbytes)
        out[: len(data)] = data
        self._still_at(key, generation)
        return len(data)

    def _still_at(self, key: str, generation: str | None) -> None:
        """After a read: raise unless ``key`` is still at ``generation``. Generations are
        never reused, so an object found at the same generation after the read was at it
        during the whole read."""
        if generation is None:
            return
        try:
            now = self.info(key).generation
        except NotFoundError:
            now = None
        if now != generation:
            raise PreconditionFailedError(
                f"{self.describe(key)} was replaced while it was read (generation {generation}, "
                f"now {now}): read it again"
            )

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
        """True if there is an object (or directory) at ``key``."""
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

    def scan(self, prefix: str = "", delimiter: str = "/") -> tuple[dict[str, FileInfo], set[str]]:
        """One delimited listing below ``prefix``: the objects whose key, after
        ``prefix/``, does not contain ``delimiter`` (with size, mtime and generation), and
        the distinct key prefixes, ending with the first ``delimiter``, of all the others
        (rolled up, as S3's ``CommonPrefixes`` and GCS's ``prefixes``). Object stores
        answer it with one request per 1,000 entries (objects plus prefixes), however many
        objects are rolled up; by default it is computed from :meth:`find`. Like every
        listing it is read afresh (no cache)."""
        if not delimiter:
            raise InvalidArgumentError("scan needs a delimiter")
        base = f"{prefix}/" if prefix else ""
        objects: dict[str, FileInfo] = {}
        prefixes: set[str] = set()
        for key, info in self.find(prefix).items():
            rest = key[len(base):] if key.startswith(base) else key
            cut = rest.find(delimiter)
            if cut < 0:
                objects[key] = info
            else:
                prefixes.add(base + rest[: cut + len(delimiter)])
        return objects, prefixes

    def read_if(self, key: str, generation: str) -> bytes:
        """The whole of ``key`` if it is at ``generation`` (a conditional GET on object
        stores): :class:`PreconditionFailedError` if it is at another one,
        :class:`NotFoundError` if it is absent. The default reads the generation before
        and after the bytes (a generation never comes back with other bytes)."""
        def check() -> None:
            if self.info(key).generation != generation:
                raise PreconditionFailedError(f"read: {self.describe(key)} changed since it was listed")

        check()
        data = self.read(key)
        check()
        return data

    def background(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` (a few requests of this driver) while the caller goes on, where a
        request has a round trip worth hiding; its result or error is the future's.
        The default runs it at once, in the caller's thread, and returns it done, so local
        backends (and test schedulers wrapping any driver) see the same operations in
        the same order as a plain call."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            fut.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(exc)
        return fut

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

    #: :meth:`list_incomplete_uploads` answers only uploads of this store's own writers
    #: (GCS: components kept in the store's reserved directory); otherwise (S3: every
    #: upload below the root, a nested store's and the user's too) recovery attributes
    #: each by its key before it touches it
    own_uploads: ClassVar[bool] = False

    def is_temporary(self, key: str) -> bool:
        """True if ``key`` is named as this driver names the temporary file of a
        single-file write (recovery removes stale ones). Default: the driver makes none."""
        return False

    def stray_leftovers(self, older_than: float) -> list[str]:
        """Keys of scratch entries the driver itself made and a killed process left
        behind (the local driver's ``renameat2`` probe directories), last changed more
        than ``older_than`` seconds ago; recovery removes them. Default: none."""
        return []

    def close(self) -> None:
        """Release resources held by the driver."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_GUARD = threading.Lock()


def background_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for :meth:`AsyncFsspecDriver.background` (each waits on one request)."""
    global _POOL
    with _POOL_GUARD:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="atomicstore-bg")
        return _POOL


def _forget_pool() -> None:
    """In a forked child the parent's pool threads do not exist: work submitted to it
    would never run. The child makes its own; likewise its own per-root process locks
    (one held by a parent thread at the fork would stay held in the child forever)."""
    global _POOL, _PROCESS_LOCKS_GUARD
    _POOL = None
    _PROCESS_LOCKS.clear()
    _PROCESS_LOCKS_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)

#: every driver of this process (a forked child resets each: :meth:`Driver._after_fork`)
_LIVE_DRIVERS: weakref.WeakSet[Driver] = weakref.WeakSet()
#: in a forked child, the parent's filesystems its drivers held: kept alive and never used
#: (their finalizers would close the parent's connections from the child)
_INHERITED: list[Any] = []


def _keep_unclosed(obj: Any) -> None:
    """Keep the finalizers of ``obj`` (s3fs and gcsfs close their sessions in one) from
    running at this process's exit: held in :data:`_INHERITED`, it is never collected,
    and at exit they would wait on the parent's event loop, which does not run here."""
    for fin in list(getattr(weakref.finalize, "_registry", {})):
        info = fin.peek()
        if info is not None and info[0] is obj:
            fin.atexit = False


def _drivers_after_fork() -> None:
    asyn = sys.modules.get("fsspec.asyn")
    if asyn is not None and not hasattr(asyn, "reset_after_fork"):
        # fsspec < 2025.3.1 does not reset its IO loop in a forked child: a filesystem made
        # there would run on the parent's loop, whose thread does not exist here (hangs)
        asyn.reset_lock()
    for driver in list(_LIVE_DRIVERS):
        driver._after_fork()


os.register_at_fork(after_in_child=_drivers_after_fork)


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


class InflightBudget:
    """Bytes of requests in flight at once on one store, shared by all its writers and
    readers: the parts of every file of a save (and the ranged reads of a restore) draw
    from one budget, so a whole save keeps the link busy without exceeding it.

    :meth:`acquire` blocks until ``n`` more bytes fit (a request larger than the whole
    budget waits until it is alone); :meth:`release` gives them back. ``peak`` is the most
    that was ever in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, give_up: Callable[[], BaseException | None] | None = None) -> int:
        """Take ``n`` bytes (at most the whole budget); return what was taken, to be
        released. ``give_up()`` is asked while waiting: an error it returns is raised."""
        n = min(max(n, 0), self.limit)
        with self._cond:
            while self.used and self.used + n > self.limit:
                err = give_up() if give_up is not None else None
                if err is not None:
                    raise err
                self._cond.wait(1.0)
            self.used += n
            self.peak = max(self.peak, self.used)
        return n

    def fits(self, n: int) -> bool:
        """Would :meth:`acquire` of ``n`` bytes return at once now? (A hint: another
        thread may take the room first.)"""
        with self._cond:
            return not self.used or self.used + min(max(n, 0), self.limit) <= self.limit

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter (one of them may have to give up)."""
        with self._cond:
            self._cond.notify_all()


class PartBody(io.RawIOBase):
    """A request body made of buffers, read in pieces by the HTTP client without copying
    the buffers as a whole; seekable, so checksums, signatures and retries can re-read it."""

    def __init__(self, segments: Sequence[memoryview]) -> None:
        super().__init__()
        self._segs = list(segments)
        self._ends = list(itertools.accumulate(s.nbytes for s in self._segs))
        self.size = self._ends[-1] if self._ends else 0
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def __len__(self) -> int:
        return self.size

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        i = bisect.bisect_right(self._ends, self._pos)
        while n < out.nbytes and i < len(self._segs):
            seg = self._segs[i]
            a = self._pos - (self._ends[i] - seg.nbytes)
            k = min(seg.nbytes - a, out.nbytes - n)
            out[n : n + k] = seg[a : a + k]
            n += k
            self._pos += k
            i += 1
        return n


def _release(budget: InflightBudget, held: int, _fut: concurrent.futures.Future[Any]) -> None:
    budget.release(held)


#: reads at least this large have their destination populated ahead of the data
#: (:func:`populate_pages`)
POPULATE_MIN = 2**20
#: the first slice of each span populated (later slices grow fourfold up to the span)
POPULATE_SLICE = 2**18
#: Linux's ``MADV_POPULATE_WRITE`` (5.14+)
_MADV_POPULATE_WRITE = 23
#: libc's ``madvise`` once looked up; None where there is none (or the kernel refused the
#: advice: before 5.14)
_madvise: Any = ()


def populate_pages(buf: memoryview, step: int = 8 * 2**20) -> None:
    """Fault in the pages of the writable buffer ``buf`` (Linux ``MADV_POPULATE_WRITE``,
    from its start, ``step`` bytes per call, the GIL released meanwhile) without
    changing a byte of it: safe while another thread writes into ``buf``.

    A restore reads into fresh arrays, and the first write to each of their pages is a
    page fault (measured here: 0.8 s of system time for 256 MiB in a fresh process).
    Without this, every one of them is taken by the event-loop thread that receives
    every response, in series with the receiving. Does nothing where ``buf`` is
    read-only or not contiguous, or the platform has no such call."""
    global _madvise
    if _madvise == ():
        _madvise = None
        if sys.platform.startswith("linux"):
            import ctypes

            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
    fn = _madvise
    if fn is None or not buf.nbytes:
        return
    import ctypes

    try:
        holder = ctypes.c_char.from_buffer(buf)
    except (TypeError, ValueError, BufferError):
        return  # read-only or not contiguous
    try:
        page = mmap.PAGESIZE
        addr = ctypes.addressof(holder)
        a = -(-addr // page) * page  # whole pages only (the partial ones fault as usual)
        end = (addr + buf.nbytes) // page * page
        while a < end:
            n = min(step, end - a)
            if fn(a, n, _MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:
                    _madvise = None  # an unknown advice: a kernel before 5.14
                return
            a += n
    finally:
        del holder


def _done(value: T) -> concurrent.futures.Future[T]:
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()
    fut.set_result(value)
    return fut


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
    default_block_size = OBJECT_BLOCK_SIZE
    #: size of the ranged requests a large read is split into
    read_chunk: ClassVar[int] = READ_CHUNK

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

    def __init__(self, fs: Any, root: str, **kwargs: Any) -> None:
        super().__init__(fs, root, **kwargs)
        #: the store's in-flight budget: every part upload and ranged read draws from it
        self.inflight = InflightBudget(self.max_inflight_bytes)
        self.io_threads = max(8, self.max_inflight_bytes // self.read_chunk)
        self._completer: concurrent.futures.ThreadPoolExecutor | None = None
        self._completer_lock = threading.Lock()

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop: asyncio.AbstractEventLoop = self.fs.loop
        return loop

    def _after_fork(self) -> None:
        """Also the in-flight budget (the parent's requests, which never end here, hold
        some of it) and the completion threads (the parent's do not exist here)."""
        super()._after_fork()
        self.inflight = InflightBudget(self.max_inflight_bytes)
        self._completer = None
        self._completer_lock = threading.Lock()

    def complete_later(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the driver's completion threads: the completions of uploads
        closed with ``close_async``, each waiting for its parts, then completing the
        object (long waits, kept off the short-request pool of :meth:`background`)."""
        with self._completer_lock:
            if self._completer is None:
                self._completer = concurrent.futures.ThreadPoolExecutor(
                    32, thread_name_prefix="atomicstore-complete")
            return self._completer.submit(fn)

    def close(self) -> None:
        with self._completer_lock:
            if self._completer is not None:
                self._completer.shutdown(wait=False)
                self._completer = None

    def connect(self, make: Callable[[], Coroutine[Any, Any, Any]],
                loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Create the backend client now (loading service models, credentials), so that
        this one-off cost is never charged to the timeout of the first request. ``make``
        runs on ``loop`` (default: the filesystem's)."""
        try:
            asyncio.run_coroutine_threadsafe(make(), loop or self._loop()).result()
        except TypeError as exc:  # an option the client does not take (`-o nonsense=1`)
            raise InvalidArgumentError(f"{self.describe()}: bad storage options: {exc}") from None
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
            try:
                done, _ = await asyncio.wait({task}, timeout=self.operation_timeout)
            except asyncio.CancelledError:  # the caller gave up (an aborted upload)
                task.cancel()
                task.add_done_callback(_swallow)
                raise
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
    def _read_range(self, key: str, start: int | None, end: int | None) -> Awaitable[bytes]:
        """A coroutine reading bytes ``[start, end)`` of ``key``."""
        return self.fs._cat_file(self.path(key), start=start, end=end)  # type: ignore[no-any-return]

    async def _get_into(self, key: str, start: int, out: memoryview, *, generation: str | None = None) -> int:
        """Read ``out.nbytes`` bytes of ``key`` from ``start`` into ``out``; how many
        there were (fewer only at the end of the object). Backends stream the answer into
        ``out`` without an intermediate copy of the range; those with
        :attr:`native_generation_reads` make it conditional on ``generation``."""
        data = await self._read_range(key, start, start + out.nbytes)
        out[: len(data)] = data
        return len(data)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.call("read", key, lambda: self._read_range(key, start, end))

    #: whether :meth:`_get_into` honours ``generation`` itself (a conditional GET), so
    #: :meth:`read_into` need not check the generation after the reads
    native_generation_reads: ClassVar[bool] = False

    def read_into(self, key: str, offset: int, out: memoryview, *, generation: str | None = None) -> int:
        """Ranged reads of :attr:`read_chunk` bytes straight into ``out``, as many at
        once as the store's in-flight budget allows; with ``generation``, each of them
        conditional on it (:meth:`Driver.read_into`)."""
        mv = memoryview(out).cast("B")
        step = self.read_chunk
        spans = [(a, min(step, mv.nbytes - a)) for a in range(0, mv.nbytes, step)]
        futures: list[concurrent.futures.Future[int]] = []

        def failed() -> BaseException | None:
            return next((f.exception() for f in futures if f.done() and not f.cancelled()
                         and f.exception() is not None), None)

        # This thread takes the destination's page faults (populate_pages, the GIL
        # released) while the requests are on their way, so that the event loop does not:
        # it would take them while it copies a response in, holding the GIL, and a slow
        # fault (a huge page to zero or compact) stalls every thread of the process (seen
        # here: 16 leaves' requests sent 1.5 s late). The spans sent so far are populated
        # whenever this thread would wait for room in the budget, and once all are sent:
        # breadth first (each span's next slice in turn), the order their bytes come in.
        populate = mv.nbytes >= POPULATE_MIN
        populated = 0  # spans[:populated] are

        def populate_sent() -> None:
            nonlocal populated
            todo = spans[populated : len(futures)]
            if not populate or not todo:
                return
            pos, piece = 0, POPULATE_SLICE
            while pos < step:
                for a, k in todo:
                    if pos < k:
                        populate_pages(mv[a + pos : a + min(k, pos + piece)], piece)
                pos += piece
                piece = min(4 * piece, step)  # (the first bytes come first: small slices)
            populated = len(futures)

        try:
            for a, k in spans:
                if futures and not self.inflight.fits(k):
                    populate_sent()
                held = self.inflight.acquire(k, failed)
                try:
                    fut = self.submit("read", key, partial(
                        self._get_into_or_end, key, offset + a, mv[a : a + k], generation),
                        "generation" if generation is not None else None)
                except BaseException:
                    self.inflight.release(held)
                    raise
                fut.add_done_callback(partial(_release, self.inflight, held))
                futures.append(fut)
            populate_sent()
            counts = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        total = 0
        for (_, k), got in zip(spans, counts, strict=True):
            total += got
            if got < k:
                break  # the object ends here
        if not self.native_generation_reads:
            self._still_at(key, generation)
        return total

    async def _get_into_or_end(self, key: str, start: int, out: memoryview,
                               generation: str | None = None) -> int:
        try:
            if generation is not None and self.native_generation_reads:
                return await self._get_into(key, start, out, generation=generation)
            return await self._get_into(key, start, out)
        except Exception as exc:
            if http_status_of(exc) == 416:  # the range starts past the end of the object
                return 0
            raise

    async def _read_sized(self, key: str, start: int, end: int, sized: Callable[[int], None]) -> bytes:
        """Like :meth:`_read_range` (bytes ``[start, end)``, fewer at the end of the
        object), and call ``sized(size of the whole object)`` as soon as the answer's
        headers tell it (S3: ``Content-Range``), before its body has arrived. Backends
        whose ranged reads say the size implement it; without it :meth:`iter_read` asks
        :meth:`info` first (one more round trip)."""
        raise NotImplementedError

    def _submit_read(self, key: str, k: int, make: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Submit a read of ``k`` bytes within the in-flight budget (released when it ends)."""
        held = self.inflight.acquire(k)
        try:
            fut = self.submit("read", key, make)
        except BaseException:
            self.inflight.release(held)
            raise
        fut.add_done_callback(partial(_release, self.inflight, held))
        return fut

    def iter_read(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        """Stream ``key`` in order, reading a few chunks ahead in parallel (within the
        in-flight budget). Where the first ranged read tells the object's size
        (:meth:`_read_sized`), the others are sent as soon as its headers arrive, and no
        request asks for the size first."""
        chunk = chunk_size or self.read_chunk
        window = max(1, min(8, self.max_inflight_bytes // chunk))
        ahead: collections.deque[tuple[int, concurrent.futures.Future[bytes]]] = collections.deque()
        pos = size = 0

        def more() -> None:
            nonlocal pos
            while pos < size and len(ahead) < window:
                k = min(chunk, size - pos)
                ahead.append((k, self._submit_read(key, k, partial(self._read_range, key, pos, pos + k))))
                pos += k

        try:
            if type(self)._read_sized is AsyncFsspecDriver._read_sized:
                size = self.info(key).size
            else:
                told: concurrent.futures.Future[int] = concurrent.futures.Future()

                def sized(n: int) -> None:  # on the event loop; a retry may tell it again
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        told.set_result(n)

                first = self._submit_read(key, chunk, partial(self._read_sized, key, 0, chunk, sized))
                ahead.append((chunk, first))
                either: list[concurrent.futures.Future[Any]] = [told, first]
                concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
                if not told.done():
                    first.result()  # its error
                    raise StorageError(f"read {self.describe(key)}: the answer did not say the object's size")
                size = told.result()
                ahead[0] = (min(chunk, size), first)
                pos = min(chunk, size)
                if not size:
                    first.result()
                    return
            more()
            while ahead:
                k, fut = ahead.popleft()
                data = fut.result()
                if len(data) != k:
                    raise StorageError(f"read {self.describe(key)}: unexpected end of the object")
                more()
                yield data
        finally:
            for _, f in ahead:
                f.cancel()

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
        async def ls() -> list[dict[str, Any]]:
            try:
                listing: list[dict[str, Any]] = await self.fs._ls(self.path(prefix), detail=True, refresh=True)
                return listing
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
        async def find() -> dict[str, dict[str, Any]]:
            self.fs.invalidate_cache()
            try:
                found: dict[str, dict[str, Any]] = await self.fs._find(self.path(prefix), detail=True)
                return found
            except FileNotFoundError:
                return {}

        out = self.call("find", prefix, find)
        return {
            self._rel(name): self._file_info(self._rel(name), v)
            for name, v in out.items()
            if v.get("type") != "directory"
        }

    #: entries per page of a delimited listing (the most S3 and GCS return)
    page_size = 1000

    async def _list_page(
        self, prefix_path: str, delimiter: str, token: str | None
    ) -> tuple[list[tuple[str, Mapping[str, Any]]], list[str], str | None]:
        """One page of a delimited listing of backend path ``prefix_path`` (bucket/key
        prefix, ending with ``/`` unless it is the bucket): ``(objects as (path, raw
        info), rolled-up prefix paths, next page token or None)``. Drivers of backends
        with delimited listings implement it; without it :meth:`scan` uses :meth:`find`."""
        raise NotImplementedError

    #: delimiters this backend was found not to honour (then :meth:`scan` uses find)
    _bad_delimiters: frozenset[str] = frozenset()

    def scan(self, prefix: str = "", delimiter: str = "/") -> tuple[dict[str, FileInfo], set[str]]:
        if type(self)._list_page is AsyncFsspecDriver._list_page or delimiter in self._bad_delimiters:
            return super().scan(prefix, delimiter)
        if not delimiter:
            raise InvalidArgumentError("scan needs a delimiter")
        where = self.path(prefix).rstrip("/") + "/"
        objects: dict[str, FileInfo] = {}
        prefixes: set[str] = set()
        token: str | None = None
        while True:  # pages depend on each other (the token): one request after another
            try:
                page, rolled, token = self.call(
                    "list", prefix, partial(self._list_page, where, delimiter, token)
                )
            except StorageError as exc:
                if http_status_of(exc) not in (400, 501):
                    raise
                # refused (e.g. S3 directory buckets take only "/")
                return self._unsupported(prefix, delimiter, f"{exc}")
            if any(not p.endswith(delimiter) for p in rolled):
                # a store that cut at the delimiter's first character only, say: its
                # answer would hide objects, so it is not used
                return self._unsupported(prefix, delimiter, f"rolled up at {rolled[0]!r}")
            for path, raw in page:
                rel = self._rel(path)
                objects[rel] = self._file_info(rel, raw)
            prefixes.update(self._rel(p) + ("/" if p.endswith("/") else "") for p in rolled)
            if not token:
                return objects, prefixes

    def _unsupported(self, prefix: str, delimiter: str, why: str) -> tuple[dict[str, FileInfo], set[str]]:
        log.warning("%s does not list with the delimiter %r (%s): listing every object instead",
                    self.describe(), delimiter, self.redact(why))
        self._bad_delimiters = self._bad_delimiters | {delimiter}
        return super().scan(prefix, delimiter)

    def background(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        return background_pool().submit(fn)

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
    """A streamed object upload: small objects go in one request, large ones in parts
    uploaded in parallel.

    A part is ``block_size`` bytes (the last one shorter) made of the caller's own buffers
    where the caller lends them (:meth:`write_borrowed`: no copy) and of copies of what it
    writes with :meth:`write`. Each part is handed to the backend as soon as it is full;
    it waits only for room in the store's in-flight budget (:class:`InflightBudget`),
    which every upload and ranged read of the store shares: parts of several files fly at
    once, and the copied bytes held by parts stay within the budget. Memory: one part
    being assembled plus the copied parts in flight.

    :meth:`close_async` hands the last part over and completes the object on the driver's
    worker threads; :meth:`close` waits for that. The first part that fails (after the
    retry policy) fails the next ``write``/``close``, and a failed completion aborts the
    upload. Subclasses implement the backend's calls.
    """

    #: borrowed writes shorter than this are copied (not worth a piece of their own)
    min_borrow = 2**16
    #: if set, called right before the request that makes the object visible (the one PUT
    #: of a small object, or the completion once every part is stored), on the thread that
    #: completes it; an exception from it fails ``close`` (the upload is aborted). A
    #: one-file commit takes its claim there (:mod:`atomicstore.commit.onefile`).
    before_complete: Callable[[], None] | None = None
    #: most parts of this one upload in flight at once (``None``: only the store's
    #: in-flight budget bounds them). Backends set it where a server takes the parts of
    #: one upload no faster with more of them at once (S3: :mod:`atomicstore.drivers.s3`)
    max_parts_in_flight: int | None = None

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
        self._pieces: list[memoryview] = []  # sealed pieces of the part being assembled
        self._piece_bytes = 0
        self.buf = bytearray()  # copied bytes not sealed into a piece yet
        self.offset = 0  # bytes handed to the backend so far
        self.parts = 0  # parts handed to the backend so far
        self.started = False
        self.closed = False
        self.aborted = False
        self.error: BaseException | None = None  # the first part that failed
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future[Any]] = []  # every part, in order
        self._closing: concurrent.futures.Future[None] | None = None
        self._live = 0  # part requests running on the event loop now
        self._live_cond = threading.Condition()
        self._flying = 0  # parts handed to the backend and not done yet
        self._flying_cond = threading.Condition()

    # -- streaming ----------------------------------------------------------------------
    def _part_size(self) -> int:
        """The size of the part being assembled (backends may grow it)."""
        return self.driver.block_size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._append(memoryview(data).cast("B"), borrow=False)

    def write_borrowed(self, data: memoryview) -> None:
        self._append(memoryview(data).cast("B"), borrow=True)

    def _append(self, mv: memoryview, *, borrow: bool) -> None:
        self._check()
        if self.closed:
            raise StorageError(f"write to {self.driver.describe(self.key)} after close")
        borrow = borrow and mv.nbytes >= self.min_borrow
        while mv.nbytes:
            take = min(self._part_size() - self._piece_bytes - len(self.buf), mv.nbytes)
            if borrow:
                self._seal()
                self._pieces.append(mv[:take])
                self._piece_bytes += take
            else:
                self.buf += mv[:take]
            mv = mv[take:]
            if self._piece_bytes + len(self.buf) >= self._part_size():
                self._flush_part(final=False)

    def _seal(self) -> None:
        """Make the copied bytes a piece (a fresh buffer takes the next ones)."""
        if self.buf:
            self._pieces.append(memoryview(self.buf))
            self._piece_bytes += len(self.buf)
            self.buf = bytearray()

    def _failure(self) -> BaseException | None:
        if self.error is not None:
            return self.error
        if self.aborted:
            return StorageError(f"upload of {self.driver.describe(self.key)} was aborted")
        return None

    def _check(self) -> None:
        err = self._failure()
        if err is not None:
            raise err

    def _flush_part(self, *, final: bool) -> None:
        self._seal()
        pieces, size = self._pieces, self._piece_bytes
        self._pieces, self._piece_bytes = [], 0
        if final and not size:
            return  # the last part was full: nothing left
        if not self.started:
            self._start()
            self.started = True
        self._take_slot(final)
        budget = self.driver.inflight
        try:
            held = budget.acquire(size, self._failure)
        except BaseException:
            self._give_slot()
            raise
        number = self.parts + 1
        try:
            fut = self._upload_part(pieces, number, self.offset, final)
        except BaseException:
            budget.release(held)
            self._give_slot()
            raise
        del pieces  # the request holds them, and lets go when it is done
        self.parts = number
        self.offset += size
        self._futures.append(fut)
        fut.add_done_callback(partial(self._part_done, held))

    def _take_slot(self, final: bool) -> None:
        """Wait until fewer than :attr:`max_parts_in_flight` parts of this upload are in
        flight (giving up if the upload failed or was aborted meanwhile), and count one more.
        The last part never waits: it is often a short tail (a file a few bytes longer
        than whole parts), and waiting for a slot would delay it, and the completion
        behind it, by a whole part's transfer."""
        cap = None if final else self.max_parts_in_flight
        with self._flying_cond:
            while cap is not None and self._flying >= cap:
                self._check()
                self._flying_cond.wait(1.0)
            self._flying += 1

    def _give_slot(self) -> None:
        with self._flying_cond:
            self._flying -= 1
            self._flying_cond.notify_all()

    def _part_done(self, held: int, fut: concurrent.futures.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            with self._lock:
                if self.error is None:
                    self.error = fut.exception()
        self.driver.inflight.release(held)
        self._give_slot()

    # -- ending -------------------------------------------------------------------------
    def close(self) -> None:
        self._close(inline=True).result()

    def close_async(self) -> concurrent.futures.Future[None]:
        return self._close(inline=False)

    def _close(self, *, inline: bool) -> concurrent.futures.Future[None]:
        if self._closing is not None:
            return self._closing
        self._check()
        if not self.started:
            self._seal()
            data = b"".join(self._pieces)  # smaller than one part
            self._pieces, self._piece_bytes = [], 0
            job: Callable[[], None] = partial(self._put_small, data)
        else:
            self._flush_part(final=True)  # (an error here: the caller aborts)
            job = self._finish
        self.closed = True
        if inline:
            try:
                job()
                self._closing = _done(None)
            except BaseException as exc:
                self._closing = concurrent.futures.Future()
                self._closing.set_exception(exc)
                raise
        else:
            self._closing = self.driver.complete_later(job)
        return self._closing

    def _put_small(self, data: bytes) -> None:
        if self.before_complete is not None:
            self.before_complete()
        try:
            self.generation = self.driver.put(self.key, data, exclusive=self.exclusive,
                                              if_generation=self.if_generation)
        except (AlreadyExistsError, StorageError):
            # A retried put whose first try landed answers 412, and the retry may be
            # invisible (aiohttp re-sends a PUT on a dropped keep-alive connection); or the
            # retries ran out with the outcome unknown: ours if the bytes match.
            if not self._bytes_landed(data):
                raise

    def _submit_part(self, op: str, make: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Submit a part request (with the retry policy), counted while it runs, so an
        abort can wait until none is left in flight before it discards the upload."""

        async def counted() -> T:
            with self._live_cond:
                self._live += 1
            try:
                return await make()
            finally:
                with self._live_cond:
                    self._live -= 1
                    self._live_cond.notify_all()

        return self.driver.submit(op, self.key, counted)

    def _settle(self) -> None:
        """Cancel every part request and wait until none is running any more (a request
        still running could store a part after the upload is discarded)."""
        for f in list(self._futures):
            f.cancel()
        loop = self.driver._loop()
        for _ in range(2):  # the cancellations are delivered on the loop, in order
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)
        with self._live_cond:
            self._live_cond.wait_for(lambda: self._live == 0, timeout=self.driver.operation_timeout or 60.0)

    def _finish(self) -> None:
        """Wait for every part, then complete the object; abort the upload on failure."""
        try:
            concurrent.futures.wait(self._futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            self._check()
            for f in self._futures:
                if f.cancelled():
                    raise StorageError(f"upload of {self.driver.describe(self.key)} was aborted")
                f.result()
            if self.before_complete is not None:
                self.before_complete()
            self._complete()
        except BaseException:
            self._abort_quietly()
            raise

    def _bytes_landed(self, data: bytes) -> bool:
        try:
            return self.driver.read(self.key) == data
        except (NotFoundError, StorageError):
            return False

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        for f in list(self._futures):
            f.cancel()
        self.driver.inflight.wake()  # a writer waiting for room gives up
        with self._flying_cond:
            self._flying_cond.notify_all()  # (or for a slot of this upload)
        closing = self._closing
        if closing is not None:
            # closed: the completion aborts the upload itself if it fails; once it is over
            # nothing of this upload is still in flight
            with contextlib.suppress(BaseException):
                closing.result()
            return
        if self.started:
            self._abort_quietly()

    def _abort_quietly(self) -> None:
        try:
            self._settle()
            self._abort()
        except Exception as exc:  # noqa: BLE001 - best effort; recovery cleans up
            log.warning("could not abort upload of %s: %s", self.driver.describe(self.key), exc)

    # backend hooks
    @abstractmethod
    def _start(self) -> None:
        """Begin the upload (before the first part)."""

    @abstractmethod
    def _upload_part(
        self, pieces: list[memoryview], number: int, offset: int, final: bool
    ) -> concurrent.futures.Future[Any]:
        """Start uploading part ``number`` (1-based; its bytes are ``pieces``, from byte
        ``offset`` of the object); a future of the request."""

    @abstractmethod
    def _complete(self) -> None:
        """Every part is uploaded: make the object complete at its key (applying the
        writer's conditions)."""

    @abstractmethod
    def _abort(self) -> None:
        """Discard what was uploaded."""
