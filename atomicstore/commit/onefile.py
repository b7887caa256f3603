"""Committing a checkpoint that is one file (flax's legacy layout: ``<prefix><step>``).

A one-file checkpoint has no room for a manifest or a marker, so the file itself
appearing under its name is the commit point:

* rename backends (POSIX, memory): stream into ``.atomicstore/staging/<name>.<attempt>``
  under a lease, fsync it, then ``rename(NOREPLACE)`` onto ``<name>`` (or
  ``RENAME_EXCHANGE`` with an existing one when overwriting), fsync the parent. Staging
  lives in the reserved directory so that flax's own listing never sees it; recovery
  removes it like any staged attempt once its lease is dead.
* object stores: under a lease, stream straight to ``<name>`` as one upload (multipart
  or parallel composite); the object becomes visible in one step when the upload completes, and
  completes only if ``<name>`` is still what the save read when it began: absent
  (``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS), or, for an overwrite, the
  same generation (``If-Match: <etag>``, ``ifGenerationMatch=<generation>``). So of two
  writers exactly one commits. An interrupted upload is invisible; recovery aborts it on
  S3 once no live lease of ``<name>`` remains, GCS expires it.
* on object stores the commit request is made under the name's claim
  (``commit/claim.py``): under it the writer checks that the name holds no
  directory-layout checkpoint (whose commit point is another key, the marker, which a
  native save of the same name writes under the same claim) and that the object is still
  at the generation the save began with, then completes. So a one-file and a native save
  of one name never both commit, and racing completions of one key never both win even
  where a store lets racing conditional completions all succeed (SeaweedFS) or ignores
  ``If-Match`` at completion (moto).

``docs/commit-protocol.md`` ("One-file checkpoints") walks each step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
from types import TracebackType

from ..drivers.parts import BufferedPartWriter
from ..errors import (
    AlreadyExistsError,
    CommitConflictError,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    TransactionError,
)
from . import conformance
from .claim import CLAIMS, ClaimHolder, NameClaim, claim_key, parse_claim_key, read_claim
from .context import CommitContext
from .names import validate_name
from .strategies import STAGING, new_attempt_id
from .transaction import require_owner

log = logging.getLogger("atomicstore.commit")

class OneFileCommit:
    """Stream one file and commit it atomically as ``name`` (a context manager).

    ``write`` accepts ``crc32c=`` like :class:`~atomicstore.TransactionFile` (ignored:
    a one-file checkpoint carries no manifest). Leaving the block normally commits;
    an exception discards everything. Raises :class:`~atomicstore.CommitConflictError`
    if ``name`` exists and ``overwrite`` is False (also when another writer wins), and
    when overwriting, if ``name`` changed since this commit began (compare-and-swap on
    the generation read then). A lease protects the save from recovery on every backend.
    On an object store the commit request is made under the name's claim (see the module docstring): it may wait
    while another live writer commits the same name, and raises
    :class:`~atomicstore.StorageTimeoutError` if that writer holds the claim longer than
    its lease's ttl + grace + one request's retry deadline.
    """

    def __init__(self, context: CommitContext, name: str, *, overwrite: bool = False) -> None:
        validate_name(name)
        if not isinstance(overwrite, bool):
            raise InvalidArgumentError("overwrite must be a bool")
        #: the store's driver, strategy, writer and times (built once by the Store)
        self.context = context
        self.name, self.overwrite = name, overwrite
        #: the process that began the commit: only it may write, commit or abort it
        self.pid = os.getpid()
        self.attempt = new_attempt_id()
        self.bytes_written = 0
        #: once committed: the generation of the file this commit made visible (its own,
        #: whatever replaced it since), or None where the backend did not say
        self.generation: str | None = None
        self._done = False
        d = context.driver
        # (Store.one_file checks too; this covers a OneFileCommit built directly)
        conformance.ensure(d, conformance.ONE_FILE)
        self.staged = d.capabilities.atomic_rename
        if not overwrite and d.exists(name):
            raise self._conflict()
        #: the generation an overwrite replaces (None: nothing may be there)
        self.expected = self._generation() if overwrite else None
        #: the claim the commit request is made under (None: the backend renames, or
        #: cannot create exclusively at all)
        self._lease = context.lease(name, self.attempt)
        self._claim = None if self.staged else context.claim(self._lease, "one-file")
        #: the refusal found under the claim when the name holds a directory-layout checkpoint
        self._layout_error: AlreadyExistsError | None = None
        self._hooked = False
        #: the checks under the claim passed: the commit request is (about to be) sent
        self._requested = False
        self._lease.acquire()
        try:
            if self.staged:
                self.key = f"{STAGING}/{name}.{self.attempt}"
                self._w = d.open_writer(self.key)
            else:  # the upload's completion is the commit point, conditional on what was read
                self.key = name
                self._w = d.open_writer(name, exclusive=self.expected is None,
                                        if_generation=self.expected)
                if self._claim is not None and isinstance(self._w, BufferedPartWriter):
                    # taken by the writer right before its commit request
                    self._w.before_complete = self._before_complete
                    self._hooked = True
        except BaseException:
            self._lease.release()
            raise

    def _check_owner(self, what: str) -> None:
        require_owner(self.pid, f"{what} {self.name!r}")

    def _before_complete(self) -> None:
        """Right before the commit request: take the claim and check the lease. The first
        try of the claim and the lease check go out together; a writer that had to wait
        for the claim checks its lease again once it holds it (it may have been declared
        dead meanwhile)."""
        claim = self._claim
        assert claim is not None
        claim.start()
        self._lease.check()  # (on an error the commit releases the claim, landed or not)
        if claim.hold():  # it waited: declared dead meanwhile?
            self._lease.check()
        # Under the claim no other writer of this name sends its commit request, so what
        # the name holds now is what the completion's precondition is evaluated against:
        # check it here as well. A store that ignores If-Match or If-None-Match on a
        # completion (moto 5.2.5 ignores If-Match there; the conformance check tests only
        # put-if-absent completion within its budget) then still gives one winner per
        # generation. And a native save of this name commits its marker under the same
        # claim: a marker there now is refused (the layouts cannot be swapped).
        # (+2 HEADs per one-file save, sent together.)
        strategy = self.context.strategy
        native = self.context.driver.background(lambda: strategy.has_checkpoint(self.name))
        try:
            generation = self._generation()
        finally:
            found = strategy.has_checkpoint(self.name) if native.cancel() else native.result()
        if found:
            self._layout_error = strategy.one_file_over_native(self.name)
            raise self._layout_error
        if generation != self.expected:
            raise AlreadyExistsError(f"{self.context.driver.describe(self.name)} changed since the save began")
        claim.confirm()  # not paused past the lease since its check (no request)
        self._requested = True

    def _generation(self) -> str | None:
        try:
            return self.context.driver.info(self.name).generation
        except NotFoundError:
            return None

    def _conflict(self) -> CommitConflictError:
        return CommitConflictError(
            f"checkpoint {self.context.driver.describe(self.name)} already exists"
            + (" (it changed since this overwrite began)" if self.overwrite else ""),
            name=self.name,
        )

    #: ``write`` takes ``borrow=True``: upload straight from ``data``, which the caller
    #: leaves unchanged until the commit or abort
    accepts_borrowed = True

    def write(
        self, data: bytes | bytearray | memoryview, *, crc32c: int | None = None, borrow: bool = False
    ) -> int:
        """Append ``data`` to the file."""
        self._check_owner("write to")
        if self._done:
            raise TransactionError(f"{self.name!r} is already committed or aborted")
        if borrow:
            self._w.write_borrowed(memoryview(data).cast("B"))
        else:
            self._w.write(data)
        n = memoryview(data).nbytes
        self.bytes_written += n
        return n

    def commit(self) -> None:
        """Close the file and make it visible under its name (the commit point)."""
        self._check_owner("commit")
        if self._done:
            raise TransactionError(f"{self.name!r} is already committed or aborted")
        self._done = True
        try:
            generation, replaced = self._complete()
        except LeaseLostError:  # (a CommitConflictError: caught first)
            self._cleanup()
            raise
        except AlreadyExistsError:
            self._cleanup()
            if self._layout_error is not None:
                raise self._layout_error from None
            raise self._conflict() from None
        except NotFoundError:
            self._on_vanished()
            raise
        except BaseException:
            self._on_failure()
            raise
        self._finish(generation, replaced)

    def _complete(self) -> tuple[str | None, bool]:
        """The commit point, by staging rename, by a conditional upload, or under the
        name's claim: (the file's generation, whether it replaced an older file)."""
        if self.staged:
            self._w.close()  # durable (fsync)
            self._lease.check()
            generation = self.context.driver.info(self.key).generation  # (rename and exchange keep it)
            return generation, self._swap_in()
        if self._claim is None:
            self._lease.check()
            self._w.close()  # the upload completes, if the precondition holds
            return self._w.generation, False
        return self._complete_claimed(self._claim), False

    def _complete_claimed(self, claim: NameClaim) -> str | None:
        """Complete the upload under the name's claim; the file's generation."""
        try:
            if not self._hooked:
                self._before_complete()
            self._w.close()  # (the claim is taken right before the completing request)
        except AlreadyExistsError:
            claim.release()  # refused: nothing of ours can land any more
            raise
        except BaseException:
            if not self._requested:  # (else it stays with the lease: below)
                claim.release()
            raise
        claim.release()
        return self._w.generation

    def _on_vanished(self) -> None:
        """The commit found its file gone (NotFoundError)."""
        if self.staged:  # the staged file vanished: recovery claimed it, fencing our lease
            try:
                self._lease.check()  # LeaseLostError, the real reason
            finally:
                self._cleanup()

    def _on_failure(self) -> None:
        """Any other error of the commit: clean up what is provably not landing."""
        if self.staged:
            self._lease.stop()  # ambiguous: recovery waits for the lease to expire
        elif self._requested:
            # The commit request was sent and may still land (a timeout, a lost reply
            # then no more retries): abort the upload (a completion that comes after it
            # fails), and keep the lease and the claim, so that no other save of the
            # name checks and commits before the lease is dead (ttl + grace).
            with contextlib.suppress(Exception):
                self._w.abort()
            self._lease.stop()
        else:
            self._cleanup()  # an unfinished upload is invisible: abort it

    def _finish(self, generation: str | None, replaced: bool) -> None:
        """After the commit point: drop the replaced file, release the lease."""
        d = self.context.driver
        self.generation = generation
        if replaced:  # the old file now sits at the staging key
            try:
                d.delete(self.key)
            except Exception as exc:  # noqa: BLE001 - recovery removes it later
                log.warning("could not remove the replaced %s: %s", d.describe(self.key), exc)
        self._lease.release()
        log.info("committed %s (%d bytes)", d.describe(self.name), self.bytes_written)

    def _swap_in(self) -> bool:
        """Rename the staged file onto its name (the commit point); True if it replaced
        an older file, which then sits at the staging key."""
        d = self.context.driver
        if not self.overwrite:
            d.rename(self.key, self.name)  # refuses an existing name atomically
        else:
            with d.lock():  # compare-and-swap: nobody overwrites or deletes in between
                if self._generation() != self.expected:
                    raise AlreadyExistsError(f"{self.name} changed since it was read")
                if self.expected is None:
                    d.rename(self.key, self.name)
                else:
                    d.exchange(self.key, self.name)
        if d.capabilities.durable_fsync:
            d.fsync_dir(posixpath.dirname(self.name))
        return self.expected is not None

    def _cleanup(self) -> None:
        self._w.abort()
        if self.staged:
            try:
                self.context.driver.delete(self.key)
            except Exception:  # noqa: BLE001 - recovery removes it later
                pass
        self._lease.release()

    def abort(self) -> None:
        """Discard what was written; nothing becomes visible. Idempotent. A no-op once
        :meth:`commit` was called, also while that commit still runs in another thread:
        the file's completion is the commit point, and a commit request already sent may
        land whatever an abort does (:meth:`commit` tells the outcome)."""
        self._check_owner("abort")
        if self._done:
            return
        self._done = True
        self._cleanup()

    def __enter__(self) -> OneFileCommit:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if os.getpid() != self.pid:  # a forked child: storage is the parent's, left alone
            if et is None:
                self._check_owner("commit")
            return
        if et is None:
            self.commit()
        else:
            self.abort()


# (the claim helpers moved to commit/claim.py; still importable from here)
__all__ = ["CLAIMS", "ClaimHolder", "OneFileCommit", "claim_key", "parse_claim_key", "read_claim"]
