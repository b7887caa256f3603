"""Orbax saves committed through atomicstore: :class:`AtomicTemporaryPath`, and
:class:`AtomicCheckpointManager`.

Orbax (``orbax-checkpoint``) writes a checkpoint into a *temporary path* and then
*finalizes* it; the class doing both is pluggable through its ``temporary_path_class``
option (``CheckpointManagerOptions``, ``Checkpointer``, ``AsyncCheckpointer``,
``StandardCheckpointer``)::

    import orbax.checkpoint as ocp
    from atomicstore.integrations.orbax import AtomicCheckpointManager, AtomicTemporaryPath

    mgr = AtomicCheckpointManager("/ckpts/run-42")  # temporary_path_class=AtomicTemporaryPath
    Gcs = AtomicTemporaryPath.with_options(project="my-project", lease_ttl=60)
    mgr = AtomicCheckpointManager("gs://bucket/run-42", options=ocp.CheckpointManagerOptions(
        temporary_path_class=Gcs))
    ckptr = ocp.StandardCheckpointer(temporary_path_class=Gcs)

Orbax's own ``ocp.CheckpointManager.save`` calls its checkpointer with ``force=True``,
which deletes an existing ``<root>/<step>`` (another writer's committed step, or its save
in flight) *before* the temporary path is made: no temporary path class can refuse that.
:class:`AtomicCheckpointManager` is the same manager saving with ``force=False``: an
existing step is refused with :class:`StepConflictError` (a
:class:`~atomicstore.CommitConflictError`) before anything is written or deleted. With a
plain asynchronous manager, a step that was there when its save began and is gone at
``create`` is reported (:class:`ForcedOverwriteWarning`), too late to keep it.

A step ``<root>/<step>`` is saved by one attempt under a lease, in the atomicstore store
at ``<root>``, committed by the commit layer: on rename backends (local disk) Orbax writes
into the attempt's staging directory, adopted into a transaction at ``finalize``
(``atomicstore.commit.steps``); on object stores Orbax's readers want the items directly
under ``<step>/``, so the attempt writes in place, takes the step with a claim
``<step>/atomicstore-claim.json`` before any byte, and commits with a conditional create of
``<step>/commit_success.txt`` (Orbax's own marker name) recording every file
(``atomicstore.commit.inplace``). A second writer of a step is refused
(:class:`~atomicstore.CommitConflictError`) before it writes anything; a writer declared dead
never commits (:class:`~atomicstore.LeaseLostError`).

``validate_final`` (what Orbax lists and restores) accepts a step only if its record is
intact and every file it names is present with its recorded size (and CRC32C where the
listing carries one). ``validate`` (what Orbax's ``cleanup_tmp_directories`` deletes)
accepts only attempts that are provably uncommitted and dead. After a crash,
:meth:`AtomicTemporaryPath.recover` removes what saves left (in-place steps, late markers,
empty step directories) and runs ``store.recover()``. On object stores one process saves a
step once at a time: a second save of a step this process is creating or holding is refused
as it begins. ``docs/integrations.md`` ("Orbax") says what is and is not guaranteed.

Supported: ``orbax-checkpoint`` :data:`SUPPORTED_ORBAX` (tested), one JAX process. This
module holds the manager side; :class:`AtomicTemporaryPath` and the release check live in
``atomicstore.integrations.orbax_path`` and are imported from here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Any

from ..commit import inplace, steps
from ..commit.inplace import CLAIM_FILE, COMMIT_FORMAT, METADATA_KEY, AttemptState, Judgement
from ..commit.names import validate_name
from ..errors import (
    AtomicStoreError,
    CommitConflictError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
)
from .orbax_path import (
    ORBAX_VERSION,
    SUPPORTED_ORBAX,
    AtomicTemporaryPath,
    ForcedOverwriteWarning,
    OrbaxVersionError,
    check_orbax_version,
)
from .orbax_path import has_temporary_path_option as has_temporary_path_option

# isort: split
# (Orbax imported after orbax_path, which raises OrbaxVersionError if it is missing or unsupported)
import orbax.checkpoint as ocp
from etils import epath

__all__ = [
    "CLAIM_FILE",
    "COMMIT_FORMAT",
    "METADATA_KEY",
    "ORBAX_VERSION",
    "SUPPORTED_ORBAX",
    "AtomicCheckpointManager",
    "AtomicTemporaryPath",
    "AttemptState",
    "ForcedOverwriteWarning",
    "Judgement",
    "OrbaxVersionError",
    "StepConflictError",
    "check_orbax_version",
]


log = logging.getLogger(__name__)


class StepConflictError(CommitConflictError, ocp.checkpoint_manager.StepAlreadyExistsError):  # type: ignore[misc]
    """:class:`AtomicCheckpointManager` refused to save a step that exists (committed,
    being saved by another writer, or an empty directory modified within ``grace``
    seconds, which may be another saver's): before anything was written. Both atomicstore's
    :class:`~atomicstore.CommitConflictError` and Orbax's ``StepAlreadyExistsError`` (a
    ``ValueError``), so either ``except`` clause catches it."""


_DESTINATION_EXISTS = re.compile(r"Destination .* already exists\.?", re.DOTALL)


def _save_without_force(save: Any, cls: Any, directory: Any, *args: Any, **kwargs: Any) -> Any:
    """``save(directory, ..., force=False)``: Orbax's "Destination ... already exists"
    becomes :class:`StepConflictError`, except for an empty step directory untouched for
    ``grace`` seconds (a crash's leftover, a user's ``mkdir``): that one is removed as
    recovery would (only if still empty) and the save goes on."""
    kwargs["force"] = False
    path = epath.Path(directory)
    for attempt in (1, 2):
        try:
            return save(directory, *args, **kwargs)
        except ValueError as exc:
            if isinstance(exc, AtomicStoreError) or not _DESTINATION_EXISTS.fullmatch(str(exc)):
                raise
            why = _take_over_empty_step(cls, path) if attempt == 1 else "was created again meanwhile"
            if why is None:
                continue  # removed: save again, once
            raise StepConflictError(f"step {path} {why}: refused before writing anything",
                                    name=path.name) from exc
    raise AssertionError("unreachable")  # pragma: no cover


def _take_over_empty_step(cls: Any, path: Any) -> str | None:
    """None if ``path`` was an empty step directory untouched for ``grace`` and is removed
    now; else why the save of it is refused."""
    exists = ("already exists (committed, or being saved by another writer, or left by a crashed "
              "save that recovery has not removed yet)")
    if not (isinstance(cls, type) and issubclass(cls, AtomicTemporaryPath)):
        return exists
    try:
        name = validate_name(path.name)
        store = cls.open_store(str(path.parent))
    except AtomicStoreError:
        return exists
    empty = steps.judge_empty_step(store, name, store.clock(), store.grace)
    if empty is None:
        return exists
    if empty.state is not steps.EmptyState.STALE:
        return (f"is an empty directory ({empty.reason}): another saver may be about to write into it. "
                f"A save takes it over, and AtomicTemporaryPath.recover removes it, once it is untouched "
                f"for grace={store.grace:.0f}s and no save of it holds a lease; delete it if it is yours")
    if not steps.remove_empty_step(store, empty):
        return "was written into while this save was taking over its empty directory"
    log.info("took over the empty step directory %s (%s)", inplace.describe(store, name), empty.reason)
    return None


def _record_of(cls: Any, path: Any) -> tuple[str, float] | None:
    """(attempt, commit time) of the committed step at ``path``, read now; None if it is
    not a committed step of this integration."""
    if not (isinstance(cls, type) and issubclass(cls, AtomicTemporaryPath)):
        return None
    try:
        store = cls.open_store(str(path.parent))
        manifest = steps.committed_manifest(store, validate_name(path.name))
    except (NotFoundError, CorruptionError, InvalidArgumentError):
        return None
    return manifest.attempt, float(manifest.committed or manifest.created)


def _restore_one_attempt(restore: Any, cls: Any, directory: Any, *args: Any, **kwargs: Any) -> Any:
    """``restore(directory, ...)``, checking that the step was the same committed attempt
    before and after it: Orbax reads its files by name, unconditionally, so a step deleted
    (or deleted and saved again) meanwhile would give bytes of two saves, or of none.
    :class:`~atomicstore.PreconditionFailedError` then."""
    path = epath.Path(directory)
    before = _record_of(cls, path)
    restored = restore(directory, *args, **kwargs)
    if before is not None and _record_of(cls, path) != before:
        raise PreconditionFailedError(
            f"step {path} was deleted or replaced while it was being read (it was attempt {before[0]}): "
            "what was read may mix two saves; restore again")
    return restored


class _Checkpointer(ocp.Checkpointer):  # type: ignore[misc]
    """Orbax's ``Checkpointer``, never deleting an existing destination (``force`` ignored),
    restoring one committed attempt."""

    def save(self, directory: Any, *args: Any, force: bool = False, **kwargs: Any) -> Any:
        return _save_without_force(super().save, self._temporary_path_class, directory, *args, **kwargs)

    def restore(self, directory: Any, *args: Any, **kwargs: Any) -> Any:
        return _restore_one_attempt(super().restore, self._temporary_path_class, directory, *args, **kwargs)


class _AsyncCheckpointer(ocp.AsyncCheckpointer):  # type: ignore[misc]
    """Orbax's ``AsyncCheckpointer``, never deleting an existing destination, restoring
    one committed attempt."""

    def save(self, directory: Any, *args: Any, force: bool = False, **kwargs: Any) -> Any:
        return _save_without_force(super().save, self._temporary_path_class, directory, *args, **kwargs)

    def restore(self, directory: Any, *args: Any, **kwargs: Any) -> Any:
        return _restore_one_attempt(super().restore, self._temporary_path_class, directory, *args, **kwargs)


class AtomicCheckpointManager(ocp.CheckpointManager):  # type: ignore[misc]
    """``ocp.CheckpointManager`` made safe for several writers of one directory.

    Orbax's ``CheckpointManager.save`` calls its checkpointer with ``force=True``, which
    deletes whatever is at ``<directory>/<step>`` (another writer's committed step, or its
    save in flight) *before* the temporary path is created, so no ``temporary_path_class``
    can refuse it. This manager is the same class with two differences:

    * its checkpointer saves with ``force=False``: a step that exists is refused before
      anything is written or deleted, with :class:`StepConflictError` (an
      :class:`~atomicstore.CommitConflictError`), except an empty step directory untouched
      for ``grace`` seconds, which is removed (only if still empty) and saved over, as
      :meth:`AtomicTemporaryPath.recover` would; a step saved concurrently is decided by
      :class:`AtomicTemporaryPath` (claim and conditional marker on object stores,
      ``rename(NOREPLACE)`` on disk), the loser getting ``CommitConflictError``;
    * ``options.temporary_path_class`` defaults to :class:`AtomicTemporaryPath` (a
      class given must be one of its subclasses, e.g. from :meth:`~AtomicTemporaryPath.with_options`).

    A step this manager already lists raises :class:`StepConflictError` too (Orbax raises
    its ``StepAlreadyExistsError`` there). ``restore`` checks that the step was the same
    committed attempt before and after Orbax read it (Orbax reads files by name): a step
    deleted or saved again meanwhile raises :class:`~atomicstore.PreconditionFailedError`.
    Everything else (arguments, retention, async saves) is ``ocp.CheckpointManager``'s.
    """

    def __init__(self, directory: Any, checkpointers: Any = None, options: Any = None,
                 **kwargs: Any) -> None:
        if options is None:
            options = ocp.CheckpointManagerOptions()
        elif not isinstance(options, ocp.CheckpointManagerOptions):
            raise InvalidArgumentError(
                f"options must be an ocp.CheckpointManagerOptions, not {type(options).__name__}")
        else:
            options = replace(options)  # Orbax mutates its options: not the caller's
        cls = options.temporary_path_class
        if cls is None:
            options.temporary_path_class = AtomicTemporaryPath
        elif not (isinstance(cls, type) and issubclass(cls, AtomicTemporaryPath)):
            raise InvalidArgumentError(
                "AtomicCheckpointManager commits through AtomicTemporaryPath: "
                f"temporary_path_class must be AtomicTemporaryPath or a subclass, not {cls!r}")
        super().__init__(directory, checkpointers, options, **kwargs)

    def _configure_checkpointer_common(self, handler: Any, options: Any, use_async: bool) -> Any:
        ckptr = super()._configure_checkpointer_common(handler, options, use_async)
        for stock, safe in ((ocp.AsyncCheckpointer, _AsyncCheckpointer), (ocp.Checkpointer, _Checkpointer)):
            if type(ckptr) is stock:
                ckptr.__class__ = safe  # the checkpointer Orbax configured, saving without force
                return ckptr
        raise OrbaxVersionError(  # pragma: no cover - every supported release makes one of them
            f"orbax-checkpoint {ORBAX_VERSION} configured a {type(ckptr).__name__}: cannot make it save "
            "without force")

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        try:
            return bool(super().save(step, *args, **kwargs))
        except ocp.checkpoint_manager.StepAlreadyExistsError as exc:
            if isinstance(exc, StepConflictError):
                raise
            raise StepConflictError(f"step {step} of {self.directory} already exists: {exc}",
                                    name=str(step)) from exc
