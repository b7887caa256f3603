"""Recovery: remove what crashed saves and deletes left behind, and nothing else.

One listing of the store nominates candidates; each is decided from storage read afresh
right before it is removed (its lease, then, after fencing an expired lease, its
commit marker; on rename backends it is claimed by an atomic rename into the trash), so
a save that commits or renews between the listing and the removal is never touched.
Committed data is never read. The rules, in ``docs/recovery.md``:

* **Never touched**: a committed checkpoint (rename: a ``<name>/`` directory; marker: the
  marker and the attempt it names), and any attempt whose lease was renewed less than
  ``ttl + grace`` seconds ago, or which has no lease and was written to less than
  ``grace`` seconds ago (a save in flight).
* **Removed**: attempts no marker names and no live lease protects (stale staging
  directories, attempt prefixes of failed or crashed saves, data of half-deleted
  checkpoints), trash of interrupted deletes, expired leases whose data is gone, stale
  temporary files of single-file writes, unfinished multipart uploads of dead
  attempts (S3), and claims of one-file commits that died holding them (S3: no live
  lease of the holder, and older than ``ttl + grace``).

* **Scope**: only names of the commit strategy's own layout (staging, trash, leases,
  claims, ``<name>/attempt-<id>/``, its uploads, its driver's temporaries), never a name pattern a
  user's checkpoint can also have (a committed checkpoint named ``checkpoint_tmp`` stays),
  never keys of another store nested below the root or the user's own.

Every removal is idempotent, so several processes may recover the same store at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import CorruptionError, InvalidArgumentError, NotFoundError, PreconditionFailedError
from .claim import parse_claim_key, read_claim
from .conformance import CONFORMANCE_PREFIX
from .lease import LEASES, LeaseState, lease_key, lease_state, parse_lease_key
from .manifest import Manifest
from .names import ATTEMPT_ID, MANIFEST_FILE, MARKER_FILE, RESERVED_DIR, validate_name
from .strategies import ATTEMPT_PREFIX, STAGING, TRASH, MarkerStrategy, RenameStrategy

if TYPE_CHECKING:
    from ..drivers.spec import FileInfo
    from .store import Store

log = logging.getLogger("atomicstore.recovery")

#: Default grace period (seconds) before unleased, unreferenced data counts as stale.
DEFAULT_GRACE = 120.0

#: the files of ``compat.flax``'s multi-process ``<prefix><step>_gda`` checkpoint
#: (``ARRAYS_FILE`` and ``gda_file`` there): the only committed checkpoint recovery ever
#: un-publishes, and only when its main file is absent
_GDA_ARRAYS = "arrays.json"
_GDA_SHARD = re.compile(r"a\d+/\d+(?:_\d+)*\.bin")
#: a temporary file of a single-file write lives for one write: one older than this (and
#: than ``grace``) is stale whatever ``grace`` says (``recover(grace=0)`` must not remove
#: the temporary of a write in progress)
TEMP_MIN_AGE = 60.0


_LEASE_WORDS = {LeaseState.LIVE: "alive", LeaseState.EXPIRED: "expired", LeaseState.GONE: "none"}


@dataclass(frozen=True)
class RecoveryAction:
    """One thing recovery removed (or, in a dry run, would remove)."""

    kind: str  # "attempt", "trash", "lease", "claim", "temp", "upload", "flax", "marker"
    target: str  # key prefix, key, or "key (upload id)"
    reason: str
    keys: int = 0


@dataclass
class RecoveryReport:
    """What recovery did (or would do, with ``dry_run``) and what it left alone."""

    dry_run: bool
    actions: list[RecoveryAction] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.actions)

    def summary(self) -> str:
        """A readable report: one line of counts, then a line per action and per save in
        flight."""
        verb = "would remove" if self.dry_run else "removed"
        lines = [f"recovery {verb} {len(self.actions)} item(s); {len(self.committed)} committed checkpoint(s) untouched; "
                 f"{len(self.in_flight)} save(s) in flight left alone"]
        lines += [f"  {a.kind}: {a.target} ({a.reason})" for a in self.actions]
        lines += [f"  in flight: {t}" for t in self.in_flight]
        return "\n".join(lines)


@dataclass
class _Attempt:
    name: str
    attempt: str
    prefix: str
    keys: list[str] = field(default_factory=list)
    newest: float = 0.0


def _valid_name(name: str) -> bool:
    try:
        validate_name(name)
    except InvalidArgumentError:
        return False
    return True


def _claimed_dirs(listing: dict[str, FileInfo]) -> set[str]:
    """Directories below the root that hold the names of a checkpoint or of a store: a
    commit marker, a manifest, or a reserved directory (another store nested there, a
    checkpoint, an attempt). Recovery removes nothing in them or above them by a name
    pattern (flax leftovers, temporaries): they are somebody's committed data or layout."""
    out: set[str] = set()
    for key in listing:
        parts = key.split("/")
        if len(parts) > 1 and parts[-1] in (MARKER_FILE, MANIFEST_FILE):
            out.add("/".join(parts[:-1]))
        for i in range(1, len(parts) - 1):
            if parts[i] == RESERVED_DIR:
                out.add("/".join(parts[:i]))
    return out


def _store_roots(listing: dict[str, FileInfo]) -> set[str]:
    """Directories below the root with a reserved directory of their own: other stores'
    roots (a key inside this store's checkpoints never has one at its top)."""
    out: set[str] = set()
    for key in listing:
        parts = key.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts) - 1) if parts[i] == RESERVED_DIR)
    return out


def _is_flax_gda(manifest: Manifest) -> bool:
    """True for the layout of ``compat.flax``'s ``_gda`` checkpoint: ``arrays.json`` and
    shard files ``a<n>/<start>.bin``, nothing else."""
    files = set(manifest.files)
    return _GDA_ARRAYS in files and all(f == _GDA_ARRAYS or _GDA_SHARD.fullmatch(f) for f in files)


def _flax_leftovers(tops: set[str], prefix: str) -> set[str]:
    """Top-level names of flax's legacy layout that may be its leftovers:
    ``<prefix>tmp`` and ``<prefix>tmp_gda`` (staging of flax's two-rename commit), and
    ``<prefix><step>_gda`` (a number as step) whose ``<prefix><step>`` does not exist (a
    crash between the two renames, or between the two deletes). Only candidates: what
    each is, is decided from storage (:meth:`_Recovery.flax`)."""
    out: set[str] = set()
    for top in tops:
        if not top.startswith(prefix):
            continue
        rest = top[len(prefix):]
        if rest in ("tmp", "tmp_gda"):
            out.add(top)
        elif rest.endswith("_gda") and f"{prefix}{rest[:-4]}" not in tops:
            try:
                float(rest[:-4])
            except ValueError:
                continue
            out.add(top)
    return out


def recover(store: Store, *, dry_run: bool = False, grace: float | None = None,
            now: float | None = None, flax_prefix: str | None = None) -> RecoveryReport:
    """See :meth:`atomicstore.Store.recover`."""
    if not isinstance(dry_run, bool):
        raise InvalidArgumentError(f"dry_run must be a bool, not {dry_run!r}")
    if now is not None and (isinstance(now, bool) or not isinstance(now, int | float) or math.isnan(now)):
        # (NaN compares false with everything: every lease would look expired)
        raise InvalidArgumentError(f"now must be Unix seconds as a number, not {now!r}")
    return _Recovery(store, dry_run, DEFAULT_GRACE if grace is None else grace,
                     store.clock() if now is None else now).run(flax_prefix)


class _Recovery:
    """One recovery pass. The listing only nominates candidates; the decision about each
    is made from storage read afresh immediately before acting on it, in this order:

    1. its lease (if alive: leave it; a writer renews before it expires);
    2. no lease and touched within ``grace``: leave it;
    3. fence: delete the expired lease (only the generation just read, so a renewal in
       between wins), after which the writer's pre-commit lease check fails;
    4. the commit marker of the name, read afresh (a writer publishes its marker before
       it releases its lease): if it names the attempt, leave it;
    5. remove: on rename backends by first renaming the attempt into the trash (so it
       can no longer be committed by a rename, and a rename that won keeps it), on
       object stores object by object.
    """

    def __init__(self, store: Store, dry_run: bool, grace: float, now: float) -> None:
        self.store, self.d = store, store.driver
        self.dry_run, self.grace, self.now = dry_run, grace, now
        self.marker_mode = isinstance(store.strategy, MarkerStrategy)
        self.report = RecoveryReport(dry_run=dry_run)

    # -- fresh reads --------------------------------------------------------------------
    def lease_state(self, name: str, attempt: str) -> tuple[str, str | None]:
        """("alive" | "expired" | "none", generation) of the attempt's lease, read now."""
        state, gen = lease_state(self.d, name, attempt, self.now, self.grace)
        return _LEASE_WORDS[state], gen

    def fence(self, name: str, attempt: str, generation: str | None) -> bool:
        """Remove an expired lease (that generation only); False if it was renewed."""
        try:
            self.d.delete(lease_key(name, attempt), if_generation=generation)
        except PreconditionFailedError:
            return False
        return True

    def committed_as(self, name: str, attempt: str) -> bool:
        """True if ``name`` is committed as ``attempt``, or its marker is unreadable
        (then nothing of that name is touched)."""
        cur = self.store.strategy.current(name)
        return cur is not None and (cur == attempt or cur.startswith("unreadable:"))

    # -- acting ---------------------------------------------------------------------------
    def act(self, kind: str, target: str, reason: str, nkeys: int = 1, tree: bool = False) -> None:
        self.report.actions.append(RecoveryAction(kind, target, reason, nkeys))
        if self.dry_run:
            return
        if tree:
            self.d.delete_tree(target)
        else:
            self.d.delete(target)

    def remove_tree(self, kind: str, prefix: str, reason: str, nkeys: int) -> bool:
        """Remove ``prefix``; on rename backends claim it into the trash first (False if a
        concurrent rename took it: committed, or removed by another recovery)."""
        if not self.dry_run and isinstance(self.store.strategy, RenameStrategy):
            trash = self.store.strategy.claim(prefix)
            if trash is None:
                return False
            prefix_removed, prefix = prefix, trash
            self.report.actions.append(RecoveryAction(kind, prefix_removed, reason, nkeys))
            self.d.delete_tree(prefix)
            return True
        self.act(kind, prefix, reason, nkeys, tree=True)
        return True

    def attempt(self, a: _Attempt) -> None:
        name, attempt = a.name, a.attempt
        state, gen = self.lease_state(name, attempt)
        if state == "alive" or (state == "none" and a.newest + self.grace > self.now):
            self.report.in_flight.append(a.prefix)
            return
        if not self.dry_run and state == "expired" and not self.fence(name, attempt, gen):
            self.report.in_flight.append(a.prefix)
            return
        if self.marker_mode and self.committed_as(name, attempt):
            return  # committed between the listing and now
        why = "lease expired" if state == "expired" else f"no lease, untouched for more than {self.grace:.0f}s"
        removed = self.remove_tree("attempt", a.prefix, f"uncommitted attempt of {name!r}: {why}", len(a.keys))
        if removed and state == "expired":
            self.report.actions.append(RecoveryAction("lease", lease_key(name, attempt), "lease of a removed attempt"))

    def stray_lease(self, name: str, attempt: str, why: str) -> None:
        state, gen = self.lease_state(name, attempt)
        if state != "expired":
            return
        if self.dry_run or self.fence(name, attempt, gen):
            self.report.actions.append(RecoveryAction("lease", lease_key(name, attempt), why))

    def claim(self, key: str) -> None:
        """The claim of a commit of a name (``commit/claim.py``), read afresh: left while the
        lease of the attempt it names is alive or while it is younger than ``ttl +
        grace`` (the claim's ttl, else the store's); otherwise removed at the generation
        read (a writer that took it over meanwhile keeps it)."""
        name = parse_claim_key(key)
        assert name is not None
        try:
            info = self.d.info(key)
            holder = read_claim(self.d, key, info.generation)
        except (NotFoundError, PreconditionFailedError):
            return  # released or taken over since the listing
        ttl = holder.ttl if holder.ttl is not None else self.store.lease_ttl
        mtime = info.mtime if info.mtime is not None else self.now
        if (holder.attempt is not None and self.lease_state(name, holder.attempt)[0] == "alive") or (
                mtime + ttl + self.grace > self.now):
            self.report.in_flight.append(key)
            return
        if not self.dry_run:
            try:
                self.d.delete(key, if_generation=info.generation)
            except PreconditionFailedError:
                return
        self.report.actions.append(RecoveryAction(
            "claim", key, f"claim of a commit of {name!r} whose writer is dead"))

    def read_markers(self, names: set[str]) -> dict[str, str | None]:
        """The attempt each marker names (None: unreadable right now, so nothing of that
        name is touched); names whose marker vanished since the listing are left out.
        One GET per marker (no generation: this only nominates; every removal re-reads
        the marker)."""
        strategy = self.store.strategy
        assert isinstance(strategy, MarkerStrategy)

        def one(name: str) -> tuple[str, str | None, bool]:
            try:
                cur = strategy.named_attempt(name)
            except Exception:  # noqa: BLE001 - conservative: touch nothing of it
                return name, None, True
            return name, cur, cur is not None

        with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(names)))) as pool:
            return {n: cur for n, cur, keep in pool.map(one, sorted(names)) if keep}

    def dangling_marker(self, name: str, attempt: str, mtime: float | None) -> str | None:
        """A marker whose attempt has no data can never be opened: a commit deleted while
        its reply was lost and re-created by a retry, or a writer declared dead whose PUT
        landed late, each dying before it took its marker back. Once older than ``grace``,
        if read afresh it still names that attempt and the attempt's manifest is still
        missing, it is rolled back to the marker it replaced (an overwrite records it)
        when that checkpoint's manifest is intact, else removed; both conditional on the
        generation read. Returns the attempt the name holds afterwards."""
        if (mtime if mtime is not None else self.now) + self.grace > self.now:
            return attempt
        strategy = self.store.strategy
        assert isinstance(strategy, MarkerStrategy)
        marker, gen, found = strategy.marker_state(name)
        if found != attempt or marker is None or self.d.exists(
                f"{strategy.attempt_prefix(name, attempt)}/{MANIFEST_FILE}"):
            return found
        old = marker.replaces
        rollback = old is not None and strategy.intact(name, old)
        key = f"{name}/{MARKER_FILE}"
        why = f"names attempt {attempt}, whose data is gone"
        if not self.dry_run:
            try:
                if old is not None and rollback:
                    self.d.put(key, old.to_bytes(), if_generation=gen)
                else:
                    self.d.delete(key, if_generation=gen)
            except PreconditionFailedError:
                return strategy.current(name)  # changed meanwhile: leave it to the next pass
        self.report.actions.append(RecoveryAction(
            "marker", key, f"{why}: rolled back to {old.attempt}" if old and rollback else why))
        return old.attempt if old is not None and rollback else None

    def live_lease_of(self, names: set[str]) -> bool:
        """True if any lease of these names is alive now (leases listed and read afresh:
        a save may have started since the pass's listing)."""
        fresh = (parse_lease_key(k) for k in self.d.find(LEASES))
        return any(self.lease_state(*lk)[0] == "alive" for lk in fresh if lk and lk[0] in names)

    # -- the pass -----------------------------------------------------------------------
    def run(self, flax_prefix: str | None) -> RecoveryReport:
        d, now, grace = self.d, self.now, self.grace
        listing = d.find("")
        attempts: dict[tuple[str, str], _Attempt] = {}
        leases: dict[tuple[str, str], str] = {}
        trash: dict[str, list[str]] = defaultdict(list)
        temps: list[tuple[str, float]] = []
        claims: list[str] = []
        #: conformance checks' scratch prefixes -> their newest object's mtime
        probes: dict[str, float] = {}
        markers: set[str] = set()
        #: directories below the root that are another store's root (its reserved
        #: directory shows in the listing while it has leases or staged files)
        nested = _store_roots(listing)

        def add_attempt(name: str, attempt: str, prefix: str, key: str, mtime: float | None) -> None:
            a = attempts.setdefault((name, attempt), _Attempt(name, attempt, prefix))
            a.keys.append(key)
            a.newest = max(a.newest, mtime if mtime is not None else now)

        for key, info in listing.items():
            if d.is_temporary(key) and not key.startswith((STAGING + "/", TRASH + "/")) and (
                    f"/{ATTEMPT_PREFIX}" not in key):
                temps.append((key, info.mtime or now))  # (never a file staged by a save)
            elif key.startswith(RESERVED_DIR + "/"):
                lk = parse_lease_key(key)
                if lk is not None:
                    leases[lk] = key
                elif parse_claim_key(key) is not None:
                    claims.append(key)
                elif key.startswith(CONFORMANCE_PREFIX + "/"):
                    probe = "/".join(key.split("/", 3)[:3])
                    probes[probe] = max(probes.get(probe, 0.0), info.mtime or now)
                elif key.startswith(STAGING + "/"):
                    dirname = key[len(STAGING) + 1 :].split("/", 1)[0]
                    name, dot, attempt = dirname.rpartition(".")
                    add_attempt(name if dot else dirname, attempt, f"{STAGING}/{dirname}", key, info.mtime)
                elif key.startswith(TRASH + "/"):
                    trash[f"{TRASH}/{key[len(TRASH) + 1 :].split('/', 1)[0]}"].append(key)
            elif self.marker_mode:
                name, _, rest = key.partition("/")
                if not _valid_name(name) or name in nested:
                    continue  # never this store's name, or another store's root
                if rest == MARKER_FILE:
                    markers.add(name)
                elif rest.startswith(ATTEMPT_PREFIX):
                    attempt = rest[len(ATTEMPT_PREFIX) :].split("/", 1)[0]
                    if self.own_attempt(name, attempt, listing, nested):
                        add_attempt(name, attempt, f"{name}/{ATTEMPT_PREFIX}{attempt}", key, info.mtime)

        if d.capabilities.directories:  # empty directories do not show up in a listing of files
            for e in d.listdir(STAGING):
                name, dot, attempt = e.name.rpartition(".")
                ident = (name if dot else e.name, attempt)
                attempts.setdefault(ident, _Attempt(ident[0], attempt, f"{STAGING}/{e.name}"))
            for e in d.listdir(TRASH):
                trash.setdefault(f"{TRASH}/{e.name}", [])

        committed = markers if self.marker_mode else set(self.store.strategy.list())
        self.report.committed = sorted(committed)

        # Which attempt each marker names (read, concurrently: a marker may name an attempt
        # the listing does not show). Used to skip committed attempts early and to repair
        # markers whose data is gone; every removal re-reads the marker itself.
        named: dict[str, str | None] = self.read_markers(markers) if self.marker_mode else {}
        for name in sorted(named):
            att = named[name]
            if att and not att.startswith("unreadable:") and (name, att) not in attempts:
                mtime = listing[f"{name}/{MARKER_FILE}"].mtime
                named[name] = self.dangling_marker(name, att, mtime)

        for ident, a in sorted(attempts.items()):
            name, attempt = ident
            if name in named and named[name] in (None, attempt):
                # committed (or unreadable: be conservative); only a dead lease goes
                if named[name] == attempt and ident in leases:
                    self.stray_lease(name, attempt, "expired lease of a committed attempt")
                continue
            self.attempt(a)

        for key in sorted(claims):
            self.claim(key)

        for (name, attempt) in sorted(leases):
            if (name, attempt) not in attempts:
                self.stray_lease(name, attempt, "expired lease with no data")

        for prefix, keys in sorted(trash.items()):
            self.act("trash", prefix, "interrupted delete", len(keys), tree=True)

        for prefix, newest in sorted(probes.items()):
            # a check cleans up after itself; one interrupted (a crash, a lost delete) leaves
            # its few small objects: no save ever reads them
            if newest + max(grace, TEMP_MIN_AGE) < now:
                self.act("temp", prefix, "conformance check interrupted", tree=True)

        claimed = _claimed_dirs(listing)
        if flax_prefix is not None:
            self.flax(listing, flax_prefix, claimed)

        for key, mtime in temps:
            # only this driver's temporaries of single-file writes, never inside a
            # checkpoint, an attempt or another store's root
            if mtime + max(grace, TEMP_MIN_AGE) < now and key.split("/", 1)[0] not in committed and (
                    not self.foreign(key, claimed)):
                self.act("temp", key, f"temporary file older than {max(grace, TEMP_MIN_AGE):.0f}s")

        for key in d.stray_leftovers(max(grace, TEMP_MIN_AGE)):
            self.act("temp", key, f"scratch directory of a killed process, older than "
                     f"{max(grace, TEMP_MIN_AGE):.0f}s", tree=True)

        if d.capabilities.multipart_uploads:
            self.uploads(listing, nested)

        if self.report.actions:
            log.info("%s", self.report.summary())
        return self.report

    @staticmethod
    def own_attempt(name: str, attempt: str, listing: dict[str, FileInfo], nested: set[str]) -> bool:
        """True if ``<name>/attempt-<attempt>/`` is in this store's own layout: the id is
        an attempt id, no commit marker sits at its top (then it is a checkpoint named like
        an attempt, of a store nested at ``<name>``), and neither it nor ``<name>`` is
        another store's root."""
        prefix = f"{name}/{ATTEMPT_PREFIX}{attempt}"
        return bool(ATTEMPT_ID.fullmatch(attempt)) and f"{prefix}/{MARKER_FILE}" not in listing and (
            name not in nested and prefix not in nested)

    def foreign(self, key: str, claimed: set[str]) -> bool:
        """True if a directory above ``key`` (below the root, outside this store's reserved
        directory) holds a checkpoint's or another store's names (:func:`_claimed_dirs`;
        on backends with directories also an empty reserved directory)."""
        if key.startswith(RESERVED_DIR + "/"):
            return False
        parts = key.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            up = "/".join(parts[:i])
            if up in claimed or (self.d.capabilities.directories and self.d.exists(f"{up}/{RESERVED_DIR}")):
                return True
        return False

    def uploads(self, listing: dict[str, FileInfo], nested: set[str]) -> None:
        """Abort unfinished multipart uploads of this store whose save is dead: the
        attempt's lease (or, for a one-file upload to ``<name>``, every lease of that
        name) is not alive now, and the upload is older than ``grace``. Where the backend
        lists every upload below the root (S3), only uploads at keys of this store's own
        layout are its own: ``<name>/attempt-<id>/…`` (see :meth:`own_attempt`) and a
        one-file checkpoint's ``<name>`` (a valid name right below the root); a nested
        store's uploads and the user's own elsewhere below the root are never touched."""
        own_only = self.d.own_uploads
        for key, upload_id, started in self.d.list_incomplete_uploads(""):
            if started + self.grace > self.now:
                continue
            if key.startswith(CONFORMANCE_PREFIX + "/"):
                if started + max(self.grace, TEMP_MIN_AGE) < self.now:  # an interrupted check's
                    self.report.actions.append(RecoveryAction(
                        "upload", f"{key} ({upload_id})", "conformance check interrupted"))
                    if not self.dry_run:
                        self.d.abort_upload(key, upload_id)
                continue
            name, _, rest = key.partition("/")
            ours = own_only or (_valid_name(name) and name not in nested)
            if rest.startswith(ATTEMPT_PREFIX):
                attempt = rest[len(ATTEMPT_PREFIX) :].split("/", 1)[0]
                if not (own_only or (ours and self.own_attempt(name, attempt, listing, nested))):
                    continue
                if self.lease_state(name, attempt)[0] == "alive":
                    continue
            elif not (own_only or (ours and not rest)):
                continue  # not a key of this store's layout
            elif self.live_lease_of({key}):
                continue  # a one-file save in flight
            self.report.actions.append(RecoveryAction("upload", f"{key} ({upload_id})", "unfinished multipart upload"))
            if not self.dry_run:
                self.d.abort_upload(key, upload_id)

    def flax(self, listing: dict[str, FileInfo], prefix: str, claimed: set[str]) -> None:
        """flax's own leftovers (:func:`_flax_leftovers`), each decided from storage: a
        committed checkpoint of any name is never removed (a ``_gda`` of
        ``compat.flax``'s multi-process layout whose main file is absent is un-published,
        at the generation read); a name with a live lease is in flight; a file may be a
        one-file checkpoint (``<prefix>tmp`` is a valid name) and is left; a tree holding
        a marker, a manifest, a reserved directory or attempts of this store is not
        flax's; what is left, older than ``grace``, with the main file of a ``_gda``
        still absent, is removed."""
        d, strategy = self.d, self.store.strategy
        tops = {k.split("/", 1)[0] for k in listing}
        if d.capabilities.directories:
            tops |= {e.name for e in d.listdir("")}
        for top in sorted(_flax_leftovers(tops, prefix)):
            staging = top[len(prefix):].startswith("tmp")
            main = None if staging else top[: -len("_gda")]
            keys = [k for k in listing if k.startswith(top + "/")]
            if top in listing or (not keys and not d.capabilities.directories):
                continue  # a file: flax's staging, or a one-file checkpoint of that name
            newest = max((listing[k].mtime or 0.0 for k in keys), default=0.0)
            names = {top} | ({main} if main else set())
            generation = strategy.current(top)
            if generation is not None:  # committed: never removed, but for one case
                if main is not None and not generation.startswith("unreadable:") and not self.busy(names, newest):
                    self.gda_orphan(top, main, generation)
                continue
            if self.busy(names, newest):
                self.report.in_flight.append(top)
                continue
            if top in claimed or any(c.startswith(top + "/") for c in claimed) or any(
                    k.split("/")[1].startswith(ATTEMPT_PREFIX) for k in keys) or (
                    d.capabilities.directories and d.exists(f"{top}/{RESERVED_DIR}")):
                continue  # holds a checkpoint's, an attempt's or another store's names
            if main is not None and d.exists(main):
                continue  # the main file appeared meanwhile
            what = "flax staging" if staging else "orphaned _gda directory"
            if isinstance(strategy, RenameStrategy):
                self.remove_tree("flax", top, f"{what} (uncommitted)", len(keys))
                continue
            # object stores: the keys listed, not the prefix (a save of that name starting
            # now writes keys of its own there)
            self.report.actions.append(RecoveryAction("flax", top, f"{what} (uncommitted)", len(keys)))
            if not self.dry_run:
                for k in keys:
                    d.delete(k)

    def busy(self, names: set[str], newest: float) -> bool:
        """True if something was written below these names within ``grace``, or a lease
        of one of them is alive (listed and read afresh)."""
        return newest + self.grace > self.now or self.live_lease_of(names)

    def gda_orphan(self, top: str, main: str, generation: str) -> None:
        """Un-publish the committed ``_gda`` checkpoint ``top`` of ``compat.flax``'s
        multi-process save if its main file ``main`` is absent (a crash between the two
        commits), recognised by its files; at ``generation``, so a newer save of that name
        is never removed. Any other committed checkpoint is left."""
        try:
            _, raw = self.store.strategy.resolve(top)
            manifest = Manifest.from_bytes(raw, where=self.d.describe(top))
        except (NotFoundError, CorruptionError):
            return
        if manifest.attempt != generation or not _is_flax_gda(manifest) or self.d.exists(main):
            return
        what = "orphaned _gda checkpoint of a multi-process save (no main file)"
        if not self.dry_run:
            try:
                self.store.strategy.unpublish(top, if_generation=generation)
            except (NotFoundError, PreconditionFailedError):
                return  # changed meanwhile: leave it to the next pass
        self.report.actions.append(RecoveryAction("flax", top, what))
