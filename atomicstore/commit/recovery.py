"""Recovery: remove what crashed saves and deletes left behind, and nothing else.

One listing of the store (plus the few lease objects and, rarely, a marker) decides
everything; committed data is never read. The rules, in ``docs/recovery.md``:

* **Never touched**: a committed checkpoint (rename: a ``<name>/`` directory; marker: the
  marker and the attempt it names), and any attempt whose lease was renewed less than
  ``ttl + grace`` seconds ago, or which has no lease and was written to less than
  ``grace`` seconds ago (a save in flight).
* **Removed**: attempts no marker names and no live lease protects (stale staging
  directories, attempt prefixes of failed or crashed saves, data of half-deleted
  checkpoints), trash of interrupted deletes, expired leases whose data is gone, stale
  temporary files of single-file writes, and unfinished multipart uploads of dead
  attempts (S3).

Every removal is idempotent, so several processes may recover the same store at once.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import CorruptionError, NotFoundError
from .lease import parse_lease_key, read_lease_ttl
from .names import MARKER_FILE, RESERVED_DIR, validate_name
from .strategies import ATTEMPT_PREFIX, STAGING, TRASH, MarkerStrategy

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("atomicstore.recovery")

#: Default grace period (seconds) before unleased, unreferenced data counts as stale.
DEFAULT_GRACE = 120.0

_PUT_TMP = re.compile(r"(^|/)\.[^/]+\.put-\d+-[0-9a-f]+$")


@dataclass(frozen=True)
class RecoveryAction:
    """One thing recovery removed (or, in a dry run, would remove)."""

    kind: str  # "attempt", "trash", "lease", "temp", "upload", "flax"
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


def _flax_leftovers(listing: dict, tops: set[str], prefix: str) -> dict[str, float]:
    """Top-level entries of flax's legacy layout that are provably uncommitted, with the
    newest modification time of their contents: ``<prefix>tmp`` and ``<prefix>tmp_gda``
    (staging of flax's two-rename commit), and ``<prefix><step>_gda`` whose
    ``<prefix><step>`` does not exist (a crash between the two renames, or between the
    two deletes)."""
    newest: dict[str, float] = defaultdict(float)
    for key, info in listing.items():
        top = key.split("/", 1)[0]
        newest[top] = max(newest[top], info.mtime or 0.0)
    out: dict[str, float] = {}
    for top in tops:
        if not top.startswith(prefix):
            continue
        rest = top[len(prefix):]
        if rest in ("tmp", "tmp_gda") or (
            rest.endswith("_gda") and rest[:-4] and not rest.startswith("tmp")
            and f"{prefix}{rest[:-4]}" not in tops
        ):
            out[top] = newest.get(top, 0.0)
    return out


def recover(store: Store, *, dry_run: bool = False, grace: float | None = None,
            now: float | None = None, flax_prefix: str | None = None) -> RecoveryReport:
    """See :meth:`atomicstore.Store.recover`."""
    d = store.driver
    grace = DEFAULT_GRACE if grace is None else grace
    now = time.time() if now is None else now
    report = RecoveryReport(dry_run=dry_run)
    listing = d.find("")
    marker_mode = isinstance(store.strategy, MarkerStrategy)

    attempts: dict[tuple[str, str], _Attempt] = {}
    leases: dict[tuple[str, str], tuple[str, float]] = {}
    trash: dict[str, list[str]] = defaultdict(list)
    temps: list[str] = []
    markers: set[str] = set()

    def add_attempt(name: str, attempt: str, prefix: str, key: str, mtime: float | None) -> None:
        a = attempts.setdefault((name, attempt), _Attempt(name, attempt, prefix))
        a.keys.append(key)
        a.newest = max(a.newest, mtime if mtime is not None else now)

    for key, info in listing.items():
        if key.startswith(RESERVED_DIR + "/"):
            lk = parse_lease_key(key)
            if lk is not None:
                leases[lk] = (key, info.mtime if info.mtime is not None else now)
            elif key.startswith(STAGING + "/"):
                dirname = key[len(STAGING) + 1 :].split("/", 1)[0]
                name, dot, attempt = dirname.rpartition(".")
                add_attempt(name if dot else dirname, attempt, f"{STAGING}/{dirname}", key, info.mtime)
            elif key.startswith(TRASH + "/"):
                trash[f"{TRASH}/{key[len(TRASH) + 1 :].split('/', 1)[0]}"].append(key)
            elif _PUT_TMP.search(key) and (info.mtime or now) + grace < now:
                temps.append(key)
            continue
        if _PUT_TMP.search(key):
            if (info.mtime or now) + grace < now:
                temps.append(key)
            continue
        if not marker_mode:
            continue
        name, _, rest = key.partition("/")
        if rest == MARKER_FILE:
            markers.add(name)
        elif rest.startswith(ATTEMPT_PREFIX):
            attempt = rest[len(ATTEMPT_PREFIX) :].split("/", 1)[0]
            add_attempt(name, attempt, f"{name}/{ATTEMPT_PREFIX}{attempt}", key, info.mtime)

    if d.capabilities.directories:  # empty directories do not show up in a listing of files
        for e in d.listdir(STAGING):
            name, dot, attempt = e.name.rpartition(".")
            ident = (name if dot else e.name, attempt)
            if ident not in attempts:
                attempts[ident] = _Attempt(ident[0], attempt, f"{STAGING}/{e.name}")
        for e in d.listdir(TRASH):
            trash.setdefault(f"{TRASH}/{e.name}", [])

    # Which attempt does each marker name? Only worth a read where a name has several.
    committed_attempt: dict[str, str | None] = {}
    if marker_mode:
        per_name: dict[str, list[str]] = defaultdict(list)
        for (name, attempt) in attempts:
            per_name[name].append(attempt)
        for name in markers:
            report.committed.append(name)
            if len(per_name.get(name, [])) == 1:
                committed_attempt[name] = per_name[name][0]
                continue
            try:
                committed_attempt[name] = store.strategy.read_marker(name).attempt  # type: ignore[attr-defined]
            except (NotFoundError, CorruptionError):
                committed_attempt[name] = None  # a broken marker: touch nothing of this name
    else:
        report.committed.extend(store.strategy.list())

    def lease_alive(key: tuple[str, str]) -> bool | None:
        """True/False for a lease, None if there is none."""
        if key not in leases:
            return None
        lkey, mtime = leases[key]
        try:
            ttl = read_lease_ttl(d, lkey)
        except NotFoundError:
            return None
        except CorruptionError:
            ttl = 0.0
        return mtime + ttl + grace > now

    def act(kind: str, target: str, reason: str, keys: list[str] | None = None, prefix: bool = False) -> None:
        report.actions.append(RecoveryAction(kind, target, reason, len(keys or [target])))
        if dry_run:
            return
        if prefix:
            d.delete_tree(target)
        else:
            d.delete(target)

    for ident, a in sorted(attempts.items()):
        name, attempt = ident
        if marker_mode and name in markers:
            won = committed_attempt.get(name)
            if won is None or won == attempt:
                # committed (or an unreadable marker: be conservative); only a dead lease goes
                if won == attempt and ident in leases and lease_alive(ident) is False:
                    act("lease", leases[ident][0], "expired lease of a committed attempt")
                continue
        alive = lease_alive(ident)
        if alive or (alive is None and a.newest + grace > now):
            report.in_flight.append(a.prefix)
            continue
        why = "lease expired" if alive is False else f"no lease, untouched for more than {grace:.0f}s"
        act("attempt", a.prefix, f"uncommitted attempt of {name!r}: {why}", a.keys, prefix=True)
        if ident in leases:
            act("lease", leases[ident][0], "lease of a removed attempt")

    for ident, (lkey, _mtime) in sorted(leases.items()):
        if ident in attempts:
            continue
        alive = lease_alive(ident)
        if alive is False:
            act("lease", lkey, "expired lease with no data")

    for prefix, keys in sorted(trash.items()):
        act("trash", prefix, "interrupted delete", keys, prefix=True)

    if flax_prefix is not None:
        tops = {k.split("/", 1)[0] for k in listing}
        if d.capabilities.directories:
            tops |= {e.name for e in d.listdir("")}
        for top, newest in sorted(_flax_leftovers(listing, tops, flax_prefix).items()):
            if newest + grace > now:
                report.in_flight.append(top)
                continue
            what = "orphaned _gda directory" if not top[len(flax_prefix):].startswith("tmp") else "flax staging"
            act("flax", top, f"{what} (uncommitted)", [top], prefix=True)

    for key in temps:
        act("temp", key, f"temporary file older than {grace:.0f}s")

    if d.capabilities.multipart_uploads:
        for key, upload_id, started in d.list_incomplete_uploads(""):
            name, _, rest = key.partition("/")
            attempt = rest[len(ATTEMPT_PREFIX) :].split("/", 1)[0] if rest.startswith(ATTEMPT_PREFIX) else ""
            alive = lease_alive((name, attempt)) if attempt else None
            if alive or (alive is None and started + grace > now):
                continue
            report.actions.append(RecoveryAction("upload", f"{key} ({upload_id})", "unfinished multipart upload"))
            if not dry_run:
                d.abort_upload(key, upload_id)

    try:
        report.committed = sorted({validate_name(n) for n in report.committed})
    except ValueError:  # pragma: no cover - names come from listings already filtered
        pass
    if report.actions:
        log.info("%s", report.summary())
    return report
