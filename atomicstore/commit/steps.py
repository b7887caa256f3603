"""Step directories another library writes (Orbax's ``<root>/<step>/``), committed and
recovered by the commit layer.

* On **rename backends** (local disk) a step is an atomicstore transaction named
  ``<step>`` (:class:`StagedCommit`): the library writes into the transaction's staging
  directory ``<root>/.atomicstore/staging/<step>.<attempt>/`` (so its own listing and tmp
  cleanup never see a save in flight, and the lease keeps recovery away). At commit its
  success file is written durably, every file is read back once (size and CRC32C, then
  ``fsync``) and adopted into the manifest, and the transaction commits (manifest, every
  directory fsynced, the lease checked, ``renameat2(RENAME_NOREPLACE)`` onto
  ``<root>/<step>/``, the root fsynced).
* On **object stores** the step is written in place: ``inplace.py``.

On every backend an *empty* step directory (no file below it: a crash's leftover or a
user's ``mkdir``) is judged here (:func:`judge_empty_step`) and removed
(:func:`remove_empty_step`) once untouched for ``grace`` seconds with no live lease of
its step, so that the removal fails if anything was written into it meanwhile.
:func:`recover_steps` is the pass over a root's steps that the adapter runs before the
store's own recovery.
"""

from __future__ import annotations

import concurrent.futures
import enum
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    CorruptionError,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)
from .inplace import (
    CLAIM_FILE,
    COMMIT_FORMAT,
    METADATA_KEY,
    AttemptState,
    InPlaceCommit,
    Judgement,
    judge_in_place,
    read_record,
    recover_claimed,
    recover_dangling_marker,
    verify_in_place,
    writes_in_place,
)
from .lease import LEASES, LeaseState, lease_state, parse_lease_key
from .manifest import FileEntry, Manifest, crc32c
from .names import MARKER_FILE, RESERVED_DIR, validate_name, validate_path
from .recovery import RecoveryAction, RecoveryReport
from .store import Store
from .strategies import STAGING
from .transaction import Transaction

#: an "empty" tree with more directories than this is not judged (hostile input)
MAX_EMPTY_DIRS = 1000


# -- the staged commit (rename backends) ---------------------------------------------------
def staging_path(store: Store, name: str, attempt: str) -> str:
    """The local directory an attempt of ``name`` is staged in (rename backends)."""
    return store.driver.path(store.strategy.attempt_prefix(name, attempt))


def parse_staging_path(path: str) -> tuple[str, str, str] | None:
    """(store root, name, attempt) if ``path`` is ``<root>/.atomicstore/staging/<name>.<attempt>``."""
    head, _, leaf = path.rstrip("/").rpartition("/")
    reserved, _, staging = head.rpartition("/")
    if staging != STAGING.rsplit("/", 1)[1] or not reserved.endswith("/" + RESERVED_DIR):
        return None
    name, dot, attempt = leaf.rpartition(".")
    if not dot or not name or not attempt:
        return None
    try:
        validate_name(name)
    except InvalidArgumentError:
        return None
    return reserved[: -len(RESERVED_DIR) - 1], name, attempt


class StagedCommit:
    """One attempt at committing a step the library writes into a staging directory
    (rename backends): a :class:`~atomicstore.commit.Transaction` whose files are adopted
    at :meth:`publish`. ``version`` (the library's release) is recorded in the manifest,
    ``mode`` given to the staging directory, ``success`` written as its
    ``commit_success.txt``."""

    def __init__(self, store: Store, name: str, attempt: str, *, version: str = "",
                 mode: int | None = None, success: bytes = b"") -> None:
        self.store, self.name, self.attempt, self.version = store, name, attempt, version
        self.mode, self.success = mode, success
        self.txn: Transaction | None = None

    @property
    def started(self) -> bool:
        """The transaction (and its lease) exists."""
        return self.txn is not None

    @property
    def path(self) -> str:
        """The local staging directory."""
        return staging_path(self.store, self.name, self.attempt)

    def begin(self) -> None:
        """Take the step (a committed one: :class:`~atomicstore.CommitConflictError`), then
        the lease, before any data; create the staging directory."""
        meta = {METADATA_KEY: {"format": COMMIT_FORMAT, "layout": "staged", "orbax_version": self.version}}
        # a committed name: CommitConflictError here; then the lease, before any data
        txn = Transaction(self.store.context, self.name, metadata=meta, attempt=self.attempt)
        self.txn = txn
        d = self.store.driver
        d.makedirs(txn.prefix)
        if self.mode is not None:
            try:
                os.chmod(d.path(txn.prefix), self.mode)
            except OSError as exc:
                raise StorageError(f"could not chmod {d.describe(txn.prefix)}: {exc}") from exc

    def _lost(self) -> LeaseLostError:
        return LeaseLostError(
            f"refusing to commit {self.store.driver.describe(self.name)}: its staging directory "
            "is gone (recovery removed it: this writer was declared dead)", name=self.name)

    def check_still_ours(self) -> None:
        """:class:`LeaseLostError` if recovery took the attempt away: its staging
        directory is gone."""
        if not os.path.isdir(self.path):
            raise self._lost()

    def publish(self) -> None:
        """Write the library's success file (``commit_success.txt``, durably), read every
        file back once and adopt it, and commit: manifest, fsyncs, lease check,
        ``rename(NOREPLACE)``, fsync of the root. Before the commit, a failure discards
        the attempt (nobody else writes its staging)."""
        txn = self.txn
        assert txn is not None
        try:
            staging = self.path
            try:
                write_durable(os.path.join(staging, MARKER_FILE), self.success)
                files = scan_staged(staging)
            except OSError as exc:
                if not os.path.isdir(staging):  # only recovery removes it, having fenced the lease
                    raise self._lost() from None
                raise StorageError(f"could not read back what Orbax wrote in {staging}: {exc}") from exc
            for path, entry in sorted(files.items()):
                txn.adopt(path, entry.size, entry.crc32c)
        except BaseException:
            txn.abort()  # nothing was committed; nobody else writes the staging
            raise
        txn.commit()  # manifest, fsyncs, lease check, rename(NOREPLACE), fsync of the root

    def abort(self) -> None:
        """Discard the staging directory and the lease."""
        if self.txn is not None:
            self.txn.abort()

    abandon = abort


#: the commit of one attempt at a step, either layout
StepCommit = StagedCommit | InPlaceCommit


def step_commit(store: Store, name: str, attempt: str, *, version: str = "", mode: int | None = None,
                success: bytes = b"") -> StepCommit:
    """The commit of one attempt at step ``name``: in place on object stores (no
    directories there, and the marker is the record: ``mode`` and ``success`` unused),
    staged elsewhere. Call ``begin()`` before the library writes, then ``publish()`` or
    ``abort()``."""
    if writes_in_place(store):
        return InPlaceCommit(store, name, attempt, version=version)
    return StagedCommit(store, name, attempt, version=version, mode=mode, success=success)


def abandon_attempt(commit: StepCommit, pid: int) -> None:
    """An attempt dropped without publish or abort (its save failed, or the process
    exits): stop its lease; what it wrote is left to recovery (or, staged, removed now).
    Nothing in a forked child (whose exit runs the finalizers it inherited): the attempt is
    its parent's, still in flight there (``pid``)."""
    if os.getpid() != pid:
        return
    try:
        commit.abandon()
    except Exception:  # noqa: BLE001 - best effort; recovery removes what is left
        pass


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to the local file ``path`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        mv = memoryview(data)
        while mv:
            mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)


def scan_staged(staging: str) -> dict[str, FileEntry]:
    """Size and CRC32C of every file the library wrote below ``staging``, read once in
    parallel and fsynced. Its ``commit_success.txt`` is not a file of the manifest (its
    name is reserved): its presence follows from the commit."""
    paths: list[tuple[str, str]] = []
    for dirpath, _dirs, files in os.walk(staging):
        for fn in files:
            full = os.path.join(dirpath, fn)
            rel = os.path.relpath(full, staging).replace(os.sep, "/")
            if rel != MARKER_FILE:
                paths.append((validate_path(rel, what="file Orbax wrote"), full))

    def one(item: tuple[str, str]) -> tuple[str, FileEntry]:
        rel, full = item
        fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StorageError(f"{full} is not a regular file")
            # read in 8 MiB pieces into one buffer (not mapped: a file truncated behind our
            # back would be a SIGBUS, not an error); the size is what was read
            value, size = 0, 0
            buf = bytearray(8 << 20)
            with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    value = crc32c(memoryview(buf)[:n], value)
                    size += n
            if size != st.st_size:
                raise StorageError(f"{full} changed size while it was checksummed")
            os.fsync(fd)  # durable before the commit point (directories: by the commit)
        finally:
            os.close(fd)
        return rel, FileEntry(size, value)

    if not paths:
        return {}
    with concurrent.futures.ThreadPoolExecutor(min(8, len(paths))) as pool:
        return dict(pool.map(one, paths))


def judge_staged(store: Store, name: str, attempt: str, now: float | None = None) -> Judgement:
    """A staging directory (rename backends): stale iff its lease expired, or it has none
    and nothing below it was written within ``grace``."""
    d = store.driver
    now = store.clock() if now is None else now
    prefix = store.strategy.attempt_prefix(name, attempt)
    if prefix.rsplit("/", 1)[1] not in {e.name for e in d.listdir(STAGING)}:
        return Judgement(AttemptState.FOREIGN, "no such attempt")
    lease, gen = lease_state(d, name, attempt, now, store.grace)
    if lease is LeaseState.LIVE:
        return Judgement(AttemptState.IN_FLIGHT, "its lease is alive", attempt, gen, True)
    listing = d.find(prefix)
    mtimes = [i.mtime for i in listing.values() if i.mtime is not None]
    try:
        mtimes.append(os.stat(d.path(prefix)).st_mtime)  # the directory itself (local disk)
    except OSError:
        pass
    if lease is LeaseState.GONE and max(mtimes, default=now) + store.grace > now:
        return Judgement(AttemptState.IN_FLIGHT, f"no lease, written to within {store.grace:.0f}s", attempt)
    return Judgement(AttemptState.STALE, f"uncommitted, lease {lease.word}", attempt, gen,
                     lease is LeaseState.EXPIRED, keys=sorted(listing))


def judge_step(store: Store, name: str, now: float | None = None) -> Judgement:
    """The step directory ``name`` as an attempt: on object stores see
    :func:`~atomicstore.commit.inplace.judge_in_place`; elsewhere never one."""
    if not writes_in_place(store):
        return Judgement(AttemptState.FOREIGN, "committed steps and foreign directories are never temporary "
                                               "(saves in flight live in .atomicstore/staging)")
    return judge_in_place(store, name, store.clock() if now is None else now)


# -- what is at a step ---------------------------------------------------------------------
class FoundStep(enum.StrEnum):
    """What was at a step as a save of it began (:func:`probe_step`)."""

    STEP = "step"  #: a directory (local disk)
    COMMITTED = "committed"  #: a claimed step with its marker (object stores)
    CLAIMED = "claimed"  #: a claimed step without marker: being saved, or a crash's leftover


def probe_step(store: Store, name: str) -> tuple[FoundStep, str | None] | None:
    """What is at step ``name`` now, to tell later whether it was deleted in between
    (:func:`step_gone`): ``(STEP, None)`` on disk, ``(COMMITTED | CLAIMED, claim
    generation)`` on object stores, None if nothing."""
    d = store.driver
    try:
        if not writes_in_place(store):
            return (FoundStep.STEP, None) if os.path.isdir(d.path(name)) else None
        gen = d.info(f"{name}/{CLAIM_FILE}").generation  # nothing there: one request
        return (FoundStep.COMMITTED if d.exists(f"{name}/{MARKER_FILE}") else FoundStep.CLAIMED), gen
    except (NotFoundError, StorageError, OSError):
        return None


def step_gone(store: Store, name: str, found: FoundStep) -> bool:
    """Whether the step :func:`probe_step` found is gone now."""
    d = store.driver
    if found is FoundStep.STEP:
        return not os.path.isdir(d.path(name))
    return not d.exists(f"{name}/{CLAIM_FILE}")


def committed_manifest(store: Store, name: str) -> Manifest:
    """The manifest of a committed step (on object stores, from its marker):
    :class:`NotFoundError` if it is not committed, :class:`CorruptionError` if its record
    is malformed or it is not a step written through this layer."""
    if not writes_in_place(store):
        manifest = store.open(name).manifest
        meta = manifest.metadata.get(METADATA_KEY)
        if not isinstance(meta, dict) or meta.get("format") != COMMIT_FORMAT or meta.get("layout") != "staged":
            raise CorruptionError(f"{store.driver.describe(name)}: not an Orbax step written through atomicstore")
        return manifest
    return read_record(store, name)


def step_damage(store: Store, name: str, manifest: Manifest) -> str | None:
    """From a fresh listing, the first file of ``manifest`` that is missing or differs in
    size (or CRC32C where the listing reports one), as ``"<path> <why>"``; None if all are
    there."""
    found = store.driver.find(name)
    for rel, entry in manifest.files.items():
        info = found.get(f"{name}/{rel}")
        if info is None or info.size != entry.size or (
                info.crc32c is not None and info.crc32c != entry.crc32c):
            why = "is missing" if info is None else "does not match its recorded size or CRC32C"
            return f"{rel} {why}"
    return None


def verify_step(store: Store, name: str) -> Manifest:
    """Re-read every file of the committed step ``name`` and check its size and CRC32C."""
    manifest = committed_manifest(store, name)
    if not writes_in_place(store):
        return store.verify(name)
    verify_in_place(store, name, manifest)
    return manifest


# -- empty step directories ----------------------------------------------------------------
class EmptyState(enum.StrEnum):
    """What an empty step directory is (:func:`judge_empty_step`)."""

    STALE = "stale"  #: untouched for ``grace`` and no live lease of the step: may be removed
    YOUNG = "young"
    LEASED = "leased"


@dataclass
class EmptyStep:
    """A step directory holding no file, judged from storage read just now. ``dirs``: what
    to remove, deepest first: on disk ``(path, (st_dev, st_ino))`` of each directory, on
    object stores ``(placeholder key, generation)`` of each zero-byte ``<dir>/`` object."""

    name: str
    state: EmptyState
    reason: str
    dirs: list[tuple[str, Any]] = field(default_factory=list)


def _local_empty_dirs(top: str) -> tuple[float, list[tuple[str, Any]]] | None:
    """(newest mtime or ctime, directories deepest first) of the local tree ``top`` if
    it holds directories only, else None."""
    newest = 0.0
    stack = [top]
    seen: list[tuple[str, Any]] = []
    while stack:
        where = stack.pop()
        try:
            st = os.lstat(where)
            if not stat.S_ISDIR(st.st_mode):
                return None
            with os.scandir(where) as it:
                entries = list(it)
        except OSError:
            return None
        newest = max(newest, st.st_mtime, st.st_ctime)
        seen.append((where, (st.st_dev, st.st_ino)))
        for e in entries:
            if not e.is_dir(follow_symlinks=False) or len(seen) + len(stack) >= MAX_EMPTY_DIRS:
                return None
            stack.append(e.path)
    return newest, sorted(seen, key=lambda x: x[0].count(os.sep), reverse=True)


def _placeholder_dirs(store: Store, name: str, now: float) -> tuple[float, list[tuple[str, Any]]] | None:
    """(newest mtime, placeholders deepest first) if everything below ``name`` on an
    object store is a zero-byte ``<dir>/`` placeholder, else None."""
    d = store.driver
    newest = 0.0
    dirs: list[tuple[str, Any]] = []
    found = d.find(name)
    if not found or len(found) > MAX_EMPTY_DIRS:
        return None
    for key in found:
        if found[key].size:
            return None
        try:
            info = d.info(key + "/")  # a "directory": the zero-byte object <key>/
        except NotFoundError:
            return None  # a zero-byte file: not empty
        newest = max(newest, info.mtime if info.mtime is not None else now)
        dirs.append((key + "/", info.generation))
    dirs.sort(key=lambda x: x[0].count("/"), reverse=True)
    return newest, dirs


def judge_empty_step(store: Store, name: str, now: float, grace: float) -> EmptyStep | None:
    """``name`` as an empty step directory, or None if it is not one: absent, not a
    directory, or anything below it is not a directory (a file, a symlink; on object
    stores an object that is not a zero-byte ``<dir>/`` placeholder). Committed steps are
    never empty (a manifest or marker is a file)."""
    d = store.driver
    tree = _placeholder_dirs(store, name, now) if writes_in_place(store) else _local_empty_dirs(d.path(name))
    if tree is None:
        return None
    newest, dirs = tree
    for lk in (parse_lease_key(k) for k in d.find(LEASES)):
        if lk is not None and lk[0] == name and lease_state(d, name, lk[1], now, grace)[0] is LeaseState.LIVE:
            return EmptyStep(name, EmptyState.LEASED, f"a save of it holds a live lease (attempt {lk[1]})", dirs)
    age = now - newest
    if newest + grace > now:
        return EmptyStep(name, EmptyState.YOUNG, f"modified {max(age, 0.0):.0f}s ago, within grace={grace:.0f}s",
                         dirs)
    return EmptyStep(name, EmptyState.STALE, f"untouched for {age:.0f}s, no live lease", dirs)


def remove_empty_step(store: Store, empty: EmptyStep) -> bool:
    """Remove a stale empty step directory, each removal failing if anything was written
    meanwhile: on disk ``rmdir`` bottom-up (which refuses a non-empty directory), each
    directory first checked to be the one judged; on object stores each placeholder
    deleted at the generation read (a file written meanwhile is another object: never
    touched). True if all of it is gone."""
    d = store.driver
    in_place = writes_in_place(store)
    for where, ident in empty.dirs:
        try:
            if not in_place:
                st = os.lstat(where)
                if (st.st_dev, st.st_ino) != ident or not stat.S_ISDIR(st.st_mode):
                    return False  # replaced since it was judged: another saver's
                os.rmdir(where)
            else:
                d.delete(where, if_generation=ident)
        except FileNotFoundError:
            continue  # removed meanwhile (another recovery)
        except (OSError, PreconditionFailedError):
            return False  # written into, or re-created, since it was judged: left alone
    return True


def recover_empty_step(store: Store, name: str, now: float, grace: float, dry_run: bool,
                       young: list[str]) -> RecoveryAction | None:
    """Remove ``name`` if it is a stale empty step directory; a younger one (or one whose
    step holds a live lease) is added to ``young``."""
    empty = judge_empty_step(store, name, now, grace)
    if empty is None:
        return None
    if empty.state is not EmptyState.STALE:
        young.append(name)
        return None
    if not dry_run and not remove_empty_step(store, empty):
        return None
    why = f"empty step directory (no file: a crashed save's or a user's mkdir): {empty.reason}"
    return RecoveryAction("orbax", name, why, len(empty.dirs))


def check_recover_arguments(dry_run: object, grace: object, now: object) -> None:
    """:class:`InvalidArgumentError` unless ``dry_run`` is a bool, ``grace`` None or
    non-negative seconds, ``now`` None or Unix seconds."""
    if not isinstance(dry_run, bool):
        raise InvalidArgumentError("dry_run must be a bool")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int | float) or grace < 0):
        raise InvalidArgumentError("grace must be a non-negative number of seconds")
    if now is not None and (isinstance(now, bool) or not isinstance(now, int | float)):
        raise InvalidArgumentError("now must be Unix seconds")


def recover_root(store: Store, *, dry_run: bool = False, grace: float | None = None,
                 now: float | None = None) -> RecoveryReport:
    """Recover a root of steps: on object stores, first remove each claimed in-place step
    that is provably uncommitted and dead (its expired lease fenced first, so the dead
    writer can never commit; its objects removed; the claim last, so that no new attempt
    takes the step before it is empty) and each marker of this layout older than ``grace``
    whose claim and files are all gone (a dead writer's marker that landed late:
    ``kind="marker"``); on every backend, each empty step directory (no file anywhere below
    it: a crash's leftover or a user's ``mkdir``; on GCS only zero-byte ``<step>/``
    placeholders) untouched for ``grace`` seconds and with no live lease of its step,
    removed so that it can only fail if anything was written into it meanwhile (``rmdir``
    bottom-up, placeholders at the generation read); then ``store.recover()`` (stale
    staging, dead leases, orphaned uploads). Returns that report, with these removals
    first (``kind="orbax"``); a younger empty step directory is listed in ``in_flight``
    (another saver may be about to write into it)."""
    check_recover_arguments(dry_run, grace, now)
    when = store.clock() if now is None else float(now)
    actions, young = recover_steps(store, when, store.grace if grace is None else float(grace), dry_run)
    report = store.recover(dry_run=dry_run, grace=grace, now=now)
    report.actions[:0] = actions
    report.in_flight.extend(young)
    return report


def recover_steps(store: Store, now: float, grace: float, dry_run: bool) -> tuple[list[RecoveryAction], list[str]]:
    """(what was removed, empty step directories left as maybe in use) over every step
    of the root: on object stores claimed steps provably uncommitted and dead, then
    dangling markers; on every backend stale empty step directories."""
    actions: list[RecoveryAction] = []
    young: list[str] = []
    in_place = writes_in_place(store)
    for e in sorted(store.driver.listdir(""), key=lambda e: e.name):
        try:
            name = validate_name(e.name)
        except InvalidArgumentError:
            continue
        if not e.is_dir:
            continue
        act: RecoveryAction | None
        if in_place:
            claimed, act = recover_claimed(store, name, now, grace, dry_run)
            if not claimed:
                act = (recover_dangling_marker(store, name, now, grace, dry_run)
                       or recover_empty_step(store, name, now, grace, dry_run, young))
        else:
            act = recover_empty_step(store, name, now, grace, dry_run, young)
        if act is not None:
            actions.append(act)
    return actions, young


__all__ = [
    "MAX_EMPTY_DIRS",
    "EmptyState",
    "EmptyStep",
    "FoundStep",
    "StagedCommit",
    "StepCommit",
    "abandon_attempt",
    "check_recover_arguments",
    "committed_manifest",
    "judge_empty_step",
    "judge_staged",
    "judge_step",
    "parse_staging_path",
    "probe_step",
    "recover_empty_step",
    "recover_root",
    "recover_steps",
    "remove_empty_step",
    "scan_staged",
    "staging_path",
    "step_commit",
    "step_damage",
    "step_gone",
    "verify_step",
    "write_durable",
]
