"""What a driver is: facts about a backend plus primitive operations.

A driver does no protocol work. It states what the backend guarantees
(:class:`Capabilities`) and performs primitive operations on keys relative to its root.
The commit layer reads the capabilities and picks a commit strategy.

Keys are ``/``-separated relative paths, already validated by the commit layer; a driver
never sees ``..`` or an absolute key.

The parts drivers are built from live beside it: :mod:`.asyncfs` (drivers over fsspec's
async filesystems), :mod:`.parts` (the in-flight byte budget and the multipart writer),
:mod:`.pools` (threads, locks, fork hooks), :mod:`.classify` (what a backend error means)
and :mod:`.renameat2` (the local filesystem's rename flags).
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # (lazily imported by the package: not in a first save)
import contextlib
import contextvars
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, NamedTuple, TypeVar

from ..errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    StorageTimeoutError,
)
from ..retry import RetryPolicy
from .classify import http_status_of
from .pools import keep_inherited, process_lock, track_for_fork

T = TypeVar("T")

#: Default chunk size for streamed reads and writes (bytes).
DEFAULT_BLOCK_SIZE = 16 * 2**20
#: Default per-request timeout on object stores (seconds).
DEFAULT_OPERATION_TIMEOUT = 120.0
#: Default budget of bytes in flight at once on one object store: every part upload and
#: ranged read of every file of the store counts against it (a whole save, not a file)
DEFAULT_MAX_INFLIGHT_BYTES = 256 * 2**20

#: set within :func:`refusals_are_final`
_REFUSALS_FINAL: contextvars.ContextVar[bool] = contextvars.ContextVar("atomicstore_refusals_final",
                                                                       default=False)


@contextlib.contextmanager
def refusals_are_final(final: bool = True) -> Iterator[None]:
    """Within this block (and in contexts copied from it, which includes the coroutines
    an async driver runs for the caller), the caller vouches that nothing left behind can
    explain a refusal of its conditional requests: its keys are new, below a prefix it
    made up, and exist whenever it deletes one at a generation. A driver that spends
    requests telling a genuine refusal from such leftovers (S3 on a store that keeps the
    directories of deleted keys, or answers 412 to a conditional delete of a key that is
    gone) then takes the refusal as it is. The conformance check runs in it: on such a
    store, what those requests could find would only confirm its refusals.

    Only a request's first try: a try sent again after a lost reply or a transient error
    may be refused because the earlier one was applied (the key it created exists, the
    key it deleted is gone), so async drivers retry outside it (``final=False``), and a
    refusal carrying ``retried=True`` is never taken as it is. A re-send the driver
    cannot see (aiohttp sends a ``PUT`` or ``DELETE`` again on a keep-alive connection
    dropped before its answer) is the caller's to reconcile: the conformance check reads
    back what its refusals leave in doubt."""
    token = _REFUSALS_FINAL.set(final)
    try:
        yield
    finally:
        _REFUSALS_FINAL.reset(token)


def refusals_final() -> bool:
    """True within :func:`refusals_are_final`."""
    return _REFUSALS_FINAL.get()


class RenameFlags(NamedTuple):
    """What a rename backend's renames can do (Linux ``renameat2`` flags)."""

    #: ``rename`` refuses an existing target in one step of its own (``RENAME_NOREPLACE``);
    #: without it the local driver falls back to ``link(2)`` and to ``rename(2)`` onto a
    #: non-empty directory
    noreplace: bool
    #: ``exchange`` swaps two whole directories in one step (``RENAME_EXCHANGE``); without
    #: it a checkpoint directory cannot be replaced atomically
    exchange: bool


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
        native_generation_reads: a ranged read can be made conditional on the object's
            generation by the backend itself (S3 ``If-Match``, GCS ``ifGenerationMatch``),
            so a read of one version needs no look at the generation after it
            (:meth:`atomicstore.drivers.asyncfs.AsyncFsspecDriver.read_into`).
        io_threads: how many reads a reader of this backend should run at once (object
            stores: as many ranged requests as the store's in-flight budget holds, set
            when the driver opens).
        batched_reads: :meth:`Driver.read_ranges_into` sends every range's requests
            from the calling thread before it waits for any (object stores, whose event
            loop does the waiting): a reader gives it all its large ranges in one call
            rather than a thread per range. Elsewhere a reader reads (and checks) each
            large leaf on a thread of its own, while its bytes are in the CPU's cache.
        rename_flags: rename backends: what their renames can do (:class:`RenameFlags`),
            or a function that finds it out when a rename first needs it (the local
            driver probes its filesystem: NFS and many FUSE mounts lack both flags, and a
            store that is only read never probes). Read through :meth:`renames`.

    A driver declares them as class data; one whose facts depend on how it was opened
    (the in-flight budget, the filesystem under a local root) keeps its own copy, made
    when it opens (:func:`dataclasses.replace`).
    """

    atomic_rename: bool
    atomic_create: bool
    durable_fsync: bool
    directories: bool
    multipart_uploads: bool = False
    pinned_reads: bool = False
    exclusive_completion: bool = False
    exclusive_names: bool = False
    native_generation_reads: bool = False
    io_threads: int = 8
    batched_reads: bool = False
    rename_flags: RenameFlags | Callable[[], RenameFlags] = RenameFlags(noreplace=True, exchange=True)

    def renames(self) -> RenameFlags:
        """:attr:`rename_flags`, found out now if they are not known yet (the local
        driver's probe: this waits for it, and raises :class:`StorageError` while it
        cannot run)."""
        flags = self.rename_flags
        return flags if isinstance(flags, RenameFlags) else flags()

    @property
    def replaces_directories(self) -> bool:
        """Rename backends: :meth:`Driver.exchange` swaps whole directories atomically
        (without it, overwriting a checkpoint directory is refused)."""
        return self.renames().exchange


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
    #: every fact the driver declares (a class's; an instance may hold its own copy, see
    #: :class:`Capabilities`)
    capabilities: Capabilities
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
        #: its parent's (see :meth:`after_fork`)
        self._remake: Callable[[], Any] | None = None
        self._fs_lock = threading.Lock()
        #: why this process cannot make the filesystem again (a forked child of a driver
        #: given a filesystem object it cannot re-create)
        self._fs_refused: str | None = None
        self._pid = os.getpid()
        track_for_fork(self)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem underneath (made on first use where the driver was
        given none: the local driver calls the OS directly and never needs it; made
        again in a forked child, see :meth:`after_fork`)."""
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

    def after_fork(self) -> None:
        """In a forked child, before anything else runs (:mod:`.pools` calls it): an async fsspec filesystem (s3fs,
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
        keep_inherited(fs)  # the parent's: kept alive, never closed from the child
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

    def read_ranges_into(self, key: str, ranges: Sequence[tuple[int, memoryview]], *,
                         generation: str | None = None, threads: int | None = None) -> list[int]:
        """:meth:`read_into` of each ``(offset, out)`` of ``ranges``, all of them at once:
        how many bytes each got. Here on up to ``threads`` threads (default
        :attr:`Capabilities.io_threads`); object-store drivers send every range's
        requests from the calling thread before waiting for any."""
        if len(ranges) <= 1 or (threads or self.capabilities.io_threads) <= 1:
            return [self.read_into(key, off, out, generation=generation) for off, out in ranges]
        with concurrent.futures.ThreadPoolExecutor(min(threads or self.capabilities.io_threads, len(ranges))) as pool:
            futures = [pool.submit(self.read_into, key, off, out, generation=generation) for off, out in ranges]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

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
        return process_lock(self.root, timeout)

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
