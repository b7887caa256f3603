"""atomicstore: crash-safe, atomic checkpoints on local disk, S3 and GCS.

Three layers, imports pointing down only:

* :mod:`atomicstore.drivers` - thin adapters over fsspec that declare what a backend
  guarantees (:class:`Capabilities`);
* :mod:`atomicstore.commit` - transactions, manifests with CRC32C, the rename and marker
  commit strategies (never imports jax);
* the pytree layer on top (save/restore of JAX/numpy trees).
"""

from .commit import (
    CheckedReader,
    Checkpoint,
    ConformanceReport,
    FileEntry,
    Guarantee,
    Manifest,
    RecoveryAction,
    RecoveryReport,
    Store,
    Transaction,
    TransactionFile,
    natural_sort,
    open_store,
)
from .drivers import Capabilities, Driver, FileInfo, Writer, register_driver
from .drivers.generic import ExclusivityWarning
from .errors import (
    AlreadyExistsError,
    AtomicStoreError,
    ChecksumMismatchError,
    CommitConflictError,
    CommitOutcomeUnknownError,
    ConformanceError,
    CoordinationError,
    CorruptionError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    StorageTimeoutError,
    TransactionError,
    UnknownProtocolError,
)
from .manager import CheckpointManager
from .pytree import restore, save
from .retry import RetryPolicy
from .tiers import TierState

#: the installed release of atomicstore
__version__ = "0.1.0"

__all__ = [
    "AlreadyExistsError",
    "AtomicStoreError",
    "Capabilities",
    "CheckedReader",
    "Checkpoint",
    "CheckpointManager",
    "TierState",
    "ChecksumMismatchError",
    "CommitConflictError",
    "CommitOutcomeUnknownError",
    "ConformanceError",
    "ConformanceReport",
    "CoordinationError",
    "CorruptionError",
    "IncompatibleCheckpointError",
    "Driver",
    "ExclusivityWarning",
    "FileEntry",
    "FileInfo",
    "Guarantee",
    "InvalidArgumentError",
    "LeaseLostError",
    "Manifest",
    "NotFoundError",
    "PreconditionFailedError",
    "RecoveryAction",
    "RecoveryReport",
    "RetryPolicy",
    "StorageError",
    "StorageTimeoutError",
    "Store",
    "Transaction",
    "TransactionError",
    "TransactionFile",
    "UnknownProtocolError",
    "Writer",
    "__version__",
    "natural_sort",
    "open_store",
    "register_driver",
    "restore",
    "save",
]
