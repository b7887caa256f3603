"""Tiered checkpoints: a fast local tier, a persistent tier, and uploads that commit.

A :class:`~atomicstore.CheckpointManager` made with ``local_dir`` saves every step to the
local tier (a directory on this machine) with the usual atomic commit and returns; a
background uploader then *persists* the steps that are due to the persistent tier (the
manager's URL). Persisting is a save of its own, not a copy: a transaction on the
persistent store, under its own lease and commit point, whose files are streamed from the
local copy and checked against the local manifest's sizes and CRC32Cs as they are read
(a flipped byte on the local disk fails the upload, which then commits nothing). The
persistent manifest carries the same CRC32Cs and metadata (``tier_save`` names the save
in both tiers).

Restore takes the newest step committed in either tier: the local copy when it reads and
verifies, else the persistent one, else the next older step; never a copy that fails its
checks. In a multi-host job each process has its own local tier
(``<local_dir>/process-<i>``) holding the state, the index and its own shard files; the
processes agree (through JAX's coordination service) on the step and the save to
restore, and a process that lacks its local part reads the persistent copy of the same
save. See ``docs/tiers.md``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import json
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .commit import Store, open_store
from .commit.locator import is_local
from .commit.manifest import FileEntry, Manifest, crc32c, crc32c_combine
from .commit.names import natural_key
from .commit.store import Checkpoint
from .errors import (
    AlreadyExistsError,
    AtomicStoreError,
    CommitConflictError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)
from .pytree import INDEX_FILE, STATE_FILE, PreparedSave, Session, restore_with_manifest
from .pytree.coordination import agree, remote_error
from .pytree.format import PARTS_FILE
from .pytree.reader import restore_opened

log = logging.getLogger("atomicstore.tiers")
Step = int | float

#: metadata key of a tiered save: ``{"save": id, "process": i, "count": n, "own": [files]}``
TIER_KEY = "tier"
#: at the local tier's root: the persistent tier it serves (``{"persistent": url}``)
TIER_FILE = "tier.json"
#: the lowest ``upload_rate`` (bytes per second) a manager takes
MIN_UPLOAD_RATE = 1024

LOCAL_COMMIT_EVENT = "/atomicstore/tiers/local_commit_secs"
UPLOAD_START_EVENT = "/atomicstore/tiers/upload_start"
UPLOAD_EVENT = "/atomicstore/tiers/upload_secs"


class TierState(enum.StrEnum):
    """Where a step is: ``local`` (only in the local tier), ``persisting`` (its upload is
    queued or running), ``persisted`` (committed in the persistent tier; maybe also local)."""

    LOCAL = "local"
    PERSISTING = "persisting"
    PERSISTED = "persisted"


def record(event: str, seconds: float | None = None) -> None:
    """A ``jax.monitoring`` event (a duration when ``seconds`` is given), if the program
    imported jax. Never imports it: these run in background threads, and a first import
    of jax there while the main thread imports it deadlocks the import (``_DeadlockError``)."""
    mon = sys.modules.get("jax.monitoring")
    try:
        if seconds is None:
            mon.record_event(event)  # type: ignore[union-attr]
        else:
            mon.record_event_duration_secs(event, seconds)  # type: ignore[union-attr]
    except AttributeError:  # no jax, or jax still being imported by another thread
        pass


@dataclass(frozen=True)
class TierOptions:
    """When a step is persisted and how many local steps are kept (see
    :class:`~atomicstore.CheckpointManager`)."""

    local_keep: int = 2
    persist_every_n_steps: int | float | None = None
    persist_every_seconds: float | None = None
    upload_rate: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.local_keep, int) or isinstance(self.local_keep, bool) or self.local_keep < 1:
            raise InvalidArgumentError("local_keep must be an int >= 1")
        for what, val in (("persist_every_n_steps", self.persist_every_n_steps),
                          ("persist_every_seconds", self.persist_every_seconds),
                          ("upload_rate", self.upload_rate)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int | float)
                                    or not val > 0 or val != val or val == float("inf")):
                raise InvalidArgumentError(f"{what} must be a positive finite number or None")
        if self.upload_rate is not None and self.upload_rate < MIN_UPLOAD_RATE:
            raise InvalidArgumentError(f"upload_rate must be at least {MIN_UPLOAD_RATE} bytes per second "
                                       "(or None: no limit)")


class Superseded(PreconditionFailedError):
    """An upload whose local save was replaced (an overwrite) or deleted before or while
    it was uploaded: it commits nothing, and is not an error of the tiers."""


@dataclass
class _Upload:
    step: Step
    save: str  # the tier_save id of the local copy to persist
    overwrite: bool
    replaced: dict[Step, str | None] = field(default_factory=dict)  # remote steps an overwrite removes
    done: threading.Event = field(default_factory=threading.Event)


class Tiers:
    """The local tier, the uploader and the tiered restore of one manager.

    ``remote`` is the persistent store; ``name``/``step_of`` the manager's naming;
    ``persisted(step, meta)`` runs in the uploader once a step committed remotely (the
    manager's retention of the persistent tier)."""

    def __init__(self, local_dir: Any, remote: Store, *, prefix: str, options: TierOptions,
                 name: Callable[[Step], str], step_of: Callable[[str], Step | None],
                 persisted: Callable[[Step, dict[str, Any], dict[Step, str | None]], None],
                 timeout: float, recover: bool, process: tuple[int, int]) -> None:
        if not isinstance(local_dir, str | os.PathLike) or "://" in str(local_dir) or not os.fspath(local_dir):
            raise InvalidArgumentError("local_dir must be a local directory path (the fast tier)")
        index, count = process
        path = os.path.realpath(os.fspath(local_dir))
        if is_local(remote.url):  # the tiers must not hold each other (recovery of one would see the other)
            other = os.path.realpath(remote.url.removeprefix("file://"))
            if os.path.commonpath([path, other]) in (path, other):
                raise InvalidArgumentError(
                    f"local_dir {path} and the persistent tier {other} are the same directory or one holds "
                    "the other: give a directory outside it")
        if count > 1:  # one local tier per process: processes may share a machine
            path = os.path.join(path, f"process-{index}")
        if os.path.exists(path) and not os.path.isdir(path):
            raise InvalidArgumentError(f"local_dir {path} is not a directory")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot make the local tier {path}: {exc}") from exc
        self.local = open_store(path)
        self._claim_local(remote.url)
        self.remote, self.prefix, self.options = remote, prefix, options
        self._name, self._step_of, self._persisted = name, step_of, persisted
        self.timeout, self.process = timeout, process
        self._lock = threading.Lock()
        _ALL.add(self)  # (its lock is made anew in a forked child: see _after_fork_in_child)
        self._queue: collections.deque[_Upload] = collections.deque()
        self._current: _Upload | None = None
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []
        self._stop = threading.Event()
        self._last_due: tuple[Step, float] | None = None
        self._remote_seen: set[Step] = set()  # the persistent steps as last listed
        self._pid = os.getpid()
        # local retention runs here, off the caller's thread (deleting a step is disk time)
        self._keeper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="atomicstore-local-retention")
        self._kept: concurrent.futures.Future[None] | None = None
        self._last_session: Session | None = None
        if recover:  # every process: each has its own local tier
            self._recover_local()
        self._resume()

    # -- the local tier ---------------------------------------------------------------
    def _claim_local(self, url: str) -> None:
        """A local tier serves one persistent tier: ``tier.json`` at its root names it
        (written by the first manager; a read-only local tier is only checked). Another
        persistent tier is refused: its manager would upload this one's steps, and restore
        them as its own."""
        doc = json.dumps({"persistent": url}).encode()
        for _ in range(2):
            try:
                found = json.loads(self.local.read_file(TIER_FILE))["persistent"]
            except NotFoundError:
                try:
                    self.local.write_file(TIER_FILE, doc, overwrite=False)
                    return
                except AlreadyExistsError:
                    continue  # (another manager wrote it first: check it)
                except (AtomicStoreError, OSError) as exc:
                    log.warning("cannot record the persistent tier in the local tier %s: %s", self.local.url, exc)
                    return
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptionError(f"{self.local.driver.describe(TIER_FILE)}: not a local tier's record ({exc})",
                                      path=TIER_FILE) from None
            if found != url:
                raise InvalidArgumentError(f"local_dir {self.local.url} is the local tier of {found}, not of {url}: "
                                           "give each persistent tier its own local_dir")
            return

    def _recover_local(self) -> None:
        try:
            report = self.local.recover(flax_prefix=self.prefix)
        except (AtomicStoreError, OSError) as exc:
            log.warning("recovery of the local tier %s could not run: %s", self.local.url, exc)
            return
        if report.actions:
            log.info("local tier: %s", report.summary())

    def local_steps(self) -> dict[Step, str | None]:
        """Committed local steps and their generation."""
        return {s: g for n, g in self.local.committed().items() if (s := self._step_of(n)) is not None}

    def remote_steps(self) -> dict[Step, str | None]:
        """Committed persistent steps and their generation (a listing, remembered as the
        view ``save`` checks against)."""
        out = {s: g for n, g in self.remote.committed().items() if (s := self._step_of(n)) is not None}
        with self._lock:
            self._remote_seen = set(out)
        return out

    def steps(self, *, for_save: bool = False) -> list[Step]:
        """Steps committed in either tier, in natural order. ``for_save``: the persistent
        tier's steps as last listed (when the manager opened, and after each upload and
        its retention) instead of a listing now: a save never waits on the bucket (a
        slow or unreachable one), and an upload of a step another job committed
        meanwhile is refused by its commit."""
        local = set(self.local_steps())
        if for_save:
            with self._lock:
                remote = set(self._remote_seen)
        else:
            remote = set(self.remote_steps())
        return sorted(local | remote, key=lambda s: natural_key(str(s)))

    def manifest(self, step: Step) -> Manifest:
        """The manifest of ``step``: the local copy's if it has one, else the persistent one."""
        name = self._name(step)
        try:
            return self.local.manifest(name)
        except NotFoundError:
            return self.remote.manifest(name)

    def due(self, step: Step, milestone: bool) -> bool:
        """Whether a step saved now is persisted (and remember it as the last due)."""
        o, now = self.options, time.monotonic()
        last = self._last_due
        if o.persist_every_n_steps is None and o.persist_every_seconds is None:
            due = True
        else:
            due = milestone or last is None
            if not due and o.persist_every_n_steps is not None:
                due = step - last[0] >= o.persist_every_n_steps  # type: ignore[index]
            if not due and o.persist_every_seconds is not None:
                due = now - last[1] >= o.persist_every_seconds  # type: ignore[index]
        if due:
            self._last_due = (step, now)
        return due

    def commit_local(self, step: Step, job: PreparedSave, meta: dict[str, Any], *, overwrite: bool,
                     replaced: dict[Step, tuple[str | None, str | None]], milestone: bool) -> dict[str, Any]:
        """Commit ``step`` to the local tier (every process, multi-host), apply local
        retention and queue its upload when it is due; the metadata committed. Process
        0 decides whether it is due and names the save (``tier.save``), for every process."""
        t0 = time.monotonic()
        name = self._name(step)
        index, count = self.process
        local_known = self.local_steps()

        def decide() -> dict[str, Any]:  # (process 0, for every process)
            # an overwrite that replaces or removes steps is persisted whenever it is due or
            # not: else the persistent tier would keep the steps it replaced or removed
            return {"save": new_save_id(), "due": self.due(step, milestone or bool(replaced)),
                    "overwrite": overwrite, "replaced": [s for s in replaced if s != step]}

        agreed: dict[str, Any] = {}

        def with_tier(decision: dict[str, Any]) -> dict[str, Any]:
            agreed.update(decision)
            return {**meta, TIER_KEY: {"save": decision["save"], "process": index, "count": count,
                                       "due": decision["due"]}}

        def replaces(decision: dict[str, Any]) -> bool:
            return bool(decision["overwrite"]) and step in local_known

        if job.session is None:
            decision = decide()
            meta = with_tier(decision)
            job.run(self.local, name, overwrite=replaces(decision), metadata=meta)
        else:
            man = job.run_part(self.local, name, overwrite=replaces, decide=decide, metadata=with_tier)
            meta, decision = man.metadata, agreed
        due = bool(meta[TIER_KEY]["due"])
        if due and job.session is not None and not job.session.main:
            self._last_due = (step, time.monotonic())  # (process 0's decide() did it there)
        for s in decision["replaced"]:  # an overwrite removes the newer local steps (each process its own)
            try:
                gone = self.local.manifest(self._name(s))
                self.local.delete(self._name(s), if_attempt=gone.attempt)
            except (NotFoundError, PreconditionFailedError):
                pass
        dt = time.monotonic() - t0
        record(LOCAL_COMMIT_EVENT, dt)
        log.info("step %s committed to the local tier %s in %.3fs%s", step, self.local.url, dt,
                 "; persisting it" if due else "")
        if due:
            remote_replaced = {s: r for s, (_, r) in replaced.items()}
            # an overwrite of the step (in either tier) replaces it in the persistent tier too,
            # also when the upload of the save it replaces commits there only after this call
            self.enqueue(_Upload(step, meta[TIER_KEY]["save"], step in replaced, remote_replaced))
        self.retain_soon()
        return meta

    def retain_soon(self) -> None:
        """Local retention on its own thread (the caller's stall is the local write only)."""
        with self._lock:
            self._kept = self._keeper.submit(self._retain_logged)

    def _retain_logged(self) -> None:
        try:
            self.retain_local()
        except Exception as exc:  # noqa: BLE001 - housekeeping: the next save retains again
            log.warning("local retention of %s: %s", self.local.url, exc)

    def protected(self) -> set[Step]:
        """Local steps retention must keep: uploads queued or running, and the newest due
        step that is not persisted yet."""
        with self._lock:
            out = {u.step for u in self._queue}
            if self._current is not None:
                out.add(self._current.step)
        return out

    def retain_local(self) -> None:
        """Keep the newest ``local_keep`` local steps, every step whose upload is queued or
        running, and the newest due step until it (or a newer step) is persisted; an
        ephemeral step goes once a newer step that is not ephemeral is committed. Each is
        deleted only as the save judged."""
        order = sorted(self.local_steps())
        mans: dict[Step, Manifest] = {}
        for s in order:
            try:
                mans[s] = self.local.manifest(self._name(s))
            except (NotFoundError, PreconditionFailedError):
                pass
            except AtomicStoreError as exc:
                log.warning("local retention keeps %s: %s", self._name(s), exc)

        def flag(s: Step, key: str) -> bool:
            meta = mans[s].metadata
            return bool(meta.get(key) if key == "ephemeral" else (meta.get(TIER_KEY) or {}).get(key))

        protected = self.protected()
        plain = [s for s in mans if not flag(s, "ephemeral")]
        keep = set(plain[-self.options.local_keep:]) | protected
        doomed = {s for s in mans if s not in keep and (not flag(s, "ephemeral") or (plain and plain[-1] > s))}
        doomed |= {s for s in mans if flag(s, "ephemeral") and plain and plain[-1] > s and s not in protected}
        due = [s for s in doomed if flag(s, "due")]
        if due:  # the newest due step stays until it (or a newer step) is persisted
            newest = max(due)
            try:
                persisted = any(r >= newest for r in self.remote_steps())
            except AtomicStoreError:  # (the persistent tier cannot be listed now: keep it)
                persisted = False
            if not persisted:
                doomed.discard(newest)
        for s in sorted(doomed):
            try:  # only the save judged: never one committed since under that name
                self.local.delete(self._name(s), if_attempt=mans[s].attempt)
            except (NotFoundError, PreconditionFailedError):
                pass
            except AtomicStoreError as exc:
                log.warning("local retention keeps %s: %s", self._name(s), exc)

    # -- the uploader ---------------------------------------------------------------------
    def enqueue(self, up: _Upload) -> None:
        """Queue an upload. Uploads run in the order queued, every one (multi-host: every
        process queues the same uploads in the same order, and each is a collective call);
        one whose local save was replaced since ends as :class:`Superseded`."""
        with self._lock:
            if any(u.step == up.step and u.save == up.save for u in [*self._queue, self._current] if u):
                return  # (that very save is already queued or uploading)
            self._queue.append(up)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="atomicstore-uploader", daemon=True)
                self._thread.start()

    def _resume(self) -> None:
        """Queue the uploads a previous run left: local steps that were due, newer than
        the newest persisted step. Multi-host: the saves every process's local tier holds
        (process 0 decides, for every process)."""
        index, count = self.process
        session = Session.begin(f"resume uploads to {self.remote.url}", self.timeout) if count > 1 else None
        try:
            mine = self._unpersisted()
            if session is None:
                todo = sorted(mine.items(), key=lambda kv: kv[0])
            elif session.main:
                views = [mine] + [session.get(f"local/{i}", f"process {i}") for i in range(1, count)]
                todo = [(s, save) for s, save in sorted(mine.items()) if all(
                    v.get(str(s)) == save if isinstance(v, dict) and "error" not in v else False
                    for v in [{str(k): x for k, x in mine.items()}, *views[1:]])]
                session.publish_plan([[s, save] for s, save in todo])
            else:
                session.put(f"local/{index}", {str(k): x for k, x in mine.items()})
                todo = [(s, save) for s, save in session.await_plan()]
        except AtomicStoreError as exc:
            if session is not None:
                session.fail(exc)
            log.warning("tiers: the uploads a previous run left are not resumed: %s", exc)
            return
        for s, save in todo:
            log.info("resuming the upload of step %s (a previous run did not persist it)", s)
            self.enqueue(_Upload(s, save, False))

    def _unpersisted(self) -> dict[Step, str]:
        """Local steps that were due and are newer than every persisted step (process 0
        and single-process; the others: every local step that was due), with their save."""
        newest = None
        if self.process[0] == 0:
            newest = max(self.remote_steps(), default=None)
        out = {}
        for s in self.local_steps():
            if newest is not None and s <= newest:
                continue
            try:
                tier = self.local.manifest(self._name(s)).metadata.get(TIER_KEY) or {}
            except AtomicStoreError:
                continue
            if tier.get("due") and isinstance(tier.get("save"), str):
                out[s] = tier["save"]
        return out

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._stop.is_set():
                    for u in self._queue:
                        u.done.set()
                    self._queue.clear()
                    self._thread = None
                    return
                up = self._current = self._queue.popleft()
            try:
                self.persist(up)
                with self._lock:
                    self._remote_seen.add(up.step)
                with contextlib.suppress(AtomicStoreError):
                    self.remote_steps()  # (what the persistent tier's retention left: save's view)
            except BaseException as exc:  # noqa: BLE001 - raised by wait_until_finished
                if isinstance(exc, Superseded):  # a newer save of the step is (or was) queued after it
                    log.info("upload of step %s skipped: %s", up.step, exc)
                elif self._stop.is_set() and isinstance(exc, AtomicStoreError):
                    log.info("upload of step %s abandoned (the manager closed on an error): %s", up.step, exc)
                else:
                    log.error("upload of step %s to %s failed (the local copy stays): %s", up.step,
                              self.remote.url, exc)
                    with self._lock:
                        self._errors.append(exc)
            finally:
                with self._lock:
                    self._current = None
                up.done.set()
            self._retain_logged()

    def wait(self) -> None:
        """Until every queued upload and the local retention ended (at once in a forked
        child: the parent's threads do not exist there)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            kept = self._kept
        if kept is not None:
            kept.result()
        while True:
            with self._lock:
                t = self._thread
            if t is None or t is threading.current_thread():
                return
            t.join()
            with self._lock:
                if self._thread is t:  # (it ended without clearing itself: never wait on it again)
                    self._thread = None

    def take_errors(self) -> list[BaseException]:
        with self._lock:
            errs, self._errors = self._errors, []
        return errs

    def abandon(self) -> None:
        """Stop after the upload in flight (its transaction aborts at its next read)."""
        self._stop.set()
        with self._lock:
            for u in self._queue:
                u.done.set()
            self._queue.clear()

    def state(self) -> dict[Step, TierState]:
        """Each step's tier state."""
        remote, local = self.remote_steps(), self.local_steps()
        busy = self.protected()
        out = {s: TierState.LOCAL for s in local}
        out.update({s: TierState.PERSISTING for s in busy if s in local and s not in remote})
        out.update({s: TierState.PERSISTED for s in remote})
        return dict(sorted(out.items(), key=lambda kv: natural_key(str(kv[0]))))

    # -- persisting: a commit ------------------------------------------------------------
    def persist(self, up: _Upload) -> Manifest | None:
        """Upload the local copy of ``up.step`` (the save ``up.save``) to the persistent
        tier as a transaction of its own; the persistent manifest, or None where another
        process committed it (multi-host: process 0 commits)."""
        name = self._name(up.step)
        session = Session.begin(f"persist of {name} to {self.remote.url}", self.timeout, background=True)
        t0 = time.monotonic()
        record(UPLOAD_START_EVENT)
        try:
            try:
                ckpt = self.local.open(name)
            except NotFoundError as exc:
                raise Superseded(f"{self.local.driver.describe(name)} was deleted before it was uploaded") from exc
            tier = ckpt.manifest.metadata.get(TIER_KEY) or {}
            if tier.get("save") != up.save:
                raise Superseded(f"{ckpt.where('')}: the local copy was replaced since the save that was to be "
                                 "persisted")
            try:
                out = (self._persist_alone(ckpt, up) if session is None
                       else self._persist_together(session, ckpt, up))
            except (CorruptionError, NotFoundError) as exc:
                if self.local.strategy.current(name) != ckpt.manifest.attempt:  # replaced (or deleted) while read
                    raise Superseded(f"{ckpt.where('')}: the local copy was replaced while it was uploaded "
                                     "(nothing was committed)") from exc
                raise
        except BaseException as exc:
            if session is not None:
                session.fail(exc)  # (plan/outcome or report/<i>: the keys an upload waits on)
            raise
        dt = time.monotonic() - t0
        record(UPLOAD_EVENT, dt)
        size = ckpt.manifest.total_bytes
        log.info("step %s persisted to %s: %.1f MiB in %.2fs (%.1f MiB/s)", up.step, self.remote.url,
                 size / 2**20, dt, size / 2**20 / max(dt, 1e-9))
        if session is not None and session.main:
            if self._last_session is not None:
                self._last_session.forget()  # every process is past it: it reported in this one
            self._last_session = session
        return out

    def _persist_alone(self, ckpt: Any, up: _Upload) -> Manifest:
        meta = _persisted_meta(ckpt.manifest.metadata)
        try:
            with self.remote.transaction(ckpt.name, metadata=meta, overwrite=up.overwrite) as txn:
                for path in sorted(ckpt.files, key=lambda p: -ckpt.files[p].size):
                    self._upload_file(ckpt, path, txn.open(path))
                txn.commit()
        except CommitConflictError:
            won = self._persisted_as(ckpt.name, up.save)
            if won is None:
                raise
            return won
        assert txn.manifest is not None
        self._after_persist(up, meta)
        return txn.manifest

    def _persisted_as(self, name: str, save: str) -> Manifest | None:
        """After a lost commit race: the persistent manifest of ``name`` if it holds this
        very save (another uploader of the same local copy won: a zombie of the last
        run, or a second manager on this local tier), else None."""
        try:
            man = self.remote.manifest(name)
        except AtomicStoreError:
            return None
        if (man.metadata.get(TIER_KEY) or {}).get("save") != save:
            return None
        log.info("%s was persisted by another uploader of the same save", self.remote.driver.describe(name))
        return man

    def _persist_together(self, session: Session, ckpt: Any, up: _Upload) -> Manifest | None:
        """Multi-host: process 0 opens the persistent transaction and publishes where its
        attempt is staged; every process uploads the files it wrote into it; process 0
        adopts the others' (checked against its own manifest's sizes and CRC32Cs) and
        commits once all are durable."""
        from .commit.adapters import open_attempt_file

        table, by = _parts(ckpt)
        mine = sorted({p for p, i in by.items() if i == session.index} | (
            {INDEX_FILE, STATE_FILE} if session.main else set()))
        if session.main:
            meta = _persisted_meta(ckpt.manifest.metadata)
            with self.remote.transaction(ckpt.name, metadata=meta, overwrite=up.overwrite) as txn:
                session.put("plan", {"what": session.what, "prefix": txn.prefix, "save": up.save})
                for path in mine:
                    self._upload_file(ckpt, path, txn.open(path))
                for i in range(1, session.count):
                    rep = session.get(f"report/{i}", f"process {i}")
                    if "error" in rep:
                        raise _remote(session, rep)
                    for path in rep["files"]:
                        entry = table.get(path)
                        if entry is None or by.get(path) != i:
                            raise CorruptionError(f"{session.what}: process {i} uploaded {path}, which is not "
                                                  "its file of this step")
                        txn.adopt(path, entry.size, entry.crc32c)  # (its uploader checked these bytes)
                missing = ({INDEX_FILE, STATE_FILE} | set(table)) - set(txn.files)
                if missing:
                    raise CorruptionError(f"{session.what}: no process uploaded {sorted(missing)[:3]}")
                try:
                    txn.commit(check=session.check_can_commit)
                except CommitConflictError:
                    won = self._persisted_as(ckpt.name, up.save)
                    if won is None:
                        raise
                    session.put("outcome", {"ok": True})
                    return won
            self._after_persist(up, meta)
            session.put("outcome", {"ok": True})
            return txn.manifest
        plan = session.get("plan", "process 0")
        if "error" in plan:
            raise _remote(session, plan)
        if plan.get("save") != up.save:
            raise PreconditionFailedError(f"{session.what}: process 0 persists another save of this step")
        for path in mine:
            self._upload_file(ckpt, path, open_attempt_file(self.remote, plan["prefix"], path))
        session.put(f"report/{session.index}", {"files": mine})
        out = session.get("outcome", "process 0", margin=session.margin)
        if not out.get("ok"):
            raise _remote(session, out)
        return None

    def _after_persist(self, up: _Upload, meta: dict[str, Any]) -> None:
        try:
            self._persisted(up.step, meta, up.replaced)
        except Exception as exc:  # noqa: BLE001 - persisted; retention is housekeeping
            log.warning("retention of the persistent tier after step %s: %s", up.step, exc)

    def _upload_file(self, ckpt: Checkpoint, path: str, out: Any) -> None:
        """Stream ``path`` of the local copy into ``out`` (a transaction's file, or a
        writer of a handed-over attempt), its size and CRC32C checked against the local
        manifest as it is read: a mismatch raises before the file is completed. Each
        chunk read is handed over as it is (immutable bytes: lent, not copied) with its
        CRC32C (computed once, for the check and the transaction)."""
        rate, entry, where = self.options.upload_rate, ckpt.files[path], ckpt.where(path)
        lend = getattr(out, "accepts_borrowed", False)
        t0, size, whole = time.monotonic(), 0, 0
        try:
            for chunk in ckpt.store.driver.iter_read(ckpt.key(path)):
                if self._stop.is_set():
                    raise AtomicStoreError(f"upload of {where} abandoned (the manager closed)")
                c = crc32c(chunk)
                whole, size = crc32c_combine(whole, c, len(chunk)), size + len(chunk)
                if size > entry.size:
                    entry.check(path, size, whole, where=where)
                if lend:
                    out.write(chunk, crc32c=c, borrow=True)
                else:  # (a driver's writer of a handed-over attempt)
                    out.write_borrowed(memoryview(chunk))
                if rate:  # the upload budget: at most `rate` bytes/s read from the local tier
                    ahead = size / rate - (time.monotonic() - t0)
                    if ahead > 0 and self._stop.wait(ahead):
                        raise AtomicStoreError(f"upload of {where} abandoned (the manager closed)")
            entry.check(path, size, whole, where=where)  # (raises ChecksumMismatchError)
        except BaseException:
            out.abort()
            raise
        out.close()

    # -- restoring ----------------------------------------------------------------------
    def restore(self, step: Step | None, target: Any, kwargs: dict[str, Any]) -> tuple[Any, Manifest | None, Step]:
        """The tree of the newest step (or ``step``) whose copy reads and verifies, the
        manifest read, and the step."""
        session = (Session.begin(f"tiered restore in {self.remote.url}", self.timeout)
                   if kwargs.get("collective", True) is True else None)
        kwargs = {**kwargs, "collective": False}
        if session is None:
            return self._restore_alone(step, target, kwargs)
        return self._restore_together(session, step, target, kwargs)

    def _copies(self, step: Step | None) -> list[Step]:
        if step is not None:
            return [step]
        try:
            steps = self.steps()
        except StorageError as exc:  # the bucket is down: the local steps (and the last listing) serve
            log.warning("the persistent tier %s cannot be listed (%s): restoring from what the local tier "
                        "holds and the persistent steps last listed", self.remote.url, exc)
            steps = self.steps(for_save=True)
        return list(reversed(steps))

    def _restore_alone(self, step: Step | None, target: Any, kwargs: dict[str, Any]) -> tuple[Any, Manifest | None, Step]:
        last: BaseException | None = None
        for s in self._copies(step):
            for tier, st in (("local", self.local), ("persistent", self.remote)):
                try:
                    out, man = restore_with_manifest(self._name(s), target, store=st, **kwargs)
                except (CorruptionError, NotFoundError, PreconditionFailedError, StorageError) as exc:
                    if not isinstance(exc, NotFoundError) or _exists(st, self._name(s)):
                        log.warning("the %s copy of step %s cannot be restored (%s); trying the next copy",
                                    tier, s, exc)
                        last = exc  # (damage, not absence, is what the caller is told)
                    elif last is None:
                        last = exc
                    continue
                return out, man, s
        if last is not None and step is not None:
            raise last
        raise NotFoundError(f"no checkpoint with prefix {self.prefix!r} in {self.local.url} or {self.remote.url}"
                            + (f" that can be restored (last error: {last})" if last is not None else ""))

    def _local_saves(self) -> dict[str, str]:
        """This process's local steps: step name -> tier save id."""
        out = {}
        for s in self.local_steps():
            try:
                tier = self.local.manifest(self._name(s)).metadata.get(TIER_KEY) or {}
            except AtomicStoreError:
                continue
            if isinstance(tier.get("save"), str):
                out[self._name(s)] = tier["save"]
        return out

    def _candidates(self, session: Session, step: Step | None) -> list[list[Any]]:
        """Process 0: the (step name, save) pairs every process can read, newest first:
        each process has the save in its local tier, or the persistent tier holds it."""
        mine = self._local_saves()
        views = [mine] + [session.get(f"local/{i}", f"process {i}") for i in range(1, session.count)]
        for i, v in enumerate(views):
            if "error" in v:
                raise remote_error(session, {**v, "process": i})
        remote: dict[str, str] = {}
        for name in self.remote.committed():
            s = self._step_of(name)
            if s is None or (step is not None and s != step):
                continue
            try:
                tier = self.remote.manifest(name).metadata.get(TIER_KEY) or {}
            except AtomicStoreError:
                continue
            remote[name] = tier.get("save") or ""
        names = {n for v in views for n in v} | set(remote)
        if step is not None:
            names &= {self._name(step)}
        out = []
        for name in sorted(names, key=natural_key, reverse=True):
            for save in dict.fromkeys([remote.get(name), *(v.get(name) for v in views)]):
                if save and all(v.get(name) == save or remote.get(name) == save for v in views):
                    out.append([name, save])
        return out

    def _restore_together(self, session: Session, step: Step | None, target: Any,
                          kwargs: dict[str, Any]) -> tuple[Any, Manifest | None, Step]:
        try:
            if session.main:
                cands = self._candidates(session, step)
                session.publish_plan(cands)
            else:
                session.put(f"local/{session.index}", self._local_saves())
                cands = session.await_plan()
        except BaseException as exc:
            session.fail(exc)
            raise
        if not cands:
            raise NotFoundError(f"no step of prefix {self.prefix!r} that every process can restore "
                                f"(from its local tier or from {self.remote.url})")
        last: BaseException | None = None
        for name, save in cands:
            rnd = Session.begin(f"tiered restore of {name} in {self.remote.url}", self.timeout)
            assert rnd is not None
            try:
                out, man = self._read_save(name, save, target, kwargs)
            except BaseException as exc:
                rnd.fail(exc)
                if not isinstance(exc, CorruptionError | NotFoundError | PreconditionFailedError):
                    raise
                last = exc
                try:
                    agree(rnd)
                except AtomicStoreError:
                    pass
                continue
            try:
                agree(rnd)
            except (CorruptionError, NotFoundError, PreconditionFailedError) as exc:
                last = exc  # another process could not read this save: every process tries the next
                continue
            s = self._step_of(name)
            assert s is not None
            return out, man, s
        assert last is not None
        raise last

    def _read_save(self, name: str, save: str, target: Any, kwargs: dict[str, Any]) -> tuple[Any, Manifest | None]:
        """Read save ``save`` of ``name``: the local copy if it is that save, else the
        persistent one (checked to be that save too)."""
        try:
            ckpt = self.local.open(name)
            if (ckpt.manifest.metadata.get(TIER_KEY) or {}).get("save") == save:
                opts = {k: v for k, v in kwargs.items() if k not in ("collective", "timeout")}
                return restore_opened(_whole(ckpt), target, **opts), ckpt.manifest
        except (CorruptionError, NotFoundError, PreconditionFailedError) as exc:
            if self.local.exists(name):
                log.warning("the local copy of %s cannot be restored (%s); reading the persistent one", name, exc)
        out, man = restore_with_manifest(name, target, store=self.remote, **kwargs)
        if man is None or (man.metadata.get(TIER_KEY) or {}).get("save") != save:
            raise PreconditionFailedError(f"{self.remote.driver.describe(name)} holds another save than the one "
                                          "the processes agreed on: restore again")
        return out, man

    def delete(self, step: Step, *, remote: bool = True) -> None:
        """Delete ``step`` from the local tier and (``remote``) the persistent one; a
        queued upload of it is dropped first."""
        with self._lock:
            self._queue = collections.deque(u for u in self._queue if u.step != step)
            running = self._current if self._current is not None and self._current.step == step else None
        if running is not None:  # it would commit after the delete: let it end first
            running.done.wait()
        name = self._name(step)
        gone = 0
        for st in (self.local, self.remote) if remote else (self.local,):
            try:
                st.delete(name)
            except NotFoundError:
                gone += 1
        if gone == (2 if remote else 1):
            raise NotFoundError(f"no step {step} in {self.local.url}" + (f" or {self.remote.url}" if remote else ""))

    def persist_now(self, step: Step) -> None:
        """Queue the upload of local ``step`` (whether it was due or not)."""
        tier = self.local.manifest(self._name(step)).metadata.get(TIER_KEY) or {}
        if not isinstance(tier.get("save"), str):
            raise InvalidArgumentError(f"step {step} of {self.local.url} is not a tiered save")
        self.enqueue(_Upload(step, tier["save"], False))

    def close(self) -> None:
        if os.getpid() != self._pid:
            return  # (a forked child: the parent's threads, locks and store are the parent's)
        self._keeper.shutdown(wait=True)
        self.local.close()


#: every Tiers of this process (weakly): a forked child gets fresh locks for them
_ALL: weakref.WeakSet[Tiers] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A lock the parent's uploader held at the fork would stay held in the child, where
    that thread does not exist: the child (which may read through the parent's manager)
    gets new ones, and no uploader."""
    for t in list(_ALL):
        t._lock = threading.Lock()
        t._thread, t._current = None, None
        t._queue.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _exists(st: Store, name: str) -> bool:
    try:
        return st.exists(name)
    except StorageError:
        return True  # (cannot tell: say why the copy could not be read)


def _remote(session: Session, report: dict[str, Any]) -> AtomicStoreError:
    """The error process 0 published about an upload, to raise here: superseded there
    (the save was replaced or deleted: every process replaced or deleted it, or will) is
    superseded here too."""
    if report.get("type") == Superseded.__name__:
        return Superseded(f"{session.what}: process {report.get('process', 0)}: {report.get('error')}")
    return remote_error(session, report)


def _persisted_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The persistent copy's metadata: the local one's, without what only the local copy
    of one process has."""
    tier = dict(meta.get(TIER_KEY) or {})
    for k in ("process", "own"):
        tier.pop(k, None)
    return {**meta, TIER_KEY: tier}


def _parts(ckpt: Checkpoint) -> tuple[dict[str, FileEntry], dict[str, int]]:
    """The whole step's shard files a multi-host local part lists (:data:`PARTS_FILE`),
    and the process that wrote each."""
    where = ckpt.where(PARTS_FILE)
    try:
        doc = json.loads(ckpt.read_bytes(PARTS_FILE))
        out, by = {}, {}
        for f in doc["files"]:
            size, crc, who = f["size"], f["crc32c"], f["by"]
            if not (isinstance(f["file"], str) and type(size) is int and type(crc) is int and size >= 0
                    and 0 <= crc < 2**32 and type(who) is int):
                raise ValueError(f"bad entry {str(f)[:80]}")
            out[f["file"]], by[f["file"]] = FileEntry(size, crc), who
    except NotFoundError:
        raise CorruptionError(f"{where}: missing from a multi-host local part", path=PARTS_FILE) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(f"{where}: not a list of shard files ({exc})", path=PARTS_FILE) from None
    return out, by


def _whole(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` as the whole step: a multi-host local part's manifest completed with the
    other processes' shard files (reading one of those raises NotFoundError here)."""
    if PARTS_FILE not in ckpt.files:
        return ckpt
    files = {**_parts(ckpt)[0], **ckpt.files}
    del files[PARTS_FILE]
    return Checkpoint(ckpt.store, ckpt.name, ckpt.prefix, dataclasses.replace(ckpt.manifest, files=files))


def new_save_id() -> str:
    return uuid.uuid4().hex


__all__ = ["TIER_KEY", "TierOptions", "TierState", "Tiers", "new_save_id"]
