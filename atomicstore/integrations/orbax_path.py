"""Orbax's ``temporary_path_class``: :class:`AtomicTemporaryPath`, and the Orbax release
this integration runs with (checked on import).

Orbax writes a checkpoint into a *temporary path* and then *finalizes* it; this class
does both through the commit layer (``atomicstore.commit.steps`` and
``atomicstore.commit.inplace``): it tracks the attempts of this process (a step, and the
items Orbax makes inside it), and answers what Orbax lists, restores and cleans up. Import
it from :mod:`atomicstore.integrations.orbax`, which documents the integration as a whole.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from ..commit import Manifest, Store, inplace, steps
from ..commit.inplace import AttemptState, Judgement
from ..commit.locator import store_at
from ..commit.names import MARKER_FILE, validate_name
from ..commit.recovery import RecoveryReport
from ..commit.steps import FoundStep, StepCommit
from ..commit.strategies import new_attempt_id
from ..errors import (
    AtomicStoreError,
    CommitConflictError,
    CorruptionError,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    StorageError,
    TransactionError,
)

__all__ = [
    "ORBAX_VERSION",
    "SUPPORTED_ORBAX",
    "AtomicTemporaryPath",
    "ForcedOverwriteWarning",
    "OrbaxVersionError",
    "ValidationError",
    "check_orbax_version",
    "has_temporary_path_option",
]

#: the Orbax releases this module is tested with: ``>= first, < second``
SUPPORTED_ORBAX = ("0.12.8", "0.13")
log = logging.getLogger(__name__)
#: how long an item waits for its step's ``create`` to begin (seconds): Orbax begins it
#: before it makes the items, so a step that has not begun by then never will
_START_WAIT = 60.0
#: how long an item waits for a ``create`` that has begun (bounded by its own timeouts)
_CREATE_WAIT = 600.0


class OrbaxVersionError(AtomicStoreError, ImportError):
    """orbax-checkpoint is missing, outside :data:`SUPPORTED_ORBAX`, or lacks the
    ``temporary_path_class`` option this integration plugs into."""


def _version_tuple(version: str) -> tuple[int, ...]:
    m = re.match(r"(\d+(?:\.\d+)*)", version.strip())
    if not m:
        raise OrbaxVersionError(f"cannot parse the orbax-checkpoint version {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def check_orbax_version(version: str) -> None:
    """Raise :class:`OrbaxVersionError` unless ``version`` is in :data:`SUPPORTED_ORBAX`."""
    if not isinstance(version, str):
        raise InvalidArgumentError("version must be a str")
    low, high = (_version_tuple(v) for v in SUPPORTED_ORBAX)
    if not low <= _version_tuple(version) < high:
        raise OrbaxVersionError(
            f"atomicstore.integrations.orbax supports orbax-checkpoint >={SUPPORTED_ORBAX[0]},"
            f"<{SUPPORTED_ORBAX[1]} (tested); found {version}"
        )


try:
    import orbax.checkpoint as ocp
    from etils import epath
    from orbax.checkpoint import checkpoint_manager as _  # noqa: F401 - ocp.checkpoint_manager
    from orbax.checkpoint._src.metadata import checkpoint as _ocp_checkpoint_metadata
    from orbax.checkpoint._src.metadata import (
        step_metadata_serialization as _ocp_step_serialization,
    )
    from orbax.checkpoint._src.path import atomicity_types as _ocp_atomicity_types
    from orbax.checkpoint._src.path.atomicity_types import TemporaryPath as _TemporaryPath
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise OrbaxVersionError(
        f"atomicstore.integrations.orbax needs orbax-checkpoint >={SUPPORTED_ORBAX[0]},"
        f"<{SUPPORTED_ORBAX[1]} ({_exc})"
    ) from _exc

#: the installed orbax-checkpoint release (checked against :data:`SUPPORTED_ORBAX` on import)
ORBAX_VERSION: str = ocp.__version__
check_orbax_version(ORBAX_VERSION)


def has_temporary_path_option() -> bool:
    """True if the installed Orbax takes ``temporary_path_class`` everywhere this
    integration is meant to be plugged in."""
    fields = getattr(ocp.CheckpointManagerOptions, "__dataclass_fields__", {})
    if "temporary_path_class" not in fields:
        return False
    for cls in (ocp.Checkpointer, ocp.AsyncCheckpointer, ocp.StandardCheckpointer):
        if "temporary_path_class" not in inspect.signature(cls.__init__).parameters:
            return False
    return ocp.path.atomicity_types.TemporaryPath is _TemporaryPath


if not has_temporary_path_option():  # pragma: no cover - every release in the range has it
    raise OrbaxVersionError(f"orbax-checkpoint {ORBAX_VERSION} lacks the temporary_path_class option")

ValidationError = _ocp_atomicity_types.ValidationError
#: Orbax's own marker name (atomicstore's object-store marker has the same one)
COMMIT_SUCCESS_FILE: str = _ocp_atomicity_types.COMMIT_SUCCESS_FILE
if COMMIT_SUCCESS_FILE != MARKER_FILE:  # pragma: no cover - the same in every supported release
    raise OrbaxVersionError(f"Orbax's marker is {COMMIT_SUCCESS_FILE!r}, atomicstore's {MARKER_FILE!r}")

#: the step attempts of this process by temporary path, oldest first (on object stores the
#: temporary path is the step itself, so one path can have several): their children are
#: items. An attempt leaves when it is finalized or aborted, or when Orbax drops it.
_LIVE: dict[str, list[weakref.ref[AtomicTemporaryPath]]] = {}
_LIVE_LOCK = threading.Lock()
#: ``.step``: the step attempt this thread's save made last. Orbax makes a save's items in
#: the thread that made its step, which is how an item finds its own attempt among several
#: of one step (two threads saving the same step)
_THREAD = threading.local()


def _after_fork_in_child() -> None:
    """A forked child starts with fresh locks (another thread of the parent may have held
    one at the fork), its own stores (opened again on first use) and none of its parent's
    attempts (an item made here never joins the parent's save)."""
    global _LIVE_LOCK
    _LIVE_LOCK = threading.Lock()
    _LIVE.clear()
    _THREAD.step = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _attempts_at(path: str) -> list[AtomicTemporaryPath]:
    """The step attempts of this process at temporary path ``path`` (hold ``_LIVE_LOCK``)."""
    refs = _LIVE.get(path, [])
    alive = [a for a in (r() for r in refs) if a is not None]
    if len(alive) != len(refs):
        if alive:
            _LIVE[path] = [weakref.ref(a) for a in alive]
        else:
            _LIVE.pop(path, None)
    return alive


class ForcedOverwriteWarning(UserWarning):
    """A step that existed when an Orbax save of it began (committed, or being saved by
    another writer) was deleted before the save's ``create``: Orbax's ``force=True``
    (which ``ocp.CheckpointManager.save`` always passes) removed it. Another writer's
    checkpoint may have been lost: use :class:`AtomicCheckpointManager`."""


class AtomicTemporaryPath(_TemporaryPath):  # type: ignore[misc]  # orbax is untyped
    """Orbax ``TemporaryPath`` whose ``finalize`` commits the step through atomicstore.

    Pass the class (or a :meth:`with_options` subclass) as ``temporary_path_class``. An
    instance is either a *step* (``<root>/<step>``, one attempt) or an *item* below a
    step in flight in this process (a plain directory inside the step's attempt, which
    the step's commit covers).
    """

    #: options for :func:`atomicstore.open_store` (storage options and atomicstore's own)
    options: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    # -- configuration ----------------------------------------------------------------------
    @classmethod
    def with_options(cls, **options: Any) -> type[AtomicTemporaryPath]:
        """A subclass whose stores open with ``options``: storage options for fsspec
        (``endpoint_url``, ``token``, ``project``...) and atomicstore's ``writer_id``,
        ``retry``, ``operation_timeout``, ``block_size``, ``lease_ttl``, ``grace``,
        ``clock``. Orbax takes a class, not an instance: this is how to configure one."""
        for k in ("lease_ttl", "grace", "operation_timeout"):
            v = options.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0
                                  or (k != "grace" and v == 0)):
                raise InvalidArgumentError(f"{k} must be a positive number of seconds")
        if "clock" in options and not callable(options["clock"]):
            raise InvalidArgumentError("clock must be a callable returning Unix seconds")
        merged = {**cls.options, **options}
        return type(cls.__name__, (cls,), {"options": MappingProxyType(merged), "__module__": cls.__module__})

    @classmethod
    def open_store(cls, directory: Any) -> Store:
        """The atomicstore :class:`~atomicstore.Store` of an Orbax root directory, e.g. to
        ``recover`` it: the commit layer's one store cache (per root and options; a forked
        child opens its own), shared with every other entry point of this process."""
        return store_at(_root_string(directory), **dict(cls.options))

    # -- construction (no storage I/O beyond opening the store) -----------------------------
    def __init__(self, *, final: Any, tmp: Any, root: str | None, name: str | None,
                 attempt: str | None, step: AtomicTemporaryPath | None = None,
                 metadata_store: Any = None, mode: int | None = None, handle: bool = False) -> None:
        self._handle = handle  # made by from_temporary: names an attempt, cannot save into it
        self._pid = os.getpid()  # only this process creates, finalizes or aborts it
        self._final = epath.Path(final)
        self._tmp = epath.Path(tmp)
        self._root = root
        self._name = name
        self._attempt = attempt
        self._step = step  # for an item: the step it belongs to
        self._metadata_store = metadata_store
        self._mode = mode
        #: the commit-layer attempt: staged (rename backends) or in place (object stores)
        self._commit: StepCommit | None = None
        self._finalized = False
        self._started = False  # create has begun
        self._created = threading.Event()  # create has ended, well or not
        self._create_error: BaseException | None = None
        self._ended = False  # finalized or aborted
        self._found: tuple[FoundStep, str | None] | None = None  # what was at the step at from_final
        self._finalizer: weakref.finalize[[StepCommit, int], AtomicTemporaryPath] | None = None

    @property
    def is_item(self) -> bool:
        return self._step is not None

    @property
    def name(self) -> str | None:
        """The step's name (its directory's name); None for an item."""
        return self._name

    @property
    def attempt(self) -> str | None:
        """The attempt id (None for an item, or a handle made by :meth:`from_temporary`
        on an in-place step)."""
        return self._attempt

    @classmethod
    def from_final(
        cls,
        final_path: Any,
        *,
        checkpoint_metadata_store: Any = None,
        file_options: Any = None,
        snapshot_type: Any = None,
    ) -> AtomicTemporaryPath:
        if snapshot_type is not None:
            raise InvalidArgumentError("AtomicTemporaryPath does not support Orbax snapshots")
        final = epath.Path(final_path)
        mode = getattr(file_options, "path_permission_mode", None)
        if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777):
            raise InvalidArgumentError(f"path_permission_mode must be a mode like 0o750, not {mode!r}")
        parent = str(final.parent)
        step = _item_step(parent)
        if step is not None or steps.parse_staging_path(parent) is not None:
            # an item of a step of this process: a plain directory inside the step's attempt
            return cls(final=final, tmp=final, root=None, name=None, attempt=None,
                       step=step or _detached(cls, parent), mode=mode)
        _check_single_process()
        name = validate_name(final.name)
        store = cls.open_store(parent)
        attempt = new_attempt_id()
        # in place: Orbax's readers expect the items under <step>/
        tmp = final if inplace.writes_in_place(store) else epath.Path(steps.staging_path(store, name, attempt))
        self = cls(final=final, tmp=tmp, root=_root_string(parent), name=name, attempt=attempt,
                   metadata_store=checkpoint_metadata_store, mode=mode)
        self._found = steps.probe_step(store, name)
        with _LIVE_LOCK:
            # on object stores every attempt of a step writes into the step itself: a save
            # of this process already taking or holding it is not joined but refused (its
            # items could not be told apart); one Orbax abandoned before create is ignored
            busy = [a for a in _attempts_at(str(tmp)) if a._in_flight()]
            if busy:
                raise CommitConflictError(
                    f"step {inplace.describe(store, name)} is being saved by another save in this "
                    f"process (attempt {busy[0].attempt}): refused before writing anything", name=name)
            _LIVE.setdefault(str(tmp), []).append(weakref.ref(self))
        _THREAD.step = weakref.ref(self)
        return self

    @classmethod
    def from_temporary(
        cls,
        temporary_path: Any,
        *,
        file_options: Any = None,
        snapshot_type: Any = None,
    ) -> AtomicTemporaryPath:
        """A handle on an existing temporary path, e.g. one :meth:`validate` accepted for
        Orbax's cleanup. It cannot be finalized: only the attempt's creator commits it."""
        if snapshot_type is not None:
            raise InvalidArgumentError("AtomicTemporaryPath does not support Orbax snapshots")
        tmp = epath.Path(temporary_path)
        parts = steps.parse_staging_path(str(tmp))
        if parts is not None:
            root, name, attempt = parts
            return cls(final=epath.Path(root) / name, tmp=tmp, root=root, name=name, attempt=attempt,
                       handle=True)
        return cls(final=tmp, tmp=tmp, root=_root_string(str(tmp.parent)), name=tmp.name, attempt=None,
                   handle=True)

    def get(self) -> Any:
        return self._tmp

    def get_final(self) -> Any:
        return self._final

    def __repr__(self) -> str:
        kind = "item" if self.is_item else f"step {self._name!r}, attempt {self._attempt}"
        return f"AtomicTemporaryPath({kind}, tmp={str(self._tmp)!r})"

    def _in_flight(self) -> bool:
        """A step attempt whose create has begun, and neither failed nor ended."""
        return self._started and not self._ended and self._create_error is None

    def _check_owner(self, what: str) -> None:
        """:class:`~atomicstore.TransactionError` in a forked child: the attempt (or the
        step of an item) belongs to the process that made it."""
        owner = self._step._pid if self._step is not None else self._pid
        if os.getpid() != owner:
            raise TransactionError(
                f"cannot {what} {self}: it was made by process {owner}, and this is a forked child of "
                "it (the save is the parent's, still in flight there); save from a temporary path "
                "made in this process")

    def _store(self) -> Store:
        if self._root is None:
            raise TransactionError(f"{self} belongs to no store")
        return type(self).open_store(self._root)

    # -- the save -----------------------------------------------------------------------------
    async def create(self) -> Any:
        """Begin the attempt (on Orbax's primary host): take the step (conflict check,
        lease; on object stores the claim), create the directory, write Orbax's step
        metadata. :class:`~atomicstore.CommitConflictError` if the step is committed or
        (object stores) being written by another attempt."""
        self._check_owner("create")
        if self.is_item:
            await asyncio.to_thread(self._create_item)
        else:
            await asyncio.to_thread(self._begin)
        return self._tmp

    def _create_item(self) -> None:
        step = self._step
        assert step is not None
        # Orbax begins a step's create before it makes its items (and, creating directories
        # asynchronously, creates the items once the step's signal came): a step whose create
        # has not begun within _START_WAIT was abandoned by Orbax and never will
        begun = time.monotonic()
        while not step._created.wait(0.2):
            waited = time.monotonic() - begun
            if not step._started and waited > _START_WAIT:
                raise TransactionError(f"{self}: its step's create was not called within {_START_WAIT:.0f}s "
                                       "(Orbax abandoned that save)")
            if waited > _CREATE_WAIT:
                raise TransactionError(f"{self}: its step was not created within {_CREATE_WAIT:.0f}s")
        if step._create_error is not None:
            raise TransactionError(f"{self}: its step failed to begin: {step._create_error}")
        if "://" not in str(self._tmp):  # local disk (object stores have no directories)
            try:
                os.makedirs(str(self._tmp), mode=self._mode or 0o755, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"could not create {self._tmp}: {exc}") from exc

    def _begin(self) -> None:
        if self._handle or self._name is None or self._attempt is None:
            raise TransactionError(f"{self} was not made by from_final: it cannot be saved into")
        with _LIVE_LOCK:
            if self._started or self._ended:
                raise TransactionError(f"{self} was already created or aborted")
            self._started = True
        try:
            store = self._store()
            self._check_not_forced(store)
            success = f"Checkpoint commit was successful to {self._final}".encode()  # Orbax's text
            commit = steps.step_commit(store, self._name, self._attempt, version=ORBAX_VERSION, mode=self._mode,
                                 success=success)
            self._commit = commit
            self._finalizer = weakref.finalize(self, steps.abandon_attempt, commit, self._pid)
            try:
                # the lease before any data; on object stores the claim, on disk the staging
                # directory: a committed or claimed step is refused here (CommitConflictError)
                commit.begin()
                self._write_step_metadata()
            except BaseException:
                self._end(abort=True)
                raise
        except BaseException as exc:
            self._create_error = exc
            raise
        finally:
            self._created.set()

    def _check_not_forced(self, store: Store) -> None:
        """Warn (:class:`ForcedOverwriteWarning`) if the step that was there when this save
        began is gone now: Orbax's ``force=True`` deleted it before calling ``create``."""
        if self._found is None:
            return
        assert self._name is not None
        kind, _gen = self._found
        if not steps.step_gone(store, self._name, kind):
            return  # still there: create refuses this save (CommitConflictError)
        what = {FoundStep.STEP: "a step directory", FoundStep.COMMITTED: "a committed step",
                FoundStep.CLAIMED: "a step being saved by another writer (or left by a crashed save)"}[kind]
        msg = (f"{inplace.describe(store, self._name)} held {what} when this save began, and it was deleted before "
               "the save's create, most likely by Orbax's force=True (which ocp.CheckpointManager.save "
               "always passes: it removes an existing step before AtomicTemporaryPath can refuse the "
               "save). If another writer saved it, its checkpoint is lost. Save through "
               "atomicstore.integrations.orbax.AtomicCheckpointManager, which never forces.")
        log.warning("%s", msg)
        warnings.warn(msg, ForcedOverwriteWarning, stacklevel=2)

    def _write_step_metadata(self) -> None:
        """What Orbax's own ``create`` writes into a new step: its StepMetadata."""
        if self._metadata_store is None:
            return
        self._metadata_store.write(
            file_path=_ocp_checkpoint_metadata.step_metadata_file_path(self._tmp),
            metadata=_ocp_step_serialization.serialize(
                ocp.metadata.StepMetadata(init_timestamp_nsecs=time.time_ns())),
        )

    async def finalize(self) -> None:
        """Commit the step (Orbax calls this on its primary host, from a background
        thread). An item is committed with its step: nothing to do."""
        if self.is_item:
            return
        self._check_owner("finalize")
        commit = self._commit
        if commit is None or not commit.started:
            raise TransactionError(f"{self} was not created by this process: only its creator commits it")
        if self._finalized:
            raise TransactionError(f"{self} was already finalized")
        self._finalized = True
        try:
            # a writer declared dead must not write again, not even Orbax's commit time
            await asyncio.to_thread(commit.check_still_ours)
        except LeaseLostError:
            self._end(abort=False)  # what is left is recovery's (the lease stopped)
            raise
        ms = self._metadata_store
        if ms is not None:  # as Orbax's own finalize: the commit time into the StepMetadata
            await asyncio.to_thread(ms.wait_until_finished)
            await asyncio.to_thread(
                ms.update,
                file_path=_ocp_checkpoint_metadata.step_metadata_file_path(self._tmp),
                commit_timestamp_nsecs=time.time_ns(),
            )
            await asyncio.to_thread(ms.wait_until_finished)
        try:
            await asyncio.to_thread(commit.publish)
        finally:
            self._end(abort=False)  # committed, or discarded, or (outcome unknown) recovery's

    def abort(self) -> None:
        """Discard an attempt this process created and has not begun to finalize: its
        staging directory (disk), or its in-place files and claim (object stores), and its
        lease. (Once ``finalize`` has begun, the commit may have happened or may still land:
        then this does nothing and recovery decides.) Orbax has no abort hook: a save that
        fails is otherwise aborted when Orbax drops its temporary path or the process exits
        (its lease stopped; on disk its staging removed), or, if it dies, by recovery."""
        if not self.is_item and not self._finalized:
            self._check_owner("abort")
            self._end(abort=True)

    def _end(self, *, abort: bool) -> None:
        """Stop tracking the attempt; with ``abort``, discard it: staging and lease, and on
        object stores, if this attempt holds the claim, its in-place files and the claim."""
        self._ended = True
        if self._finalized:  # no item of it can come after its finalize
            with _LIVE_LOCK:
                refs = _LIVE.get(str(self._tmp), [])
                refs[:] = [r for r in refs if r() is not self]
                if not refs:
                    _LIVE.pop(str(self._tmp), None)
        if self._finalizer is not None:
            self._finalizer.detach()
        if abort and self._commit is not None:
            self._commit.abort()

    # -- what Orbax lists, restores and cleans up ----------------------------------------------
    @classmethod
    async def validate_final(cls, final_path: Any) -> None:
        """Raise Orbax's ``ValidationError`` unless ``final_path`` is a committed step
        whose files are all present (read afresh; see :meth:`check_final`)."""
        await asyncio.to_thread(cls.check_final, final_path)

    @classmethod
    def check_final(cls, final_path: Any) -> Manifest:
        """The manifest of the committed step at ``final_path`` (on object stores, built
        from its marker), after checking from a fresh listing that every file it names is
        present with its size (and CRC32C where the listing reports one). Raises Orbax's
        ``ValidationError`` otherwise."""
        path = epath.Path(final_path)
        try:
            name = validate_name(path.name)
            store = cls.open_store(str(path.parent))
            manifest = steps.committed_manifest(store, name)
            damage = steps.step_damage(store, name, manifest)
        except (NotFoundError, CorruptionError, InvalidArgumentError) as exc:
            raise ValidationError(f"{path} is not a committed atomicstore Orbax step: {exc}") from None
        if damage is not None:
            raise ValidationError(f"{path}: {damage} (partly deleted or overwritten)")
        return manifest

    @classmethod
    async def validate(cls, temporary_path: Any) -> None:
        """Raise Orbax's ``ValidationError`` unless ``temporary_path`` is provably
        uncommitted and not in flight (what Orbax's tmp cleanup may then delete): see
        :meth:`judge`."""
        judged = await asyncio.to_thread(cls.judge, temporary_path)
        if judged.state is not AttemptState.STALE:
            raise ValidationError(f"{temporary_path} is not a stale uncommitted attempt: {judged.reason}")

    @classmethod
    def judge(cls, temporary_path: Any, *, now: float | None = None) -> Judgement:
        """What ``temporary_path`` is, from storage read now. ``"stale"`` only for an
        atomicstore staging directory, or (object stores) a step holding this integration's
        claim and no marker, whose attempt's lease has expired (or is absent while nothing
        was written for ``grace`` seconds). Committed steps, saves in flight and anything
        not written by this integration are never stale."""
        path = str(epath.Path(temporary_path))
        parts = steps.parse_staging_path(path)
        if parts is not None:
            return steps.judge_staged(cls.open_store(parts[0]), parts[1], parts[2], now)
        p = epath.Path(path)
        try:
            name = validate_name(p.name)
        except InvalidArgumentError:
            return Judgement(AttemptState.FOREIGN, "not a step name")
        return steps.judge_step(cls.open_store(str(p.parent)), name, now)

    # -- maintenance ----------------------------------------------------------------------------
    @classmethod
    def recover(cls, directory: Any, *, dry_run: bool = False, grace: float | None = None,
                now: float | None = None) -> RecoveryReport:
        """Recover the Orbax root ``directory``: remove what crashed saves left (claimed
        in-place steps provably uncommitted and dead, late markers of dead writers, empty
        step directories untouched for ``grace``), then ``store.recover()``; see
        :func:`atomicstore.commit.steps.recover_root`."""
        steps.check_recover_arguments(dry_run, grace, now)  # before the store is opened
        return steps.recover_root(cls.open_store(directory), dry_run=dry_run, grace=grace, now=now)

    @classmethod
    def verify(cls, final_path: Any) -> Manifest:
        """Re-read every file of the committed step at ``final_path`` and check its size and
        CRC32C: :class:`~atomicstore.ChecksumMismatchError` naming the file,
        :class:`~atomicstore.NotFoundError` if the step is not committed."""
        path = epath.Path(final_path)
        name = validate_name(path.name)
        return steps.verify_step(cls.open_store(str(path.parent)), name)


# -- helpers ---------------------------------------------------------------------------------
def _root_string(directory: Any) -> str:
    if not (isinstance(directory, str | os.PathLike) or hasattr(directory, "as_posix")):
        raise InvalidArgumentError(f"expected a directory path or URL, not {type(directory).__name__}")
    s = str(directory)
    if not s.strip():
        raise InvalidArgumentError("expected a directory path or URL")
    return s.rstrip("/") if len(s) > 1 else s


def _check_single_process() -> None:
    import jax

    if jax.process_count() > 1:
        raise InvalidArgumentError(
            "AtomicTemporaryPath supports one JAX process: multi-host Orbax saves are not "
            "supported by this integration")


def _item_step(parent: str) -> AtomicTemporaryPath | None:
    """The step attempt of this process whose child ``parent``'s children are (items), or
    None if ``parent`` is no step attempt's temporary path. Among several attempts of one
    step (object stores), the one this thread made last (Orbax makes a save's items in the
    thread that made its step); else the only one not failed or ended."""
    with _LIVE_LOCK:
        found = _attempts_at(parent)
    if not found:
        return None
    ref = getattr(_THREAD, "step", None)
    mine: AtomicTemporaryPath | None = ref() if ref is not None else None
    if mine is not None and any(a is mine for a in found):
        return mine
    live = [a for a in found if not a._ended and a._create_error is None]
    begun = [a for a in live if a._started]
    if len(live) == 1:
        return live[0]
    if len(begun) == 1:
        return begun[0]  # the others were never created (Orbax abandoned them)
    if not live:
        return found[-1]  # its create failed: so does the item's
    raise CommitConflictError(f"{len(live)} saves of {parent} are in flight in this process: cannot tell "
                              "which one this item belongs to", name=epath.Path(parent).name)


def _detached(cls: type[AtomicTemporaryPath], parent: str) -> AtomicTemporaryPath:
    """A stand-in step for an item whose step is not in flight in this process."""
    step = cls(final=parent, tmp=parent, root=None, name=None, attempt=None)
    step._created.set()
    return step
