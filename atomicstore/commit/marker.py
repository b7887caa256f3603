"""The marker strategy: write an attempt's files, then create its commit marker.

See :mod:`atomicstore.commit.strategy` for the layout and ``docs/commit-protocol.md`` for
every step and what a crash at that step leaves behind.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future

from ..drivers.parts import ABORT_WAIT
from ..errors import (
    AlreadyExistsError,
    CommitOutcomeUnknownError,
    CorruptionError,
    LeaseLostError,
    NotFoundError,
    PreconditionFailedError,
)
from .claim import NameClaim
from .manifest import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Marker, sha256
from .names import ATTEMPT_ID, ATTEMPT_PREFIX, MANIFEST_FILE, MARKER_FILE, validate_name
from .strategy import (
    FOREIGN,
    READ_AHEAD_BYTES,
    CommitStrategy,
    KeyClass,
    KeyKind,
    read_capped,
    unreadable_generation,
    valid_name,
)

log = logging.getLogger("atomicstore.commit")


class Settled(enum.StrEnum):
    """What a marker PUT whose outcome was unclear turned out to be (:meth:`MarkerStrategy.settle`)."""

    OURS = "ours"  #: the marker names this attempt: committed
    SUPERSEDED = "superseded"  #: committed, and already replaced or deleted by a later writer
    LOST = "lost"  #: another writer's marker is there, this attempt's data intact
    UNKNOWN = "unknown"  #: no marker, this attempt's data intact
    ERROR = "error"  #: the read-back itself failed


class MarkerStrategy(CommitStrategy):
    """Write the attempt's files and manifest, then create the marker conditionally.

    An overwrite replaces the marker with a conditional PUT on the generation (S3 ETag,
    GCS generation) of the marker it read; a delete removes the marker conditionally on
    the generation it read, then the data.
    """

    kind = "marker"
    in_place = True

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
            return None, gen, unreadable_generation(raw)
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
        claim: NameClaim | None = None, inline: Mapping[str, bytes] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        d = self.driver
        old: Marker | None = None
        gen: str | None = None  # with it, a compare-and-swap on the marker read
        if overwrite:
            if ready is not None:  # every file complete before a conflict discards them
                ready()
                ready = None
            old, gen, found = self.marker_state(name)
            if found != expected:
                self.discard(name, attempt)
                raise self._conflict(name, old.writer if old else None)
        # The manifest and the name's claim are written while the last files' uploads
        # complete (``ready``): no round trip of their own. A one-file save of this name
        # sends its commit request under the same claim, so the object <name> checked
        # under it cannot appear before our marker does (commit/claim.py).
        if claim is not None:
            claim.start()
        released: Future[None] | None = None
        keep = False
        try:
            self._put_manifest(name, attempt, manifest, ready)
            self._before_commit_point(name, attempt, check, claim)
            if claim is not None:
                claim.confirm()  # not paused past the lease since its check (no request)
            try:
                outcome, written = self._commit_point(name, attempt, writer, manifest, old, gen, check, inline)
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
            if outcome is Settled.OURS:
                self._check_data_still_there(name, attempt, written, old, check)
        finally:
            if claim is not None and not keep:
                if released is None:
                    claim.release()
                else:
                    released.result()
        if old is not None and old.attempt != attempt:
            self._cleanup(self._prefix(name, old.attempt))  # the replaced checkpoint's data

    def _before_commit_point(self, name: str, attempt: str, check: Callable[[], None] | None,
                             claim: NameClaim | None) -> None:
        """Hold the name's claim, check the lease and that no one-file checkpoint took the
        name; on any error the attempt is discarded."""
        d = self.driver
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

    def _commit_point(self, name: str, attempt: str, writer: str, manifest: bytes, old: Marker | None,
                      gen: str | None, check: Callable[[], None] | None,
                      inline: Mapping[str, bytes] | None = None) -> tuple[Settled, str | None]:
        """Create (or, at ``gen``, replace) the marker: the commit point. It carries the
        manifest and ``inline`` files as far as they fit (:meth:`Marker.new`). Returns
        (outcome, the marker's generation if ours): :attr:`Settled.OURS` or
        :attr:`Settled.SUPERSEDED` (see :meth:`settle`); raises when another writer won
        or the outcome is unknown."""
        d = self.driver
        marker = Marker.new(name, attempt, writer, manifest, replaces=old, files=inline)
        outcome = Settled.OURS
        try:  # the commit point
            written = d.put(f"{name}/{MARKER_FILE}", marker.to_bytes(), exclusive=gen is None,
                            if_generation=gen)
        except AlreadyExistsError:
            # Either another writer won, or our own write was applied and only the reply
            # was lost (the retry was then refused): read it back to know which.
            outcome, written, current = self.settle(name, attempt, check)
            if outcome is Settled.LOST:
                self.discard(name, attempt)
                raise self._conflict(name, current.writer if current else None) from None
            if outcome is Settled.UNKNOWN:
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
                outcome, written, _ = self.settle(name, attempt, check)
            except LeaseLostError:
                raise
            except Exception:  # noqa: BLE001 - the original error is the one to report
                outcome = Settled.ERROR
            if outcome not in (Settled.OURS, Settled.SUPERSEDED):
                raise
        return outcome, written

    def settle(self, name: str, attempt: str, check: Callable[[], None] | None
               ) -> tuple[Settled, str | None, Marker | None]:
        """Whether a marker PUT whose outcome is unclear (refused retry, lost reply) made
        ``attempt`` the committed ``name``, read afresh: :attr:`Settled.OURS` (the marker
        names it; with its generation), :attr:`Settled.SUPERSEDED` (it committed and a
        later overwrite or delete already replaced it: the marker records it as the one
        replaced, or the attempt's manifest was removed, which only happens to committed
        data while its writer's lease lives), :attr:`Settled.LOST` (another writer's
        marker is there and this attempt's data is intact) or :attr:`Settled.UNKNOWN`
        (no marker, data intact)."""
        marker, gen, found = self.marker_state(name)
        if found == attempt:
            return Settled.OURS, gen, marker
        if marker is not None and marker.replaces is not None and marker.replaces.attempt == attempt:
            return Settled.SUPERSEDED, None, marker
        if not self.driver.exists(f"{self._prefix(name, attempt)}/{MANIFEST_FILE}"):
            if check:
                check()  # recovery removes a dead writer's data: LeaseLostError then
            return Settled.SUPERSEDED, None, marker
        return (Settled.UNKNOWN if found is None else Settled.LOST), None, marker

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

    def _put_manifest(self, name: str, attempt: str, manifest: bytes,
                      ready: Callable[[], None] | None = None) -> None:
        """Write the attempt's manifest while ``ready()`` waits for the attempt's files
        to be complete (nothing names the attempt before its marker, so the order of
        the two does not matter to readers or recovery). On a failure to write it the
        attempt is discarded (nothing can name it yet); ``ready``'s error is raised once
        the manifest's request has ended, leaving the attempt to the caller's abort,
        which first ends the files' uploads."""
        d = self.driver
        key = f"{self._prefix(name, attempt)}/{MANIFEST_FILE}"
        put = d.background(lambda: d.put(key, manifest))
        try:
            if ready is not None:
                ready()
        except BaseException:
            if not put.cancel():
                # (so that the abort's discard sees it; a request the server holds is not
                # waited for longer than a part: if it lands later, recovery removes it)
                concurrent.futures.wait([put], timeout=ABORT_WAIT)
            raise
        try:
            d.put(key, manifest) if put.cancel() else put.result()
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

    def resolve(self, name: str) -> tuple[str, bytes]:
        prefix, manifest, _ = self.resolve_ahead(name, None, ())
        return prefix, manifest

    def resolve_at(self, name: str, generation: str) -> tuple[str, bytes]:
        prefix, manifest, _ = self.resolve_ahead(name, generation, ())
        return prefix, manifest

    def resolve_ahead(self, name: str, generation: str | None, ahead: Sequence[str]
                      ) -> tuple[str, bytes, dict[str, bytes]]:
        """The marker names the attempt, and usually carries its manifest and small files
        (:meth:`Marker.new`): then the checkpoint's metadata takes this one request. The
        files ``ahead`` it does not carry, and the manifest if it does not, are read
        together: one round trip more, not one each. (An attempt's files are written
        once, before its marker, and only ever deleted; the manifest copy is used only if
        it has the digest the marker names, and the caller checks the files against the
        manifest.)"""
        key = f"{name}/{MARKER_FILE}"
        try:
            if generation is None:
                marker = self.read_marker(name)
            else:
                marker = Marker.from_bytes(self.driver.read_if(key, generation), where=self.driver.describe(key))
        except NotFoundError:
            raise NotFoundError(f"no committed checkpoint {self.driver.describe(name)}") from None
        if marker.name != name:
            raise CorruptionError(f"{self.driver.describe(name)}: marker names {marker.name!r}")
        prefix = self._prefix(name, marker.attempt)
        carried = marker.inline.get(MANIFEST_FILE)
        if carried is not None and sha256(carried) != marker.manifest_sha256:
            carried = None  # (not the manifest it names: read the manifest itself)
        done = {p: marker.inline[p] for p in ahead if carried is not None and p in marker.inline}

        def read(path: str) -> Callable[[], bytes]:
            return lambda: read_capped(self.driver, f"{prefix}/{path}", READ_AHEAD_BYTES)

        reads = {p: self.driver.background(read(p)) for p in ahead if p not in done}
        try:
            manifest = carried if carried is not None else self._manifest(name, prefix, marker)
        finally:
            for p, fut in reads.items():  # every one done before this returns
                try:
                    data = fut.result()
                except Exception:  # noqa: BLE001 - read later the usual way (its error then)
                    continue
                if len(data) <= READ_AHEAD_BYTES:
                    done[p] = data
        return prefix, manifest, done

    def _manifest(self, name: str, prefix: str, marker: Marker) -> bytes:
        """The manifest of the checkpoint ``marker`` commits, checked against it."""
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
        return manifest

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

    # -- the layout, for recovery ------------------------------------------------------
    def classify_top(self, key: str, listing: Collection[str], nested: Collection[str]) -> KeyClass:
        """``<name>/commit_success.txt`` (a commit point), ``<name>/attempt-<id>/…`` of
        this store's own layout (:meth:`owns_attempt`), ``<name>`` itself."""
        name, _, rest = key.partition("/")
        if not valid_name(name) or name in nested:
            return FOREIGN  # never this store's name, or another store's root
        if not rest:
            return KeyClass(KeyKind.ONE_FILE, name)
        if rest == MARKER_FILE:
            return KeyClass(KeyKind.MARKER, name)
        if rest.startswith(ATTEMPT_PREFIX):
            attempt = rest[len(ATTEMPT_PREFIX) :].split("/", 1)[0]
            if self.owns_attempt(name, attempt, listing, nested):
                return KeyClass(KeyKind.ATTEMPT, name, attempt, self._prefix(name, attempt))
        return FOREIGN

    def owns_attempt(self, name: str, attempt: str, listing: Collection[str], nested: Collection[str]) -> bool:
        """True if ``<name>/attempt-<attempt>/`` is in this store's own layout: the id is
        an attempt id, no commit marker sits at its top (then it is a checkpoint named like
        an attempt, of a store nested at ``<name>``), and neither it nor ``<name>`` is
        another store's root."""
        prefix = self._prefix(name, attempt)
        return bool(ATTEMPT_ID.fullmatch(attempt)) and f"{prefix}/{MARKER_FILE}" not in listing and (
            name not in nested and prefix not in nested)

    def repair_point(self, name: str, attempt: str, *, dry_run: bool
                     ) -> tuple[str | None, tuple[str, str] | None]:
        """A marker whose attempt has no data can never be opened: a commit deleted while
        its reply was lost and re-created by a retry, or a writer declared dead whose PUT
        landed late, each dying before it took its marker back. If, read afresh, it still
        names ``attempt`` and the attempt's manifest is still missing, it is rolled back to
        the marker it replaced (an overwrite records it) when that checkpoint's manifest is
        intact, else removed; both conditional on the generation read."""
        marker, gen, found = self.marker_state(name)
        if found != attempt or marker is None or self.driver.exists(
                f"{self._prefix(name, attempt)}/{MANIFEST_FILE}"):
            return found, None
        old = marker.replaces
        rollback = old is not None and self.intact(name, old)
        key = f"{name}/{MARKER_FILE}"
        why = f"names attempt {attempt}, whose data is gone"
        if not dry_run:
            try:
                if old is not None and rollback:
                    self.driver.put(key, old.to_bytes(), if_generation=gen)
                else:
                    self.driver.delete(key, if_generation=gen)
            except PreconditionFailedError:
                return self.current(name), None  # changed meanwhile: leave it to the next pass
        if old is not None and rollback:
            return old.attempt, (key, f"{why}: rolled back to {old.attempt}")
        return None, (key, why)


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
            return unreadable_generation(raw)
