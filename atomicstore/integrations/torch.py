"""PyTorch distributed checkpoint (DCP) storage that commits through atomicstore.

:class:`AtomicStorageWriter` and :class:`AtomicStorageReader` implement
``torch.distributed.checkpoint.StorageWriter`` / ``StorageReader``::

    import torch.distributed.checkpoint as dcp
    from atomicstore.integrations.torch import AtomicStorageReader, AtomicStorageWriter

    dcp.save(state_dict, storage_writer=AtomicStorageWriter("s3://bucket/run/step_100"))
    dcp.load(state_dict, storage_reader=AtomicStorageReader("s3://bucket/run/step_100"))

The URL names one checkpoint: ``<store>/<name>``. DCP's planners decide what each rank
writes (``DTensor``, sharded state dicts, resharding on load); atomicstore does the storage:

* the coordinator opens one attempt (a transaction, with its lease) when it makes the
  global plan; a committed ``name`` is refused there (:class:`~atomicstore.CommitConflictError`,
  unless ``overwrite=True``), before any rank writes a byte;
* every rank streams its ``__<rank>_<n>.distcp`` files into that attempt, computing a
  CRC32C per file and per item; an error in any rank or any writer thread fails the save;
* the coordinator commits once, in ``finish``, with ``.metadata`` and every rank's files
  in the manifest: the checkpoint is visible iff complete, and one writer wins a name.

The files are DCP's own (``torch.save`` per item, through DCP's stream extensions if
any, ``.metadata`` pickled by DCP with the stock per-item records), so a committed
checkpoint on local disk is also readable by the stock ``FileSystemReader``. atomicstore
adds ``manifest.json`` and ``atomicstore-dcp.json`` (the CRC32C of every item's stored
bytes, so a ranged read is verified). The reader unpickles ``.metadata`` with a
restricted unpickler (DCP's metadata classes only), tensor items with
``weights_only=True``, and lets DCP's planner unpickle a non-tensor item (which it does with
``weights_only=False``) only once it has unpickled with ``weights_only=True``: a hostile
pickle runs nothing. A trusted checkpoint whose non-tensor items hold other classes loads
with ``weights_only=False`` (or with those classes in ``torch.serialization.add_safe_globals``).

The writer and the reader take the stock ``FileSystemWriter``'s and ``FileSystemReader``'s
arguments (``path=``, ``single_file_per_rank``, ``sync_files``, ``thread_count``,
``per_thread_copy_ahead``, ``cache_staged_state_dict``, ``overwrite``, ``_extensions``,
``serialization_format``; ``_extension_registry``); ``docs/integrations.md`` says what
each does here.

A save that fails after the global plan leaves its attempt open on the coordinator until
the writer is used again (``reset``), leaves a ``with`` block on the error, is :meth:`aborted
<AtomicStorageWriter.abort>`, or the process exits (garbage collection may do it sooner,
but something may still hold the writer: use the ``with`` block); a coordinator that
dies leaves it to recovery (``store.recover()``) once its lease has expired.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import os
import pickle
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import IO, Any, TypeVar, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..commit import Checkpoint, Store, Transaction
from ..commit.adapters import open_attempt_file
from ..commit.locator import names_checkpoint, split_location, store_at
from ..commit.manifest import crc32c, crc32c_combine
from ..drivers import Writer
from ..drivers.parts import InflightBudget
from ..errors import (
    AtomicStoreError,
    ChecksumMismatchError,
    CommitConflictError,
    CorruptionError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    TransactionError,
)

try:  # DCP's stream extensions and serialization formats (torch >= 2.7)
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    _TORCH_SAVE: Any = SerializationFormat.TORCH_SAVE
except ImportError:  # pragma: no cover - older torch: neither exists, only the default is accepted
    ExtensionRegistry = StreamTransformExtension = SerializationFormat = None  # type: ignore[assignment,misc]
    _TORCH_SAVE = "torch_save"

__all__ = ["ITEMS_FILE", "METADATA_FILE", "AtomicStorageReader", "AtomicStorageWriter", "atomicstore_error", "load",
           "save"]

#: DCP's metadata file (pickled :class:`~torch.distributed.checkpoint.metadata.Metadata`)
METADATA_FILE = ".metadata"
#: atomicstore's record of every item's byte range and CRC32C, per file
ITEMS_FILE = "atomicstore-dcp.json"
DCP_VERSION = "1.0.0"  # what the stock writer records in Metadata.version
SUFFIX = ".distcp"

_T = TypeVar("_T")


# -- what travels between ranks (pickled by DCP's collectives) -------------------------------
@dataclasses.dataclass(frozen=True)
class AttemptPlan:
    """The coordinator's answer to one rank's local plan: where to write, and the file
    name prefix of that rank (``__<rank>_``, as the stock writer)."""

    prefix: str
    files: str


@dataclasses.dataclass(frozen=True)
class ItemRecord:
    """One written item: where it is, the CRC32C of its stored bytes, its file's final size
    and CRC32C, and the descriptors of the stream extensions it went through (DCP's
    ``transform_descriptors``; empty: none)."""

    file: str
    offset: int
    length: int
    crc32c: int
    file_size: int
    file_crc32c: int
    transforms: tuple[str, ...] = ()
    #: the attempt written into (``Transaction.prefix``): ``finish`` commits only that one
    attempt: str = ""


# -- helpers ------------------------------------------------------------------------------
def _split(checkpoint_id: str | os.PathLike[str]) -> tuple[str, str]:
    """(store root, checkpoint name); a plain path is made absolute."""
    if not isinstance(checkpoint_id, str | os.PathLike):
        raise InvalidArgumentError(f"checkpoint id must be a path or URL string, not {type(checkpoint_id).__name__}")
    return split_location(checkpoint_id, absolute=True)


def _where_to(checkpoint_id: str | os.PathLike[str] | None, path: str | os.PathLike[str] | None,
              cls: str) -> tuple[str, str]:
    """(root, name) from ``checkpoint_id`` or the stock writers' and readers' ``path=``
    (one of them)."""
    if checkpoint_id is not None and path is not None:
        raise InvalidArgumentError(f"{cls}: pass checkpoint_id or path (the stock name of the same argument), "
                                   "not both")
    where = checkpoint_id if checkpoint_id is not None else path
    if where is None:
        raise InvalidArgumentError(f"{cls}: checkpoint_id (or path=) is required: '<store>/<name>'")
    return _split(where)


def _can_pin() -> bool:
    """Whether pinned memory can be had (it needs an accelerator)."""
    acc = getattr(torch, "accelerator", None)
    return bool(acc.is_available()) if acc is not None else torch.cuda.is_available()


def _count(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


class _ItemStream(io.RawIOBase):
    """The stream ``torch.save`` writes one file through: forwards to a driver writer,
    keeping the file's size and CRC32C and the CRC32C of the current item (one pass)."""

    def __init__(self, writer: Writer) -> None:
        self._w = writer
        self.size = 0
        self.crc = 0
        self.item_crc = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if n:
            c = crc32c(mv)
            self._w.write(mv)
            self.crc = crc32c_combine(self.crc, c, n)
            self.item_crc = crc32c_combine(self.item_crc, c, n)
            self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def seekable(self) -> bool:
        return False


class _Unclosable(io.RawIOBase):
    """What a stream extension writes into: closing it (as an extension's writer does when
    it is closed) only flushes, so the file goes on with the next item (DCP's own
    ``NoCloseWriter``)."""

    def __init__(self, raw: _ItemStream) -> None:
        super().__init__()
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        self.flush()


def _item_size(wi: WriteItem) -> int:
    if wi.tensor_data is None:
        return 0
    return int(torch.Size(wi.tensor_data.size).numel()) * torch.empty((), dtype=wi.tensor_data.properties.dtype
                                                                        ).element_size()


def _buckets(items: list[WriteItem], n: int) -> list[list[WriteItem]]:
    """Items split over ``n`` files by size (the stock writer's rule), empty files dropped."""
    if n <= 1:
        return [items] if items else []
    out: list[list[WriteItem]] = [[] for _ in range(n)]
    load = [0] * n
    byte_items = [wi for wi in items if wi.type == WriteItemType.BYTE_IO]
    for i, wi in enumerate(byte_items):
        out[i % n].append(wi)
    for wi in sorted((wi for wi in items if wi.type != WriteItemType.BYTE_IO), key=_item_size, reverse=True):
        k = load.index(min(load))
        out[k].append(wi)
        load[k] += _item_size(wi)
    return [b for b in out if b]


# -- .metadata: a pickle, read with a restricted unpickler ----------------------------------
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: every global DCP's metadata pickles (checked on torch 2.13 and 2.14); nothing else is found
_METADATA_GLOBALS = frozenset({
    *((_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                   "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                   "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # older DCP metadata (the ShardedTensor-era TensorProperties)
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided")
    # a stock writer's StorageMeta.checkpoint_id (atomicstore's is a str)
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: a global (the only way a pickle reaches
    code) must be one of DCP's metadata classes, ``torch.Size``, a ``torch.dtype`` or a
    layout; anything else (``os.system``, ``builtins.eval``, a class of the caller's)
    raises before it is looked up, so a hostile ``.metadata`` runs nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def _unpickle_metadata(raw: bytes) -> Metadata:
    """DCP metadata from ``raw`` through :class:`_MetadataUnpickler`, its storage records
    checked; ``ValueError`` (saying why) if it is anything else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure: not readable metadata
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"not DCP metadata (a {type(metadata).__name__})")
    for key, info in metadata.storage_data.items():
        if not isinstance(key, MetadataIndex) or not isinstance(key.fqn, str):
            raise ValueError(f"a storage record keyed by {type(key).__name__}")
        descs = getattr(info, "transform_descriptors", None)
        if not (isinstance(info, _StorageInfo) and isinstance(info.relative_path, str)
                and _count(info.offset, 0, 2**62) and _count(info.length, 0, 2**62)
                and (descs is None or (isinstance(descs, list | tuple) and all(isinstance(d, str) for d in descs)))):
            raise ValueError(f"malformed storage record of {key.fqn!r}")
    return metadata


#: items at least this large are read by torch.load straight from storage (_ItemFile)
_DIRECT_READ = 1 << 20
_EDGE = 64 << 10


class _ItemFile(io.RawIOBase):
    """One item's byte range of a checkpoint file, as the seekable file ``torch.load``
    reads, verified to be exactly what ``torch.load`` was given.

    Every byte comes from one of three places: the first and last 64 KiB (the zip headers
    and directory), read up front and served from memory, or the middle (the tensor's
    bytes), read straight from storage into the caller's buffer (the tensor's own memory:
    one copy, as the stock reader makes), each range CRC32C'd as it is read. :meth:`crc32c`
    then gives the item's CRC32C from exactly those bytes, whatever the order, sizes or
    overlaps of torch's reads (a torch version may read differently), reading only the
    middle bytes torch never asked for."""

    def __init__(self, ckpt: Checkpoint, file: str, offset: int, length: int) -> None:
        super().__init__()
        self.ckpt, self.file, self.offset, self.length = ckpt, file, offset, length
        self.pos = 0
        self.head = ckpt.read_range(file, offset, offset + min(length, _EDGE))
        self.tail_at = max(len(self.head), length - _EDGE)
        self.tail = ckpt.read_range(file, offset + self.tail_at, offset + length)
        self.middle: list[tuple[int, int, int]] = []  # (start, length, CRC32C) of each middle range served

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self.pos, self.length)[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        a = self.pos
        end = a + max(0, min(mv.nbytes, self.length - a))
        h, t = len(self.head), self.tail_at
        if a < min(end, h):  # from the head
            mv[: min(end, h) - a] = self.head[a : min(end, h)]
        lo, hi = max(a, h), min(end, t)
        if lo < hi:  # from storage, into the caller's buffer
            part = mv[lo - a : hi - a]
            self.ckpt.read_range_into(self.file, self.offset + lo, part)
            self.middle.append((lo, hi - lo, crc32c(part)))
        lo = max(a, t)
        if lo < end:  # from the tail
            mv[lo - a : end - a] = self.tail[lo - t : end - t]
        self.pos = end
        return end - a

    def _read_crc(self, a: int, b: int) -> int:
        return crc32c(self.ckpt.read_range(self.file, self.offset + a, self.offset + b))

    def crc32c(self) -> int | None:
        """The CRC32C of the item as ``torch.load`` was given it (head, middle ranges,
        tail), the middle bytes it never read read now; None if a middle range it was given
        twice (overlapping reads) is no longer what storage holds."""
        h, t = len(self.head), self.tail_at
        chosen: list[tuple[int, int, int]] = []  # the largest ranges first, then what does not overlap them
        for a, n, c in sorted(set(self.middle), key=lambda sp: -sp[1]):
            if all(a + n <= b or b + m <= a for b, m, _ in chosen):
                chosen.append((a, n, c))
            elif self._read_crc(a, a + n) != c:  # given twice: the other copy checked against storage
                return None
        crc, at = crc32c(self.head), h
        for a, n, c in sorted(chosen):
            if a > at:
                crc = crc32c_combine(crc, self._read_crc(at, a), a - at)
            crc, at = crc32c_combine(crc, c, n), a + n
        if at < t:
            crc = crc32c_combine(crc, self._read_crc(at, t), t - at)
        return crc32c_combine(crc, crc32c(self.tail), len(self.tail))


def _abort(holder: list[Transaction | None]) -> None:
    txn = holder[0]
    holder[0] = None
    if txn is not None:
        txn.abort()


class _Located:
    """Where a writer's or reader's checkpoint lives: ``<root>/<name>`` and its store."""

    root: str
    name: str
    store_options: dict[str, Any]
    _store: Store | None

    @property
    def checkpoint_id(self) -> str:
        return f"{self.root}/{self.name}"

    @property
    def store(self) -> Store:
        """The store holding the checkpoint (opened on first use, again if the root changed)."""
        if self._store is None or self._store.url.rstrip("/") != self.root.rstrip("/"):
            self._store = store_at(self.root, **self.store_options)
        return self._store


# -- writer -------------------------------------------------------------------------------
class AtomicStorageWriter(_Located, StorageWriter, BlockingAsyncStager):
    """A DCP ``StorageWriter`` whose checkpoint becomes visible only complete, once.

    It takes the stock ``FileSystemWriter``'s arguments, in its order, with their meaning
    (``docs/integrations.md`` has the table):

    Args:
        checkpoint_id: ``<store>/<name>``: a local path or an ``s3://``/``gs://``/fsspec URL
            (``path=`` is the same argument under the stock writer's name; DCP's
            ``checkpoint_id=`` may name another one per save).
        single_file_per_rank: True (default): each rank writes ``thread_count`` files;
            False: one file per item, as the stock writer.
        sync_files: accepted for the stock writer's sake: atomicstore always makes a
            commit durable (files and directories fsynced on POSIX), ``False`` included.
        thread_count: files (and threads) each rank writes at once.
        per_thread_copy_ahead: accepted (an int >= 0); the stock writer uses it to copy
            ahead from the GPU on one thread. Here each item is copied to the CPU as it
            is written.
        cache_staged_state_dict: as the stock writer (a ``BlockingAsyncStager``): with
            ``dcp.async_save``, keep the staged CPU copy of the state for the next save.
        overwrite: replace a committed checkpoint of that name in one atomic step
            (compare-and-swap: a concurrent overwrite makes one of them fail); by default
            (unlike the stock writer, whose default is True) a committed name is refused
            with :class:`~atomicstore.CommitConflictError`.
        _extensions: DCP's stream extensions (e.g. ``ZStandard()`` compression) applied to
            every item, as the stock writer does; the CRC32Cs are those of the stored
            (transformed) bytes.
        serialization_format: ``SerializationFormat.TORCH_SAVE`` only (``SAFETENSORS``
            is refused: DCP's own readers do not read it back from these files).
        store_options: passed to :func:`~atomicstore.open_store` (``retry``,
            ``lease_ttl``, ``writer_id``, fsspec storage options such as ``endpoint_url``).

    Usable as a context manager: leaving the block on an error aborts the attempt of a
    save that failed after its plan (DCP has no hook for that). Use one writer per save in
    flight, as with DCP's own writers.
    """

    def __init__(self, checkpoint_id: str | os.PathLike[str] | None = None, single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = False,
                 _extensions: Sequence[Any] | None = None, serialization_format: Any = _TORCH_SAVE, *,
                 path: str | os.PathLike[str] | None = None, **store_options: Any) -> None:
        StorageWriter.__init__(self)
        for arg, v in (("single_file_per_rank", single_file_per_rank), ("sync_files", sync_files),
                       ("cache_staged_state_dict", cache_staged_state_dict), ("overwrite", overwrite)):
            if not isinstance(v, bool):
                raise InvalidArgumentError(f"{arg} must be a bool")
        if not _count(thread_count, 1, 64):
            raise InvalidArgumentError("thread_count must be an int from 1 to 64")
        if not _count(per_thread_copy_ahead, 0, 2**62):
            raise InvalidArgumentError("per_thread_copy_ahead must be an int >= 0 (bytes)")
        self.extensions: tuple[Any, ...] = self._check_extensions(_extensions)
        if serialization_format != _TORCH_SAVE and serialization_format != getattr(_TORCH_SAVE, "value", _TORCH_SAVE):
            raise InvalidArgumentError(
                f"serialization_format={serialization_format!r} is not supported: AtomicStorageWriter writes DCP's "
                "torch_save format, which FileSystemReader and AtomicStorageReader read (SAFETENSORS files are "
                "read only by HuggingFaceStorageReader from a directory of its own layout)")
        self.root, self.name = _where_to(checkpoint_id, path, "AtomicStorageWriter")
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.overwrite = overwrite
        self.thread_count = thread_count
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.serialization_format = _TORCH_SAVE
        self.store_options = dict(store_options)
        self.is_coordinator = False
        self.rank = 0
        self._store: Store | None = None
        self._txn: list[Transaction | None] = [None]
        self._finalizer = weakref.finalize(self, _abort, self._txn)
        self.save_id = os.urandom(8).hex()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s copy of the state to the CPU (the stock writer's, a
        ``BlockingAsyncStager``'s). With ``cache_staged_state_dict`` the copy is kept for the
        next save, in pinned memory where there is an accelerator to pin it for (the stock
        writer fails without one)."""
        if self.cache_staged_state_dict and self.state_dict_cache is None and not _can_pin():
            from torch.distributed._state_dict_utils import _create_cpu_state_dict

            self.state_dict_cache = _create_cpu_state_dict(state_dict)
        staged: dict[str, Any] = super().stage(state_dict)
        return staged

    @staticmethod
    def _check_extensions(extensions: Sequence[Any] | None) -> tuple[Any, ...]:
        if extensions is None:
            return ()
        if isinstance(extensions, str | bytes) or not isinstance(extensions, Sequence):
            raise InvalidArgumentError("_extensions must be a sequence of DCP StreamTransformExtension objects")
        for ex in extensions:
            if StreamTransformExtension is None or not isinstance(ex, StreamTransformExtension):
                raise InvalidArgumentError(
                    f"_extensions: {type(ex).__name__} is not a torch.distributed.checkpoint._extension."
                    "StreamTransformExtension (the only kind of extension DCP's writers apply)")
        return tuple(extensions)

    # pickled by DCP's process-based async executor: the store is reopened on the other side
    def __getstate__(self) -> dict[str, Any]:
        if self._txn[0] is not None:
            raise TransactionError("an AtomicStorageWriter cannot be pickled in the middle of a save")
        state = self.__dict__.copy()
        state["_store"] = None
        state["state_dict_cache"] = None  # (a cache of the stager, rebuilt on its side)
        del state["_txn"], state["_finalizer"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._txn = [None]
        self._finalizer = weakref.finalize(self, _abort, self._txn)

    @property
    def transaction(self) -> Transaction | None:
        """The coordinator's open attempt between the global plan and ``finish``."""
        return self._txn[0]

    def abort(self) -> None:
        """Abort a save in flight (its attempt's data is removed). Idempotent."""
        _abort(self._txn)

    def __enter__(self) -> AtomicStorageWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an error (dcp.save raised) aborts the attempt the failed save left
        # open. Leaving normally does not: an async_save may still be running with this
        # writer (a failed save whose error was caught inside the block is aborted by the
        # next save, abort(), or garbage collection).
        if et is not None:
            self.abort()

    # -- StorageWriter ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.abort()  # a save that failed after the global plan never reached finish
        if checkpoint_id:
            self.root, self.name = _split(checkpoint_id)
        self.save_id = os.urandom(8).hex()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise InvalidArgumentError(
                "AtomicStorageWriter needs use_collectives=True: one commit of every rank's files needs the "
                "ranks to agree")
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs.get("rank") or 0)
        self.store  # noqa: B018 - open (and validate the URL) in every rank before any data moves

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.abort()
        if not all(getattr(p, "usable", True) for p in plans):
            # DCP's plan caching: such a rank writes its cached plan of an earlier save,
            # which names that save's attempt (a committed checkpoint's files, on S3)
            raise InvalidArgumentError(
                "AtomicStorageWriter: a rank sent a cached save plan (a SavePlanner with plan caching, e.g. "
                "DefaultSavePlanner(enable_plan_caching=True)): a cached plan names an earlier save's attempt, "
                "so that rank would write into it; use a planner without plan caching")
        # the conflict check and the lease come first: a committed name fails every rank
        # here, before any rank writes
        try:
            txn = self.store.transaction(self.name, metadata={"format": "torch.distributed.checkpoint"},
                                         overwrite=self.overwrite)
        except CommitConflictError as exc:
            if type(exc) is not CommitConflictError:
                raise
            raise CommitConflictError(
                f"{self.checkpoint_id} is already a committed checkpoint: nothing was written. Pass overwrite=True "
                "to replace it in one atomic step (the stock FileSystemWriter's default is True, "
                "AtomicStorageWriter's is False)", name=exc.name, winner=exc.winner) from None
        self._txn[0] = txn
        return [dataclasses.replace(p, storage_data=AttemptPlan(txn.prefix, f"__{i}_")) for i, p in enumerate(plans)]

    def _files(self, plan: SavePlan, where: AttemptPlan) -> list[tuple[str, list[WriteItem]]]:
        """(file name, its items): ``thread_count`` files by size, or one per item."""
        groups = _buckets(plan.items, self.thread_count) if self.single_file_per_rank else [[wi] for wi in plan.items]
        return [(f"{where.files}{n}{SUFFIX}", items) for n, items in enumerate(groups)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        where = plan.storage_data
        if not isinstance(where, AttemptPlan):
            raise TransactionError("AtomicStorageWriter.write_data: the plan was not made by AtomicStorageWriter "
                                   "(prepare_global_plan)")
        if self.is_coordinator:
            self._check_same_save(where.prefix, "write_data")
        jobs = self._files(plan, where)
        store = self.store
        extensions = self.extensions
        descriptors = tuple(ex.get_descriptor() for ex in reversed(extensions))  # (the stock writer's order)

        def one(file: str, items: list[WriteItem]) -> list[WriteResult]:
            w = open_attempt_file(store, where.prefix, file)
            stream = _ItemStream(w)
            spans: list[tuple[WriteItem, int, int, int]] = []
            try:
                # bytes first, then tensors, as the stock writer
                for wi in sorted(items, key=lambda x: x.type != WriteItemType.BYTE_IO):
                    data = planner.resolve_data(wi)
                    start = stream.size
                    stream.item_crc = 0
                    sink: IO[bytes] = cast(IO[bytes], stream)
                    if extensions:
                        sink = cast(IO[bytes], _Unclosable(stream))
                        for ex in extensions:
                            sink = ex.transform_to(sink)
                    if wi.type == WriteItemType.BYTE_IO:
                        if not isinstance(data, io.BytesIO):
                            raise InvalidArgumentError(f"item {wi.index.fqn}: planner resolved {type(data).__name__}, "
                                                       "expected io.BytesIO")
                        sink.write(data.getbuffer())
                    else:
                        if not isinstance(data, torch.Tensor):
                            raise InvalidArgumentError(f"item {wi.index.fqn}: planner resolved {type(data).__name__}, "
                                                       "expected a tensor")
                        tensor = data.detach().cpu()
                        if tensor.untyped_storage().nbytes() != tensor.nbytes:
                            # a view (a slice, qkv.chunk(3), a flat buffer's parameter):
                            # torch.save writes its whole storage; the stock writer clones
                            tensor = tensor.clone()
                        torch.save(tensor, sink)
                    if extensions:
                        sink.close()  # the extensions' last bytes (the item's stream stays open)
                    spans.append((wi, start, stream.size - start, stream.item_crc))
                w.close()
            except BaseException:
                w.abort()
                raise
            return [WriteResult(index=wi.index, size_in_bytes=n,
                                storage_data=ItemRecord(file, off, n, c, stream.size, stream.crc, descriptors,
                                                        where.prefix))
                    for wi, off, n, c in spans]

        # errors are raised here, not stored in the returned future: a torch Future holding
        # an exception whose traceback reaches this frame is a cycle Python's GC cannot see
        # through, and it would keep this writer (and its attempt) alive
        if len(jobs) <= 1 or self.thread_count <= 1:
            results = [r for f, items in jobs for r in one(f, items)]
        else:
            # every thread is waited for, and the first error (from any thread) raised
            with concurrent.futures.ThreadPoolExecutor(min(self.thread_count, len(jobs))) as pool:
                parts = [pool.submit(one, f, items) for f, items in jobs]
                results = [r for p in parts for r in p.result()]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _check_same_save(self, attempt: str, step: str) -> None:
        """Raise :class:`~atomicstore.TransactionError` unless ``attempt`` is the one this
        writer's open save planned: another save on this writer (a second ``async_save``
        while one was in flight) reset it meanwhile, and aborted the attempt this save
        writes into. Nothing of the other save is touched."""
        txn = self._txn[0]
        if txn is None or txn.prefix != attempt:
            raise TransactionError(
                f"{step} of {self.checkpoint_id}: this save's attempt was aborted by another save on the same "
                "AtomicStorageWriter (one writer per save in flight: give each async_save its own writer); "
                "nothing of this save is committed")

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        txn = self._txn[0]
        if txn is None:
            raise TransactionError(f"finish of {self.checkpoint_id}: no save in flight (aborted, or already "
                                   "committed)")
        # every result was written into the attempt open now: else another save on this
        # writer replaced this one's (its transaction is not this save's to commit or abort)
        for wr in (wr for rank in results for wr in rank):
            if isinstance(wr.storage_data, ItemRecord):
                self._check_same_save(wr.storage_data.attempt, "finish")
        try:
            storage: dict[MetadataIndex, _StorageInfo] = {}
            items: dict[str, list[list[int]]] = {}
            files: dict[str, tuple[int, int]] = {}
            for wr in (wr for rank in results for wr in rank):
                rec = wr.storage_data
                if not isinstance(rec, ItemRecord):
                    raise TransactionError(f"finish of {self.checkpoint_id}: a write result of {wr.index.fqn} "
                                           "was not written by AtomicStorageWriter")
                if files.setdefault(rec.file, (rec.file_size, rec.file_crc32c)) != (rec.file_size, rec.file_crc32c):
                    raise TransactionError(f"finish of {self.checkpoint_id}: {rec.file} reported twice")
                storage[wr.index] = (_StorageInfo(rec.file, rec.offset, rec.length, list(rec.transforms))
                                     if rec.transforms else _StorageInfo(rec.file, rec.offset, rec.length))
                items.setdefault(rec.file, []).append([rec.offset, rec.length, rec.crc32c])
            metadata.version = DCP_VERSION
            metadata.storage_data = storage
            metadata.storage_meta = self.storage_meta()
            raw = pickle.dumps(metadata)
            try:  # what the reader would refuse is refused before the commit
                _unpickle_metadata(raw)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"finish of {self.checkpoint_id}: the save's DCP metadata holds what AtomicStorageReader's "
                    f"restricted unpickler refuses ({exc}); a custom planner put it there (planner_data or "
                    "storage_meta): keep those to DCP's own types and plain data") from None
            for file, (size, crc) in sorted(files.items()):
                txn.adopt(file, size, crc)
            # (the torch that wrote it: DCP's metadata of a newer torch may not load in an older one)
            txn.write_bytes(ITEMS_FILE, json.dumps({"version": 1, "torch": torch.__version__, "items": items},
                                                   sort_keys=True).encode())
            txn.write_bytes(METADATA_FILE, raw)
            if self._txn[0] is txn:  # (not another save's, set meanwhile)
                self._txn[0] = None
            txn.commit()
        except BaseException:
            if self._txn[0] is txn:
                _abort(self._txn)
            if not txn.committed:
                txn.abort()
            raise

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return names_checkpoint(checkpoint_id, absolute=True)


# -- reader -------------------------------------------------------------------------------
class AtomicStorageReader(_Located, StorageReader):
    """A DCP ``StorageReader`` that reads only a committed checkpoint and verifies every
    item it reads against its CRC32C.

    An uncommitted (or missing) checkpoint raises :class:`~atomicstore.NotFoundError`; a
    damaged one :class:`~atomicstore.ChecksumMismatchError` or
    :class:`~atomicstore.CorruptionError` naming the file and item (a ``.metadata``
    that is not DCP metadata, hostile pickles included, is refused unexecuted); one
    replaced or deleted while it is read :class:`~atomicstore.PreconditionFailedError`.
    DCP wraps errors raised while loading in its ``CheckpointException`` (its ``failures``
    maps each rank to the error).

    Args:
        checkpoint_id: ``<store>/<name>`` as for :class:`AtomicStorageWriter` (``path=``:
            the same, under the stock reader's name).
        _extension_registry: as the stock ``FileSystemReader``'s: the stream extensions
            items were written with (default: DCP's, ``ZStandard`` included).
        thread_count: items each rank reads, checks and decodes at once (default: one on
            local disk, where a load is bound by memory bandwidth; 8 on object stores,
            where each read waits on the network).
        max_inflight_bytes: bound on the bytes of the items being read at once (a
            larger item is read alone); the extra memory of a load is about twice this.
        weights_only: a non-tensor item (DCP's planner unpickles it with
            ``weights_only=False``) is first unpickled with ``weights_only=True``, and
            refused (:class:`~atomicstore.CorruptionError` naming the file and item) if that
            fails: a hostile pickle runs nothing. ``False`` (trusted checkpoints only) lets
            such items hold any class, as the stock reader does.
        store_options: passed to :func:`~atomicstore.open_store`.
    """

    def __init__(self, checkpoint_id: str | os.PathLike[str] | None = None, _extension_registry: Any = None, *,
                 path: str | os.PathLike[str] | None = None, thread_count: int | None = None,
                 max_inflight_bytes: int = 256 * 2**20, weights_only: bool = True,
                 **store_options: Any) -> None:
        super().__init__()
        if not isinstance(weights_only, bool):
            raise InvalidArgumentError("weights_only must be a bool")
        #: a non-tensor item (DCP unpickles it in the planner, ``torch.load(weights_only=False)``)
        #: must first unpickle with ``weights_only=True``: a hostile pickle runs nothing
        self.weights_only = weights_only
        if thread_count is not None and not _count(thread_count, 1, 64):
            raise InvalidArgumentError("thread_count must be None or an int from 1 to 64")
        if not _count(max_inflight_bytes, 1, 2**62):
            raise InvalidArgumentError("max_inflight_bytes must be a positive int")
        if _extension_registry is not None and (ExtensionRegistry is None
                                                or not isinstance(_extension_registry, ExtensionRegistry)):
            raise InvalidArgumentError("_extension_registry must be a torch.distributed.checkpoint._extension."
                                       "ExtensionRegistry")
        self.extension_registry = _extension_registry
        self.max_inflight_bytes = max_inflight_bytes
        self.root, self.name = _where_to(checkpoint_id, path, "AtomicStorageReader")
        self.thread_count = thread_count
        self.store_options = dict(store_options)
        self._store: Store | None = None
        self._ckpt: Checkpoint | None = None
        self._items: dict[tuple[str, int], tuple[int, int]] = {}
        self.storage_data: dict[MetadataIndex, Any] = {}
        #: each tensor's dtype as the metadata records it (an item must hold that dtype)
        self._dtypes: dict[str, torch.dtype] = {}
        self.load_id = os.urandom(8).hex()
        #: why the last ``read_metadata`` failed (DCP reports it only as text)
        self.metadata_error: AtomicStoreError | None = None

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_store": None, "_ckpt": None}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.root, self.name = _split(checkpoint_id)
        self._ckpt = None
        self._items = {}
        self.storage_data = {}
        self._dtypes = {}
        self.load_id = os.urandom(8).hex()

    def _open(self) -> Checkpoint:
        if self._ckpt is None:
            try:
                # both small files beside the manifest (or in the commit marker): one
                # round trip of metadata where the store allows, not three
                self._ckpt = self.store.open(self.name, read_ahead=[METADATA_FILE, ITEMS_FILE])
            except NotFoundError as exc:
                raise NotFoundError(f"{self.checkpoint_id}: no committed checkpoint ({exc})") from None
        return self._ckpt

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP turns an error here into an AssertionError quoting it: keep ours for load()
        try:
            ckpt = self._open()
            return self._replacement_named(ckpt, "its DCP metadata", lambda: self._read_metadata(ckpt))
        except AtomicStoreError as exc:
            self.metadata_error = exc
            raise

    def _read_metadata(self, ckpt: Checkpoint) -> Metadata:
        for f in (METADATA_FILE, ITEMS_FILE):
            if f not in ckpt.files:
                raise CorruptionError(f"{ckpt.where(f)}: missing: {self.checkpoint_id} is not a DCP checkpoint "
                                      "written by AtomicStorageWriter", path=f)
        raw = ckpt.read_bytes(METADATA_FILE)  # verified against the manifest before unpickling
        try:
            metadata = _unpickle_metadata(raw)
        except ValueError as exc:
            writer = self._writer_torch(ckpt)
            if writer is not None and _newer_torch(writer):
                # intact (its CRC32C matched), but DCP changed its metadata classes since
                # this torch (torch 2.15 added TensorProperties.strides): not corrupt
                raise IncompatibleCheckpointError(
                    f"{ckpt.where(METADATA_FILE)}: written by torch {writer}, whose DCP metadata this older "
                    f"torch ({torch.__version__}) cannot read ({exc}); load it with torch "
                    f"{writer.split('+')[0]} or newer. Nothing was run", path=METADATA_FILE) from None
            raise CorruptionError(f"{ckpt.where(METADATA_FILE)}: not DCP metadata, refused unexecuted ({exc})",
                                  path=METADATA_FILE) from None
        self._items = self._parse_items(ckpt)
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata

    def _writer_torch(self, ckpt: Checkpoint) -> str | None:
        """The torch version the item records name as the writer's, if any (older
        checkpoints, and damaged records, name none)."""
        try:
            version = json.loads(ckpt.read_bytes(ITEMS_FILE)).get("torch")
        except Exception:  # noqa: BLE001 - only a better message is at stake
            return None
        return version if isinstance(version, str) and 0 < len(version) <= 64 else None

    def _parse_items(self, ckpt: Checkpoint) -> dict[tuple[str, int], tuple[int, int]]:
        try:
            doc = json.loads(ckpt.read_bytes(ITEMS_FILE))
            out = {}
            for file, spans in doc["items"].items():
                if file not in ckpt.files:
                    raise ValueError(f"names {file!r}, which is not in the checkpoint")
                for off, n, crc in spans:
                    if not all(isinstance(v, int) and v >= 0 for v in (off, n, crc)) or off + n > ckpt.files[file].size:
                        raise ValueError(f"bad span {[off, n, crc]!r} of {file}")
                    out[(file, off)] = (n, crc)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptionError(f"{ckpt.where(ITEMS_FILE)}: malformed ({exc})", path=ITEMS_FILE) from None
        return out

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self._dtypes = {fqn: md.properties.dtype for fqn, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata) and isinstance(md.properties.dtype, torch.dtype)}
        if not self._items:
            ckpt = self._open()
            self._items = self._replacement_named(ckpt, "its item records", lambda: self._parse_items(ckpt))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _record(self, ckpt: Checkpoint, req: ReadItem) -> tuple[str, int, int, int, tuple[str, ...]]:
        """(file, offset, length, CRC32C, stream extensions) of an item, from DCP's metadata
        and ours."""
        info = self.storage_data.get(req.storage_index)
        fqn = req.storage_index.fqn
        if not isinstance(info, _StorageInfo):
            raise CorruptionError(f"{ckpt.where(METADATA_FILE)}: no storage record for {fqn}", path=METADATA_FILE,
                                  leaf=fqn)
        file, off = info.relative_path, info.offset
        expected = self._items.get((file, off))
        if expected is None or expected[0] != info.length:
            raise CorruptionError(f"{ckpt.where(file)}: {fqn} at [{off}, {off + info.length}) has no checksum record",
                                  path=file, leaf=fqn)
        return file, off, info.length, expected[1], tuple(getattr(info, "transform_descriptors", None) or ())

    def _replaced(self, ckpt: Checkpoint) -> bool:
        """Whether the checkpoint being read was replaced or deleted since it was opened."""
        try:
            return ckpt.store.strategy.current(self.name) != ckpt.manifest.attempt
        except AtomicStoreError:
            return False

    def _replacement_named(self, ckpt: Checkpoint, what: str, read: Callable[[], _T]) -> _T:
        """``read()``; an error of atomicstore's raised while the checkpoint was replaced or
        deleted (its files gone: ``NotFoundError``; other bytes: a checksum error) is
        :class:`~atomicstore.PreconditionFailedError`, not damage."""
        try:
            return read()
        except AtomicStoreError as exc:
            if not isinstance(exc, PreconditionFailedError) and self._replaced(ckpt):
                raise PreconditionFailedError(
                    f"{self.checkpoint_id} was replaced or deleted (an overwrite or delete by another job) while "
                    f"it was being read (at {what}: {type(exc).__name__}); load it again") from None
            raise

    def _untransform(self, ckpt: Checkpoint, file: str, fqn: str, descs: tuple[str, ...], data: bytes) -> bytes:
        """An item's bytes back through the stream extensions it was written with."""
        registry = self.extension_registry
        if registry is None:
            if ExtensionRegistry is None:  # pragma: no cover - torch without extensions
                raise CorruptionError(f"{ckpt.where(file)}: item {fqn} names stream extensions {list(descs)}, "
                                      "which this torch does not have", path=file, leaf=fqn)
            registry = ExtensionRegistry()
        try:
            extensions = registry.from_descriptor_list(descs)
        except Exception as exc:  # noqa: BLE001 - unknown extension, or one it cannot build here
            raise InvalidArgumentError(
                f"{ckpt.where(file)}: item {fqn} was written through the stream extensions {list(descs)}, which "
                f"this reader cannot undo ({exc}): pass _extension_registry= with them registered") from None
        stream: IO[bytes] = io.BytesIO(data)
        for ex in extensions:
            if StreamTransformExtension is not None and isinstance(ex, StreamTransformExtension):
                stream = ex.transform_from(stream)
        try:
            return stream.read(-1)
        except Exception as exc:  # noqa: BLE001 - bytes that passed their CRC32C but do not decode
            raise CorruptionError(f"{ckpt.where(file)}: item {fqn} does not decode through {list(descs)} ({exc})",
                                  path=file, leaf=fqn) from None

    @staticmethod
    def _check_weights_only(ckpt: Checkpoint, file: str, fqn: str, data: bytes) -> None:
        """Refuse a non-tensor item that unpickles only with ``weights_only=False``:
        DCP's load planner unpickles it so (``DefaultLoadPlanner.load_bytes``), and its
        globals could run anything. What passes here names only the globals torch allows
        (and those of ``torch.serialization.add_safe_globals``), so the planner's unpickling
        of the same bytes runs nothing else."""
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - refused, or not a pickle at all
            why = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
            raise CorruptionError(
                f"{ckpt.where(file)}: item {fqn} does not load with weights_only=True, refused unexecuted "
                f"({why}); if this checkpoint is trusted, load it with weights_only=False, or allow its "
                "classes with torch.serialization.add_safe_globals", path=file, leaf=fqn) from None

    def _load_item(self, ckpt: Checkpoint, req: ReadItem, planner: LoadPlanner, lock: threading.Lock) -> None:
        self._replacement_named(ckpt, f"item {req.storage_index.fqn}",
                                lambda: self._load_checked(ckpt, req, planner, lock))

    def _load_checked(self, ckpt: Checkpoint, req: ReadItem, planner: LoadPlanner, lock: threading.Lock) -> None:
        file, off, length, crc, descs = self._record(ckpt, req)
        fqn = req.storage_index.fqn

        def mismatch() -> ChecksumMismatchError:
            return ChecksumMismatchError(f"{ckpt.where(file)}: item {fqn} at [{off}, {off + length}) fails its "
                                         "CRC32C check", path=file, leaf=fqn)

        src: io.RawIOBase | io.BytesIO
        if descs or req.type == LoadItemType.BYTE_IO or length < _DIRECT_READ:
            data = ckpt.read_range(file, off, off + length)
            if crc32c(data) != crc:
                raise mismatch()
            if descs:  # checked as stored, then decoded
                data = self._untransform(ckpt, file, fqn, descs, data)
            if req.type == LoadItemType.BYTE_IO:
                if self.weights_only:
                    self._check_weights_only(ckpt, file, fqn, data)
                with lock:
                    planner.load_bytes(req, io.BytesIO(data))
                return
            src = io.BytesIO(data)
        else:  # large: the tensor's bytes go from storage straight into its memory, checked there
            src = _ItemFile(ckpt, file, off, length)
        try:
            tensor = torch.load(cast(IO[bytes], src), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged item, or bytes torch.save did not write
            if isinstance(src, _ItemFile) and src.crc32c() != crc:
                raise mismatch() from None
            raise CorruptionError(f"{ckpt.where(file)}: item {fqn} is not a saved tensor ({exc})", path=file,
                                  leaf=fqn) from None
        if isinstance(src, _ItemFile) and src.crc32c() != crc:
            raise mismatch()  # before anything reached the caller's tensors
        # what DCP writes for a tensor item is a dense tensor of the dtype its metadata
        # records: anything else (another object, a sparse, quantized or meta tensor, a
        # complex tensor where float32 is recorded) would fail deep in torch, or be cast
        # silently into the caller's tensor
        what = _not_the_recorded_tensor(tensor, self._dtypes.get(fqn))
        if what is not None:
            raise CorruptionError(f"{ckpt.where(file)}: item {fqn} is not the dense tensor its metadata records "
                                  f"({what})", path=file, leaf=fqn)
        try:
            tensor = _narrow(tensor, req.storage_offsets, req.lengths)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise CorruptionError(f"{self.checkpoint_id}: item {fqn}: the plan's region is outside the "
                                  f"saved chunk ({exc})", leaf=fqn) from None
        with lock:
            target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CorruptionError(f"{self.checkpoint_id}: item {fqn} has size {tuple(tensor.size())}, "
                                  f"the plan expects {tuple(target.size())}", leaf=fqn)
        try:
            target.copy_(tensor)  # items fill distinct targets: outside the lock
        except RuntimeError as exc:  # (a target of another dtype or device is the caller's choice)
            raise CorruptionError(f"{ckpt.where(file)}: item {fqn} cannot be copied into its target ({exc})",
                                  path=file, leaf=fqn) from None
        with lock:
            planner.commit_tensor(req, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ckpt = self._open()

        def where(req: ReadItem) -> tuple[str, int]:
            info = self.storage_data.get(req.storage_index)
            return getattr(info, "relative_path", ""), getattr(info, "offset", 0)

        reqs = sorted(plan.items, key=where)
        lock = threading.Lock()  # the planner is not thread-safe: only its calls are serialised
        # a budget of its own (the store's would starve: an item holding it all waits for
        # its own ranged reads, which draw from the store's budget too)
        budget = InflightBudget(self.max_inflight_bytes)

        def one(req: ReadItem) -> None:
            info = self.storage_data.get(req.storage_index)
            with budget.hold(getattr(info, "length", 0)):
                self._load_item(ckpt, req, planner, lock)

        # items are read, checked and decoded on several threads, at most
        # max_inflight_bytes of them at once (an item larger than that alone)
        threads = self.thread_count or (1 if ckpt.store.driver.capabilities.directories else 8)
        if len(reqs) <= 1 or threads <= 1:
            for r in reqs:
                one(r)
        else:
            with concurrent.futures.ThreadPoolExecutor(min(threads, len(reqs))) as pool:
                for p in [pool.submit(one, r) for r in reqs]:
                    p.result()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return names_checkpoint(checkpoint_id, absolute=True)


def _not_the_recorded_tensor(obj: object, recorded: torch.dtype | None) -> str | None:
    """What ``obj`` (a tensor item as ``torch.load`` returned it) is, if it is not the dense
    tensor of dtype ``recorded`` that DCP writes; None if it is."""
    if not isinstance(obj, torch.Tensor):
        return f"a {type(obj).__name__}"
    if obj.layout is not torch.strided:
        return f"a {obj.layout} tensor"
    if obj.is_quantized or obj.is_meta:
        return f"a {'quantized' if obj.is_quantized else 'meta'} tensor"
    if recorded is not None and obj.dtype != recorded:
        return f"a {obj.dtype} tensor, the metadata records {recorded}"
    return None


def _newer_torch(version: str) -> bool:
    """Whether ``version`` (a torch version a checkpoint records) is newer than this torch's,
    by their release numbers (``2.15.0+cu132`` -> (2, 15, 0); not a version -> never newer).
    Not torch's ``TorchVersion``: it compares what it cannot parse as a string, so a
    forged record (``"garbage"``) would count as newer."""

    def release(v: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", v.split("+")[0])[:3])

    return release(version) > release(torch.__version__)


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The part of a saved chunk a read item asks for (DCP's narrow_tensor_by_index)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = torch.narrow(tensor, dim, start, length)
    return tensor


# -- conveniences: DCP's calls with atomicstore's errors unwrapped ---------------------------
def atomicstore_error(exc: BaseException) -> AtomicStoreError | None:
    """The atomicstore error behind a DCP ``CheckpointException`` (that of the lowest rank
    that raised one), ``exc`` itself if it is one, else None."""
    if isinstance(exc, AtomicStoreError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for _, wrapped in sorted(failures.items(), key=lambda kv: kv[0]):
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(inner, AtomicStoreError):
                return inner
    return None


def _unwrapped(call: Callable[[], _T], reader: AtomicStorageReader | None = None) -> _T:
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call()
    except CheckpointException as exc:
        inner = atomicstore_error(exc) or (reader.metadata_error if reader is not None else None)
        if inner is None:
            raise
        raise inner from exc


def save(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, overwrite: bool = False,
         thread_count: int = 1, planner: SavePlanner | None = None, process_group: Any = None,
         **store_options: Any) -> Metadata:
    """``dcp.save`` through :class:`AtomicStorageWriter`, called by every rank. An
    atomicstore error in any rank (e.g. :class:`~atomicstore.CommitConflictError`) is raised
    as itself, DCP's ``CheckpointException`` as its cause; the attempt of a failed save is
    aborted before this returns."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(state_dict, dict):
        raise InvalidArgumentError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    with AtomicStorageWriter(checkpoint_id, overwrite=overwrite, thread_count=thread_count, **store_options) as w:
        metadata: Metadata = _unwrapped(lambda: dcp.save(state_dict, storage_writer=w, planner=planner,
                                                         process_group=process_group))
        return metadata


def load(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, planner: LoadPlanner | None = None,
         process_group: Any = None, thread_count: int | None = None, weights_only: bool = True,
         **store_options: Any) -> None:
    """``dcp.load`` (in place, resharding onto ``state_dict``'s layout) through
    :class:`AtomicStorageReader`; atomicstore errors are raised as themselves (e.g.
    :class:`~atomicstore.ChecksumMismatchError` naming the file and item).
    ``weights_only=False`` lets non-tensor items hold any pickle (trusted checkpoints only:
    see :class:`AtomicStorageReader`)."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(state_dict, dict):
        raise InvalidArgumentError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    reader = AtomicStorageReader(checkpoint_id, thread_count=thread_count, weights_only=weights_only,
                                 **store_options)
    _unwrapped(lambda: dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group),
               reader)
