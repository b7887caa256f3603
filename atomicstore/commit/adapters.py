"""Writes and deletes the compat modules and integrations need beyond :class:`Store`'s
transactions, one-file commits and deletes, so that no module above the commit layer
calls a driver's mutating method:

* :func:`open_attempt_file`: a rank or process that does not hold the
  :class:`~atomicstore.Transaction` writes a file into its attempt (the owner counts it
  with :meth:`~atomicstore.Transaction.adopt`): torch DCP's ranks;
* :func:`delete_one_file_step`: retention deletes a one-file checkpoint and the directory
  that holds its arrays beside it (flax's ``<prefix><step>`` and ``<prefix><step>_gda``).
"""

from __future__ import annotations

import re

from ..drivers import Writer
from ..errors import CorruptionError, InvalidArgumentError, NotFoundError, PreconditionFailedError
from .names import ATTEMPT_ID, validate_name, validate_path
from .store import Store
from .strategy import KeyKind

_TRAILING_ATTEMPT = re.compile(rf"({ATTEMPT_ID.pattern})$")


def is_attempt_prefix(store: Store, prefix: str) -> bool:
    """Whether ``prefix`` is where ``store``'s commit strategy stages the files of an
    attempt (what :attr:`Transaction.prefix` returns), for some name and attempt id."""
    m = _TRAILING_ATTEMPT.search(prefix) if isinstance(prefix, str) else None
    if m is None:
        return False
    attempt = m.group(1)
    for part in prefix.split("/"):
        for name in {part, part.removesuffix(f".{attempt}")}:
            try:
                validate_name(name)
            except InvalidArgumentError:
                continue
            if store.strategy.attempt_prefix(name, attempt) == prefix:
                return True
    return False


def open_attempt_file(store: Store, prefix: str, path: str) -> Writer:
    """Start writing ``<prefix>/<path>``, a file of the attempt staged at ``prefix`` (a
    :attr:`Transaction.prefix` handed over by the process that holds the transaction).
    The file counts only once the owner :meth:`~atomicstore.Transaction.adopt`\\ s it, with
    the size and CRC32C the writer reports; until the commit it is an uncommitted
    attempt's data (removed with the attempt, or by recovery).
    :class:`~atomicstore.InvalidArgumentError` for a ``prefix`` that is no attempt's, or
    a ``path`` that could escape it."""
    validate_path(path)
    if not is_attempt_prefix(store, prefix):
        raise InvalidArgumentError(f"{prefix!r} is not where {store.url} stages a save attempt's files")
    return store.driver.open_writer(f"{prefix}/{path}")


def delete_one_file_step(store: Store, name: str, companion: str | None = None, *,
                         if_generation: str | None = None) -> bool:
    """Delete the one-file checkpoint ``name``, then the directory ``companion`` beside it
    (the step's arrays). The file is the step's commit point: it goes first, conditionally
    on the generation read (:meth:`Store.delete_one_file`; with ``if_generation``, the one
    the caller judged), so a crash in between leaves a step that is not listed and arrays
    recovery can orphan, never a listed step without its arrays.

    A companion that is a committed checkpoint is deleted as one (:meth:`Store.delete`:
    its commit point first, at the generation read), and nothing else: one that another
    writer committed after that delete is that writer's. A companion that is no committed
    checkpoint (flax's own arrays, or what a crash left) is a plain directory: its files
    go, but never one of the store's own layout below it (an attempt in flight of a save
    of that name, with a live lease: recovery judges those by their leases), and on an
    object store each at the generation listed (a file replaced meanwhile stays).

    Returns False (and deletes nothing) if ``name`` was replaced meanwhile by another
    writer: not the step the caller judged. A ``name`` that is no file (missing, or a
    checkpoint of the directory layout, which is left alone) does not stop the
    companion's delete."""
    try:
        store.delete_one_file(name, if_generation=if_generation)
    except PreconditionFailedError:
        return False
    except (NotFoundError, InvalidArgumentError, CorruptionError):
        pass  # no file there (gone already, or a native checkpoint: not ours to delete)
    if companion is None:
        return True
    validate_name(companion)
    try:
        committed = store.exists(companion)
    except CorruptionError:  # committed, its commit point unreadable: still a checkpoint
        committed = True
    if committed:
        try:
            store.delete(companion)
            return True
        except (NotFoundError, PreconditionFailedError):
            return True  # deleted, or replaced meanwhile by another writer's commit: theirs
        except CorruptionError:
            pass  # its commit point is unreadable: its files go below, as a directory's
    _delete_directory(store, companion)
    return True


def _delete_directory(store: Store, prefix: str) -> None:
    """Delete the files below ``prefix``, a directory that is no committed checkpoint,
    but none of the store's own layout (see :func:`delete_one_file_step`)."""
    d = store.driver
    if d.capabilities.atomic_rename:
        # rename backends stage in the reserved directory, never below a name, and a
        # commit cannot rename onto a directory that exists: the tree is not in flight
        if d.exists(prefix) or d.listdir(prefix):
            d.delete_tree(prefix)
        return
    found = d.find(prefix)
    for key, info in found.items():
        if store.strategy.classify(key, listing=found).kind is not KeyKind.FOREIGN:
            continue  # an attempt of a save of that name, or its commit point: not ours
        try:
            d.delete(key, if_generation=info.generation)
        except (NotFoundError, PreconditionFailedError):
            pass  # gone, or replaced meanwhile: not the file listed


__all__ = ["delete_one_file_step", "is_attempt_prefix", "open_attempt_file"]
