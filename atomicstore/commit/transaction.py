"""A transaction: any number of streamed files committed as one checkpoint, or none."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from types import TracebackType
from typing import Any

from ..drivers.parts import abort_deadline
from ..drivers.spec import Writer
from ..errors import AlreadyExistsError, InvalidArgumentError, TransactionError
from .context import CommitContext
from .manifest import (
    MARKER_INLINE_BYTES,
    MAX_MANIFEST_BYTES,
    Crc32cHasher,
    FileEntry,
    Manifest,
    encode_metadata,
)
from .names import validate_path

log = logging.getLogger("atomicstore.commit")



def require_owner(pid: int, what: str) -> None:
    """:class:`~atomicstore.TransactionError` unless this is process ``pid``, which began
    the save: in a forked child the attempt is the parent's, still in flight there (a child
    committing or aborting it would commit the parent's half-written files, or delete the
    data the parent's commit names)."""
    if os.getpid() != pid:
        raise TransactionError(
            f"cannot {what}: this transaction belongs to process {pid}; a forked child cannot "
            "commit or abort it (begin a new one in this process)"
        )

class _State(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


class TransactionFile:
    """A file being written inside a transaction: write bytes, then close.

    Computes the file's CRC32C while streaming; the bytes go straight to the driver's
    writer (object stores: parts uploaded in parallel within the store's in-flight
    budget, several files' at once).
    """

    #: ``write`` takes ``borrow=True`` (see :meth:`write`)
    accepts_borrowed = True

    def __init__(self, txn: Transaction, path: str, writer: Writer) -> None:
        self._txn = txn
        self.path = path
        self._writer = writer
        self._hash = Crc32cHasher()
        self.closed = False
        self._leased = False
        #: a copy of the file's bytes while it is small enough for the commit point to
        #: carry (:data:`~atomicstore.commit.manifest.MARKER_INLINE_BYTES`); None after
        self._kept: list[bytes] | None = []

    def write(
        self, data: bytes | bytearray | memoryview, *, crc32c: int | None = None, borrow: bool = False
    ) -> int:
        """Append ``data``. Pass its ``crc32c`` if already known (saves a pass over it).

        With ``borrow=True`` the writer may upload straight from ``data`` instead of a
        copy: the caller promises not to change those bytes until the transaction has
        committed or aborted."""
        self._txn._check_owner(f"write to {self.path!r} of")
        if self.closed:
            raise TransactionError(f"write to closed file {self.path!r}")
        try:
            mv = memoryview(data).cast("B")
        except TypeError as exc:  # not a buffer, or not C-contiguous
            raise InvalidArgumentError(
                f"write to {self.path!r}: need a C-contiguous bytes-like object ({exc})"
            ) from None
        if not self._leased and self._hash.size + mv.nbytes >= self._txn.context.driver.block_size:
            self._txn._lease.wait()  # a part may be uploaded now: not before the lease
            self._leased = True
        if self._kept is not None:
            if self._hash.size + mv.nbytes <= MARKER_INLINE_BYTES:
                self._kept.append(bytes(mv))
            else:
                self._kept = None
        if crc32c is None:
            self._hash.update(mv)
        else:
            self._hash.combine(crc32c, mv.nbytes)
        if borrow:
            self._writer.write_borrowed(mv)
        else:
            self._writer.write(mv)
        return mv.nbytes

    @property
    def bytes_written(self) -> int:
        """Bytes written to this file so far."""
        return self._hash.size

    def close(self, *, wait: bool = True) -> None:
        """Finish the file: complete at its key when this returns. With ``wait=False``
        an object-store upload completes in the background while the caller goes on
        (e.g. to the next file): :meth:`Transaction.commit` waits for it and raises its
        error, leaving the transaction open (to abort; a ``with`` block aborts it)."""
        self._txn._check_owner(f"close {self.path!r} of")
        if self.closed:
            return
        self._txn._lease.wait()  # nothing of the attempt is stored before its lease
        entry = FileEntry(self._hash.size, self._hash.value)
        kept = None if self._kept is None else b"".join(self._kept)
        if wait:
            self._writer.close()
            self.closed = True
            self._txn._file_done(self.path, entry, kept=kept)
        else:
            done = self._writer.close_async()
            self.closed = True
            self._txn._file_done(self.path, entry, self._writer, done, kept=kept)

    def abort(self) -> None:
        """Discard this file's bytes, best effort (leaving a ``with`` block on an error does
        it). The transaction can then no longer commit: abort it too. No-op once closed."""
        self._txn._check_owner(f"abort {self.path!r} of")
        if not self.closed:
            self.closed = True
            self._writer.abort()

    def __enter__(self) -> TransactionFile:
        return self

    def __exit__(self, et: type[BaseException] | None, *_: Any) -> None:
        if et is not None and not self._txn._owned():
            return  # a forked child's error: the file is the parent's, left alone
        if et is None:
            self.close()
        else:
            self.abort()


class Transaction:
    """Write files under one checkpoint name; commit them all at once or not at all.

    Use as a context manager: leaving the block normally commits, an exception aborts
    (nothing becomes visible and the staged data is removed)::

        with store.transaction("step_100", metadata={"step": 100}) as txn:
            with txn.open("state.bin") as f:
                f.write(payload)
            txn.write_bytes("meta.json", b"{}")

    Files may be written from several threads at once. ``commit`` raises
    :class:`~atomicstore.CommitConflictError` if another writer committed the name first.
    """

    def __init__(
        self,
        context: CommitContext,
        name: str,
        *,
        metadata: dict[str, Any] | None,
        attempt: str,
        overwrite: bool = False,
    ) -> None:
        #: the process that made the transaction: only it may write, commit or abort it
        self.pid = os.getpid()
        #: the store's driver, strategy, writer and times (built once by the Store)
        self.context = context
        self.name = name
        self.attempt = attempt
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        encode_metadata(self.metadata)  # what no reader could read is refused before the lease
        self._files: dict[str, FileEntry] = {}
        #: copies of small files, in the order closed, for the commit point to carry
        #: (at most MARKER_INLINE_BYTES in all)
        self._small: dict[str, bytes] = {}
        self._open: dict[str, TransactionFile] = {}
        #: closed files whose upload may still be completing: path -> (writer, its future)
        self._closing: dict[str, tuple[Writer, concurrent.futures.Future[None]]] = {}
        self._lock = threading.Lock()
        self._state = _State.OPEN
        #: done once :meth:`abort` was called: a commit still waiting for its files'
        #: uploads gives up (the abort then goes ahead)
        self._abort_asked: concurrent.futures.Future[None] = concurrent.futures.Future()
        #: the thread running :meth:`commit` (an abort from it, i.e. from a signal handler
        #: that interrupted the commit, cannot take the lock the commit holds)
        self._committer: int | None = None
        #: such an abort: carried out by the commit once it ended
        self._abort_deferred = False
        self.started = time.time()
        #: the committed manifest, once :meth:`commit` succeeded
        self.manifest: Manifest | None = None
        self._lease = context.lease(name, attempt)
        #: the name's claim, held around the commit point on object stores (commit/claim.py)
        self._claim = context.claim(self._lease, "directory")
        strategy = context.strategy

        def early() -> str | None:
            strategy.begin(name, attempt, overwrite=overwrite)
            return strategy.current(name) if overwrite else None

        # The conflict check and the lease go out together, and the caller's files start
        # streaming while the lease is written: each file's object is only created once the
        # lease is stored (TransactionFile.close, and ``prefix`` for files written
        # directly), so recovery still never sees data without a lease. (On local
        # backends ``background`` runs at once: check, then lease, as before.)
        found = context.driver.background(early)
        if found.done():
            found.result()  # a conflict is raised before any lease is written
        self._lease.acquire(wait=False)
        try:
            #: the generation an overwrite replaces (compare-and-swap): read now, checked at commit
            self.expected = found.result()
        except BaseException:
            self._lease.release()
            raise
        self._prefix = strategy.attempt_prefix(name, attempt)

    # -- writing ------------------------------------------------------------------------
    def open(self, path: str) -> TransactionFile:
        """Start writing ``path`` (relative, ``/``-separated) inside the checkpoint."""
        validate_path(path)
        self._check_owner(f"write {path!r} in")
        with self._lock:
            self._check_open()
            if path in self._files or path in self._open:
                raise InvalidArgumentError(f"{path!r} is already written in this transaction")
            f = TransactionFile(self, path, self.context.driver.open_writer(f"{self._prefix}/{path}"))
            self._open[path] = f
            return f

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole file at once."""
        with self.open(path) as f:
            f.write(data)

    @property
    def prefix(self) -> str:
        """Key prefix (below the store root) this attempt's files are staged under. (Asked
        for to write files there directly: it waits until the attempt's lease is stored.)"""
        self._lease.wait()
        return self._prefix

    def adopt(self, path: str, size: int, crc32c: int) -> None:
        """Count a file another process wrote (and made durable) directly at
        ``<prefix>/<path>`` as part of this checkpoint. Its size and CRC32C go into the
        manifest, so readers check it like any other file."""
        validate_path(path)
        if not isinstance(size, int) or size < 0 or not isinstance(crc32c, int) or not 0 <= crc32c < 2**32:
            raise InvalidArgumentError(f"adopt {path!r}: bad size or CRC32C")
        self._check_owner(f"adopt {path!r} in")
        with self._lock:
            self._check_open()
            if path in self._files or path in self._open:
                raise InvalidArgumentError(f"{path!r} is already written in this transaction")
            self._files[path] = FileEntry(size, crc32c)

    def _file_done(self, path: str, entry: FileEntry, writer: Writer | None = None,
                   done: concurrent.futures.Future[None] | None = None, *, kept: bytes | None = None) -> None:
        with self._lock:
            self._open.pop(path, None)
            self._files[path] = entry
            if kept is not None and sum(map(len, self._small.values())) + len(kept) <= MARKER_INLINE_BYTES:
                self._small[path] = kept
            if writer is not None and done is not None and not (done.done() and done.exception() is None):
                self._closing[path] = (writer, done)

    @property
    def files(self) -> dict[str, FileEntry]:
        """Files closed so far, with sizes and CRC32C."""
        with self._lock:
            return dict(self._files)

    def _owned(self) -> bool:
        return os.getpid() == self.pid

    def _check_owner(self, what: str = "use") -> None:
        require_owner(self.pid, f"{what} transaction {self.name!r}")

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise TransactionError(f"transaction for {self.name!r} is already {self._state.value}")

    # -- ending -------------------------------------------------------------------------
    def commit(self, *, check: Callable[[], None] | None = None) -> Manifest:
        """Write the manifest and publish the checkpoint. Returns its manifest.

        A manifest larger than readers accept (:data:`~atomicstore.commit.manifest.MAX_MANIFEST_BYTES`:
        too many files, or metadata grown since the transaction began) raises
        :class:`~atomicstore.InvalidArgumentError` before anything is published; the
        transaction stays open, to be aborted (a ``with`` block does it).

        ``check()`` (e.g. a multi-host save's own deadline) runs with the lease check,
        after everything is written, right before the commit point; its error aborts.

        :class:`~atomicstore.TransactionError` in a forked child of the process that began
        the transaction (nothing is changed)."""
        self._check_owner("commit")
        try:
            with self._lock:
                self._committer = threading.get_ident()
                try:
                    self._check_open()
                    if self._open:
                        raise TransactionError(
                            f"cannot commit {self.name!r}: files still open: {sorted(self._open)}"
                        )
                    manifest, data = self._encode_manifest()  # (every entry is known at close)
                    self._publish(data, check, [done for _, done in self._closing.values()])
                    self._state = _State.COMMITTED
                    self.manifest = manifest
                    self._lease.release()
                finally:
                    self._committer = None
        except BaseException:
            if self._abort_deferred:  # asked from within this commit (a signal handler)
                self.abort()
            raise
        log.info("committed %s (%d files, %d bytes)", self.context.driver.describe(self.name),
                 len(manifest.files), manifest.total_bytes)
        return manifest

    def _encode_manifest(self) -> tuple[Manifest, bytes]:
        """The manifest of what was written, and its bytes; InvalidArgumentError (nothing
        changed, the transaction stays open) if it cannot be published."""
        manifest = Manifest(
            name=self.name,
            attempt=self.attempt,
            writer=self.context.writer_id,
            created=self.started,
            files=dict(self._files),
            metadata=self.metadata,
            committed=time.time(),
        )
        try:
            data = manifest.to_bytes()
        except (TypeError, ValueError, RecursionError) as exc:  # metadata changed since
            raise InvalidArgumentError(f"cannot commit {self.name!r}: metadata is no longer "
                                       f"JSON ({exc})") from None
        if len(data) > MAX_MANIFEST_BYTES:  # (the transaction stays open, to be aborted)
            raise InvalidArgumentError(
                f"cannot commit {self.name!r}: its manifest would take {len(data):,} bytes "
                f"({len(self._files):,} files), over the {MAX_MANIFEST_BYTES:,} readers accept"
            )
        return manifest, data

    def _publish(self, data: bytes, check: Callable[[], None] | None,
                 closing: list[concurrent.futures.Future[None]]) -> None:
        """Publish the manifest ``data`` through the strategy (the commit point), once
        every ``closing`` upload is complete (the strategy waits for them while its
        first requests are on their way). Until they are, an error leaves the transaction
        open, to be aborted (which ends the uploads first); after, the transaction is
        aborted, its lease released or, if the commit point may still land, kept."""
        lease_check = self._lease.check
        files_ready = False

        def checks() -> None:
            lease_check()
            if check is not None:
                check()

        def ready() -> None:
            nonlocal files_ready
            pending = set(closing)
            while pending and not self._abort_asked.done():
                concurrent.futures.wait([*pending, self._abort_asked], return_when=FIRST_COMPLETED)
                pending = {d for d in pending if not d.done()}
            if self._abort_asked.done():  # (an abort from another thread wins, as before the commit point)
                raise TransactionError(f"transaction for {self.name!r} was aborted while it committed")
            for done in closing:  # all ended: the first failure is raised
                error = done.exception()
                if error is not None:
                    raise error
            files_ready = True

        try:
            # publish cleans up after itself where that is provably safe; it checks
            # the lease (a writer declared dead must not commit) after writing the
            # manifest, right before the commit point
            self.context.strategy.publish(
                self.name, self.attempt, self.context.writer_id, data, overwrite=self.overwrite,
                expected=self.expected, check=checks, claim=self._claim, inline=self._small,
                ready=ready,
            )
        except BaseException as exc:
            if not files_ready:
                # a file's upload failed (or the wait for them was interrupted): nothing
                # was published, and uploads may still be in flight: the caller aborts
                raise
            self._state = _State.ABORTED
            if isinstance(exc, AlreadyExistsError):  # refused at the commit point (another
                # writer won, or a one-file checkpoint of the name appeared): nothing published
                self.context.strategy.discard(self.name, self.attempt)
                self._lease.release()
            else:
                # Maybe ambiguous (the commit point may still land): keep the lease object
                # so recovery waits ttl + grace before it removes this attempt's data.
                self._lease.stop()
            raise

    def abort(self) -> None:
        """Discard everything written; nothing becomes visible. Idempotent. Called from
        another thread while :meth:`commit` still waits for the files' uploads, it wins:
        that commit raises :class:`~atomicstore.TransactionError`. Otherwise a no-op once
        :meth:`commit` was called: a commit that raised with its outcome unknown (its
        commit request timed out, or its reply was lost after the last retry) may still
        land afterwards, which no abort can take back (the attempt's data is kept for it;
        delete the checkpoint if it appears). :class:`~atomicstore.TransactionError` in a
        forked child (nothing is changed).

        Called from within :meth:`commit` on the committing thread (a signal handler, e.g.
        for SIGTERM, that interrupted it), the same holds: it returns at once, and if the
        commit was still waiting for the uploads, that commit raises
        :class:`~atomicstore.TransactionError` after carrying out the abort itself.

        The files' uploads are ended together: a server holding their last requests
        delays the abort by at most ``ABORT_WAIT`` (10 s) for all of them, not per file."""
        self._check_owner("abort")
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self._abort_asked.set_result(None)  # a commit waiting for uploads gives up
        if self._committer == threading.get_ident():
            self._abort_deferred = True  # (the commit holds the lock, further up this stack)
            return
        with self._lock:
            if self._state is not _State.OPEN:
                return
            self._state = _State.ABORTED
            writers: list[Any] = list(self._open.values()) + [w for w, _ in self._closing.values()]
            self._open.clear()
            self._closing.clear()
        # each returns once nothing of its upload is in flight any more (or its bound is up)
        errors: list[BaseException] = []
        with abort_deadline():  # one deadline for all: a writer queued behind others waits what is left
            if len(writers) == 1:
                try:
                    writers[0].abort()
                except BaseException as exc:  # noqa: BLE001 - raised below, after the cleanup
                    errors.append(exc)
            elif writers:
                with concurrent.futures.ThreadPoolExecutor(min(16, len(writers))) as pool:
                    ended = [pool.submit(contextvars.copy_context().run, w.abort) for w in writers]
                errors = [e for e in (f.exception() for f in ended) if e is not None]
        self.context.strategy.discard(self.name, self.attempt)
        self._lease.release()
        if errors:
            raise errors[0]

    @property
    def committed(self) -> bool:
        """True once :meth:`commit` has made the checkpoint visible."""
        return self._state is _State.COMMITTED

    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._owned():
            # a forked child leaving the parent's block: storage is left alone (the
            # attempt is the parent's); leaving normally is an error, not a commit
            if et is None:
                self._check_owner("commit")
            return
        if et is None:
            if self._state is _State.OPEN:
                try:
                    self.commit()
                except BaseException:
                    if self._state is _State.OPEN:  # a file failed, or one was left open
                        self.abort()
                    raise
        else:
            self.abort()
