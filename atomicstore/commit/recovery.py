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
import enum
import logging
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..drivers.spec import FileInfo
from ..errors import CorruptionError, InvalidArgumentError, NotFoundError, PreconditionFailedError
from .claim import parse_claim_key, read_claim
from .context import CommitContext
from .flaxlayout import FlaxCandidate, flax_candidates, is_flax_gda
from .lease import LEASES, LeaseState, lease_key, lease_state, parse_lease_key
from .manifest import Manifest
from .names import ATTEMPT_PREFIX, MANIFEST_FILE, MARKER_FILE, RESERVED_DIR
from .strategy import KeyClass, KeyKind

log = logging.getLogger("atomicstore.recovery")

#: Default grace period (seconds) before unleased, unreferenced data counts as stale.
DEFAULT_GRACE = 120.0

#: a temporary file of a single-file write lives for one write: one older than this (and
#: than ``grace``) is stale whatever ``grace`` says (``recover(grace=0)`` must not remove
#: the temporary of a write in progress)
TEMP_MIN_AGE = 60.0


class ActionKind(enum.StrEnum):
    """What a :class:`RecoveryAction` removed (a str: compares and prints as its value)."""

    ATTEMPT = "attempt"  #: an uncommitted attempt's data
    TRASH = "trash"  #: a tree an interrupted delete left in the trash
    LEASE = "lease"  #: an expired lease
    CLAIM = "claim"  #: the claim of a commit whose writer is dead
    TEMP = "temp"  #: a stale temporary file, scratch directory or conformance probe
    UPLOAD = "upload"  #: an unfinished multipart upload
    FLAX = "flax"  #: a leftover of flax's legacy layout
    MARKER = "marker"  #: a commit marker whose data is gone (rolled back or removed)
    ORBAX = "orbax"  #: a leftover of Orbax's layout (``integrations.orbax``)


@dataclass(frozen=True)
class RecoveryAction:
    """One thing recovery removed (or, in a dry run, would remove)."""

    kind: str  # an ActionKind (a str): "attempt", "trash", "lease", "claim", "temp", "upload", "flax", "marker"
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


@dataclass
class _Scan:
    """One listing of the root, each key classified by the strategy (only nominations:
    every removal is decided from storage read afresh)."""

    listing: dict[str, FileInfo]
    #: directories below the root that are another store's root (its reserved directory
    #: shows in the listing while it has leases or staged files)
    nested: set[str]
    attempts: dict[tuple[str, str], _Attempt] = field(default_factory=dict)
    leases: dict[tuple[str, str], str] = field(default_factory=dict)
    trash: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    temps: list[tuple[str, float]] = field(default_factory=list)
    claims: list[str] = field(default_factory=list)
    #: conformance checks' scratch prefixes -> their newest object's mtime
    probes: dict[str, float] = field(default_factory=dict)
    #: names whose commit point the listing showed -> the point's mtime
    points: dict[str, float | None] = field(default_factory=dict)


def _claimed_dirs(listing: Mapping[str, FileInfo]) -> set[str]:
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


def _store_roots(listing: Mapping[str, FileInfo]) -> set[str]:
    """Directories below the root with a reserved directory of their own: other stores'
    roots (a key inside this store's checkpoints never has one at its top)."""
    out: set[str] = set()
    for key in listing:
        parts = key.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts) - 1) if parts[i] == RESERVED_DIR)
    return out


def recover(context: CommitContext, *, dry_run: bool = False, grace: float | None = None,
            now: float | None = None, flax_prefix: str | None = None) -> RecoveryReport:
    """See :meth:`atomicstore.Store.recover`."""
    if not isinstance(dry_run, bool):
        raise InvalidArgumentError(f"dry_run must be a bool, not {dry_run!r}")
    if now is not None and (isinstance(now, bool) or not isinstance(now, int | float) or math.isnan(now)):
        # (NaN compares false with everything: every lease would look expired)
        raise InvalidArgumentError(f"now must be Unix seconds as a number, not {now!r}")
    return _Recovery(context, dry_run, DEFAULT_GRACE if grace is None else grace,
                     context.clock() if now is None else now).run(flax_prefix)


class _Recovery:
    """One recovery pass. The listing only nominates candidates; the decision about each
    is made from storage read afresh immediately before acting on it, in this order:

    1. its lease (if alive: leave it; a writer renews before it expires);
    2. no lease and touched within ``grace``: leave it;
    3. fence: delete the expired lease (only the generation just read, so a renewal in
       between wins), after which the writer's pre-commit lease check fails;
    4. where a commit point names attempts in place (marker), the commit point of the
       name, read afresh (a writer publishes its marker before it releases its lease):
       if it names the attempt, leave it;
    5. remove: where committing renames (POSIX) by first renaming the attempt into the
       trash (so it can no longer be committed by a rename, and a rename that won keeps
       it), on object stores object by object.

    What each key is, is the strategy's to say (:meth:`CommitStrategy.classify`): a key
    it does not recognise as its own is never removed.
    """

    def __init__(self, context: CommitContext, dry_run: bool, grace: float, now: float) -> None:
        self.context, self.d, self.strategy = context, context.driver, context.strategy
        self.dry_run, self.grace, self.now = dry_run, grace, now
        self.report = RecoveryReport(dry_run=dry_run)

    # -- fresh reads --------------------------------------------------------------------
    def lease_state(self, name: str, attempt: str) -> tuple[LeaseState, str | None]:
        """The state of the attempt's lease and its generation, read now."""
        return lease_state(self.d, name, attempt, self.now, self.grace)

    def alive(self, name: str, attempt: str) -> bool:
        """True if the attempt's lease is alive now."""
        return self.lease_state(name, attempt)[0] is LeaseState.LIVE

    def fence(self, name: str, attempt: str, generation: str | None) -> bool:
        """Remove an expired lease (that generation only); False if it was renewed."""
        try:
            self.d.delete(lease_key(name, attempt), if_generation=generation)
        except PreconditionFailedError:
            return False
        return True

    def committed_as(self, name: str, attempt: str) -> bool:
        """True if ``name`` is committed as ``attempt``, or its commit point is unreadable
        (then nothing of that name is touched)."""
        cur = self.strategy.current(name)
        return cur is not None and (cur == attempt or cur.startswith("unreadable:"))

    def live_lease_of(self, names: set[str]) -> bool:
        """True if any lease of these names is alive now (leases listed and read afresh:
        a save may have started since the pass's listing)."""
        fresh = (parse_lease_key(k) for k in self.d.find(LEASES))
        return any(self.alive(*lk) for lk in fresh if lk and lk[0] in names)

    def busy(self, names: set[str], newest: float) -> bool:
        """True if something was written below these names within ``grace``, or a lease
        of one of them is alive (listed and read afresh)."""
        return newest + self.grace > self.now or self.live_lease_of(names)

    # -- acting ---------------------------------------------------------------------------
    def record(self, kind: ActionKind, target: str, reason: str, nkeys: int = 0) -> None:
        self.report.actions.append(RecoveryAction(kind, target, reason, nkeys))

    def act(self, kind: ActionKind, target: str, reason: str, nkeys: int = 1, tree: bool = False) -> None:
        self.record(kind, target, reason, nkeys)
        if self.dry_run:
            return
        if tree:
            self.d.delete_tree(target)
        else:
            self.d.delete(target)

    def remove_tree(self, kind: ActionKind, prefix: str, reason: str, nkeys: int) -> bool:
        """Remove the uncommitted tree ``prefix`` the strategy's way
        (:meth:`CommitStrategy.remove_tree`: on rename backends claimed into the trash
        first); False if a concurrent rename took it (committed, or removed by another
        recovery)."""
        if not self.dry_run and not self.strategy.remove_tree(prefix):
            return False
        self.record(kind, prefix, reason, nkeys)
        return True

    # -- the pass -----------------------------------------------------------------------
    def run(self, flax_prefix: str | None) -> RecoveryReport:
        scan = self.scan()
        committed = self.strategy.committed_names(set(scan.points))
        self.report.committed = sorted(committed)
        named = self.commit_points(scan)
        self.attempts(scan, named)
        for key in sorted(scan.claims):
            self.claim(key)
        for (name, attempt) in sorted(scan.leases):
            if (name, attempt) not in scan.attempts:
                self.stray_lease(name, attempt, "expired lease with no data")
        for prefix, keys in sorted(scan.trash.items()):
            self.act(ActionKind.TRASH, prefix, "interrupted delete", len(keys), tree=True)
        self.probes(scan)
        claimed = _claimed_dirs(scan.listing)
        if flax_prefix is not None:
            self.flax(scan.listing, flax_prefix, claimed)
        self.temps(scan, committed, claimed)
        if self.d.capabilities.multipart_uploads:
            self.uploads(scan.listing, scan.nested)
        if self.report.actions:
            log.info("%s", self.report.summary())
        return self.report

    def scan(self) -> _Scan:
        """List the root once and sort every key by what the strategy says it is."""
        listing = self.d.find("")
        scan = _Scan(listing, _store_roots(listing))
        for key, info in listing.items():
            self.add(scan, self.strategy.classify(key, listing=listing, nested=scan.nested), key, info.mtime)
        for kc in self.strategy.reserved_trees():  # (empty directories: not in a listing of files)
            if kc.kind is KeyKind.ATTEMPT:
                scan.attempts.setdefault((kc.name, kc.attempt), _Attempt(kc.name, kc.attempt, kc.prefix))
            elif kc.kind is KeyKind.TRASH:
                scan.trash.setdefault(kc.prefix, [])
        return scan

    def add(self, scan: _Scan, kc: KeyClass, key: str, mtime: float | None) -> None:
        """Record one classified key in ``scan`` (a foreign key is not recorded)."""
        now = self.now
        if kc.kind is KeyKind.TEMP:
            scan.temps.append((key, mtime or now))
        elif kc.kind is KeyKind.LEASE:
            scan.leases[(kc.name, kc.attempt)] = key
        elif kc.kind is KeyKind.CLAIM:
            scan.claims.append(key)
        elif kc.kind is KeyKind.PROBE:
            scan.probes[kc.prefix] = max(scan.probes.get(kc.prefix, 0.0), mtime or now)
        elif kc.kind is KeyKind.ATTEMPT:
            a = scan.attempts.setdefault((kc.name, kc.attempt), _Attempt(kc.name, kc.attempt, kc.prefix))
            a.keys.append(key)
            a.newest = max(a.newest, mtime if mtime is not None else now)
        elif kc.kind is KeyKind.TRASH:
            scan.trash[kc.prefix].append(key)
        elif kc.kind is KeyKind.MARKER:
            scan.points[kc.name] = mtime

    def commit_points(self, scan: _Scan) -> dict[str, str | None]:
        """Which attempt each listed commit point names, where commit points name attempts
        in place (read concurrently: a marker may name an attempt the listing does not
        show). Used to skip committed attempts early and to repair markers whose data is
        gone; every removal re-reads the commit point itself. None: unreadable right now,
        so nothing of that name is touched; names whose point vanished are left out."""
        if not self.strategy.in_place:
            return {}
        named = self.read_points(set(scan.points))
        for name in sorted(named):
            att = named[name]
            if att and not att.startswith("unreadable:") and (name, att) not in scan.attempts:
                named[name] = self.dangling_point(name, att, scan.points[name])
        return named

    def read_points(self, names: set[str]) -> dict[str, str | None]:
        """The attempt each commit point names (one GET each, no generation: this only
        nominates)."""
        strategy = self.strategy

        def one(name: str) -> tuple[str, str | None, bool]:
            try:
                cur = strategy.named_attempt(name)
            except Exception:  # noqa: BLE001 - conservative: touch nothing of it
                return name, None, True
            return name, cur, cur is not None

        with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(names)))) as pool:
            return {n: cur for n, cur, keep in pool.map(one, sorted(names)) if keep}

    def dangling_point(self, name: str, attempt: str, mtime: float | None) -> str | None:
        """A commit point naming ``attempt``, whose data the listing did not show: once
        older than ``grace``, the strategy repairs it if its data is still gone when read
        afresh (:meth:`MarkerStrategy.repair_point`). Returns the attempt the name holds
        afterwards."""
        if (mtime if mtime is not None else self.now) + self.grace > self.now:
            return attempt
        held, done = self.strategy.repair_point(name, attempt, dry_run=self.dry_run)
        if done is not None:
            self.record(ActionKind.MARKER, *done)
        return held

    def attempts(self, scan: _Scan, named: dict[str, str | None]) -> None:
        """Every attempt the listing showed, committed ones skipped."""
        for ident, a in sorted(scan.attempts.items()):
            name, attempt = ident
            if name in named and named[name] in (None, attempt):
                # committed (or unreadable: be conservative); only a dead lease goes
                if named[name] == attempt and ident in scan.leases:
                    self.stray_lease(name, attempt, "expired lease of a committed attempt")
                continue
            self.attempt(a)

    def attempt(self, a: _Attempt) -> None:
        name, attempt = a.name, a.attempt
        state, gen = self.lease_state(name, attempt)
        if state is LeaseState.LIVE or (state is LeaseState.GONE and a.newest + self.grace > self.now):
            self.report.in_flight.append(a.prefix)
            return
        if not self.dry_run and state is LeaseState.EXPIRED and not self.fence(name, attempt, gen):
            self.report.in_flight.append(a.prefix)
            return
        if self.strategy.in_place and self.committed_as(name, attempt):
            return  # committed between the listing and now
        why = "lease expired" if state is LeaseState.EXPIRED else f"no lease, untouched for more than {self.grace:.0f}s"
        removed = self.remove_tree(ActionKind.ATTEMPT, a.prefix, f"uncommitted attempt of {name!r}: {why}", len(a.keys))
        if removed and state is LeaseState.EXPIRED:
            self.record(ActionKind.LEASE, lease_key(name, attempt), "lease of a removed attempt", 0)

    def stray_lease(self, name: str, attempt: str, why: str) -> None:
        state, gen = self.lease_state(name, attempt)
        if state is not LeaseState.EXPIRED:
            return
        if self.dry_run or self.fence(name, attempt, gen):
            self.record(ActionKind.LEASE, lease_key(name, attempt), why, 0)

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
        ttl = holder.ttl if holder.ttl is not None else self.context.lease_ttl
        mtime = info.mtime if info.mtime is not None else self.now
        if (holder.attempt is not None and self.alive(name, holder.attempt)) or (
                mtime + ttl + self.grace > self.now):
            self.report.in_flight.append(key)
            return
        if not self.dry_run:
            try:
                self.d.delete(key, if_generation=info.generation)
            except PreconditionFailedError:
                return
        self.record(ActionKind.CLAIM, key, f"claim of a commit of {name!r} whose writer is dead", 0)

    def probes(self, scan: _Scan) -> None:
        for prefix, newest in sorted(scan.probes.items()):
            # a check cleans up after itself; one interrupted (a crash, a lost delete) leaves
            # its few small objects: no save ever reads them
            if newest + max(self.grace, TEMP_MIN_AGE) < self.now:
                self.act(ActionKind.TEMP, prefix, "conformance check interrupted", tree=True)

    def temps(self, scan: _Scan, committed: set[str], claimed: set[str]) -> None:
        age = max(self.grace, TEMP_MIN_AGE)
        for key, mtime in scan.temps:
            # only this driver's temporaries of single-file writes, never inside a
            # checkpoint, an attempt or another store's root
            if mtime + age < self.now and key.split("/", 1)[0] not in committed and (
                    not self.foreign(key, claimed)):
                self.act(ActionKind.TEMP, key, f"temporary file older than {age:.0f}s")
        for key in self.d.stray_leftovers(age):
            self.act(ActionKind.TEMP, key, f"scratch directory of a killed process, older than {age:.0f}s", tree=True)

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
        lists every upload below the root (S3), only uploads at keys the strategy
        classifies as its own are: an attempt's (``<name>/attempt-<id>/…`` of this store's
        layout) and a one-file checkpoint's ``<name>``; a nested store's uploads and the
        user's own elsewhere below the root are never touched. Where it lists only this
        store's own (``own_uploads``), every one is."""
        own_only = self.d.own_uploads
        keys: Mapping[str, FileInfo] = {} if own_only else listing
        for key, upload_id, started in self.d.list_incomplete_uploads(""):
            if started + self.grace > self.now:
                continue
            kc = self.strategy.classify(key, listing=keys, nested=set() if own_only else nested)
            if kc.kind is KeyKind.PROBE:
                if started + max(self.grace, TEMP_MIN_AGE) < self.now:  # an interrupted check's
                    self.record(ActionKind.UPLOAD, f"{key} ({upload_id})", "conformance check interrupted")
                    if not self.dry_run:
                        self.d.abort_upload(key, upload_id)
                continue
            if kc.kind is KeyKind.ATTEMPT:
                if self.alive(kc.name, kc.attempt):
                    continue
            elif not (own_only or kc.kind is KeyKind.ONE_FILE):
                continue  # not a key of this store's layout
            elif self.live_lease_of({key}):
                continue  # a one-file save in flight
            self.record(ActionKind.UPLOAD, f"{key} ({upload_id})", "unfinished multipart upload")
            if not self.dry_run:
                self.d.abort_upload(key, upload_id)

    # -- flax's legacy layout -------------------------------------------------------------
    def flax(self, listing: dict[str, FileInfo], prefix: str, claimed: set[str]) -> None:
        """flax's own leftovers (:func:`~atomicstore.commit.flaxlayout.flax_candidates`),
        each decided from storage: a committed checkpoint of any name is never removed
        (a ``_gda`` of ``compat.flax``'s multi-process layout whose main file is absent
        is un-published, at the generation read); a name with a live lease is in flight;
        a file may be a one-file checkpoint (``<prefix>tmp`` is a valid name) and is
        left; a tree holding a marker, a manifest, a reserved directory or attempts of
        this store is not flax's; what is left, older than ``grace``, with the main file
        of a ``_gda`` still absent, is removed."""
        tops = {k.split("/", 1)[0] for k in listing}
        if self.d.capabilities.directories:
            tops |= {e.name for e in self.d.listdir("")}
        for c in flax_candidates(tops, prefix):
            self.flax_leftover(c, listing, claimed)

    def flax_leftover(self, c: FlaxCandidate, listing: dict[str, FileInfo], claimed: set[str]) -> None:
        d, top = self.d, c.top
        keys = [k for k in listing if k.startswith(top + "/")]
        if top in listing or (not keys and not d.capabilities.directories):
            return  # a file: flax's staging, or a one-file checkpoint of that name
        newest = max((listing[k].mtime or 0.0 for k in keys), default=0.0)
        generation = self.strategy.current(top)
        if generation is not None:  # committed (whatever its name says): never removed, but for one case
            if c.main is not None and not generation.startswith("unreadable:") and not self.busy(c.names, newest):
                self.gda_orphan(top, c.main, generation)
            return
        if self.busy(c.names, newest):
            self.report.in_flight.append(top)
            return
        if top in claimed or any(x.startswith(top + "/") for x in claimed) or any(
                k.split("/")[1].startswith(ATTEMPT_PREFIX) for k in keys) or (
                d.capabilities.directories and d.exists(f"{top}/{RESERVED_DIR}")):
            return  # holds a checkpoint's, an attempt's or another store's names
        if c.main is not None and d.exists(c.main):
            return  # the main file appeared meanwhile
        # rename backends: the tree, claimed into the trash; object stores: the keys
        # listed, not the prefix (a save of that name starting now writes keys of its own)
        if self.dry_run or self.strategy.remove_keys(top, keys):
            self.record(ActionKind.FLAX, top, f"{c.what} (uncommitted)", len(keys))

    def gda_orphan(self, top: str, main: str, generation: str) -> None:
        """Un-publish the committed ``_gda`` checkpoint ``top`` of ``compat.flax``'s
        multi-process save if its main file ``main`` is absent (a crash between the two
        commits), recognised by its files; at ``generation``, so a newer save of that name
        is never removed. Any other committed checkpoint is left."""
        try:
            _, raw = self.strategy.resolve(top)
            manifest = Manifest.from_bytes(raw, where=self.d.describe(top))
        except (NotFoundError, CorruptionError):
            return
        if manifest.attempt != generation or not is_flax_gda(manifest) or self.d.exists(main):
            return
        what = "orphaned _gda checkpoint of a multi-process save (no main file)"
        if not self.dry_run:
            try:
                self.strategy.unpublish(top, if_generation=generation)
            except (NotFoundError, PreconditionFailedError):
                return  # changed meanwhile: leave it to the next pass
        self.record(ActionKind.FLAX, top, what)
