"""A transaction: any number of streamed files committed as one checkpoint, or none."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..drivers.base import Writer
from ..errors import CommitConflictError, InvalidArgumentError, TransactionError
from .lease import Lease
from .manifest import Crc32cHasher, FileEntry, Manifest
from .names import validate_path

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("atomicstore.commit")


class _State(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


class TransactionFile:
    """A file being written inside a transaction: write bytes, then close.

    Computes the file's CRC32C while streaming; the bytes go straight to the driver's
    writer (bounded memory: at most one block buffered on object stores).
    """

    def __init__(self, txn: Transaction, path: str, writer: Writer) -> None:
        self._txn = txn
        self.path = path
        self._writer = writer
        self._hash = Crc32cHasher()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview, *, crc32c: int | None = None) -> int:
        """Append ``data``. Pass its ``crc32c`` if already known (saves a pass over it)."""
        if self.closed:
            raise TransactionError(f"write to closed file {self.path!r}")
        try:
            mv = memoryview(data).cast("B")
        except TypeError as exc:  # not a buffer, or not C-contiguous
            raise InvalidArgumentError(
                f"write to {self.path!r}: need a C-contiguous bytes-like object ({exc})"
            ) from None
        if crc32c is None:
            self._hash.update(mv)
        else:
            self._hash.combine(crc32c, mv.nbytes)
        self._writer.write(mv)
        return mv.nbytes

    @property
    def bytes_written(self) -> int:
        return self._hash.size

    def close(self) -> None:
        if self.closed:
            return
        self._writer.close()
        self.closed = True
        self._txn._file_done(self.path, FileEntry(self._hash.size, self._hash.value))

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.abort()

    def __enter__(self) -> TransactionFile:
        return self

    def __exit__(self, et: type[BaseException] | None, *_: Any) -> None:
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
        store: Store,
        name: str,
        *,
        metadata: dict[str, Any] | None,
        attempt: str,
        overwrite: bool = False,
    ) -> None:
        self.store = store
        self.name = name
        self.attempt = attempt
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        self._files: dict[str, FileEntry] = {}
        self._open: dict[str, TransactionFile] = {}
        self._lock = threading.Lock()
        self._state = _State.OPEN
        self.started = time.time()
        #: the committed manifest, once :meth:`commit` succeeded
        self.manifest: Manifest | None = None
        self._lease = Lease(store.driver, name, attempt, store.writer_id, store.lease_ttl, store.clock)
        # the conflict check comes first (cheap), then the lease, then any data
        store.strategy.begin(name, attempt, overwrite=overwrite)
        #: the generation an overwrite replaces (compare-and-swap): read now, checked at commit
        self.expected = store.strategy.current(name) if overwrite else None
        self._lease.acquire()
        self._prefix = store.strategy.attempt_prefix(name, attempt)

    # -- writing ------------------------------------------------------------------------
    def open(self, path: str) -> TransactionFile:
        """Start writing ``path`` (relative, ``/``-separated) inside the checkpoint."""
        validate_path(path)
        with self._lock:
            self._check_open()
            if path in self._files or path in self._open:
                raise InvalidArgumentError(f"{path!r} is already written in this transaction")
            f = TransactionFile(self, path, self.store.driver.open_writer(f"{self._prefix}/{path}"))
            self._open[path] = f
            return f

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole file at once."""
        with self.open(path) as f:
            f.write(data)

    @property
    def prefix(self) -> str:
        """Key prefix (below the store root) this attempt's files are staged under."""
        return self._prefix

    def adopt(self, path: str, size: int, crc32c: int) -> None:
        """Count a file another process wrote (and made durable) directly at
        ``<prefix>/<path>`` as part of this checkpoint. Its size and CRC32C go into the
        manifest, so readers check it like any other file."""
        validate_path(path)
        if not isinstance(size, int) or size < 0 or not isinstance(crc32c, int) or not 0 <= crc32c < 2**32:
            raise InvalidArgumentError(f"adopt {path!r}: bad size or CRC32C")
        with self._lock:
            self._check_open()
            if path in self._files or path in self._open:
                raise InvalidArgumentError(f"{path!r} is already written in this transaction")
            self._files[path] = FileEntry(size, crc32c)

    def _file_done(self, path: str, entry: FileEntry) -> None:
        with self._lock:
            self._open.pop(path, None)
            self._files[path] = entry

    @property
    def files(self) -> dict[str, FileEntry]:
        """Files closed so far, with sizes and CRC32C."""
        with self._lock:
            return dict(self._files)

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise TransactionError(f"transaction for {self.name!r} is already {self._state.value}")

    # -- ending -------------------------------------------------------------------------
    def commit(self, *, check: Callable[[], None] | None = None) -> Manifest:
        """Write the manifest and publish the checkpoint. Returns its manifest.

        ``check()`` (e.g. a multi-host save's own deadline) runs with the lease check,
        after everything is written, right before the commit point; its error aborts."""
        with self._lock:
            self._check_open()
            if self._open:
                raise TransactionError(
                    f"cannot commit {self.name!r}: files still open: {sorted(self._open)}"
                )
            manifest = Manifest(
                name=self.name,
                attempt=self.attempt,
                writer=self.store.writer_id,
                created=self.started,
                files=dict(self._files),
                metadata=self.metadata,
                committed=time.time(),
            )
            data = manifest.to_bytes()
            lease_check = self._lease.check

            def checks() -> None:
                lease_check()
                if check is not None:
                    check()

            try:
                # publish cleans up after itself where that is provably safe; it checks
                # the lease (a writer declared dead must not commit) after writing the
                # manifest, right before the commit point
                self.store.strategy.publish(
                    self.name, self.attempt, self.store.writer_id, data, overwrite=self.overwrite,
                    expected=self.expected, check=checks,
                )
            except CommitConflictError:
                self._state = _State.ABORTED
                self.store.strategy.discard(self.name, self.attempt)
                self._lease.release()
                raise
            except BaseException:
                # Maybe ambiguous (the commit point may still land): keep the lease object
                # so recovery waits ttl + grace before it removes this attempt's data.
                self._state = _State.ABORTED
                self._lease.stop()
                raise
            self._state = _State.COMMITTED
            self.manifest = manifest
            self._lease.release()
        log.info("committed %s (%d files, %d bytes)", self.store.driver.describe(self.name),
                 len(manifest.files), manifest.total_bytes)
        return manifest

    def abort(self) -> None:
        """Discard everything written; nothing becomes visible. Idempotent."""
        with self._lock:
            if self._state is not _State.OPEN:
                return
            self._state = _State.ABORTED
            pending = list(self._open.values())
            self._open.clear()
        for f in pending:
            f.abort()
        self.store.strategy.discard(self.name, self.attempt)
        self._lease.release()

    @property
    def committed(self) -> bool:
        return self._state is _State.COMMITTED

    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is None:
            if self._state is _State.OPEN:
                self.commit()
        else:
            self.abort()
