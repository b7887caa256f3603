"""The in-place commit: a directory another library writes directly under ``<name>/``
on an object store, committed by a marker that records every file.

Orbax's readers want a step's items directly under ``<step>/`` and treat every
subdirectory of a step as an item, so an Orbax step on an object store cannot be staged in
an ``attempt-<id>/`` prefix (the marker strategy's layout, ``strategies.py``): the library
writes in place, and this module commits what it wrote. One attempt (:class:`InPlaceCommit`):

* **claim**: before any byte, the attempt's lease, then a conditional create
  (``ifGenerationMatch=0``) of ``<name>/atomicstore-claim.json`` naming the attempt: a
  second writer of the name is refused there (:class:`CommitConflictError`);
* **publish**: list the files (the store's CRC32C where it reports one, else read back),
  check the claim and the lease, and create the non-empty ``<name>/commit_success.txt``
  conditionally: the commit point and the record of the attempt (writer, size and CRC32C
  of every file);
* **settle**: a refused create whose bytes turn out to be ours (a lost reply) is a commit;
  another writer's marker is :class:`CommitConflictError`;
* **take back**: after the marker landed, the claim and the files are checked once more: a
  writer declared dead whose marker PUT was delayed past its lease (recovery removed its
  step meanwhile) deletes its marker again and raises :class:`LeaseLostError`.

Judging and recovery of such steps (:func:`judge_in_place`, :func:`recover_claimed`,
:func:`recover_dangling_marker`) follow the same rules as ``recovery.py``: the lease read
by :func:`~atomicstore.commit.lease.lease_state`, an expired lease fenced before anything is
removed, the claim removed last. Never imports the library whose files it commits: its
version is passed in.
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    CommitConflictError,
    CorruptionError,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)
from .lease import Lease, LeaseState, lease_key, lease_state
from .manifest import Crc32cHasher, FileEntry, Manifest
from .names import ATTEMPT_PREFIX, MARKER_FILE, validate_path
from .recovery import RecoveryAction
from .store import Store
from .strategies import MarkerStrategy, read_capped

log = logging.getLogger("atomicstore.commit")

#: the object that takes a step on object stores (conditional create, names the attempt)
CLAIM_FILE = "atomicstore-claim.json"
#: the key of a staged step's manifest metadata that marks it as an Orbax step
METADATA_KEY = "orbax"
#: ``format`` of an in-place step's ``commit_success.txt`` (and of the metadata)
COMMIT_FORMAT = "atomicstore.orbax/1"
#: ``format`` of the claim
CLAIM_FORMAT = "atomicstore.orbax-claim/1"
#: a claim longer than this is not one of this module's
MAX_STEP_CLAIM_BYTES = 64 * 2**10
#: a commit record longer than this is refused unread
MAX_RECORD_BYTES = 64 * 2**20
_ATTEMPT = re.compile(r"[A-Za-z0-9_-]{1,100}")
#: how a lease state reads in a judgement's reason


class AttemptState(enum.StrEnum):
    """What an attempt is, judged from storage (compares equal to its old string)."""

    STALE = "stale"  #: provably uncommitted and dead: may be removed
    IN_FLIGHT = "in_flight"
    COMMITTED = "committed"
    FOREIGN = "foreign"  #: not an attempt of this layout: never touched


@dataclass
class Judgement:
    """What an attempt is, decided from storage read just now (see :class:`AttemptState`)."""

    state: AttemptState
    reason: str
    attempt: str | None = None
    lease_generation: str | None = None
    lease_exists: bool = False
    claim_generation: str | None = None
    keys: list[str] = field(default_factory=list)


def writes_in_place(store: Store) -> bool:
    """Object stores (no atomic rename): the library writes its step in place."""
    return isinstance(store.strategy, MarkerStrategy)


def describe(store: Store, key: str) -> str:
    """``key`` of ``store`` as messages name it."""
    return store.driver.describe(key)


class InPlaceCommit:
    """One attempt at committing ``<name>/`` in place (see the module docstring).

    ``version`` (the writing library's release) is recorded in the marker. The caller
    writes the files between :meth:`begin` and :meth:`publish`; :meth:`abort` discards
    them, :meth:`abandon` only stops the lease (what was written is recovery's)."""

    def __init__(self, store: Store, name: str, attempt: str, *, version: str = "") -> None:
        self.store, self.name, self.attempt, self.version = store, name, attempt, version
        self.lease: Lease | None = None
        #: this attempt holds the step's claim
        self.claimed = False

    @property
    def started(self) -> bool:
        """The attempt holds its lease (what is written is its own to commit or abort)."""
        return self.lease is not None

    def begin(self) -> None:
        """Refuse a committed step, take the lease, then the claim."""
        store, name = self.store, self.name
        d = store.driver
        if d.exists(f"{name}/{MARKER_FILE}"):
            raise CommitConflictError(f"step {d.describe(name)} is already committed", name=name)
        lease = store.context.lease(name, self.attempt)
        lease.acquire()  # before any data: recovery leaves the attempt alone while it lives
        self.lease = lease
        self._claim()

    def _claim(self) -> None:
        """Take the step before any byte is written: a conditional create that exactly one
        attempt wins (a lost reply is recognised by its bytes, which name the attempt)."""
        store, name = self.store, self.name
        doc = {"format": CLAIM_FORMAT, "name": name, "attempt": self.attempt,
               "writer": store.writer_id, "created": time.time()}
        try:
            store.write_file(f"{name}/{CLAIM_FILE}", json.dumps(doc, sort_keys=True).encode(),
                             overwrite=False)
        except AlreadyExistsError:
            holder = read_step_claim(store, name)
            who = f"attempt {holder['attempt']} of {holder['writer']}" if holder else "another writer"
            raise CommitConflictError(
                f"step {store.driver.describe(name)} is being written by {who} (or was left by "
                "a crashed save, until recovery removes it): refused before writing anything",
                name=name,
            ) from None
        self.claimed = True

    def check_still_ours(self) -> None:
        """:class:`LeaseLostError` (the lease stopped) if recovery took this attempt away:
        its claim is gone or another attempt's."""
        holder = read_step_claim(self.store, self.name)
        if holder is None or holder["attempt"] != self.attempt:
            self.claimed = False  # not ours (any more): never remove it
            if self.lease is not None:
                self.lease.stop()
            raise LeaseLostError(
                f"refusing to commit {self.store.driver.describe(self.name)}: its claim is gone or "
                "another attempt's (this writer was declared dead and its step cleaned up)", name=self.name)

    def publish(self) -> None:
        """Commit what was written: the marker, created conditionally (the commit point).
        Before it, nothing is committed and a failure discards the attempt (a lost lease
        leaves it to recovery); after it, see :meth:`_settle` and :meth:`_take_back`."""
        lease = self.lease
        assert lease is not None
        store, name = self.store, self.name
        d = store.driver
        try:
            self.check_still_ours()
            files = in_place_files(store, name)
            doc = {"format": COMMIT_FORMAT, "layout": "in-place", "name": name, "attempt": self.attempt,
                   "writer": store.writer_id, "orbax_version": self.version, "committed": time.time(),
                   "files": {p: {"size": e.size, "crc32c": f"{e.crc32c:08x}"} for p, e in sorted(files.items())}}
            marker = json.dumps(doc, sort_keys=True, indent=0).encode()
            lease.check()  # a writer declared dead must not commit; nothing is written after it
        except LeaseLostError:
            lease.stop()  # the step is recovery's now
            raise
        except BaseException:
            self.abort()  # nothing was committed; this attempt holds the claim
            raise
        key = f"{name}/{MARKER_FILE}"
        written: str | None
        try:
            # the commit point: ifGenerationMatch=0 / If-None-Match
            written = d.put(key, marker, exclusive=True)
        except AlreadyExistsError:
            # another writer's marker, or our own first try landed and only its reply was
            # lost (the retry was refused): read the bytes back to know which
            ours, written = holds(store, key, marker)
            if not ours:
                lease.release()
                raise CommitConflictError(
                    f"step {d.describe(name)} was committed by another writer", name=name) from None
        except BaseException as exc:
            # a timeout, or retries exhausted: the write may have landed (then we committed)
            # or may still land, so the attempt is kept (its lease object too, so that
            # recovery waits ttl + grace) for recovery to judge
            ours, written = holds(store, key, marker) if isinstance(exc, Exception) else (False, None)
            if not ours:
                lease.stop()
                raise
        if written is None:  # a store that does not report generations
            written = holds(store, key, marker)[1]
        try:
            self._take_back(files, written)
        except LeaseLostError:
            lease.stop()
            raise
        lease.release()

    def _take_back(self, files: Mapping[str, FileEntry], written: str | None) -> None:
        """After the marker landed (as the core marker protocol does after its PUT): the
        claim must still be this attempt's and every file it records still there. A writer
        declared dead whose PUT was delayed past ``lease_ttl + grace`` lands its marker on a
        step recovery has removed (files, then claim): then the marker is taken back,
        conditionally on the generation just written, and :class:`LeaseLostError` raised.
        (Recovery removes such a marker too, if this writer dies before taking it back.)"""
        store, name = self.store, self.name
        d = store.driver
        holder = read_step_claim(store, name)
        claim_ours = holder is not None and holder["attempt"] == self.attempt
        found = d.find(name) if claim_ours else {}
        missing = [rel for rel, e in files.items()
                   if (i := found.get(f"{name}/{rel}")) is None or i.size != e.size]
        if claim_ours and not missing:
            return
        key = f"{name}/{MARKER_FILE}"
        try:
            if written is not None:
                d.delete(key, if_generation=written)
        except (PreconditionFailedError, NotFoundError):
            pass  # replaced or removed meanwhile: not ours to touch
        self.claimed = False
        why = f"{len(missing)} of its files are gone" if claim_ours else "its claim is gone or another attempt's"
        raise LeaseLostError(
            f"{d.describe(name)}: this writer's commit marker landed after it was declared dead and "
            f"its step removed by recovery ({why}): the marker was taken back, nothing committed",
            name=name)

    def abort(self) -> None:
        """Discard the attempt: if it holds the claim, its files and then the claim; its lease."""
        if self.lease is None:
            return
        if self.claimed:
            try:
                remove_in_place(self.store, self.name, keep_claim=False)
            except Exception:  # noqa: BLE001 - recovery removes what is left
                pass
        self.lease.release()

    def abandon(self) -> None:
        """The attempt was dropped without publish or abort: release its lease; what it
        wrote is left to recovery."""
        if self.lease is not None:
            self.lease.release()


def holds(store: Store, key: str, data: bytes) -> tuple[bool, str | None]:
    """(True, its generation) if ``key`` holds exactly ``data`` now (a write whose outcome
    was unclear), else (False, None). The generation is read first: a conditional delete
    on it fails if the object changed after."""
    try:
        gen = store.driver.info(key).generation
        if store.driver.read(key) != data:
            return False, None
    except (NotFoundError, StorageError):
        return False, None
    return True, gen


def read_step_claim(store: Store, name: str) -> dict[str, Any] | None:
    """The claim of an in-place step (validated), None if absent or unreadable."""
    try:
        raw = read_capped(store.driver, f"{name}/{CLAIM_FILE}", MAX_STEP_CLAIM_BYTES)
    except NotFoundError:
        return None
    if len(raw) > MAX_STEP_CLAIM_BYTES:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not (isinstance(doc, dict) and doc.get("format") == CLAIM_FORMAT and doc.get("name") == name
            and isinstance(doc.get("attempt"), str) and isinstance(doc.get("writer"), str)
            and _ATTEMPT.fullmatch(doc["attempt"])):
        return None
    return doc


def skip_in_place(rel: str) -> bool:
    """Keys below an in-place step that are not the library's files: marker, claim, and
    the atomicstore attempts of other writers (never written by an in-place commit)."""
    return rel in (MARKER_FILE, CLAIM_FILE) or rel.startswith(ATTEMPT_PREFIX)


def in_place_files(store: Store, name: str) -> dict[str, FileEntry]:
    """Size and CRC32C of every file of an in-place step, from a fresh listing (the
    store's own CRC32C where it reports one, else read back)."""
    out: dict[str, FileEntry] = {}
    unknown: list[tuple[str, str]] = []
    for key, info in store.driver.find(name).items():
        rel = key[len(name) + 1:]
        if skip_in_place(rel):
            continue
        validate_path(rel, what="file Orbax wrote")
        if info.crc32c is not None:
            out[rel] = FileEntry(info.size, info.crc32c)
        else:
            unknown.append((rel, key))

    def read(item: tuple[str, str]) -> tuple[str, FileEntry]:
        rel, key = item
        h = Crc32cHasher()
        for chunk in store.driver.iter_read(key):
            h.update(chunk)
        return rel, FileEntry(h.size, h.value)

    if unknown:
        with concurrent.futures.ThreadPoolExecutor(min(8, len(unknown))) as pool:
            out.update(pool.map(read, unknown))
    return out


def read_record(store: Store, name: str) -> Manifest:
    """The manifest of the committed in-place step ``name``, built from its marker:
    :class:`NotFoundError` if it has none, :class:`CorruptionError` if it is malformed or
    not this module's record (stock Orbax's marker)."""
    key = f"{name}/{MARKER_FILE}"
    where = store.driver.describe(key)
    try:
        size = store.driver.info(key).size
    except NotFoundError:
        raise NotFoundError(f"no committed step {store.driver.describe(name)}") from None
    if size > MAX_RECORD_BYTES:
        raise CorruptionError(f"{where}: {size} bytes, larger than the {MAX_RECORD_BYTES} allowed", path=key)
    return parse_record(store.driver.read(key), name, where)


def parse_record(raw: bytes, name: str, where: str) -> Manifest:
    """An in-place step's ``commit_success.txt`` (read from storage: hostile)."""
    if len(raw) > MAX_RECORD_BYTES:
        raise CorruptionError(f"{where}: {len(raw)} bytes, larger than the {MAX_RECORD_BYTES} allowed")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptionError(f"{where}: not an atomicstore Orbax commit record (stock Orbax's marker?)") from None
    try:
        if not isinstance(doc, dict) or doc.get("format") != COMMIT_FORMAT or doc.get("layout") != "in-place":
            raise TypeError("not an atomicstore Orbax commit record")
        if doc.get("name") != name:
            raise TypeError(f"it names step {doc.get('name')!r}")
        attempt, writer, committed = doc["attempt"], doc["writer"], doc["committed"]
        if not (isinstance(attempt, str) and _ATTEMPT.fullmatch(attempt)):
            raise TypeError("bad attempt")
        if not isinstance(writer, str) or isinstance(committed, bool) or not isinstance(committed, int | float):
            raise TypeError("bad writer or time")
        raw_files = doc["files"]
        if not isinstance(raw_files, dict):
            raise TypeError("files is not an object")
        files = {}
        for p, e in raw_files.items():
            validate_path(p)
            if skip_in_place(p) or not isinstance(e, dict):
                raise TypeError(f"bad entry {p!r}")
            size, crc = e.get("size"), e.get("crc32c")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise TypeError(f"bad size for {p!r}")
            if not isinstance(crc, str) or not re.fullmatch(r"[0-9a-f]{8}", crc):
                raise TypeError(f"bad crc32c for {p!r}")
            files[p] = FileEntry(size, int(crc, 16))
    except (KeyError, TypeError, InvalidArgumentError) as exc:
        raise CorruptionError(f"{where}: malformed commit record ({exc})", path=MARKER_FILE) from None
    return Manifest(name=name, attempt=attempt, writer=writer, created=float(committed), files=files,
                    metadata={METADATA_KEY: {"format": COMMIT_FORMAT, "layout": "in-place",
                                             "orbax_version": str(doc.get("orbax_version", ""))}},
                    committed=float(committed))


def verify_in_place(store: Store, name: str, manifest: Manifest) -> None:
    """Re-read every file ``manifest`` records below ``name`` and check its size and
    CRC32C: :class:`~atomicstore.ChecksumMismatchError` naming the file."""
    found = store.driver.find(name)
    for rel, entry in sorted(manifest.files.items()):
        key = f"{name}/{rel}"
        if key not in found:
            raise ChecksumMismatchError(f"{store.driver.describe(key)}: file is missing", path=rel)
        h = Crc32cHasher()
        for chunk in store.driver.iter_read(key):
            h.update(chunk)
        entry.check(rel, h.size, h.value, where=store.driver.describe(key))


def judge_in_place(store: Store, name: str, now: float, grace: float | None = None) -> Judgement:
    """An in-place step: stale iff it holds a claim of this module, has no marker, and its
    attempt's lease expired (or it has none and nothing was written within ``grace``). A
    step without a claim is not this module's to judge (stock Orbax's, Orbax's root
    metadata, a user's directory)."""
    d = store.driver
    g = store.grace if grace is None else grace
    claim_key = f"{name}/{CLAIM_FILE}"
    try:
        claim_gen = d.info(claim_key).generation  # the generation first: a change after shows
    except NotFoundError:
        return Judgement(AttemptState.FOREIGN, "no atomicstore claim: not an attempt of this integration")
    claim = read_step_claim(store, name)
    if claim is None:
        return Judgement(AttemptState.FOREIGN, "unreadable claim: left alone")
    attempt = claim["attempt"]
    if d.exists(f"{name}/{MARKER_FILE}"):
        return Judgement(AttemptState.COMMITTED, "it has a commit marker", attempt)
    lease, gen = lease_state(d, name, attempt, now, g)
    if lease is LeaseState.LIVE:
        return Judgement(AttemptState.IN_FLIGHT, "its lease is alive", attempt, gen, True, claim_gen)
    listing = d.find(name)
    newest = max(((i.mtime if i.mtime is not None else now) for i in listing.values()), default=0.0)
    if lease is LeaseState.GONE and newest + g > now:
        return Judgement(AttemptState.IN_FLIGHT, f"no lease, written to within {g:.0f}s", attempt, None, False,
                         claim_gen)
    return Judgement(AttemptState.STALE, f"uncommitted, lease {lease.word}", attempt, gen,
                     lease is LeaseState.EXPIRED, claim_gen, sorted(listing))


def remove_in_place(store: Store, name: str, *, keep_claim: bool, claim_generation: str | None = None) -> int:
    """Remove the files of an uncommitted in-place step, then, unless ``keep_claim``, its
    claim (only at ``claim_generation`` if given)."""
    d = store.driver
    keys = [k for k in sorted(d.find(name), reverse=True) if not skip_in_place(k[len(name) + 1:])]
    for k in keys:
        d.delete(k)
    if not keep_claim:
        try:
            d.delete(f"{name}/{CLAIM_FILE}", if_generation=claim_generation)
        except PreconditionFailedError:
            pass  # another attempt's claim: not ours to remove
    return len(keys)


def recover_claimed(store: Store, name: str, now: float, grace: float, dry_run: bool
                    ) -> tuple[bool, RecoveryAction | None]:
    """(whether ``name`` holds a claim of this module, what was removed): a claimed step
    that is provably uncommitted and dead is removed, its expired lease fenced first (the
    dead writer can never commit), the claim last (no new attempt takes the step before it
    is empty)."""
    j = judge_in_place(store, name, now, grace)
    if j.state is AttemptState.FOREIGN and j.claim_generation is None:
        return False, None
    if j.state is not AttemptState.STALE:
        return True, None
    why = f"uncommitted in-place Orbax step (attempt {j.attempt}): {j.reason}"
    if dry_run:
        return True, RecoveryAction("orbax", name, why, len(j.keys))
    assert j.attempt is not None
    d = store.driver
    if j.lease_exists:  # fence: the dead writer's pre-commit lease check now fails
        try:
            d.delete(lease_key(name, j.attempt), if_generation=j.lease_generation)
        except PreconditionFailedError:
            return True, None  # renewed meanwhile: alive
    if d.exists(f"{name}/{MARKER_FILE}"):
        return True, None  # it committed right before the fence
    try:
        if d.info(f"{name}/{CLAIM_FILE}").generation != j.claim_generation:
            return True, None  # another attempt took the step meanwhile
    except NotFoundError:
        return True, None
    n = remove_in_place(store, name, keep_claim=False, claim_generation=j.claim_generation)
    # a marker of the dead writer landing during the removal (its PUT delayed in the network)
    # names files that are gone now: take it back at once (its writer, if it still runs,
    # does the same when it checks its step after the PUT)
    take_back_marker(store, name, j.attempt)
    return True, RecoveryAction("orbax", name, why, n + 1)


def take_back_marker(store: Store, name: str, attempt: str) -> bool:
    """Remove ``name``'s marker if it is this module's record of ``attempt`` (at the
    generation read with it); True if removed."""
    d = store.driver
    key = f"{name}/{MARKER_FILE}"
    try:
        gen = d.info(key).generation
        raw = read_capped(d, key, MAX_RECORD_BYTES)
        if parse_record(raw, name, d.describe(key)).attempt != attempt:
            return False
        d.delete(key, if_generation=gen)
    except (NotFoundError, CorruptionError, PreconditionFailedError):
        return False
    return True


def recover_dangling_marker(store: Store, name: str, now: float, grace: float, dry_run: bool
                            ) -> RecoveryAction | None:
    """A step holding only this module's marker, its claim and every file it records
    gone: a writer declared dead whose marker PUT landed after recovery removed its step
    (and which died before taking it back), or a delete that stopped before the marker.
    Stock Orbax would list it and fail to restore it, and it blocks new saves of the step.
    Once older than ``grace`` (its writer takes it back itself right after its PUT), it is
    removed at the generation read, its record read afresh. A step whose files are only
    partly gone is left alone (a committed step damaged by a plain delete: not provably
    garbage)."""
    d = store.driver
    key = f"{name}/{MARKER_FILE}"
    try:
        info = d.info(key)
        raw = read_capped(d, key, MAX_RECORD_BYTES)
    except NotFoundError:
        return None
    try:
        record = parse_record(raw, name, d.describe(key))
    except CorruptionError:
        return None  # stock Orbax's marker, or not ours: never touched
    if (info.mtime if info.mtime is not None else now) + grace > now:
        return None
    if d.exists(f"{name}/{CLAIM_FILE}"):
        return None
    found = d.find(name)
    if any(f"{name}/{rel}" in found for rel in record.files):
        return None
    why = f"commit marker of attempt {record.attempt} whose claim and files are gone"
    if not dry_run:
        try:
            d.delete(key, if_generation=info.generation)
        except (PreconditionFailedError, NotFoundError):
            return None  # changed meanwhile: the next pass decides
    return RecoveryAction("marker", key, why, 1)


__all__ = [
    "CLAIM_FILE",
    "CLAIM_FORMAT",
    "COMMIT_FORMAT",
    "MAX_RECORD_BYTES",
    "MAX_STEP_CLAIM_BYTES",
    "METADATA_KEY",
    "AttemptState",
    "InPlaceCommit",
    "Judgement",
    "describe",
    "holds",
    "in_place_files",
    "judge_in_place",
    "parse_record",
    "read_record",
    "read_step_claim",
    "recover_claimed",
    "recover_dangling_marker",
    "remove_in_place",
    "skip_in_place",
    "take_back_marker",
    "verify_in_place",
    "writes_in_place",
]
