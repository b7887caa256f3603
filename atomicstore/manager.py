"""CheckpointManager: step-numbered checkpoints in one directory or bucket prefix.

Steps are discovered from storage (committed checkpoints only), never from a cache. Save
semantics follow ``flax.training.checkpoints``: without ``overwrite`` a step that is not
newer than every existing one is refused; with ``overwrite`` the same step is replaced
atomically and newer ones are removed once it committed. Retention keeps the newest
``keep`` (or the best ``keep`` by ``best_fn``), one every ``keep_every_n_steps``, and every
milestone; an ephemeral checkpoint is removed as soon as a newer non-ephemeral one commits.
Retention runs only after the new checkpoint is committed, and never deletes (nor counts)
a step whose metadata it cannot read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy as copy_module
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from .commit import Store, open_store
from .commit.manifest import (
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    Manifest,
    encode_metadata,
    metadata_depth,
)
from .commit.names import natural_key, validate_name
from .errors import (
    AtomicStoreError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
)
from .pytree import DEFAULT_TIMEOUT, PreparedSave, Session, restore_with_manifest
from .pytree import restore as restore_tree
from .pytree.coordination import check_timeout, process_index_count
from .tiers import TierOptions, Tiers, TierState, record

log = logging.getLogger("atomicstore.manager")
Step = int | float

WRITE_EVENT = "/jax/checkpoint/write/durations_sec"
READ_EVENT = "/jax/checkpoint/read/durations_sec"


def record_event(event: str, seconds: float) -> None:
    """A ``jax.monitoring`` duration event (see :func:`atomicstore.tiers.record`)."""
    record(event, seconds)


def check_step(step: Any) -> Step:
    if isinstance(step, bool) or not isinstance(step, int | float | np.integer | np.floating):
        raise InvalidArgumentError(f"step must be an int or a float, not {type(step).__name__}")
    step = step.item() if isinstance(step, np.generic) else step
    if isinstance(step, float) and not np.isfinite(step):
        raise InvalidArgumentError(f"step must be finite, got {step}")
    return cast(Step, step)


def check_retention(prefix: Any, keep: Any = 1, keep_every_n_steps: Any = None) -> None:
    """Validate the naming and retention arguments shared with ``compat.flax``."""
    if not isinstance(prefix, str) or not prefix or "/" in prefix or ".." in prefix:
        raise InvalidArgumentError("prefix must be a non-empty string without '/' or '..'")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise InvalidArgumentError("keep must be an int >= 1")
    if keep_every_n_steps is not None and (
        not isinstance(keep_every_n_steps, int) or isinstance(keep_every_n_steps, bool) or keep_every_n_steps < 1
    ):
        raise InvalidArgumentError("keep_every_n_steps must be a positive int or None")


class CheckpointManager:
    """Save, restore and retain step-numbered checkpoints ``<prefix><step>``.

    Args:
        directory_or_url: local directory or URL (``s3://…``, ``gs://…``).
        prefix: checkpoint names are ``f"{prefix}{step}"``.
        keep: how many checkpoints retention keeps (the newest, or the best with
            ``best_fn``).
        keep_every_n_steps: also keep one checkpoint every this many steps.
        best_fn: ``metrics -> float``; with it, the ``keep`` best are kept. A step for
            which it raises or returns NaN (no metrics, no such metric, a NaN metric)
            ranks below every step with a number; among equal scores the newer ranks first.
        best_mode: ``"max"`` or ``"min"``.
        overwrite: allow saving a step that is not newer than the latest (the same step is
            replaced atomically; newer ones are removed once the new step committed).
        async_save: write and commit in a background thread; ``save`` returns once the
            state is snapshotted (jax arrays copied to host, numpy arrays copied unless
            ``save(..., copy=False)`` promises not to mutate them).
        max_pending: saves in flight at once (async); the next ``save`` waits.
        storage_options: passed to fsspec.
        recover: run recovery (grace period rule) when the directory is opened (by
            process 0 only, in a multi-host job). It is housekeeping: if it fails (a
            read-only mount, read-only credentials), that is logged once and the manager
            opens anyway (reading works).
        timeout: multi-host jobs: seconds a process waits for the others in a save (see
            :func:`atomicstore.save`).
        local_dir: a local directory as a fast tier (see ``docs/tiers.md``): ``save``
            commits there, and the steps due are then persisted to ``directory_or_url``
            in the background, each as a commit of its own whose bytes are checked
            against the local manifest. ``restore`` reads the newest step of either tier,
            from the local copy when it verifies. Multi-host: each process uses
            ``<local_dir>/process-<i>``.
        local_keep: tiers: how many steps the local tier keeps (besides steps whose
            upload is queued or running, and a due step not persisted yet).
        persist_every_n_steps: tiers: a step is persisted when this many steps passed
            since the last persisted one (and always the first step a manager saves, and
            milestones). With neither this nor ``persist_every_seconds``, every step is.
        persist_every_seconds: tiers: a step is persisted when this many seconds passed
            since the last persisted one.
        upload_rate: tiers: at most this many bytes per second are read from the local
            tier for uploads (None: as fast as the persistent tier takes them), so that
            uploads leave the local disk's bandwidth to the next save.

    Multi-host (``jax.distributed``) jobs: every process creates the manager and calls
    ``save``, ``restore`` and ``delete`` with the same arguments in the same order, as
    with Orbax. Arrays sharded across processes are written by the processes holding
    them; process 0 checks the step, writes the rest, commits and applies retention
    before any process returns, so every process then sees the same steps.
    Errors of a background save in any process are raised by the next call in every
    process.
    """

    def __init__(
        self,
        directory_or_url: str,
        *,
        prefix: str = "checkpoint_",
        keep: int = 1,
        keep_every_n_steps: int | None = None,
        best_fn: Callable[[dict[str, Any]], float] | None = None,
        best_mode: str = "max",
        overwrite: bool = False,
        async_save: bool = False,
        max_pending: int = 1,
        storage_options: dict[str, Any] | None = None,
        recover: bool = True,
        store: Store | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        local_dir: str | os.PathLike[str] | None = None,
        local_keep: int = 2,
        persist_every_n_steps: int | float | None = None,
        persist_every_seconds: float | None = None,
        upload_rate: float | None = None,
    ) -> None:
        check_retention(prefix, keep, keep_every_n_steps)
        tier_options = TierOptions(local_keep, persist_every_n_steps, persist_every_seconds, upload_rate)
        try:
            validate_name(f"{prefix}0")
        except InvalidArgumentError:
            raise InvalidArgumentError(f"prefix {prefix!r} cannot start a checkpoint name: use letters, "
                                       "digits and '_.+=-', not starting with '.'") from None
        self.timeout = check_timeout(timeout)
        if best_mode not in ("max", "min"):
            raise InvalidArgumentError("best_mode must be 'max' or 'min'")
        if best_fn is not None and not callable(best_fn):
            raise InvalidArgumentError("best_fn must be callable")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise InvalidArgumentError("max_pending must be an int >= 1")
        self.prefix, self.keep, self.keep_every_n_steps = prefix, keep, keep_every_n_steps
        self.best_fn, self.best_mode, self.overwrite = best_fn, best_mode, overwrite
        self.async_save = async_save
        if storage_options is not None and not isinstance(storage_options, dict):
            raise InvalidArgumentError("storage_options must be a dict")
        self.store = store or open_store(directory_or_url, **(storage_options or {}))
        self._pid = os.getpid()  # a forked child must make its own manager
        self._pending: list[threading.Thread] = []
        self._slots = threading.BoundedSemaphore(max_pending)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: name -> (generation of its commit point, metadata read at exactly that
        #: generation): what retention already verified (see _readable_metadata)
        self._verified: dict[str, tuple[str, dict[str, Any]]] = {}
        self._verified_lock = threading.Lock()
        if recover and process_index_count()[0] == 0:
            self._recover()
        self._tiers: Tiers | None = None
        if local_dir is not None:
            self._tiers = Tiers(local_dir, self.store, prefix=prefix, options=tier_options, name=self._name,
                                step_of=self._step_of, persisted=self._persisted, timeout=self.timeout,
                                recover=recover, process=process_index_count())

    def _recover(self) -> None:
        """Recovery on open. Housekeeping: a store this process cannot write to (read-only
        mount or credentials) is still opened for reading; the failure is logged once per
        store and process."""
        try:
            report = self.store.recover(flax_prefix=self.prefix)
        except InvalidArgumentError:
            raise
        except (AtomicStoreError, OSError) as exc:
            with _RECOVERY_FAILED_LOCK:
                first = self.store.url not in _RECOVERY_FAILED
                _RECOVERY_FAILED.add(self.store.url)
            log.log(logging.WARNING if first else logging.DEBUG,
                    "recovery of %s could not run, so leftovers of crashed saves stay there until a "
                    "process that can write to it opens it (or runs `atomicstore recover`); the "
                    "manager is open for reading (saves need write access): %s", self.store.url, exc)
            return
        if report.actions:
            log.info("%s", report.summary())

    # -- naming ------------------------------------------------------------------------
    def _name(self, step: Step) -> str:
        return f"{self.prefix}{step}"

    def _step_of(self, name: str) -> Step | None:
        """The step ``name`` is the checkpoint of, or None: only the name this manager
        gives that step (``checkpoint_05`` or ``checkpoint_1e1`` is not a step: ``restore``
        of the step it parses as would open another name)."""
        if not name.startswith(self.prefix):
            return None
        rest = name[len(self.prefix):]
        step: Step
        try:
            step = int(rest)
        except ValueError:
            try:
                step = float(rest)
            except ValueError:
                return None
            if not np.isfinite(step):
                return None
        return step if self._name(step) == name else None

    def all_steps(self) -> list[Step]:
        """Committed steps, in natural order (read from storage, never cached); with
        tiers, the steps of either tier."""
        if self._tiers is not None:
            return self._tiers.steps()
        steps = [s for s in (self._step_of(n) for n in self.store.list()) if s is not None]
        return sorted(steps, key=lambda s: natural_key(str(s)))

    def latest_step(self) -> Step | None:
        """The last committed step in natural order, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: Step) -> dict[str, Any]:
        """The metadata saved with ``step``: ``user``, ``metrics``, ``items``,
        ``started`` and ``committed`` (Unix times), ``version``, ``milestone``,
        ``ephemeral``, ``step``, and ``attempt`` (the id of the save that committed it).
        NaN and infinite metrics read back as floats. Raises
        :class:`~atomicstore.CorruptionError` when the stored metadata is not what a
        manager writes."""
        step = check_step(step)
        name = self._name(step)
        if self._tiers is not None:
            return self._decode(name, self._tiers.manifest(step))
        return self._decode(name, self.store.manifest(name))

    def _decode(self, name: str, man: Manifest) -> dict[str, Any]:
        """The metadata of manifest ``man`` of checkpoint ``name``, its non-finite metrics
        restored; the manager's own fields are checked (they come from storage)."""
        meta = {**man.metadata, "committed": man.committed, "attempt": man.attempt}
        try:
            for key in ("user", "metrics", "items"):
                if not isinstance(meta.get(key, {}), dict):
                    raise ValueError(f"{key} is not an object")
            for key in ("milestone", "ephemeral"):
                if not isinstance(meta.get(key, False), bool):
                    raise ValueError(f"{key} is not a boolean")
            if NONFINITE in meta:
                meta["metrics"] = _restore_nonfinite(meta.get("metrics", {}), meta.pop(NONFINITE))
        except ValueError as exc:
            where = self.store.driver.describe(f"{name}/manifest.json")
            raise CorruptionError(f"{where}: not the metadata of a CheckpointManager step ({exc})",
                                  path="manifest.json") from None
        return meta

    # -- saving ------------------------------------------------------------------------
    def save(
        self,
        step: Step,
        tree: Any,
        *,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        force: bool = False,
        milestone: bool = False,
        ephemeral: bool = False,
        copy: bool = True,
        items: dict[str, Any] | None = None,
    ) -> None:
        """Save ``tree`` as ``step``, with optional named JSON ``items`` (e.g. a data
        iterator's position or a config) committed together with it. Raises an earlier
        background save's error first.

        ``metadata``, ``metrics`` and ``items`` are JSON (``metrics`` may hold NaN and
        infinities: they read back as floats) and together take at most
        :data:`~atomicstore.commit.manifest.MAX_METADATA_BYTES`. Every argument is checked
        before ``save`` returns, also with ``async_save`` (:class:`InvalidArgumentError`
        naming it); what fails in the background is raised by the next call."""
        session = Session.begin(f"save of step {step} in {self.store.url}", self.timeout)
        try:  # (the session is drawn first: every process draws it, whatever fails next)
            self._check_open()
            self._raise_pending_error()
            step = self._check_save(step, items, force=force, milestone=milestone, ephemeral=ephemeral, copy=copy)
            user = _json_argument(metadata, metrics, items)
            overwrite = self.overwrite or bool(force)
            newer: list[Step] = []
            if session is None or session.main:  # process 0 decides on the step
                newer = self._newer(step, overwrite)
                # 2.0 and 2 are one step: replacing it keeps the name it was committed under
                step = next((s for s in newer if s == step), step)
            meta = {**user, "started": time.time(), "version": _version(), "milestone": bool(milestone),
                    "ephemeral": bool(ephemeral), "step": step}
            job = PreparedSave(tree, session=session, snapshot=self.async_save, copy=bool(copy),
                               every_process=self._tiers is not None)
            if not self.async_save:
                gens = self._generations(newer) if overwrite else {}
        except BaseException as exc:
            if session is not None:
                session.fail(exc)
            raise
        if not self.async_save:
            self._save_now(step, job, meta, gens)
            return
        self._save_later(step, job, meta, overwrite, newer, session)

    def _check_save(self, raw_step: Any, items: Any, *, force: Any, milestone: Any, ephemeral: Any,
                    copy: Any) -> Step:
        """:meth:`save`'s own arguments checked (``metadata``, ``metrics`` and ``items``'
        values are checked as JSON by ``_json_argument``); the step."""
        step = check_step(raw_step)
        for flag, val in (("force", force), ("milestone", milestone), ("ephemeral", ephemeral),
                          ("copy", copy)):
            if not isinstance(val, bool | np.bool_):
                raise InvalidArgumentError(f"{flag} must be a bool, not {type(val).__name__}")
        if milestone and ephemeral:
            raise InvalidArgumentError("a checkpoint cannot be both a milestone and ephemeral")
        try:
            validate_name(self._name(step))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"step {step!r}: {exc}") from None
        if items is not None and isinstance(items, dict) and not all(isinstance(k, str) and k for k in items):
            raise InvalidArgumentError("items must be named by non-empty strings")
        return step

    def _save_later(self, step: Step, job: PreparedSave, meta: dict[str, Any], overwrite: bool,
                    newer: list[Step], session: Session | None) -> None:
        """The async half of :meth:`save`: once the saves before it are done, save in a
        background thread (at most ``max_pending`` at once: a slot is taken here)."""
        self._slots.acquire()
        self.wait_until_finished(_raise=False, _uploads=False)  # saves are ordered (uploads are not saves)
        try:
            self._raise_pending_error()  # the previous save failed while this one waited
            if session is None or session.main:  # again: the saves waited for may have committed it
                newer = self._newer(step, overwrite)
            gens = self._generations(newer) if overwrite else {}
        except BaseException as exc:
            self._slots.release()
            if session is not None:
                session.fail(exc)
            raise
        t = threading.Thread(target=self._background, args=(step, job, meta, gens),
                             name=f"atomicstore-save-{step}", daemon=True)
        with self._lock:
            self._pending.append(t)
        t.start()

    def _newer(self, step: Step, overwrite: bool) -> list[Step]:
        """The committed steps not older than ``step`` (what an overwrite replaces and
        removes); without ``overwrite`` there must be none. With tiers, a persistent tier
        that cannot be listed now does not stop a local save (see ``Tiers.steps``)."""
        steps = self._tiers.steps(for_save=True) if self._tiers is not None else self.all_steps()
        newer = [s for s in steps if s >= step]
        if newer and not overwrite:
            raise InvalidArgumentError(
                f"step {step} is not newer than the latest checkpoint {steps[-1]} "
                f"(pass overwrite=True to the manager, or force=True)"
            )
        return newer

    def _generations(self, steps: list[Step]) -> dict[Step, Any]:
        """Which checkpoint each of ``steps`` is now (read when the save is called), so
        that removing them later removes only those, never one saved since; with tiers,
        ``(local, persistent)``."""
        if self._tiers is not None:
            local, remote = self._tiers.local.strategy, self.store.strategy
            return {s: (local.current(self._name(s)), remote.current(self._name(s))) for s in steps}
        return {s: self.store.strategy.current(self._name(s)) for s in steps}

    def _background(self, step: Step, job: PreparedSave, meta: dict[str, Any], newer: dict[Step, str | None]) -> None:
        try:
            self._save_now(step, job, meta, newer)
        except BaseException as exc:  # noqa: BLE001 - kept and raised on the next call
            log.error("background save of step %s failed: %s", step, exc)
            with self._lock:
                self._error = self._error or exc
        finally:
            self._slots.release()

    def _save_now(self, step: Step, job: PreparedSave, meta: dict[str, Any], newer: dict[Step, Any]) -> None:
        t0 = time.monotonic()
        if self._tiers is not None:
            self._tiers.commit_local(step, job, meta, overwrite=step in newer, replaced=newer,
                                     milestone=bool(meta.get("milestone")))
            record_event(WRITE_EVENT, time.monotonic() - t0)
            return

        def after() -> None:  # process 0, once committed
            # flax: overwriting removes newer steps, here only once the new step committed
            for s, gen in newer.items():
                if s != step and gen is not None:
                    try:  # only the checkpoint that was there when save was called
                        self.store.delete(self._name(s), if_attempt=gen)
                    except (NotFoundError, PreconditionFailedError):
                        pass  # deleted, or saved again, by someone else meanwhile
            self._retain(step, meta)

        job.run(self.store, self._name(step), overwrite=step in newer, metadata=meta, after=after)
        dt = time.monotonic() - t0
        record_event(WRITE_EVENT, dt)
        log.info("saved step %s in %.3fs", step, dt)

    def _persisted(self, step: Step, meta: dict[str, Any], replaced: dict[Step, str | None]) -> None:
        """Tiers, once ``step`` committed in the persistent tier: an overwrite's newer
        steps there go, then retention of the persistent tier."""
        for s, gen in replaced.items():
            if s != step and gen is not None:
                try:
                    self.store.delete(self._name(s), if_attempt=gen)
                except (NotFoundError, PreconditionFailedError):
                    pass
        self._retain(step, meta)

    def tier_state(self) -> dict[Step, TierState]:
        """Tiers: each step's state, ``local`` (in the local tier only), ``persisting``
        (its upload is queued or running) or ``persisted`` (committed in the persistent
        tier, maybe also local)."""
        if self._tiers is None:
            raise InvalidArgumentError("this CheckpointManager has no local tier (local_dir)")
        return self._tiers.state()

    def persist(self, step: Step) -> None:
        """Tiers: queue the upload of local ``step`` to the persistent tier now, even if it
        was not due (e.g. before a planned shutdown); :meth:`wait_until_finished` waits
        for it."""
        if self._tiers is None:
            raise InvalidArgumentError("this CheckpointManager has no local tier (local_dir)")
        self._check_open()
        self.wait_until_finished(_uploads=False)  # (a save of that step in flight commits first)
        self._tiers.persist_now(check_step(step))

    def _readable_metadata(self) -> tuple[dict[Step, dict[str, Any]], dict[Step, str]]:
        """The metadata of each committed step retention can read, in natural order, from
        one listing of the store plus a read of each step whose commit point is not at the
        generation this manager already verified. A step deleted since the listing is
        left out silently; one whose manifest cannot be read is left out with a warning
        (retention keeps it: see "Unreadable steps" in docs/manager.md).

        What is reused: the metadata of a step read by a *conditional* read of its commit
        point at the generation the listing gave (S3 ``If-Match``, GCS
        ``ifGenerationMatch``), keyed by name and that generation. A commit point at the
        same generation is the same marker, naming the same attempt and manifest digest,
        and an attempt's manifest is written once, before its marker, and removed only
        after its marker is (un-publish first), so a fresh read would give the same
        metadata. It only ranks steps: each deletion is still conditional on the attempt
        judged (``delete(if_attempt=...)``), which reads the marker afresh, and a step
        judged from remembered metadata is read again before it is deleted
        (docs/commit-protocol.md, "Metadata requests"). Also returns the steps whose
        metadata was remembered, with their generation."""
        listed = self.store.committed()
        steps = {s: n for n in listed if (s := self._step_of(n)) is not None and self._name(s) == n}
        with self._verified_lock:
            for name in [n for n in self._verified if n not in listed]:
                del self._verified[name]  # gone: forget it (bounded by what is committed)
            known = {n: v for n, v in self._verified.items() if v[0] == listed[n]}

        def read(s: Step) -> tuple[Step, dict[str, Any] | None]:
            name = steps[s]
            if name in known:
                return s, known[name][1]
            return s, self._read_metadata(s, listed[name])

        todo = sorted(steps, key=lambda s: natural_key(str(s)))
        misses = sum(1 for s in todo if steps[s] not in known)
        if misses > 1:  # (e.g. the first save of a manager: every step, concurrently)
            with concurrent.futures.ThreadPoolExecutor(min(16, misses)) as pool:
                found = list(pool.map(read, todo))
        else:
            found = [read(s) for s in todo]
        reused = {s: known[steps[s]][0] for s in todo if steps[s] in known}
        return {s: m for s, m in found if m is not None}, reused

    def _read_metadata(self, step: Step, generation: str | None, *, fallback: bool = True
                       ) -> dict[str, Any] | None:
        """The metadata of ``step`` (None if it is gone or unreadable), remembered when
        read at ``generation``; without ``fallback``, also None if the step is no longer
        at ``generation``."""
        name = self._name(step)
        with self._verified_lock:
            self._verified.pop(name, None)  # (remembered again below if it reads well)
        try:
            if generation is not None:
                try:
                    man = self.store.open(name, generation=generation).manifest
                except PreconditionFailedError:
                    if not fallback:
                        return None
                    # changed since the listing: read what is there now, not remembered
                else:
                    meta = self._decode(name, man)
                    with self._verified_lock:
                        self._verified[name] = (generation, meta)
                    return meta
            return self.metadata(step)
        except NotFoundError:
            return None
        except CorruptionError as exc:
            if self._gone(step):
                return None  # deleted between reading its marker and its manifest
            log.warning("retention keeps checkpoint %s: its metadata cannot be read, so it is "
                        "neither deleted nor counted towards keep (%s)", name, exc)
            return None

    def _gone(self, step: Step) -> bool:
        try:
            return not self.store.exists(self._name(step))
        except AtomicStoreError:
            return False

    def _retain(self, new_step: Step, new_meta: dict[str, Any]) -> None:
        """Apply retention after ``new_step`` (saved with ``new_meta``) committed. Steps
        whose metadata cannot be read are never deleted nor counted towards ``keep``."""
        metas, reused = self._readable_metadata()
        steps = list(metas)
        drop: set[Step] = set()
        # ephemeral checkpoints go once a newer non-ephemeral one exists
        for s in steps:
            if metas[s].get("ephemeral") and not new_meta.get("ephemeral") and s < new_step:
                drop.add(s)
        candidates = [s for s in steps if s not in drop and not metas[s].get("milestone")
                      and not metas[s].get("ephemeral")]
        if self.best_fn is not None:
            ranked = sorted(candidates, key=lambda s: (self._score(metas[s]), natural_key(str(s))), reverse=True)
            keep = set(ranked[: self.keep])
        else:
            keep = set(candidates[-self.keep:])
        last_kept = -np.inf  # flax's rule: of the older ones, keep one every n steps
        for s in candidates:
            if s in keep:
                continue
            if self.keep_every_n_steps and s - last_kept >= self.keep_every_n_steps:
                last_kept = s
                continue
            drop.add(s)
        self._delete_dropped(drop, metas, reused)

    def _score(self, meta: dict[str, Any]) -> float:
        """A checkpoint's rank by ``best_fn`` of its metrics (higher is better); the
        worst when it has no usable metric."""
        try:
            raw = self.best_fn(meta.get("metrics") or {})  # type: ignore[misc]
            try:
                v = float(raw)
            except OverflowError:  # an int beyond a float's range (10**400): still ordered
                v = math.inf if raw > 0 else -math.inf
        except Exception:  # noqa: BLE001 - no usable metric: worst
            return -math.inf
        if math.isnan(v):  # (no order: it would make the ranking arbitrary)
            return -math.inf
        return v if self.best_mode == "max" else -v

    def _delete_dropped(self, drop: set[Step], metas: dict[Step, dict[str, Any]], reused: dict[Step, str]) -> None:
        """Delete the checkpoints retention dropped, oldest first."""
        for s in sorted(drop, key=lambda s: natural_key(str(s))):
            if s in reused:  # judged from remembered metadata: never delete what cannot be read now
                fresh = self._read_metadata(s, reused[s], fallback=False)
                if fresh is None or fresh["attempt"] != metas[s]["attempt"]:
                    continue
            try:  # only the checkpoint retention judged: never a newer one of that name
                self.store.delete(self._name(s), if_attempt=metas[s]["attempt"])
            except (NotFoundError, PreconditionFailedError):
                pass

    # -- restoring ---------------------------------------------------------------------
    def restore(self, step: Step | None = None, target: Any = None, *, with_items: bool = False,
                **kwargs: Any) -> Any:
        """Restore ``step`` (the latest when None); with ``with_items``, return
        ``(tree, items)``. Other arguments as for :func:`atomicstore.restore`. Raises
        :class:`NotFoundError` when there is no checkpoint. Waits for background saves
        first, so a step just saved is restorable. In a multi-host job every process
        calls it: process 0 picks the step (when None) and the save, every process
        restores that one or every process raises (see ``docs/multiprocess.md``)."""
        self.wait_until_finished(_uploads=False)
        kwargs.setdefault("timeout", self.timeout)
        if self._tiers is not None:
            t0 = time.monotonic()
            out, man, step = self._tiers.restore(None if step is None else check_step(step), target, kwargs)
            record_event(READ_EVENT, time.monotonic() - t0)
            if not with_items:
                return out
            name = self._name(step)
            return out, (dict(self._decode(name, man).get("items") or {}) if man is not None else self.items(step))
        if step is None:
            # multi-host: process 0 picks the latest step for every process (another job
            # may commit a step between two processes' listings)
            session = (Session.begin(f"latest step to restore in {self.store.url}", self.timeout)
                       if kwargs.get("collective", True) is True else None)
            step = self.latest_step() if session is None else session.decide(self.latest_step)
            if step is None:
                raise NotFoundError(f"no checkpoint with prefix {self.prefix!r} in {self.store.url}")
        step = check_step(step)
        t0 = time.monotonic()
        url = f"{self.store.url}/{self._name(step)}"
        if not with_items:
            out = restore_tree(url, target, store=self.store, **kwargs)
            record_event(READ_EVENT, time.monotonic() - t0)
            return out
        out, man = restore_with_manifest(url, target, store=self.store, **kwargs)
        record_event(READ_EVENT, time.monotonic() - t0)
        # the items of the very save restored, not of one that replaced it since
        # (decoded and checked like any stored metadata: hostile items are CorruptionError)
        name = self._name(step)
        return out, (dict(self._decode(name, man).get("items") or {}) if man is not None
                     else self.items(step))

    def items(self, step: Step) -> dict[str, Any]:
        """The named JSON items saved with ``step``."""
        return dict(self.metadata(step).get("items") or {})

    def delete(self, step: Step) -> None:
        """Delete ``step`` (in a multi-host job: every process calls it, process 0 deletes)."""
        session = Session.begin(f"delete of step {step} in {self.store.url}", self.timeout)
        name = self._name(check_step(step))
        if self._tiers is not None:
            tiers, step = self._tiers, check_step(step)
            if session is None:
                tiers.delete(step)
                return
            if not session.main:  # its own local part (process 0's outcome says whether the step was there)
                with contextlib.suppress(NotFoundError):
                    tiers.delete(step, remote=False)
            session.decide(lambda: tiers.delete(step))  # process 0: both tiers; its error reaches every process
            return
        if session is None:
            self.store.delete(name)
        else:
            session.decide(lambda: self.store.delete(name))

    # -- async bookkeeping -----------------------------------------------------------------
    def wait_until_finished(self, _raise: bool = True, _uploads: bool = True) -> None:
        """Block until every background save finished, and with tiers every upload
        queued; raise the first error of one. In a forked child: at once (the parent's
        threads do not exist there, and a lock one of them held at the fork stays held)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            pending = list(self._pending)
        for t in pending:
            t.join()
        with self._lock:
            self._pending = [t for t in self._pending if t.is_alive()]
        if self._tiers is not None and _uploads:
            self._tiers.wait()
        if _raise:
            self._raise_pending_error()
            if self._tiers is not None and _uploads and (errs := self._tiers.take_errors()):
                raise errs[0]

    def _raise_pending_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            msg = f"a background save failed: {err}"
            again: AtomicStoreError = AtomicStoreError(msg)
            if isinstance(err, AtomicStoreError):  # the same class, so `except CoordinationError` works
                try:
                    again = type(err)(msg)
                    again.__dict__.update(vars(err))  # (path, leaf, name... of the original)
                except TypeError:
                    pass
            raise again from err

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the CheckpointManager is closed")
        if os.getpid() != self._pid:
            # its background saves and their slots belong to the parent's threads, which
            # do not exist here: waiting for them would never end
            raise InvalidArgumentError(
                f"this CheckpointManager was made in process {self._pid}; a forked child "
                "must make its own (the parent's background saves do not exist in the child)"
            )

    def close(self) -> None:
        """Wait for background saves and raise any error they had. With tiers, the
        uploads queued are finished first (leaving a ``with`` block on an exception
        abandons them instead: an upload in flight aborts and commits nothing, and the
        next manager on this local tier resumes it)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_until_finished()
        finally:
            if self._tiers is not None:
                self._tiers.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, et: Any, *_: Any) -> None:
        if et is None:
            self.close()
        else:  # do not mask the exception in flight
            self._closed = True
            if self._tiers is not None:
                self._tiers.abandon()
            self.wait_until_finished(_raise=False)


#: what ``save``'s ``metadata``, ``metrics`` and ``items`` may take together (bytes of JSON):
#: a checkpoint's metadata limit, less room for the manager's own fields
USER_METADATA_BYTES = MAX_METADATA_BYTES - 1024

#: recovery on open failed for these store URLs (logged once per store and process)
_RECOVERY_FAILED: set[str] = set()
_RECOVERY_FAILED_LOCK = threading.Lock()

#: metadata key listing the non-finite metrics: ``[[path, "nan" | "inf" | "-inf"], ...]``,
#: each path (object keys and array indices) leading to a ``null`` in ``metrics``
NONFINITE = "metrics_nonfinite"
_NONFINITE_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _json_argument(metadata: Any, metrics: Any, items: Any) -> dict[str, Any]:
    """The manager's metadata fields for ``save``'s ``metadata``, ``metrics`` and
    ``items``: checked (JSON, nesting, size, each named; then together), copied (a caller
    changing them after an async ``save`` returned changes nothing), and the non-finite
    metrics listed apart so that the manifest stays strict JSON."""
    fields: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for what, key, val in (("metadata", "user", metadata), ("metrics", "metrics", metrics),
                           ("items", "items", items)):
        val = {} if val is None else val
        extra: dict[str, Any] = {}
        if what == "metrics" and isinstance(val, dict):
            val, nonfinite = _split_nonfinite(val)
            if nonfinite:
                extra[NONFINITE] = nonfinite
        text = encode_metadata(val, what=what, depth=MAX_METADATA_DEPTH - 1, limit=USER_METADATA_BYTES)
        sizes[what] = len(text) + (len(json.dumps(extra[NONFINITE])) if extra else 0)
        fields[key] = json.loads(text)
        fields.update(extra)
    if sum(sizes.values()) > USER_METADATA_BYTES:
        parts = ", ".join(f"{k} {v:,}" for k, v in sizes.items())
        raise InvalidArgumentError(
            f"metadata, metrics and items together take {sum(sizes.values()):,} bytes as JSON "
            f"({parts}), over the {USER_METADATA_BYTES:,} a step's metadata may take "
            f"(readers refuse manifests over {MAX_MANIFEST_BYTES:,} bytes)"
        )
    return fields


def _split_nonfinite(metrics: dict[str, Any]) -> tuple[dict[str, Any], list[list[Any]]]:
    """``metrics`` as JSON values with each NaN or infinity replaced by None, and the
    list of where they were (see :data:`NONFINITE`)."""
    try:
        plain = json.loads(json.dumps(metrics))  # (keys as JSON makes them; tuples as lists)
    except RecursionError:
        raise InvalidArgumentError(f"metrics is nested deeper than {MAX_METADATA_DEPTH - 1} levels") from None
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"metrics must hold JSON values only (nothing executable is "
                                   f"stored): {exc}") from None
    found: list[list[Any]] = []
    todo: list[tuple[Any, list[Any]]] = [(plain, [])]
    while todo:
        node, path = todo.pop()
        pairs = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in pairs:
            if isinstance(v, float) and not math.isfinite(v):
                node[k] = None
                found.append([[*path, k], "nan" if math.isnan(v) else "inf" if v > 0 else "-inf"])
            elif isinstance(v, dict | list) and len(path) < MAX_METADATA_DEPTH:
                todo.append((v, [*path, k]))
    return plain, sorted(found, key=json.dumps)


def _restore_nonfinite(metrics: Any, nonfinite: Any) -> dict[str, Any]:
    """``metrics`` with the values :data:`NONFINITE` lists put back (a copy); ValueError
    if the list is not what :func:`_split_nonfinite` writes."""
    if not isinstance(nonfinite, list) or not isinstance(metrics, dict):
        raise ValueError(f"{NONFINITE} is not a list")
    if metadata_depth(metrics) > MAX_METADATA_DEPTH:  # (a manager never writes it: deepcopy could not copy it)
        raise ValueError(f"metrics nested deeper than {MAX_METADATA_DEPTH} levels")
    out = copy_module.deepcopy(metrics)
    for entry in nonfinite:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and entry[0]
                and isinstance(entry[1], str) and entry[1] in _NONFINITE_VALUES):
            raise ValueError(f"bad {NONFINITE} entry {str(entry)[:80]}")
        path, parent, node = entry[0], None, out
        for k in path:
            ok = (isinstance(node, dict) and isinstance(k, str) and k in node) or (
                isinstance(node, list) and type(k) is int and 0 <= k < len(node))
            if not ok:
                raise ValueError(f"{NONFINITE} path {str(path)[:80]} is not in metrics")
            parent, node = node, node[k]
        if node is not None:
            raise ValueError(f"{NONFINITE} path {str(path)[:80]} does not lead to null")
        parent[path[-1]] = _NONFINITE_VALUES[entry[1]]
    return out


def _version() -> str:
    from . import __version__

    return f"atomicstore {__version__}"
