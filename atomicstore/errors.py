"""The one exception hierarchy of atomicstore.

Every error the library raises on purpose derives from :class:`AtomicStoreError`.
Several also derive from the matching builtin (``ValueError``, ``FileNotFoundError``,
``FileExistsError``, ``TimeoutError``, ``OSError``) so that existing ``except`` clauses in
callers keep working.
"""

from __future__ import annotations


class AtomicStoreError(Exception):
    """Base class of every error raised by atomicstore."""


class InvalidArgumentError(AtomicStoreError, ValueError):
    """An argument of a public call is malformed (raised before anything is written)."""


class UnknownProtocolError(InvalidArgumentError):
    """No driver is registered for a URL's protocol, and fsspec does not know it either."""


class NotFoundError(AtomicStoreError, FileNotFoundError):
    """A checkpoint or a file inside one does not exist (or is not committed)."""


class AlreadyExistsError(AtomicStoreError, FileExistsError):
    """A file or checkpoint that must not be replaced already exists.

    ``retried`` is True when atomicstore's own retry policy got this answer on a retry of
    a request whose earlier try may have been applied (its reply was lost). False does not
    prove the opposite (an HTTP client may re-send a PUT on its own), so callers that can
    reconcile by reading the object back always do.
    """

    retried: bool = False


class PreconditionFailedError(AlreadyExistsError):
    """A conditional write or delete found another generation of the object than the one
    it was conditioned on (someone else wrote or removed it since it was read)."""


class CommitConflictError(AlreadyExistsError):
    """Another writer committed the same checkpoint name first; this attempt lost.

    None of the losing attempt's bytes are part of the committed checkpoint.
    """

    def __init__(self, message: str, *, name: str = "", winner: str | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.winner = winner


class LeaseLostError(CommitConflictError):
    """This writer's lease expired or was removed by recovery (it was declared dead), so
    it must not commit: another run may have replaced it."""


class TransactionError(AtomicStoreError, RuntimeError):
    """A transaction was used in a way its state does not allow (e.g. write after commit)."""


class CoordinationError(AtomicStoreError, RuntimeError):
    """A multi-process save or restore could not agree: another process failed, died or
    did not answer within the timeout. Nothing was committed."""


class StorageError(AtomicStoreError, OSError):
    """A storage operation failed (after the retry policy gave up, if it was transient)."""


class CommitOutcomeUnknownError(StorageError):
    """A commit whose reply was lost could not be confirmed: before it was read back, the
    checkpoint was deleted by another process. This writer may have committed (and been
    deleted) or lost; either way the name does not hold its data now."""


class ConformanceError(StorageError):
    """The store does not hold a guarantee atomicstore relies on to commit (found by the
    conformance check before the first commit on an endpoint: e.g. it ignores a
    precondition, or lets two racing conditional writes both succeed). Nothing was
    written. ``guarantee`` names it, ``endpoint`` the store, ``report`` is the whole
    :class:`~atomicstore.ConformanceReport`."""

    def __init__(self, message: str, *, guarantee: str = "", endpoint: str = "", report: object = None) -> None:
        super().__init__(message)
        self.guarantee = guarantee
        self.endpoint = endpoint
        self.report = report


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage operation did not finish within its timeout."""


class CorruptionError(AtomicStoreError):
    """Stored data is damaged or not what the manifest promises.

    ``path`` names the file (relative to the checkpoint) and ``leaf`` the tree leaf when
    the pytree layer knows it.
    """

    def __init__(self, message: str, *, path: str | None = None, leaf: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.leaf = leaf


class ChecksumMismatchError(CorruptionError):
    """A file's bytes do not match the size or CRC32C recorded in its manifest."""


class IncompatibleCheckpointError(AtomicStoreError):
    """An intact checkpoint (its checksums match) in a format this installation cannot
    read: written by a newer release of the library that wrote it (e.g. torch DCP metadata
    of a newer torch). ``path`` names the file."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


__all__ = [
    "AlreadyExistsError",
    "AtomicStoreError",
    "ChecksumMismatchError",
    "CommitConflictError",
    "CommitOutcomeUnknownError",
    "ConformanceError",
    "CorruptionError",
    "IncompatibleCheckpointError",
    "InvalidArgumentError",
    "LeaseLostError",
    "NotFoundError",
    "PreconditionFailedError",
    "StorageError",
    "StorageTimeoutError",
    "TransactionError",
    "UnknownProtocolError",
]
