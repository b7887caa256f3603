"""Commit layer: transactions, manifests, commit strategies, recovery. Never imports jax."""

from .checked import CheckedReader
from .conformance import ConformanceReport, Guarantee
from .context import CommitContext
from .manifest import FileEntry, Manifest, Marker, crc32c
from .names import natural_key, natural_sort, path_argument, validate_name, validate_path
from .onefile import OneFileCommit
from .recovery import ActionKind, RecoveryAction, RecoveryReport
from .store import Checkpoint, Store, open_store
from .strategies import (
    CommitStrategy,
    KeyClass,
    KeyKind,
    MarkerStrategy,
    RenameStrategy,
    Settled,
    choose_strategy,
)
from .transaction import Transaction, TransactionFile

__all__ = [
    "ActionKind",
    "CheckedReader",
    "CommitContext",
    "Checkpoint",
    "CommitStrategy",
    "ConformanceReport",
    "FileEntry",
    "Guarantee",
    "KeyClass",
    "KeyKind",
    "Manifest",
    "MarkerStrategy",
    "OneFileCommit",
    "Marker",
    "RecoveryAction",
    "RecoveryReport",
    "RenameStrategy",
    "Settled",
    "Store",
    "Transaction",
    "TransactionFile",
    "choose_strategy",
    "crc32c",
    "natural_key",
    "natural_sort",
    "open_store",
    "path_argument",
    "validate_name",
    "validate_path",
]
