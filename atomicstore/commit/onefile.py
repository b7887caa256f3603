"""Committing a checkpoint that is one file (flax's legacy layout: ``<prefix><step>``).

A one-file checkpoint has no room for a manifest or a marker, so the file itself
appearing under its name is the commit point:

* rename backends (POSIX, memory): stream into ``.atomicstore/staging/<name>.<attempt>``
  under a lease, fsync it, then ``rename(NOREPLACE)`` onto ``<name>`` (or
  ``RENAME_EXCHANGE`` with an existing one when overwriting), fsync the parent. Staging
  lives in the reserved directory so that flax's own listing never sees it; recovery
  removes it like any staged attempt once its lease is dead.
* object stores: stream straight to ``<name>`` as one upload (multipart or resumable);
  the object becomes visible in one step when the upload completes, and with
  ``overwrite=False`` completes only if nothing is there (``If-None-Match: *`` on S3,
  ``ifGenerationMatch=0`` on GCS), so of two writers exactly one commits. An interrupted
  upload is invisible; recovery aborts it on S3, GCS expires it.

``docs/commit-protocol.md`` ("One-file checkpoints") walks each step.
"""

from __future__ import annotations

import logging
import posixpath
from types import TracebackType
from typing import TYPE_CHECKING

from ..errors import AlreadyExistsError, CommitConflictError, NotFoundError, TransactionError
from .lease import Lease
from .names import validate_name
from .strategies import STAGING, new_attempt_id

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("atomicstore.commit")


class OneFileCommit:
    """Stream one file and commit it atomically as ``name`` (a context manager).

    ``write`` accepts ``crc32c=`` like :class:`~atomicstore.TransactionFile` (ignored:
    a one-file checkpoint carries no manifest). Leaving the block normally commits;
    an exception discards everything. Raises :class:`~atomicstore.CommitConflictError`
    if ``name`` exists and ``overwrite`` is False (also when another writer wins).
    """

    def __init__(self, store: Store, name: str, *, overwrite: bool = False) -> None:
        validate_name(name)
        self.store, self.name, self.overwrite = store, name, overwrite
        self.attempt = new_attempt_id()
        self.bytes_written = 0
        self._done = False
        d = store.driver
        self.staged = d.capabilities.atomic_rename
        self._lease: Lease | None = None
        if not overwrite and d.exists(name):
            raise self._conflict()
        if self.staged:
            self.key = f"{STAGING}/{name}.{self.attempt}"
            self._lease = Lease(d, name, self.attempt, store.writer_id, store.lease_ttl)
            self._lease.acquire()
            try:
                self._w = d.open_writer(self.key)
            except BaseException:
                self._lease.release()
                raise
        else:
            self.key = name
            self._w = d.open_writer(name, exclusive=not overwrite)

    def _conflict(self) -> CommitConflictError:
        return CommitConflictError(
            f"checkpoint {self.store.driver.describe(self.name)} already exists", name=self.name
        )

    def write(self, data: bytes | bytearray | memoryview, *, crc32c: int | None = None) -> int:
        if self._done:
            raise TransactionError(f"{self.name!r} is already committed or aborted")
        self._w.write(data)
        n = memoryview(data).nbytes
        self.bytes_written += n
        return n

    def commit(self) -> None:
        """Close the file and make it visible under its name (the commit point)."""
        if self._done:
            raise TransactionError(f"{self.name!r} is already committed or aborted")
        self._done = True
        d = self.store.driver
        try:
            self._w.close()  # durable on POSIX (fsync); the upload completes on object stores
        except AlreadyExistsError:
            raise self._conflict() from None
        except BaseException:
            self._cleanup()
            raise
        if not self.staged:
            log.info("committed %s (%d bytes)", d.describe(self.name), self.bytes_written)
            return
        assert self._lease is not None
        try:
            self._lease.check()
            replaced = False
            if self.overwrite:
                try:
                    d.exchange(self.key, self.name)
                    replaced = True
                except NotFoundError:
                    pass
            if not replaced:
                d.rename(self.key, self.name)
            if d.capabilities.durable_fsync:
                d.fsync_dir(posixpath.dirname(self.name))
        except AlreadyExistsError:
            self._cleanup()
            raise self._conflict() from None
        except BaseException:
            self._lease.stop()  # ambiguous: recovery waits for the lease to expire
            raise
        if replaced:  # the old file now sits at the staging key
            try:
                d.delete(self.key)
            except Exception as exc:  # noqa: BLE001 - recovery removes it later
                log.warning("could not remove the replaced %s: %s", d.describe(self.key), exc)
        self._lease.release()
        log.info("committed %s (%d bytes)", d.describe(self.name), self.bytes_written)

    def _cleanup(self) -> None:
        self._w.abort()
        if self.staged:
            try:
                self.store.driver.delete(self.key)
            except Exception:  # noqa: BLE001 - recovery removes it later
                pass
            if self._lease is not None:
                self._lease.release()

    def abort(self) -> None:
        """Discard what was written; nothing becomes visible. Idempotent."""
        if self._done:
            return
        self._done = True
        self._cleanup()

    def __enter__(self) -> OneFileCommit:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.commit()
        else:
            self.abort()


__all__ = ["OneFileCommit"]
