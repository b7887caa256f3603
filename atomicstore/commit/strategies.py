"""The two commit strategies, one small class each behind one protocol.

:class:`RenameStrategy` for backends whose driver declares ``atomic_rename`` (POSIX,
memory); :class:`MarkerStrategy` for the others (object stores). ``docs/commit-protocol.md``
walks every step of both and what a crash at that step leaves behind.

Layout below the store root::

    rename:  <name>/                      committed: files + manifest.json
             .atomicstore/staging/<name>.<attempt>/   in flight
             .atomicstore/trash/<name>.<attempt>/     being deleted
    marker:  <name>/commit_success.txt    the commit point (names the attempt)
             <name>/attempt-<attempt>/    files + manifest.json of one attempt
"""

from __future__ import annotations

import logging
import posixpath
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future

from ..drivers.spec import Driver
from ..errors import (
    AlreadyExistsError,
    CommitConflictError,
    CommitOutcomeUnknownError,
    CorruptionError,
    LeaseLostError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)
from .claim import NameClaim
from .manifest import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Manifest, Marker, sha256
from .names import ATTEMPT_PREFIX as ATTEMPT_PREFIX
from .names import MANIFEST_FILE, MARKER_FILE, RESERVED_DIR, validate_name

log = logging.getLogger("atomicstore.commit")

STAGING = f"{RESERVED_DIR}/staging"
TRASH = f"{RESERVED_DIR}/trash"


def new_attempt_id() -> str:
    """A unique, time-ordered id for one commit attempt."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(6)


class CommitStrategy(ABC):
    """How files staged under one attempt become one committed checkpoint.

    A committed checkpoint's *generation* is the id of the attempt it holds (or, for one
    whose manifest or marker is unreadable, ``unreadable:<digest>``): overwrites and
    deletes are compare-and-swap operations on the generation their caller read.
    """

    #: short name shown in reprs and docs
    kind: str

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    @abstractmethod
    def begin(self, name: str, attempt: str, *, overwrite: bool = False) -> str:
        """Prepare an attempt; return the key prefix its files are written under.
        Raises :class:`CommitConflictError` early if ``name`` is already committed (unless
        ``overwrite``)."""

    @abstractmethod
    def current(self, name: str) -> str | None:
        """The generation of committed ``name``, read afresh; None if it is not committed."""

    @abstractmethod
    def publish(
        self, name: str, attempt: str, writer: str, manifest: bytes, *, overwrite: bool = False,
        expected: str | None = None, check: Callable[[], None] | None = None,
        claim: NameClaim | None = None,
    ) -> None:
        """Write the manifest and make the attempt the committed ``name`` (the commit
        point). Raises :class:`CommitConflictError` if another attempt won. With
        ``overwrite``, the checkpoint of generation ``expected`` (None: no checkpoint) is
        replaced in the same atomic step, and its data removed afterwards; if ``name`` is
        at another generation by then, :class:`CommitConflictError`. ``check`` (the
        writer's lease check) runs after everything is written and made durable, right
        before the commit point: nothing this attempt writes comes after it. ``claim`` (the
        name's claim, on object stores: ``commit/claim.py``) is held around the commit
        point; the rename strategy needs none (a directory and a file cannot share a
        name there)."""

    @abstractmethod
    def attempt_prefix(self, name: str, attempt: str) -> str:
        """Where the files of an attempt are staged."""

    @abstractmethod
    def discard(self, name: str, attempt: str) -> None:
        """Remove the data of an uncommitted attempt (best effort)."""

    @abstractmethod
    def resolve(self, name: str) -> tuple[str, bytes]:
        """(data prefix, manifest bytes) of committed ``name``; :class:`NotFoundError`
        if it is not committed."""

    @abstractmethod
    def list(self) -> list[str]:
        """Names of committed checkpoints (unsorted)."""

    def committed(self) -> dict[str, str | None]:
        """Committed names, each with the storage generation of its commit point as the
        same listing saw it (None where a listing does not give one cheaply). A
        generation names one commit point forever: see :meth:`resolve_at`."""
        return dict.fromkeys(self.list())

    def resolve_at(self, name: str, generation: str) -> tuple[str, bytes]:
        """Like :meth:`resolve`, but only if the commit point of ``name`` is still at
        ``generation`` (:class:`PreconditionFailedError` otherwise, :class:`NotFoundError`
        if it is gone), read in the same request as the commit point itself."""
        raise PreconditionFailedError(f"{self.driver.describe(name)}: no generations on this backend")

    @abstractmethod
    def unpublish(self, name: str, *, if_generation: str | None = None) -> None:
        """Delete ``name``: remove the commit point first, then the data. Only the
        generation read when the delete starts (or ``if_generation``) is removed: a newer
        checkpoint of the same name is never deleted (:class:`PreconditionFailedError`)."""

    def _cleanup(self, prefix: str) -> None:
        """Remove a replaced checkpoint's data after a commit: a failure here must not
        make a commit that happened look failed (recovery removes what is left)."""
        try:
            self.driver.delete_tree(prefix)
        except Exception as exc:  # noqa: BLE001 - logged; recovery removes it
            log.warning("committed, but could not remove the replaced data %s: %s",
                        self.driver.describe(prefix), exc)

    def is_file(self, name: str) -> bool:
        """Whether ``name`` itself is a single file/object (a one-file checkpoint, such as
        flax's, lives there); a directory or a prefix is not."""
        try:
            self.driver.info(name)
        except NotFoundError:
            return False
        return True

    def has_checkpoint(self, name: str) -> bool:
        """Whether a directory-layout checkpoint is committed as ``name`` (what a one-file
        save must not land on: :meth:`one_file_over_native`)."""
        return self.current(name) is not None

    def native_over_one_file(self, name: str) -> AlreadyExistsError:
        """The refusal to save a directory-layout checkpoint as ``name``, which holds a
        single file: the two layouts cannot be swapped in one atomic step (and a marker
        committed beside the object would leave two checkpoints under one name)."""
        return AlreadyExistsError(
            f"{self.driver.describe(name)} holds a single-file checkpoint (flax's layout, or "
            "another single file): a directory-layout checkpoint cannot replace it, because the "
            "two layouts cannot be swapped atomically; delete it first or save under another name"
        )

    def one_file_over_native(self, name: str) -> AlreadyExistsError:
        """The refusal to save a one-file checkpoint as ``name``, which holds a committed
        directory-layout checkpoint (the converse of :meth:`native_over_one_file`)."""
        return AlreadyExistsError(
            f"{self.driver.describe(name)} holds a directory-layout checkpoint: a single-file "
            "(flax) checkpoint cannot replace it, because the two layouts cannot be swapped "
            "atomically; delete it first or save under another name"
        )

    def _conflict(self, name: str, winner: str | None = None) -> CommitConflictError:
        return CommitConflictError(
            f"checkpoint {self.driver.describe(name)} was committed by another writer"
            + (f" ({winner})" if winner else ""),
            name=name,
            winner=winner,
        )

    def _changed(self, name: str, expected: str | None, found: str | None) -> PreconditionFailedError:
        return PreconditionFailedError(
            f"checkpoint {self.driver.describe(name)} changed since it was read "
            f"(expected {expected or 'none'}, found {found or 'none'})"
        )


def read_capped(driver: Driver, key: str, limit: int) -> bytes:
    """``key``, but at most ``limit + 1`` bytes of it: a marker or manifest read from
    storage is hostile input, and one over its limit is refused by its parser
    (:class:`CorruptionError`) without ever being read whole."""
    return driver.read(key, 0, limit + 1)


def _unreadable(raw: bytes) -> str:
    return f"unreadable:{sha256(raw)[:16]}"


def _parent_dirs(paths: list[str]) -> list[str]:
    """Every directory that holds one of ``paths``, deepest first ('' excluded)."""
    dirs: set[str] = set()
    for p in paths:
        d = posixpath.dirname(p)
        while d:
            dirs.add(d)
            d = posixpath.dirname(d)
    return sorted(dirs, key=lambda d: (-d.count("/"), d))


class RenameStrategy(CommitStrategy):
    """Stage in a sibling directory, fsync everything, rename onto the final name.

    A plain commit is one ``rename(NOREPLACE)``. Overwrites and deletes compare the
    generation and swap under the driver's store lock (``flock`` on POSIX), so that a
    concurrent overwrite or delete cannot slip in between the comparison and the rename.
    """

    kind = "rename"

    def attempt_prefix(self, name: str, attempt: str) -> str:
        return f"{STAGING}/{name}.{attempt}"

    _staging = attempt_prefix

    def begin(self, name: str, attempt: str, *, overwrite: bool = False) -> str:
        if self.driver.exists(name) and not self.empty_dir(name):
            if self.current(name) is None:
                if self.is_file(name):
                    raise self.native_over_one_file(name)
                raise self._not_a_checkpoint(name)
            if not overwrite:
                raise self._conflict(name)
            if not self.driver.capabilities.replaces_directories:
                raise StorageError(
                    f"cannot replace {self.driver.describe(name)} atomically: this filesystem "
                    "lacks renameat2(RENAME_EXCHANGE) (NFS, FUSE); delete the checkpoint, then save it"
                )
        return self._staging(name, attempt)  # created by the first file written into it

    def current(self, name: str) -> str | None:
        try:
            raw = read_capped(self.driver, f"{name}/{MANIFEST_FILE}", MAX_MANIFEST_BYTES)
        except NotFoundError:
            return None
        try:
            return Manifest.from_bytes(raw, where=name).attempt
        except CorruptionError:
            return _unreadable(raw)

    def publish(
        self, name: str, attempt: str, writer: str, manifest: bytes, *, overwrite: bool = False,
        expected: str | None = None, check: Callable[[], None] | None = None,
        claim: NameClaim | None = None,
    ) -> None:
        d = self.driver
        staging = self._staging(name, attempt)
        try:
            w = d.open_writer(f"{staging}/{MANIFEST_FILE}")
            try:
                w.write(manifest)
                w.close()  # fsync of the manifest
            except BaseException:
                w.abort()
                raise
            if d.capabilities.durable_fsync:
                files = list(Manifest.from_bytes(manifest, where="staged manifest").files)
                for sub in _parent_dirs(files):
                    d.fsync_dir(f"{staging}/{sub}")
                d.fsync_dir(staging)
            replaced = False
            if not overwrite:
                if check:
                    check()
                try:
                    d.rename(staging, name)  # the commit point (fails if recovery claimed staging)
                except AlreadyExistsError:
                    with d.lock():  # an empty directory (a user's mkdir) is taken over
                        if not self.empty_dir(name):
                            raise
                        replaced = self._take_over_empty(staging, name)
            else:
                if check:  # (outside the store lock: a lease renewal takes it on POSIX)
                    check()
                with d.lock():  # nobody else deletes or overwrites in between
                    found = self.current(name)
                    if found != expected:
                        raise AlreadyExistsError(f"{name}: generation {found}, expected {expected}")
                    if expected is None and self.empty_dir(name):
                        replaced = self._take_over_empty(staging, name)
                    elif expected is None:
                        d.rename(staging, name)  # the commit point
                    else:
                        d.exchange(staging, name)  # the commit point of an overwrite
                        replaced = True
        except LeaseLostError:
            self.discard(name, attempt)
            raise
        except AlreadyExistsError:
            self.discard(name, attempt)
            raise self._conflict(name) from None
        except NotFoundError:
            # the staging directory vanished: recovery claimed it, having fenced our lease
            self.discard(name, attempt)
            if check:
                check()  # LeaseLostError, the real reason
            raise
        except BaseException:
            self.discard(name, attempt)
            raise
        # Committed. A failure below leaves a committed (maybe not yet durable) checkpoint.
        if d.capabilities.durable_fsync:
            # Make the new entry durable. (The staging directory's entry was never made
            # durable, so its removal needs no fsync: the POSIX model in tests/crashsim.py
            # shows that an fsync of the staging parent here changes no crash state.)
            d.fsync_dir("")
        if replaced:  # the replaced checkpoint now sits at the staging name
            self._cleanup(staging)

    def _not_a_checkpoint(self, name: str) -> AlreadyExistsError:
        """The refusal to write over ``name``, which exists and is no checkpoint: a file,
        or a directory of someone else's files (a stock DCP or Orbax checkpoint, a user's
        run directory), named with what it holds."""
        d = self.driver
        held = sorted(e.name + ("/" if e.is_dir else "") for e in d.listdir(name))
        what = (f"a directory holding {', '.join(held[:5])}" + (f" and {len(held) - 5} more" if len(held) > 5 else "")
                if held else "a file")
        return AlreadyExistsError(
            f"{d.describe(name)} exists and is not a checkpoint ({what}): atomicstore replaces only "
            "checkpoints it committed; remove it or save under another name"
        )

    def empty_dir(self, name: str) -> bool:
        """Whether ``name`` is an empty directory (made by a user's ``mkdir``,
        ``tempfile.mkdtemp`` or ``TemporaryDirectory``): never a checkpoint (a committed
        one holds its manifest), so a commit takes it over (:meth:`_take_over_empty`).
        A file never is one, though a driver may list nothing below it (memory): it may be
        a one-file checkpoint."""
        d = self.driver
        return (d.capabilities.directories and d.exists(name) and not d.find(name)
                and not d.listdir(name) and not self.is_file(name))

    def _take_over_empty(self, staging: str, name: str) -> bool:
        """Commit ``staging`` onto the empty directory ``name`` in one atomic step (the
        caller holds the store lock and checked it is empty): the two are exchanged, and
        the empty directory, now at the staging name, is removed after the commit (True).
        Without ``RENAME_EXCHANGE`` the driver's rename is ``rename(2)``, which replaces an
        empty directory atomically (False: nothing left to remove); a filesystem with
        NOREPLACE but not EXCHANGE is refused."""
        d = self.driver
        if d.capabilities.replaces_directories:
            d.exchange(staging, name)  # the commit point
            return True
        try:
            d.rename(staging, name)  # the commit point
        except AlreadyExistsError:
            raise StorageError(
                f"cannot commit onto the empty directory {d.describe(name)} atomically: this "
                "filesystem lacks renameat2(RENAME_EXCHANGE); remove the directory, then save"
            ) from None
        return False

    def discard(self, name: str, attempt: str) -> None:
        try:
            self.driver.delete_tree(self._staging(name, attempt))
        except Exception as exc:  # noqa: BLE001 - recovery removes what is left
            log.warning("could not remove staged %s: %s", name, exc)

    def resolve(self, name: str) -> tuple[str, bytes]:
        try:
            return name, read_capped(self.driver, f"{name}/{MANIFEST_FILE}", MAX_MANIFEST_BYTES)
        except NotFoundError:
            raise NotFoundError(f"no committed checkpoint {self.driver.describe(name)}") from None

    def list(self) -> list[str]:
        out = []
        for e in self.driver.listdir(""):
            if not e.is_dir or e.name.startswith("."):
                continue
            try:
                validate_name(e.name)
            except ValueError:
                continue
            if self.driver.exists(f"{e.name}/{MANIFEST_FILE}"):
                out.append(e.name)
        return out

    def claim(self, prefix: str) -> str | None:
        """Move the tree ``prefix`` into the trash in one atomic step (so that nothing can
        commit it any more) and return its trash prefix; None if it is gone already."""
        d = self.driver
        trash = f"{TRASH}/{posixpath.basename(prefix)}.{secrets.token_hex(4)}"
        d.makedirs(TRASH)
        try:
            d.rename(prefix, trash)
        except NotFoundError:
            return None
        return trash

    def unpublish(self, name: str, *, if_generation: str | None = None) -> None:
        d = self.driver
        with d.lock():
            found = self.current(name)
            if found is None and not d.exists(name):
                raise NotFoundError(f"no committed checkpoint {d.describe(name)}")
            if if_generation is not None and found != if_generation:
                raise self._changed(name, if_generation, found)
            trash = self.claim(name)  # un-publish: the name is gone in one step
            if trash is None:
                raise NotFoundError(f"no committed checkpoint {d.describe(name)}")
            if d.capabilities.durable_fsync:
                d.fsync_dir("")
        d.delete_tree(trash)


class MarkerStrategy(CommitStrategy):
    """Write the attempt's files and manifest, then create the marker conditionally.

    An overwrite replaces the marker with a conditional PUT on the generation (S3 ETag,
    GCS generation) of the marker it read; a delete removes the marker conditionally on
    the generation it read, then the data.
    """

    kind = "marker"

    def attempt_prefix(self, name: str, attempt: str) -> str:
        return f"{name}/{ATTEMPT_PREFIX}{attempt}"

    _prefix = attempt_prefix

    def begin(self, name: str, attempt: str, *, overwrite: bool = False) -> str:
        d = self.driver
        # The object <name> itself (a one-file checkpoint) is checked alongside the marker
        # (and the lease the caller writes meanwhile): both HEADs go out together. Were the
        # background threads all busy, the check is taken back and run here (a caller
        # already on one of them never waits on a queued request).
        one_file = d.background(lambda: self.is_file(name))
        if not overwrite and d.exists(f"{name}/{MARKER_FILE}"):
            one_file.cancel()
            raise self._conflict(name)
        if self.is_file(name) if one_file.cancel() else one_file.result():
            raise self.native_over_one_file(name)
        return self._prefix(name, attempt)

    def has_checkpoint(self, name: str) -> bool:
        return self.driver.exists(f"{name}/{MARKER_FILE}")  # one HEAD

    def marker_state(self, name: str) -> tuple[Marker | None, str | None, str | None]:
        """(marker if readable, its generation, the checkpoint's generation) read afresh;
        (None, None, None) if there is no marker. The object's generation is read first,
        so a conditional write on it fails if the marker changed after the read."""
        key = f"{name}/{MARKER_FILE}"
        try:
            gen = self.driver.info(key).generation
            raw = read_capped(self.driver, key, MAX_MARKER_BYTES)
        except NotFoundError:
            return None, None, None
        try:
            marker = Marker.from_bytes(raw, where=self.driver.describe(key))
        except CorruptionError:
            return None, gen, _unreadable(raw)
        return marker, gen, marker.attempt

    def current(self, name: str) -> str | None:
        return self.marker_state(name)[2]

    def intact(self, name: str, marker: Marker) -> bool:
        """True if the manifest ``marker`` names exists and has its digest."""
        try:
            raw = read_capped(self.driver, f"{self._prefix(name, marker.attempt)}/{MANIFEST_FILE}", MAX_MANIFEST_BYTES)
        except NotFoundError:
            return False
        return sha256(raw) == marker.manifest_sha256

    def publish(
        self, name: str, attempt: str, writer: str, manifest: bytes, *, overwrite: bool = False,
        expected: str | None = None, check: Callable[[], None] | None = None,
        claim: NameClaim | None = None,
    ) -> None:
        d = self.driver
        old: Marker | None = None
        gen: str | None = None  # with it, a compare-and-swap on the marker read
        if overwrite:
            old, gen, found = self.marker_state(name)
            if found != expected:
                self.discard(name, attempt)
                raise self._conflict(name, old.writer if old else None)
        # The name's claim is taken while the manifest is written (one more PUT, no more
        # round trips): a one-file save of this name sends its commit request under the
        # same claim, so the object <name> checked under it cannot appear before our
        # marker does (commit/claim.py).
        if claim is not None:
            claim.start()
        released: Future[None] | None = None
        keep = False
        try:
            self._put_manifest(name, attempt, manifest)
            try:  # before the commit point: on any error the attempt is discarded
                one_file: Future[bool] | None = None
                if claim is not None:
                    claim.hold()  # (held by another writer of this name: waits)
                    one_file = d.background(lambda: self.is_file(name))  # with the lease check
                if check:
                    check()
                if one_file is not None and (self.is_file(name) if one_file.cancel() else one_file.result()):
                    raise self.native_over_one_file(name)
            except BaseException:
                self.discard(name, attempt)
                raise
            if claim is not None:
                claim.confirm()  # not paused past the lease since its check (no request)
            try:
                outcome, written = self._commit_point(name, attempt, writer, manifest, old, gen, check)
            except AlreadyExistsError:
                raise  # refused (or declared dead): nothing of ours can land any more
            except BaseException:
                # The marker PUT may still land (a timeout, a lost reply then no more
                # retries): the claim stays, with the lease the transaction keeps, so no
                # other save of the name checks and commits before the lease is dead
                keep = True
                raise
            if claim is not None:
                released = d.background(claim.release)  # with the check below
            if outcome == "ours":
                self._check_data_still_there(name, attempt, written, old, check)
        finally:
            if claim is not None and not keep:
                if released is None:
                    claim.release()
                else:
                    released.result()
        if old is not None and old.attempt != attempt:
            self._cleanup(self._prefix(name, old.attempt))  # the replaced checkpoint's data

    def _commit_point(self, name: str, attempt: str, writer: str, manifest: bytes, old: Marker | None,
                      gen: str | None, check: Callable[[], None] | None) -> tuple[str, str | None]:
        """Create (or, at ``gen``, replace) the marker: the commit point. Returns
        (outcome, the marker's generation if ours): ``"ours"`` or ``"superseded"``
        (see :meth:`_settle`); raises when another writer won or the outcome is unknown."""
        d = self.driver
        marker = Marker.new(name, attempt, writer, manifest, replaces=old)
        outcome = "ours"
        try:  # the commit point
            written = d.put(f"{name}/{MARKER_FILE}", marker.to_bytes(), exclusive=gen is None,
                            if_generation=gen)
        except AlreadyExistsError:
            # Either another writer won, or our own write was applied and only the reply
            # was lost (the retry was then refused): read it back to know which.
            outcome, written, current = self._settle(name, attempt, check)
            if outcome == "lost":
                self.discard(name, attempt)
                raise self._conflict(name, current.writer if current else None) from None
            if outcome == "unknown":
                self.discard(name, attempt)  # no marker names it now
                raise CommitOutcomeUnknownError(
                    f"{d.describe(name)} was deleted while this writer confirmed its commit (the "
                    "reply was lost): it may have committed and been deleted, or lost to another "
                    "writer that was deleted; nothing of it is left") from None
            log.info("commit of %s: reply lost, the marker was ours (%s)", d.describe(name), outcome)
        except Exception:
            # The marker write may or may not have been applied (a timeout, a lost reply
            # then no more retries): if it is ours, we committed; otherwise the attempt's
            # data is left for recovery, because a late write of our marker could still
            # land and must never point at deleted data.
            try:
                outcome, written, _ = self._settle(name, attempt, check)
            except LeaseLostError:
                raise
            except Exception:  # noqa: BLE001 - the original error is the one to report
                outcome = "error"
            if outcome not in ("ours", "superseded"):
                raise
        return outcome, written

    def _settle(self, name: str, attempt: str, check: Callable[[], None] | None
                ) -> tuple[str, str | None, Marker | None]:
        """Whether a marker PUT whose outcome is unclear (refused retry, lost reply) made
        ``attempt`` the committed ``name``, read afresh: ``"ours"`` (the marker names it;
        with its generation), ``"superseded"`` (it committed and a later overwrite or
        delete already replaced it: the marker records it as the one replaced, or the
        attempt's manifest was removed, which only happens to committed data while its
        writer's lease lives), ``"lost"`` (another writer's marker is there and this
        attempt's data is intact) or ``"unknown"`` (no marker, data intact)."""
        marker, gen, found = self.marker_state(name)
        if found == attempt:
            return "ours", gen, marker
        if marker is not None and marker.replaces is not None and marker.replaces.attempt == attempt:
            return "superseded", None, marker
        if not self.driver.exists(f"{self._prefix(name, attempt)}/{MANIFEST_FILE}"):
            if check:
                check()  # recovery removes a dead writer's data: LeaseLostError then
            return "superseded", None, marker
        return ("unknown" if found is None else "lost"), None, marker

    def _check_data_still_there(self, name: str, attempt: str, written: str | None,
                                old: Marker | None, check: Callable[[], None] | None) -> None:
        """After the marker PUT succeeded: if the marker is still the one this writer wrote,
        the attempt's manifest must still exist. It is gone if this writer was paused past
        its lease between its check and the PUT and recovery removed its data, or if a
        first try of a create had landed (reply lost), another process deleted the
        checkpoint, and a retry created the marker again. Then the marker is taken back
        (the replaced one put back for an overwrite), conditionally on the generation this
        PUT wrote: the first case raises :class:`LeaseLostError`, the second is a commit
        that a later delete removed. A marker that is gone or another's means the commit
        happened and a later delete or overwrite superseded it: committed."""
        if self.driver.exists(f"{self._prefix(name, attempt)}/{MANIFEST_FILE}"):
            return
        # (read after the manifest: a delete or overwrite removes the marker before data)
        _, now, found = self.marker_state(name)
        if found != attempt or now != written:
            return  # superseded after it committed
        key = f"{name}/{MARKER_FILE}"
        try:
            if old is not None:
                self.driver.put(key, old.to_bytes(), if_generation=written)
            else:
                self.driver.delete(key, if_generation=written)
        except PreconditionFailedError:
            pass  # replaced meanwhile: not ours to touch
        if check:
            check()  # LeaseLostError when this writer had been declared dead
        # The lease is alive, so only a delete of the committed checkpoint removed its data:
        # our first try had committed (reply lost) and was deleted, a retry re-created the
        # marker. The commit happened and a later delete removed it: report it committed.
        log.warning("%s was committed and then deleted by another process before the commit "
                    "reply arrived; a retry had re-created its marker, now removed",
                    self.driver.describe(name))

    def _put_manifest(self, name: str, attempt: str, manifest: bytes) -> None:
        """Write the attempt's manifest; on failure the attempt is discarded (nothing
        can name it yet)."""
        try:
            self.driver.put(f"{self._prefix(name, attempt)}/{MANIFEST_FILE}", manifest)
        except BaseException:
            self.discard(name, attempt)
            raise

    def _marker_or_none(self, name: str) -> Marker | None:
        try:
            return self.read_marker(name)
        except (NotFoundError, CorruptionError):
            return None

    def discard(self, name: str, attempt: str) -> None:
        try:
            self.driver.delete_tree(self._prefix(name, attempt))
        except Exception as exc:  # noqa: BLE001 - recovery removes what is left
            log.warning("could not remove attempt %s of %s: %s", attempt, name, exc)

    def read_marker(self, name: str) -> Marker:
        key = f"{name}/{MARKER_FILE}"
        return Marker.from_bytes(read_capped(self.driver, key, MAX_MARKER_BYTES), where=self.driver.describe(key))

    def named_attempt(self, name: str) -> str | None:
        """The attempt the marker of ``name`` names (``unreadable:<digest>`` if it cannot
        be parsed), None if there is none: one GET, no generation, so for nominating only,
        never for a conditional write (see :meth:`marker_state`)."""
        key = f"{name}/{MARKER_FILE}"
        try:
            raw = read_capped(self.driver, key, MAX_MARKER_BYTES)
        except NotFoundError:
            return None
        try:
            return Marker.from_bytes(raw, where=self.driver.describe(key)).attempt
        except CorruptionError:
            return _unreadable(raw)

    def resolve(self, name: str) -> tuple[str, bytes]:
        try:
            marker = self.read_marker(name)
        except NotFoundError:
            raise NotFoundError(f"no committed checkpoint {self.driver.describe(name)}") from None
        return self._resolved(name, marker)

    def resolve_at(self, name: str, generation: str) -> tuple[str, bytes]:
        key = f"{name}/{MARKER_FILE}"
        try:
            raw = self.driver.read_if(key, generation)
        except NotFoundError:
            raise NotFoundError(f"no committed checkpoint {self.driver.describe(name)}") from None
        return self._resolved(name, Marker.from_bytes(raw, where=self.driver.describe(key)))

    def _resolved(self, name: str, marker: Marker) -> tuple[str, bytes]:
        """(data prefix, manifest) of the checkpoint ``marker`` commits, checked."""
        if marker.name != name:
            raise CorruptionError(f"{self.driver.describe(name)}: marker names {marker.name!r}")
        prefix = self._prefix(name, marker.attempt)
        key = f"{prefix}/{MANIFEST_FILE}"
        try:
            manifest = read_capped(self.driver, key, MAX_MANIFEST_BYTES)
        except NotFoundError:
            raise CorruptionError(
                f"{self.driver.describe(key)}: the commit marker names a manifest that is missing",
                path=MANIFEST_FILE,
            ) from None
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise CorruptionError(f"{self.driver.describe(key)}: larger than the {MAX_MANIFEST_BYTES} bytes "
                                  "a manifest may take", path=MANIFEST_FILE)
        if sha256(manifest) != marker.manifest_sha256:
            raise CorruptionError(
                f"{self.driver.describe(key)}: manifest does not match its commit marker",
                path=MANIFEST_FILE,
            )
        return prefix, manifest

    def list(self) -> list[str]:
        return list(self.committed())

    def committed(self) -> dict[str, str | None]:
        """One listing of the root with the delimiter ``/attempt-``: each checkpoint is
        its marker (an object, listed with its generation) plus one rolled-up prefix for
        the files of all its attempts, so the listing costs one request per ~500
        checkpoints however many files they hold (``docs/commit-protocol.md``)."""
        objects, _ = self.driver.scan("", f"/{ATTEMPT_PREFIX}")
        out: dict[str, str | None] = {}
        for key, info in objects.items():
            name, _, rest = key.partition("/")
            if rest == MARKER_FILE:
                try:
                    out[validate_name(name)] = info.generation
                except ValueError:
                    continue
        return out

    def unpublish(self, name: str, *, if_generation: str | None = None) -> None:
        d = self.driver
        marker, gen, found = self.marker_state(name)
        if found is None:
            raise NotFoundError(f"no committed checkpoint {d.describe(name)}")
        if if_generation is not None and found != if_generation:
            raise self._changed(name, if_generation, found)
        # un-publish first, and only the marker that was read (a retry whose first try
        # landed finds it gone: fine)
        key = f"{name}/{MARKER_FILE}"
        try:
            d.delete(key, if_generation=gen)
        except PreconditionFailedError:
            # Another generation is there now. If it names the attempt we read, a writer's
            # retry re-created it after our first try landed (reply lost): remove it too.
            # Otherwise the checkpoint we read is gone either way (deleted by our first
            # try, or replaced): only its data is left to remove.
            _, now_gen, now_found = self.marker_state(name)
            if now_found == found:
                d.delete(key, if_generation=now_gen)
        if marker is None:
            return
        d.delete_tree(self._prefix(name, marker.attempt))
        # A writer whose marker PUT landed before this delete, reply lost, may have
        # re-created the marker by a retry in between: it names the data just removed.
        _, now_gen, now_found = self.marker_state(name)
        if now_found == marker.attempt:
            try:
                d.delete(key, if_generation=now_gen)
            except PreconditionFailedError:
                pass  # replaced meanwhile: its writer's own check handles it


def choose_strategy(driver: Driver) -> CommitStrategy:
    """Rename where the driver declares atomic rename, marker otherwise."""
    if driver.capabilities.atomic_rename:
        return RenameStrategy(driver)
    return MarkerStrategy(driver)
