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
* where racing conditional completions of one key are not known to be exclusive
  (``Capabilities.exclusive_completion`` false, i.e. S3: SeaweedFS lets several racing
  completions win), the commit request is made under a claim: right before it, the
  writer creates ``.atomicstore/claims/<name>.json`` with one conditional PUT (exclusive
  on every store measured) and deletes it, at the generation it wrote, once the request
  answered. A writer that finds the claim held waits while the holder's lease is alive;
  once that lease is dead or gone it removes the lease (at the generation read: a holder
  that was only paused then fails its lease check) and takes the claim over (a PUT
  conditional on the claim's generation: one successor wins). The commit request stays
  conditional: the claim only keeps two of them from racing.

``docs/commit-protocol.md`` ("One-file checkpoints") walks each step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import posixpath
import time
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from ..drivers.base import BufferedPartWriter, Driver, FileInfo
from ..errors import (
    AlreadyExistsError,
    CommitConflictError,
    CorruptionError,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    PreconditionFailedError,
    StorageTimeoutError,
    TransactionError,
)
from . import conformance
from .lease import Lease, lease_key, read_lease_ttl
from .names import ATTEMPT_ID, RESERVED_DIR, validate_name
from .strategies import STAGING, new_attempt_id
from .transaction import require_owner

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("atomicstore.commit")

#: where a one-file commit holds its claim while its commit request is in flight, on
#: backends whose conditional upload completions are not known to be exclusive
CLAIMS = f"{RESERVED_DIR}/claims"
#: a claim is a small JSON document: anything longer is not one of atomicstore's
MAX_CLAIM_BYTES = 4096
#: first and longest pause between two looks at a claim held by a live writer (seconds)
CLAIM_POLL = (0.02, 0.5)


def claim_key(name: str) -> str:
    """The key of the claim of the one-file checkpoint ``name``."""
    return f"{CLAIMS}/{name}.json"


def parse_claim_key(key: str) -> str | None:
    """The checkpoint name of a claim key, or None if ``key`` is not one."""
    if not key.startswith(CLAIMS + "/") or not key.endswith(".json"):
        return None
    name = key[len(CLAIMS) + 1 : -len(".json")]
    try:
        return validate_name(name)
    except InvalidArgumentError:
        return None


@dataclass(frozen=True)
class ClaimHolder:
    """What a claim says about the writer holding it (read from storage, validated:
    ``attempt`` is None when the claim is not a readable claim of atomicstore's)."""

    attempt: str | None
    writer: str = ""
    ttl: float | None = None


def read_claim(driver: Driver, key: str, generation: str | None) -> ClaimHolder:
    """The holder named by the claim ``key`` at ``generation`` (hostile input: a malformed
    claim names no attempt). :class:`NotFoundError` if it is gone,
    :class:`PreconditionFailedError` if it changed."""
    raw = driver.read_if(key, generation) if generation else driver.read(key, 0, MAX_CLAIM_BYTES + 1)
    try:
        if len(raw) > MAX_CLAIM_BYTES:
            raise ValueError(f"{len(raw)} bytes")
        doc = json.loads(raw.decode())
        attempt, writer, ttl = doc["attempt"], doc.get("writer", ""), doc.get("ttl")
        if not (isinstance(attempt, str) and ATTEMPT_ID.fullmatch(attempt) and isinstance(writer, str)):
            raise ValueError("no attempt id")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)
                                or not 0 < ttl < 7 * 86400):
            ttl = None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
        log.warning("%s is not a claim of atomicstore's (%s)", driver.describe(key), exc)
        return ClaimHolder(None)
    return ClaimHolder(attempt, writer[:200], None if ttl is None else float(ttl))


class _Claim:
    """The claim of one one-file commit: taken right before its commit request, released
    right after it answered (see the module docstring)."""

    def __init__(self, commit: OneFileCommit) -> None:
        store = commit.store
        self.commit = commit
        self.driver = store.driver
        self.key = claim_key(commit.name)
        self.doc = json.dumps({"name": commit.name, "attempt": commit.attempt, "writer": store.writer_id,
                               "expected": commit.expected, "ttl": store.lease_ttl}).encode()
        self.held = False
        self.generation: str | None = None
        #: lease key -> its ttl (a lease's ttl never changes)
        self._ttls: dict[str, float] = {}
        #: claim generation -> its holder (a generation never comes back with other bytes)
        self._holders: dict[str, ClaimHolder] = {}

    def _holder_lease(self, holder: ClaimHolder) -> tuple[bool, float, FileInfo | None]:
        """(alive, ttl, info) of the holder's lease, read now: alive while it was renewed
        less than its ttl + grace ago (by the storage's clock, as recovery judges it);
        info None if it is gone."""
        store, d = self.commit.store, self.driver
        if holder.attempt is None:
            return False, store.lease_ttl, None
        key = lease_key(self.commit.name, holder.attempt)
        try:
            info = d.info(key)
            if key not in self._ttls:
                try:
                    self._ttls[key] = read_lease_ttl(d, key)
                except CorruptionError:
                    self._ttls[key] = 0.0
        except NotFoundError:
            return False, store.lease_ttl, None
        ttl, now = self._ttls[key], store.clock()
        mtime = info.mtime if info.mtime is not None else now
        return mtime + ttl + store.grace > now, ttl, info

    def _fence(self, lease: FileInfo | None) -> bool:
        """Remove a dead holder's lease at the generation read (as recovery fences one),
        so that a holder that was only paused fails its lease check; False if it was
        renewed meanwhile (then it is alive)."""
        if lease is None:
            return True
        try:
            self.driver.delete(lease.key, if_generation=lease.generation)
        except PreconditionFailedError:
            return False
        return True

    def _put(self, if_generation: str | None) -> bool:
        """Create the claim (or, at ``if_generation``, take it over); False if refused."""
        try:
            gen = self.driver.put(self.key, self.doc, exclusive=if_generation is None,
                                  if_generation=if_generation)
        except AlreadyExistsError:  # (PreconditionFailedError too) ours, if its reply was lost: looked at next
            return False
        self.held, self.generation = True, gen
        return True

    def try_take(self) -> bool:
        """One try: create the claim; False if it exists (held, or ours if a reply was
        lost: :meth:`take` finds out)."""
        return self._put(None)

    def take(self, *, tried: bool = False) -> None:
        """Hold the claim: create it; if another writer holds it, wait while that writer's
        lease is alive; once the lease is dead or gone, remove the lease (fencing a holder
        that was only paused) and take the claim over.
        :class:`StorageTimeoutError` if a live holder keeps it longer than its lease's
        ttl + grace + the retry deadline of one request. ``tried``: :meth:`try_take` was
        refused just now."""
        store, d = self.commit.store, self.driver
        delay = CLAIM_POLL[0]
        waiting_on: str | None = ""
        since = time.monotonic()
        if not tried and self._put(None):
            return
        while True:
            try:
                info = d.info(self.key)
                gen = info.generation
                holder = self._holders.get(gen) if gen else None
                if holder is None:
                    holder = read_claim(d, self.key, gen)
            except NotFoundError:  # released meanwhile
                if self._put(None):
                    return
                continue
            except PreconditionFailedError:  # replaced meanwhile
                continue
            if gen:
                self._holders[gen] = holder
            if holder.attempt == self.commit.attempt:  # our own PUT, its reply lost
                self.held, self.generation = True, info.generation
                return
            alive, ttl, lease = self._holder_lease(holder)
            if not alive:
                if self._fence(lease) and self._put(info.generation):
                    log.warning("took over the claim of %s from attempt %s (writer %r), whose lease is "
                                "dead or gone", d.describe(self.commit.name), holder.attempt, holder.writer)
                    return
                continue
            if gen != waiting_on:
                waiting_on, since = gen, time.monotonic()
            limit = ttl + store.grace + (d.retry.deadline if d.retry.deadline is not None else math.inf)
            if time.monotonic() - since > limit:
                raise StorageTimeoutError(
                    f"commit of {d.describe(self.commit.name)}: attempt {holder.attempt} (writer "
                    f"{holder.writer!r}) has held its claim {d.describe(self.key)} for more than "
                    f"{limit:.0f}s while its lease stays alive; nothing was committed")
            time.sleep(delay)
            delay = min(2 * delay, CLAIM_POLL[1])

    def release(self) -> None:
        """Delete the claim, at the generation this writer wrote (a successor that took it
        over keeps it). Best effort: recovery removes a claim left behind."""
        if not self.held:
            return
        self.held = False
        try:
            self.driver.delete(self.key, if_generation=self.generation)
        except PreconditionFailedError:
            log.warning("the claim %s was taken over before it was released", self.driver.describe(self.key))
        except Exception as exc:  # noqa: BLE001 - recovery removes it later
            log.warning("could not release the claim %s: %s", self.driver.describe(self.key), exc)


class OneFileCommit:
    """Stream one file and commit it atomically as ``name`` (a context manager).

    ``write`` accepts ``crc32c=`` like :class:`~atomicstore.TransactionFile` (ignored:
    a one-file checkpoint carries no manifest). Leaving the block normally commits;
    an exception discards everything. Raises :class:`~atomicstore.CommitConflictError`
    if ``name`` exists and ``overwrite`` is False (also when another writer wins), and
    when overwriting, if ``name`` changed since this commit began (compare-and-swap on
    the generation read then). A lease protects the save from recovery on every backend.
    On a backend whose conditional upload completions are not known to be exclusive (S3)
    the commit request is made under a claim (see the module docstring): it may wait
    while another live writer commits the same name, and raises
    :class:`~atomicstore.StorageTimeoutError` if that writer holds the claim longer than
    its lease's ttl + grace + one request's retry deadline.
    """

    def __init__(self, store: Store, name: str, *, overwrite: bool = False) -> None:
        validate_name(name)
        if not isinstance(overwrite, bool):
            raise InvalidArgumentError("overwrite must be a bool")
        self.store, self.name, self.overwrite = store, name, overwrite
        #: the process that began the commit: only it may write, commit or abort it
        self.pid = os.getpid()
        self.attempt = new_attempt_id()
        self.bytes_written = 0
        #: once committed: the generation of the file this commit made visible (its own,
        #: whatever replaced it since), or None where the backend did not say
        self.generation: str | None = None
        self._done = False
        d = store.driver
        # (Store.one_file checks too; this covers a OneFileCommit built directly)
        conformance.ensure(d, conformance.ONE_FILE)
        self.staged = d.capabilities.atomic_rename
        if not overwrite and d.exists(name):
            raise self._conflict()
        #: the generation an overwrite replaces (None: nothing may be there)
        self.expected = self._generation() if overwrite else None
        caps = d.capabilities
        #: the claim the commit request is made under (None: the backend decides racing
        #: completions exclusively, or renames, or cannot create exclusively at all)
        self._claim = _Claim(self) if (
            not self.staged and caps.atomic_create and not caps.exclusive_completion) else None
        self._hooked = False
        self._lease = Lease(d, name, self.attempt, store.writer_id, store.lease_ttl, store.clock)
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
        first = self.store.driver.background(claim.try_take)
        try:
            self._lease.check()
        except BaseException:
            with contextlib.suppress(Exception):
                first.result()  # (landed or not: then the commit releases it)
            raise
        if not first.result():
            claim.take(tried=True)
            self._lease.check()
        # Under the claim no other one-file writer completes, so what the name holds now is
        # what the completion's precondition is evaluated against: check it here as well. A
        # store that ignores If-Match or If-None-Match on a completion (moto 5.2.5 ignores
        # If-Match there; the conformance check tests only put-if-absent completion within its
        # budget) then still gives one winner per generation. (+1 HEAD per one-file save.)
        if self._generation() != self.expected:
            raise AlreadyExistsError(f"{self.store.driver.describe(self.name)} changed since the save began")

    def _generation(self) -> str | None:
        try:
            return self.store.driver.info(self.name).generation
        except NotFoundError:
            return None

    def _conflict(self) -> CommitConflictError:
        return CommitConflictError(
            f"checkpoint {self.store.driver.describe(self.name)} already exists"
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
        d = self.store.driver
        replaced = False
        try:
            if self.staged:
                self._w.close()  # durable (fsync)
                self._lease.check()
                generation = d.info(self.key).generation  # (rename and exchange keep it)
                replaced = self._swap_in()
            elif self._claim is None:
                self._lease.check()
                self._w.close()  # the upload completes, if the precondition holds
                generation = self._w.generation
            else:
                try:
                    if not self._hooked:
                        self._before_complete()
                    self._w.close()  # (the claim is taken right before the completing request)
                finally:
                    self._claim.release()
                generation = self._w.generation
        except LeaseLostError:  # (a CommitConflictError: caught first)
            self._cleanup()
            raise
        except AlreadyExistsError:
            self._cleanup()
            raise self._conflict() from None
        except NotFoundError:
            if self.staged:  # the staged file vanished: recovery claimed it, fencing our lease
                try:
                    self._lease.check()  # LeaseLostError, the real reason
                finally:
                    self._cleanup()
            raise
        except BaseException:
            if self.staged:
                self._lease.stop()  # ambiguous: recovery waits for the lease to expire
            else:
                self._cleanup()  # an unfinished upload is invisible: abort it
            raise
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
        d = self.store.driver
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
                self.store.driver.delete(self.key)
            except Exception:  # noqa: BLE001 - recovery removes it later
                pass
        self._lease.release()

    def abort(self) -> None:
        """Discard what was written; nothing becomes visible. Idempotent."""
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


__all__ = ["CLAIMS", "ClaimHolder", "OneFileCommit", "claim_key", "parse_claim_key", "read_claim"]
