"""fjformer's streaming checkpoint format, read safely and written atomically.

Switch with one import::

    from atomicstore.compat.fjformer import CheckpointManager   # was: from fjformer.checkpoint import ...

The format (``fjformer/checkpoint/streamer.py``, ``CheckpointManager.save_state_to_file``,
0.0.91 and earlier) is a file of consecutive msgpack values, one per leaf of the state in
the order of ``flax.traverse_util.flatten_dict(flax.serialization.to_state_dict(state))``
(empty dicts leave no item). Each value is a 2-element array ``[key path, leaf]``: the key
path an array of strings, the leaf a ``bin`` holding ``flax.serialization.to_bytes(leaf)``
(an array as flax's ndarray ext type 1, a numpy scalar as ext 3, a complex as ext 2,
Python scalars, str, bytes and None as themselves). There is no header, index or
checksum. :func:`save_state_to_file` writes exactly the bytes fjformer writes for the
same state, ``gather_fns`` and ``float_dtype``; :func:`load_checkpoint` returns what
fjformer's ``load_checkpoint`` returns (a nested dict, or ``target``'s type through
``flax.serialization.from_state_dict``), ``remove_dict_prefix`` and ``shard_fns`` included.

What is safer than fjformer:

* the file is committed atomically through :meth:`atomicstore.Store.one_file` (staged,
  fsynced, ``rename`` on POSIX; one conditional upload on S3 and GCS): a reader sees the
  old file or the new one, never a part; a crashed save leaves nothing under the name and
  recovery removes its leftovers. ``s3://`` and ``gs://`` URLs work (``storage_options=``
  go to fsspec);
* every leaf is streamed from its own buffer and read back one leaf at a time: memory
  holds one leaf, never the file;
* a file written here gets a CRC32C per leaf, kept in a JSON record next to it
  (``.<name>.crc32c.json``, see :data:`RECORD_FORMAT`; the file itself stays
  byte-identical to fjformer's). Loading checks each leaf against it before decoding,
  so a flipped bit raises :class:`~atomicstore.ChecksumMismatchError` naming the file and
  the leaf. The record is bound to the generation of the file its own commit produced
  (inode and mtime, S3 ETag, GCS generation, as the commit reported it, never read back
  later: another save may have replaced the file by then), and is not written when the
  file changed since: a file replaced by anything else (fjformer itself) is read
  unchecked, as are files fjformer wrote. On GCS the object's own CRC32C is checked as well;
* the file is hostile input: every length is checked against the file's size before
  anything is allocated, dtype strings go through one strict parser, and anything that
  is not a well-formed item (truncated, garbage, wrong types, non-string keys, unknown ext
  types, duplicate or overlapping key paths) raises :class:`~atomicstore.CorruptionError`
  naming the file and, once read, the leaf. Nothing is unpickled;
* where fjformer pickles (``save_pickle``, the metadata and dataset of ``save_all``) this
  module writes JSON (``save_json``), atomically.

A file fjformer wrote itself carries no checksums: damage inside array data, or a cut
exactly between two leaves, cannot be detected there.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from ..commit import Store, crc32c, path_argument, validate_name, validate_path
from ..commit.locator import is_local, split_location, store_at
from ..commit.manifest import crc32c_combine
from ..commit.strategies import read_capped
from ..errors import (
    AtomicStoreError,
    ChecksumMismatchError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
)
from ..pytree import StateWriter
from ..pytree import msgpack_io as mp
from ..pytree.dtypes import parse_dtype
from ..pytree.format import (
    EXT_COMPLEX,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    FLAX_MAX_CHUNK,
    aligned_empty,
    bytes_view,
)
from ..pytree.tree import is_jax_array
from ..pytree.writer import check_depth

log = logging.getLogger("atomicstore.compat.fjformer")

PyTree = Any
KeyPath = tuple[str, ...]

#: ``format`` of the JSON checksum record written next to each file
RECORD_FORMAT = "atomicstore.fjformer.crc32c/1"
_BF16, _F16, _F32, _F64 = (np.dtype(t) for t in (ml_dtypes.bfloat16, np.float16, np.float32, np.float64))
#: fjformer's names of ``float_dtype`` (``fjformer.checkpoint.streamer.get_dtype``)
FLOAT_DTYPE_NAMES: dict[str, np.dtype] = {
    "bf16": _BF16, "bfloat16": _BF16, "fp16": _F16, "float16": _F16,
    "fp32": _F32, "float32": _F32, "fp64": _F64, "float64": _F64,
}
#: the dtypes fjformer's ``float_dtype`` converts (others are written unchanged)
_CONVERTED = frozenset({_BF16, _F16, _F32, _F64})
#: leaves larger than this are read into an aligned array with no second copy
_DIRECT_READ = 1 << 20
_HEAD = 4096
#: longest key path and key component (UTF-8 bytes) accepted from a file, and so written
MAX_KEY_DEPTH = mp.MAX_DEPTH
MAX_KEY_BYTES = 1 << 16
#: largest checksum record and JSON file read (whole); larger ones are never written
MAX_RECORD_BYTES = 64 << 20
_WRITE_BUFFER = 1 << 20


def _record_key(name: str) -> str:
    return f".{name}.crc32c.json"


# -- arguments ------------------------------------------------------------------------------
def _check_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be a bool, got {value!r}")
    return value


def _check_options(storage_options: Any) -> dict[str, Any]:
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options):
        raise InvalidArgumentError("storage_options must be a mapping of str to values (passed to fsspec)")
    return dict(storage_options)


def _float_dtype(float_dtype: Any) -> np.dtype | None:
    """fjformer's ``get_dtype``: None or "" converts nothing; one of its names; else any
    numeric dtype (``jnp.bfloat16``, ``np.float16``...)."""
    if float_dtype is None or (isinstance(float_dtype, str) and float_dtype == ""):
        return None
    if isinstance(float_dtype, str):
        if float_dtype not in FLOAT_DTYPE_NAMES:
            raise InvalidArgumentError(f"float_dtype {float_dtype!r} is not one of {sorted(FLOAT_DTYPE_NAMES)}")
        return FLOAT_DTYPE_NAMES[float_dtype]
    try:
        dt: np.dtype = np.dtype(float_dtype)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"float_dtype {float_dtype!r} is not a dtype") from None
    if not (dt.kind in "biufc" or dt.type.__module__ == "ml_dtypes") or dt.fields is not None:
        raise InvalidArgumentError(f"float_dtype {float_dtype!r} is not a numeric dtype")
    return dt


def _prefix(remove_dict_prefix: Any) -> KeyPath | None:
    if remove_dict_prefix is None:
        return None
    if isinstance(remove_dict_prefix, str | bytes) or not isinstance(remove_dict_prefix, tuple | list):
        raise InvalidArgumentError("remove_dict_prefix must be a tuple (or list) of str, e.g. ('params', 'params')")
    if not all(isinstance(k, str) for k in remove_dict_prefix):
        raise InvalidArgumentError("remove_dict_prefix must hold only str keys")
    return tuple(remove_dict_prefix)


def _flax() -> Any:
    """flax (fjformer depends on it; its state-dict rules decide the key paths)."""
    try:
        import flax.serialization
        import flax.traverse_util
    except ImportError as exc:  # pragma: no cover - flax is a test dependency
        raise InvalidArgumentError(f"atomicstore.compat.fjformer needs flax here (pip install flax): {exc}") from None
    return flax


def _state_dict(tree: Any, what: str, fl: Any, *, keep_empty: bool = False) -> dict[KeyPath, Any]:
    """``flatten_dict(to_state_dict(tree))``, as fjformer computes it, checked."""
    # flax's to_state_dict recurses: refuse a cyclic tree, or one too deep for any key path,
    # first (a key path one key too long is named by _check_keys)
    check_depth(tree, what, limit=MAX_KEY_DEPTH + 1)
    try:
        sd = fl.serialization.to_state_dict(tree)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise InvalidArgumentError(f"{what} cannot be turned into a flax state dict: {exc}") from None
    if not isinstance(sd, Mapping):
        raise InvalidArgumentError(f"{what} must be a dict or a pytree whose flax state dict is a dict, "
                                   f"got {type(tree).__name__}")
    try:
        flat: dict[KeyPath, Any] = fl.traverse_util.flatten_dict(sd, keep_empty_nodes=keep_empty)
    except (TypeError, ValueError, AssertionError, RecursionError) as exc:
        raise InvalidArgumentError(f"{what} cannot be flattened: {exc}") from None
    for key in flat:
        if not all(isinstance(k, str) for k in key):
            raise InvalidArgumentError(f"{what}: key path {key!r} has a key that is not a str")
    return flat


def _check_keys(flat: dict[KeyPath, Any]) -> None:
    """Refuse key paths the reader would refuse (deeper than :data:`MAX_KEY_DEPTH`, a key
    longer than :data:`MAX_KEY_BYTES` in UTF-8): before anything is written."""
    for key in flat:
        if len(key) > MAX_KEY_DEPTH:
            raise InvalidArgumentError(f"state: the key path {'/'.join(key[:8])}/... has {len(key)} keys: at most "
                                       f"{MAX_KEY_DEPTH} (the most a reader accepts)")
        for k in key:
            n = len(k.encode("utf-8", "surrogatepass"))
            if n > MAX_KEY_BYTES:
                raise InvalidArgumentError(f"state: a key of {n} bytes ({k[:40]!r}...): at most {MAX_KEY_BYTES} "
                                           "(the longest a reader accepts)")


def _functions(fns: Any, what: str, fl: Any) -> dict[KeyPath, Callable[[Any], Any] | None] | None:
    """fjformer's ``flatten_dict(to_state_dict(fns))``: key path -> function or None."""
    if fns is None:
        return None
    flat = _state_dict(fns, what, fl)
    for key, fn in flat.items():
        if fn is not None and not callable(fn):
            raise InvalidArgumentError(f"{what}[{'/'.join(key)}] is not callable (a {type(fn).__name__})")
    return flat


# -- stores ---------------------------------------------------------------------------------
_recovered: set[str] = set()


def _locate(path: Any, storage_options: Any, *, writing: bool) -> tuple[Store, str]:
    """(the store holding ``path``'s directory, the file's name in it). Reading a local
    file that does not exist raises :class:`NotFoundError` without creating anything."""
    p = path_argument(path, "path")
    opts = _check_options(storage_options)
    local = is_local(p)
    if local:
        p = os.path.abspath(p.removeprefix("file://"))
        root, name = os.path.split(p)
    else:
        try:
            root, name = split_location(p)
        except InvalidArgumentError:
            raise InvalidArgumentError(f"{p!r} does not name a file inside a bucket ('s3://bucket/dir/file')") from None
    if writing:
        validate_name(name)
    else:
        validate_path(name, what="checkpoint file name")
        if local and not os.path.isfile(p):
            raise NotFoundError(f"{p}: no such checkpoint file")
    return store_at(root, **opts), name


def _recover_once(st: Store) -> None:
    """Remove what crashed saves left in this store (once per store and process)."""
    if st.url in _recovered:
        return
    report = st.recover()
    if report.actions:
        log.info("%s", report.summary())
    _recovered.add(st.url)


# -- writing --------------------------------------------------------------------------------
class _Sink:
    """Writes items to a one-file commit (or nowhere), small pieces buffered, with the
    CRC32C and size of each item."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.buf = bytearray()
        self.size = 0
        self.crc = 0
        self.crcs: list[int] = []
        self.total = 0
        self._item_start = 0

    def write(self, data: bytes | bytearray | memoryview, crc32c: int | None = None) -> None:  # noqa: ARG002
        """One piece (``crc32c=`` accepted for :class:`StateWriter`, recomputed per item)."""
        if self.f is None:
            return
        self.crc = _crc(data, self.crc)
        n = memoryview(data).nbytes
        self.size += n
        if n < 65536:
            self.buf += data
            if len(self.buf) >= _WRITE_BUFFER:
                self.flush()
        else:
            self.flush()
            self.f.write(data)

    def end_item(self) -> None:
        if self.f is None:
            return
        n = self.size - self._item_start
        self.total = crc32c_combine(self.total, self.crc, n) if self.crcs else self.crc
        self.crcs.append(self.crc)
        self.crc, self._item_start = 0, self.size

    def flush(self) -> None:
        if self.buf:
            self.f.write(self.buf)
            self.buf = bytearray()


def _crc(data: bytes | bytearray | memoryview, value: int) -> int:
    return crc32c(data, value)


class _Counter:
    """A sink that only counts (for the length of a chunked leaf before writing it)."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview, crc32c: int | None = None) -> None:  # noqa: ARG002
        self.size += memoryview(data).nbytes


def _leaf_encoding(key: KeyPath, value: Any) -> tuple[list[Any], int] | StateWriter:
    """The pieces of ``flax.serialization.to_bytes(value)`` and their length, without
    copying array data; a :class:`StateWriter` for arrays flax splits into chunks."""
    where = "/".join(key)
    if is_jax_array(value):
        if not getattr(value, "is_fully_addressable", True):
            raise InvalidArgumentError(f"leaf {where} is a jax.Array sharded across processes: gather it "
                                       "first (gather_fns), as fjformer requires")
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as exc:  # e.g. typed PRNG keys
            raise InvalidArgumentError(f"leaf {where} cannot be copied to host as an array: {exc}") from None
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        if arr.dtype.hasobject or arr.dtype.fields is not None:
            raise InvalidArgumentError(f"leaf {where}: object and structured dtypes cannot be saved ({arr.dtype})")
        if arr.nbytes > FLAX_MAX_CHUNK and isinstance(value, np.ndarray):
            return StateWriter(arr, sort_keys=False)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        code = EXT_NDARRAY if isinstance(value, np.ndarray) else EXT_NPSCALAR
        head = mp.array_header(3) + mp.pack(list(arr.shape)) + mp.pack(arr.dtype.name) + mp.bin_header(arr.nbytes)
        ext = mp.ext_header(code, len(head) + arr.nbytes)
        return [ext + head, bytes_view(arr)], len(ext) + len(head) + arr.nbytes
    if type(value) is complex:
        payload = msgpack.packb((value.real, value.imag))
        blob = mp.ext_header(EXT_COMPLEX, len(payload)) + payload
        return [blob], len(blob)
    if value is None or type(value) in (bool, int, float, str, bytes):
        try:
            blob = mp.pack(value)
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"leaf {where} cannot be encoded: {exc}") from None
        return [blob], len(blob)
    raise InvalidArgumentError(f"leaf {where} has type {type(value).__name__}, which flax's to_bytes cannot "
                               "encode (use arrays, numpy scalars, bool, int, float, complex, str, bytes, None)")


def _cast(value: Any, dtype: np.dtype | None) -> Any:
    """fjformer's ``get_dtype``: float16/bfloat16/float32/float64 leaves become ``dtype``."""
    if dtype is None:
        return value
    dt = getattr(value, "dtype", None)
    try:
        convert = dt is not None and np.dtype(dt) in _CONVERTED
    except TypeError:
        convert = False
    return value.astype(dtype) if convert else value


def _write_items(sink: _Sink, flat: dict[KeyPath, Any], gathers: dict[KeyPath, Any] | None, cast: np.dtype | None,
                 mismatch_allowed: bool) -> int:
    """Stream every leaf as fjformer's ``save_state_to_file`` does; return how many
    leaves had no gather function."""
    missing = 0
    for key, value in flat.items():
        if gathers is not None:
            fn = gathers.get(key)
            if fn is None:
                if not mismatch_allowed:
                    raise InvalidArgumentError(f"gather_fns has no function for leaf {'/'.join(key)} "
                                               "(mismatch_allowed=False)")
                missing += 1
            else:
                value = fn(value)
        value = _cast(value, cast)
        enc = _leaf_encoding(key, value)
        if isinstance(enc, StateWriter):
            counter = _Counter()
            enc.write(counter)
            length = counter.size
        else:
            pieces, length = enc
        try:
            head = mp.array_header(2) + mp.array_header(len(key)) + b"".join(mp.pack(k) for k in key)
            head += mp.bin_header(length)
        except ValueError as exc:  # a msgpack bin holds at most 4 GiB, as for fjformer
            raise InvalidArgumentError(f"leaf {'/'.join(key)}: {exc}") from None
        sink.write(head)
        if isinstance(enc, StateWriter):
            enc.write(sink)
        else:
            for piece in pieces:
                sink.write(piece)
        sink.end_item()
    return missing


def save_state_to_file(
    state: PyTree,
    path: str | os.PathLike[str],
    gather_fns: PyTree | None = None,
    float_dtype: Any = None,
    verbose: bool = False,
    mismatch_allowed: bool = True,
    *,
    overwrite: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Write ``state`` to ``path`` in fjformer's streaming format, atomically.

    Byte-identical to fjformer's ``CheckpointManager.save_state_to_file`` with the same
    arguments: leaves in ``flatten_dict(to_state_dict(state))`` order, each passed through
    its function in ``gather_fns`` (a tree of callables or None shaped like the state;
    leaves without one are written unchanged unless ``mismatch_allowed`` is False), then
    float16/bfloat16/float32/float64 leaves converted to ``float_dtype`` (``"bf16"``,
    ``"fp16"``, ``"fp32"``, ``"fp64"``, their long names, or a dtype).

    ``path`` is a local path or an ``s3://``/``gs://`` URL (``storage_options`` go to
    fsspec). The file is committed atomically (see :meth:`atomicstore.Store.one_file`):
    an existing file is replaced in one step (``overwrite=False`` raises
    :class:`~atomicstore.CommitConflictError` instead, as does another writer replacing
    it meanwhile); a CRC32C record ``.<name>.crc32c.json`` is written next to it.
    ``os.devnull`` writes nothing but still runs every gather function, as fjformer's
    disabled manager does (processes of a multi-host job must all run them).
    """
    _check_bool(verbose, "verbose")
    _check_bool(mismatch_allowed, "mismatch_allowed")
    _check_bool(overwrite, "overwrite")
    cast = _float_dtype(float_dtype)
    p = path_argument(path, "path")
    fl = _flax()
    flat = _state_dict(state, "state", fl)
    _check_keys(flat)
    gathers = _functions(gather_fns, "gather_fns", fl)
    if p == os.devnull:
        _write_items(_Sink(None), flat, gathers, cast, mismatch_allowed)
        return
    st, name = _locate(p, storage_options, writing=True)
    _recover_once(st)
    with st.one_file(name, overwrite=overwrite) as f:
        sink = _Sink(f)
        missing = _write_items(sink, flat, gathers, cast, mismatch_allowed)
        sink.flush()
    if verbose:
        log.info("saved %d leaves (%d bytes) to %s; %d without a gather function", len(sink.crcs), sink.size,
                 st.driver.describe(name), missing)
    _write_record(st, name, sink, f.generation)


def _write_record(st: Store, name: str, sink: _Sink, generation: str | None) -> None:
    """The CRC32C record of the file just committed, bound to ``generation``, the one its
    own commit produced (never one read afterwards: another save may have replaced the
    file since, and its bytes are not these). Not written when the file is no longer at
    that generation (the save that replaced it writes its own record), nor when the
    backend did not say which generation the commit made. The file is committed
    already: a failure here leaves it readable, unchecked, and is logged."""
    where = st.driver.describe(name)
    if generation is None:
        log.info("%s: the backend did not report the committed generation: no checksum record written", where)
        return
    try:
        try:
            now = st.driver.info(name).generation
        except NotFoundError:
            now = None
        if now != generation:
            log.info("%s was replaced right after this save committed it: its checksum record is left to "
                     "the save that replaced it", where)
            return
        record = {"format": RECORD_FORMAT, "file": name, "size": sink.size, "generation": generation,
                  "crc32c": sink.total, "items": sink.crcs}
        data = json.dumps(record, separators=(",", ":")).encode()
        if len(data) > MAX_RECORD_BYTES:  # more than a reader reads: the file loads unchecked
            log.warning("%s: %d leaves need a checksum record of %d bytes, more than readers accept (%d): "
                        "none written", where, len(sink.crcs), len(data), MAX_RECORD_BYTES)
            return
        st.write_file(_record_key(name), data, overwrite=True)
    except AtomicStoreError as exc:
        log.warning("%s is committed, but its checksum record could not be written: %s", where, exc)


# -- reading --------------------------------------------------------------------------------
@dataclass
class _Record:
    size: int
    crc32c: int
    items: list[int]


def _read_bounded(st: Store, key: str, size: int) -> bytes | None:
    """``key`` whole, read as a file of ``size`` bytes (its size looked at before): at most
    one byte more is read, whatever replaced it since; None if it grew meanwhile."""
    raw = read_capped(st.driver, key, size)
    return raw if len(raw) <= size else None


def _read_record(st: Store, name: str, size: int, generation: str | None) -> _Record | None:
    """The checksum record of ``name`` if it describes this generation of the file."""
    drv, key = st.driver, _record_key(name)
    where = drv.describe(key)
    try:
        rsize = drv.info(key).size
    except NotFoundError:
        return None
    if rsize > MAX_RECORD_BYTES:  # never written (an older version did): not read, the file read unchecked
        log.warning("%s: a checksum record of %d bytes, more than %d: ignored, %s is read unchecked", where, rsize,
                    MAX_RECORD_BYTES, name)
        return None
    try:
        raw = _read_bounded(st, key, rsize)
    except NotFoundError:
        raw = None
    if raw is None or len(raw) != rsize:  # replaced (by a save in progress: its file is newer than ours)
        log.debug("%s changed while it was read: %s is read unchecked", where, name)
        return None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
            raise ValueError("not an atomicstore fjformer checksum record")
        gen, rec_size, total, items = doc["generation"], doc["size"], doc["crc32c"], doc["items"]
        if doc.get("file") != name or not isinstance(gen, str) or type(rec_size) is not int or rec_size < 0:
            raise ValueError("bad file, generation or size")
        if not isinstance(items, list) or len(items) > rec_size // 4 + 1:
            raise ValueError("bad item list")
        if not all(type(c) is int and 0 <= c < 2**32 for c in [total, *items]):
            raise ValueError("bad CRC32C")
    except (ValueError, KeyError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptionError(f"{where}: unreadable checksum record: {exc}", path=key) from None
    if generation is None or gen != generation:
        log.debug("%s describes another generation of %s: reading it unchecked", where, name)
        return None
    if rec_size != size:
        raise ChecksumMismatchError(f"{drv.describe(name)}: {size} bytes, but its checksum record says {rec_size}",
                                    path=name)
    return _Record(rec_size, total, items)


class _Stream:
    """Sequential reads of one file whose size is known: nothing past the size is ever
    allocated, and CRC32C is kept per item."""

    def __init__(self, chunks: Iterator[bytes], size: int, where: str, name: str) -> None:
        self.chunks, self.size, self.where, self.name = chunks, size, where, name
        self.buf = memoryview(b"")
        self.pos = 0
        self.crc = 0

    def _fill(self, what: str) -> None:
        for chunk in self.chunks:
            if chunk:
                self.buf = memoryview(chunk)
                return
        raise CorruptionError(f"{self.where}: the file ends at byte {self.pos}, inside {what}, before the "
                              f"{self.size} bytes it had (it changed while being read)", path=self.name)

    def check(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise CorruptionError(f"{self.where}: {what} at byte {self.pos} needs {n} bytes, past the end of the "
                                  f"file ({self.size} bytes): the file is truncated or damaged", path=self.name)

    def readinto(self, out: memoryview, what: str) -> None:
        n = out.nbytes
        self.check(n, what)
        done = 0
        while done < n:
            if not self.buf:
                self._fill(what)
            k = min(n - done, len(self.buf))
            out[done : done + k] = self.buf[:k]
            self.buf = self.buf[k:]
            done += k
        self.crc = crc32c(out, self.crc)
        self.pos += n

    def read(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self.readinto(memoryview(buf), what)
        return bytes(buf)

    def skip(self, n: int, what: str) -> None:
        self.check(n, what)
        while n:
            if not self.buf:
                self._fill(what)
            k = min(n, len(self.buf))
            self.crc = crc32c(self.buf[:k], self.crc)
            self.buf, self.pos, n = self.buf[k:], self.pos + k, n - k

    def at_end(self) -> bool:
        if self.pos < self.size:
            return False
        if self.buf or any(self.chunks):
            raise CorruptionError(f"{self.where}: the file is longer than the {self.size} bytes it had "
                                  "(it changed while being read)", path=self.name)
        return True

    def take_crc(self) -> int:
        crc, self.crc = self.crc, 0
        return crc


def _corrupt(s: _Stream, msg: str, leaf: str | None = None) -> CorruptionError:
    return CorruptionError(f"{s.where}: {msg}", path=s.name, leaf=leaf)


def _uint(s: _Stream, width: int, what: str) -> int:
    return int.from_bytes(s.read(width, what), "big")


def _array_len(s: _Stream, what: str) -> int:
    at = s.pos
    b = s.read(1, what)[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b in (0xDC, 0xDD):
        return _uint(s, 2 if b == 0xDC else 4, what)
    raise _corrupt(s, f"{what} at byte {at} is not a msgpack array (type byte 0x{b:02x})")


def _key_component(s: _Stream, what: str) -> str:
    at = s.pos
    b = s.read(1, what)[0]
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
    elif b in (0xD9, 0xDA, 0xDB):
        n = _uint(s, {0xD9: 1, 0xDA: 2, 0xDB: 4}[b], what)
    else:
        raise _corrupt(s, f"{what} at byte {at} is not a string (type byte 0x{b:02x}): fjformer key paths are "
                          "strings")
    if n > MAX_KEY_BYTES:
        raise _corrupt(s, f"{what} at byte {at} declares {n} bytes, more than {MAX_KEY_BYTES}")
    raw = s.read(n, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _corrupt(s, f"{what} at byte {at} is not valid UTF-8") from None


def _item_head(s: _Stream, i: int) -> tuple[KeyPath, int]:
    """(key path, length of the leaf's bytes) of the ``i``-th item."""
    at = s.pos
    n = _array_len(s, f"item {i}")
    if n != 2:
        raise _corrupt(s, f"item {i} at byte {at} is an array of {n}, not a (key path, value) pair")
    depth = _array_len(s, f"the key path of item {i}")
    if not 1 <= depth <= MAX_KEY_DEPTH:
        raise _corrupt(s, f"the key path of item {i} at byte {at} has {depth} keys (1 to {MAX_KEY_DEPTH} allowed)")
    key = tuple(_key_component(s, f"a key of item {i}") for _ in range(depth))
    leaf = "/".join(key)
    vat = s.pos
    try:
        b = s.read(1, f"leaf {leaf}")[0]
        if b not in (0xC4, 0xC5, 0xC6):
            raise _corrupt(s, f"leaf {leaf} (item {i}) at byte {vat} is not bytes (type byte 0x{b:02x}): "
                              "fjformer stores flax's to_bytes of each leaf", leaf)
        length = _uint(s, {0xC4: 1, 0xC5: 2, 0xC6: 4}[b], f"leaf {leaf}")
        s.check(length, f"leaf {leaf}")
    except CorruptionError as exc:
        if exc.leaf is None:
            exc.leaf = leaf
        raise
    return key, length


def _dtype_shape(name: Any, shape: Any, s: _Stream, leaf: str) -> tuple[np.dtype, tuple[int, ...], int]:
    dt = parse_dtype(name, path=s.name, leaf=leaf, where=s.where)
    if not isinstance(shape, list) or len(shape) > 64 or not all(type(d) is int and 0 <= d < 2**62 for d in shape):
        raise _corrupt(s, f"leaf {leaf}: shape {str(shape)[:80]} is not a list of at most 64 sizes", leaf)
    return dt, tuple(shape), math.prod(shape)


def _no_ext(code: int, span: mp.Span) -> Any:
    raise CorruptionError(f"ext type {code} inside an array's encoding")


def _array_plan(head: bytes, n: int, s: _Stream, leaf: str) -> tuple[int, np.dtype, tuple[int, ...], int] | None:
    """(ext code, dtype, shape, data offset) when a leaf of ``n`` bytes starting with
    ``head`` is one plain array whose data fills the rest; None for anything else."""
    try:
        b = head[0]
        if 0xD4 <= b <= 0xD8:
            ln, code, hdr = 1 << (b - 0xD4), head[1], 2
        elif b in (0xC7, 0xC8, 0xC9):
            w = {0xC7: 1, 0xC8: 2, 0xC9: 4}[b]
            ln, code, hdr = int.from_bytes(head[1 : 1 + w], "big"), head[1 + w], 2 + w
        else:
            return None
        if code not in (EXT_NDARRAY, EXT_NPSCALAR) or hdr + ln != n:
            return None
        val, end = mp.scan(mp.Source(lambda a, z: head[hdr + a : hdr + z], ln), on_ext=_no_ext)
        if end != ln or not (isinstance(val, list) and len(val) == 3 and isinstance(val[2], mp.Span)):
            return None
        dt, shape, count = _dtype_shape(val[1], val[0], s, leaf)
        if count * dt.itemsize != val[2].end - val[2].start:
            return None
        return code, dt, shape, hdr + val[2].start
    except (CorruptionError, IndexError, TypeError, ValueError):
        return None  # the general decoder reports what is wrong, after the checksum


def _read_leaf(s: _Stream, n: int, leaf: str) -> tuple[bool, Any]:
    """(True, array) for a large plain array read straight into an aligned array, or
    (False, the leaf's bytes) to decode once checked."""
    if n <= _DIRECT_READ:
        buf = bytearray(n)
        s.readinto(memoryview(buf), f"leaf {leaf}")
        return False, buf
    head = s.read(_HEAD, f"leaf {leaf}")
    plan = _array_plan(head, n, s, leaf)
    if plan is None:
        buf = bytearray(n)
        buf[:_HEAD] = head
        s.readinto(memoryview(buf)[_HEAD:], f"leaf {leaf}")
        return False, buf
    code, dt, shape, off = plan
    arr = aligned_empty(shape, dt)
    flat = bytes_view(arr)
    got = _HEAD - off
    flat[:got] = head[off:]
    s.readinto(flat[got:], f"leaf {leaf}")
    return True, arr[()] if code == EXT_NPSCALAR else arr


def _decode(buf: bytearray, s: _Stream, leaf: str) -> Any:
    """``flax.serialization.from_bytes(None, buf)``, on hostile bytes: arrays as views of
    ``buf`` (no copy), dtype and shape checked against the data, no unknown ext types."""
    mv = memoryview(buf)

    def on_ext(code: int, span: mp.Span) -> Any:
        if code in (EXT_NDARRAY, EXT_NPSCALAR):
            return _decode_array(buf, mv, code, span, s, leaf)
        if code == EXT_COMPLEX:
            return _decode_complex(mv, span, s, leaf)
        raise _corrupt(s, f"leaf {leaf}: unknown msgpack ext type {code} (flax writes 1, 2 and 3)", leaf)

    def finish(v: Any) -> Any:
        if isinstance(v, mp.Span):
            return bytes(mv[v.start : v.end])
        if isinstance(v, list):
            return [finish(x) for x in v]
        if isinstance(v, dict):
            d = {k: finish(x) for k, x in v.items()}
            return _unchunk(d, s, leaf) if "__msgpack_chunked_array__" in d else d
        return v

    try:
        val, end = mp.scan(_source(mv, 0, len(buf)), on_ext=on_ext)
        if end != len(buf):
            raise _corrupt(s, f"leaf {leaf}: {len(buf) - end} bytes after its value", leaf)
        return finish(val)
    except CorruptionError as exc:
        if exc.leaf is not None:
            raise
        raise _corrupt(s, f"leaf {leaf}: {exc}", leaf) from None
    except (TypeError, ValueError, RecursionError) as exc:  # e.g. an array as a map key
        raise _corrupt(s, f"leaf {leaf}: cannot be decoded: {type(exc).__name__}: {exc}", leaf) from None


def _source(mv: memoryview, base: int, size: int) -> mp.Source:
    """The ``size`` bytes of ``mv`` from ``base``, for :func:`mp.scan`."""
    return mp.Source(lambda a, z: bytes(mv[base + a : base + z]), size)


def _decode_array(buf: bytearray, mv: memoryview, code: int, span: mp.Span, s: _Stream, leaf: str) -> Any:
    """A numpy array (or scalar) ext value of ``buf`` (``mv``: its view) at ``span``: a view
    of ``buf`` where it is aligned, dtype and shape checked against the data."""
    size = span.end - span.start
    val, end = mp.scan(_source(mv, span.start, size), on_ext=_no_ext)
    if end != size or not (isinstance(val, list) and len(val) == 3):
        raise _corrupt(s, f"leaf {leaf}: an array is not encoded as (shape, dtype, data)", leaf)
    dt, shape, count = _dtype_shape(val[1], val[0], s, leaf)
    data = val[2]
    nbytes = (data.end - data.start) if isinstance(data, mp.Span) else len(data) if isinstance(data, bytes) else -1
    if nbytes != count * dt.itemsize:
        raise _corrupt(s, f"leaf {leaf}: {nbytes} data bytes for shape {shape} of {dt}", leaf)
    if count == 0:
        arr = np.empty(shape, dt)
    elif isinstance(data, mp.Span):
        arr = np.frombuffer(buf, dtype=dt, count=count, offset=span.start + data.start).reshape(shape)
        if not arr.flags.aligned:
            arr = arr.copy()
    else:
        arr = np.frombuffer(data, dtype=dt, count=count).reshape(shape).copy()
    return arr[()] if code == EXT_NPSCALAR else arr


def _decode_complex(mv: memoryview, span: mp.Span, s: _Stream, leaf: str) -> complex:
    """A complex number ext value of ``mv`` at ``span``: (real, imag)."""
    val, end = mp.scan(_source(mv, span.start, span.end - span.start), on_ext=_no_ext)
    if end != span.end - span.start or not (
            isinstance(val, list) and len(val) == 2
            and all(type(x) in (int, float) for x in val)):
        raise _corrupt(s, f"leaf {leaf}: a complex number is not encoded as (real, imag)", leaf)
    return complex(val[0], val[1])


def _unchunk(d: dict[str, Any], s: _Stream, leaf: str) -> Any:
    """flax's chunked array (over 1 GiB) back into one array."""
    try:
        shape_d, chunks_d = d["shape"], d["chunks"]
        shape = [shape_d[str(i)] for i in range(len(shape_d))]
        chunks = [chunks_d[str(i)] for i in range(len(chunks_d))]
        if not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 64:
            raise ValueError("bad shape")
        if not chunks or not all(isinstance(c, np.ndarray) and c.ndim == 1 and c.dtype == chunks[0].dtype
                                 for c in chunks):
            raise ValueError("chunks are not 1-d arrays of one dtype")
        if sum(c.size for c in chunks) != math.prod(shape):
            raise ValueError("chunk sizes do not add up to the shape")
        return np.concatenate(chunks).reshape(shape)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _corrupt(s, f"leaf {leaf}: bad chunked array: {exc}", leaf) from None


class _Replaced(Exception):
    """The file was replaced while it was read: read it again."""


def _read_item(s: _Stream, i: int, key: KeyPath, n: int, prefix: KeyPath | None, record: _Record | None,
               start: int, total: int, on_leaf: Callable[[KeyPath, Any], None]) -> int:
    """The rest of item ``i`` (its leaf's ``n`` bytes): read or skipped, checked against
    the record, decoded, handed to ``on_leaf``. Returns the CRC32C of the file so far."""
    where, name, leaf = s.where, s.name, "/".join(key)
    keep = prefix is None or key[: len(prefix)] == prefix
    direct: bool = True
    raw: Any = None
    if keep:
        direct, raw = _read_leaf(s, n, leaf)
    else:
        s.skip(n, f"leaf {leaf}")
    crc = s.take_crc()
    if record is not None and (i >= len(record.items) or record.items[i] != crc):
        raise ChecksumMismatchError(
            f"{where}: leaf {leaf} (item {i}, bytes {start}-{s.pos}) fails its CRC32C check"
            if i < len(record.items) else f"{where}: more leaves than its checksum record lists",
            path=name, leaf=leaf)
    total = crc32c_combine(total, crc, s.pos - start) if i else crc
    if keep:
        rel = key[len(prefix):] if prefix is not None else key
        if not rel:
            raise InvalidArgumentError(f"{where}: remove_dict_prefix {prefix} names the leaf {leaf}, "
                                       "not a subtree")
        on_leaf(rel, raw if direct else _decode(raw, s, leaf))
    return total


def _read_items(st: Store, name: str, prefix: KeyPath | None,
                on_leaf: Callable[[KeyPath, Any], None]) -> int:
    """Stream the items of ``name``, checking each against its checksum record, and pass
    ``(key path without prefix, leaf)`` to ``on_leaf``; return how many were read."""
    drv = st.driver
    info = drv.info(name)
    where = drv.describe(name)
    try:
        record = _read_record(st, name, info.size, info.generation)
        s = _Stream(drv.iter_read(name), info.size, where, name)
        i = total = 0
        while not s.at_end():
            start = s.pos
            key, n = _item_head(s, i)
            leaf = "/".join(key)
            try:
                total = _read_item(s, i, key, n, prefix, record, start, total, on_leaf)
            except CorruptionError as exc:
                if exc.leaf is None:
                    exc.leaf = leaf
                raise
            i += 1
        if record is not None and i != len(record.items):
            raise ChecksumMismatchError(f"{where}: {i} leaves, its checksum record lists {len(record.items)}",
                                        path=name)
        if info.crc32c is not None and total != info.crc32c:
            raise ChecksumMismatchError(f"{where}: the object's CRC32C does not match its bytes", path=name)
    except CorruptionError:
        try:
            replaced = drv.info(name).generation != info.generation
        except NotFoundError:
            replaced = True
        if replaced:
            raise _Replaced() from None
        raise
    # Object stores are read in ranges: a file replaced meanwhile (by a writer that leaves
    # no checksum record, e.g. fjformer) may have given some of them. Its generation
    # says: the same one from start to end, or read it again. A local file was read
    # through one open descriptor: one version, whatever replaced the name since.
    if drv.capabilities.pinned_reads:
        return i
    try:
        same = drv.info(name).generation == info.generation
    except NotFoundError:
        same = False
    if not same:
        raise _Replaced()
    return i


def load_checkpoint(
    path: str | os.PathLike[str],
    target: PyTree | None = None,
    shard_fns: PyTree | None = None,
    remove_dict_prefix: tuple[str, ...] | list[str] | None = None,
    verbose: bool = False,
    mismatch_allowed: bool = True,
    callback: Callable[[Any, KeyPath], Any] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> PyTree:
    """Read a file in fjformer's streaming format, one leaf at a time.

    Returns what fjformer's ``CheckpointManager.load_checkpoint`` returns: without
    ``target`` the nested dict of the key paths (lists and tuples come back as dicts
    keyed ``"0"``, ``"1"``...); with it, ``flax.serialization.from_state_dict(target,
    state)`` after adding the target's empty dicts the file has no item for.

    Args:
        remove_dict_prefix: only leaves under this key path are read, and the prefix is
            removed from their keys (``("params", "params")``).
        shard_fns: a tree of functions (or None) shaped like the (prefix-stripped) state,
            applied to each leaf as it is read (e.g. to put it on its devices); a leaf
            without one is kept as read, or raises with ``mismatch_allowed=False``.
        callback: called ``callback(leaf, key_path)`` after ``shard_fns``; its result is
            ignored, as fjformer ignores it (fjformer 0.0.91 also fails without one).

    ``path`` is a local path or an ``s3://``/``gs://`` URL (``storage_options`` go to
    fsspec). A file damaged or not in this format raises
    :class:`~atomicstore.CorruptionError` naming it and the leaf
    (:class:`~atomicstore.ChecksumMismatchError` when its checksum record catches it); a
    missing file :class:`~atomicstore.NotFoundError`; a target the checkpoint does not
    fit :class:`~atomicstore.InvalidArgumentError`. An object replaced while it is read is
    read again (a local file is read through one open descriptor: one version); replaced
    three times in a row, :class:`~atomicstore.PreconditionFailedError`.
    """
    prefix = _prefix(remove_dict_prefix)
    _check_bool(verbose, "verbose")
    _check_bool(mismatch_allowed, "mismatch_allowed")
    if callback is not None and not callable(callback):
        raise InvalidArgumentError("callback must be callable(leaf, key_path) or None")
    fl = _flax() if target is not None or shard_fns is not None else None
    fns = _functions(shard_fns, "shard_fns", fl)
    st, name = _locate(path, storage_options, writing=False)
    where = st.driver.describe(name)
    for attempt in range(3):
        tree = _Tree(where, name, fns, mismatch_allowed, callback)
        try:
            n = _read_items(st, name, prefix, tree.add)
            break
        except _Replaced:
            if attempt == 2:  # not damage: a writer replacing it faster than it can be read
                raise PreconditionFailedError(f"{where}: the file was replaced three times while being read "
                                              "(a writer saves it faster than it can be read); load it again") from None
            log.info("%s was replaced while being read: reading it again", where)
    if verbose:
        log.info("loaded %d of %d leaves from %s; %d without a shard function", len(tree.leaves), n, where,
                 tree.missing)
    if target is None:
        return tree.state
    fl = _flax()
    for key, value in _state_dict(target, "target", fl, keep_empty=True).items():
        if value is fl.traverse_util.empty_node and not tree.occupied(key):
            node = tree.state
            for k in key[:-1]:
                node = node.setdefault(k, {})
            node.setdefault(key[-1], {})
    try:
        return fl.serialization.from_state_dict(target, tree.state)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise InvalidArgumentError(f"{where}: the checkpoint does not fit the target: {exc}") from None


class _Tree:
    """The nested state dict built leaf by leaf (fjformer's ``unflatten_dict``), each leaf
    through its shard function and the callback first; a key path stored twice, or both
    as a leaf and as a subtree, is refused."""

    def __init__(self, where: str, name: str, fns: dict[KeyPath, Any] | None, mismatch_allowed: bool,
                 callback: Callable[[Any, KeyPath], Any] | None) -> None:
        self.where, self.name, self.fns, self.mismatch_allowed, self.callback = (
            where, name, fns, mismatch_allowed, callback)
        self.state: dict[str, Any] = {}
        self.leaves: set[KeyPath] = set()
        self.inner: set[KeyPath] = set()
        self.missing = 0

    def occupied(self, key: KeyPath) -> bool:
        return key in self.leaves or key in self.inner or any(key[:j] in self.leaves for j in range(1, len(key)))

    def add(self, key: KeyPath, value: Any) -> None:
        leaf = "/".join(key)
        if self.occupied(key):
            raise CorruptionError(f"{self.where}: leaf {leaf} is stored twice, or both as a leaf and as a subtree",
                                  path=self.name, leaf=leaf)
        if self.fns is not None:
            fn = self.fns.get(key)
            if fn is None:
                if not self.mismatch_allowed:
                    raise InvalidArgumentError(f"{self.where}: shard_fns has no function for leaf {leaf} "
                                               "(mismatch_allowed=False)")
                self.missing += 1
            else:
                value = fn(value)
        if self.callback is not None:
            self.callback(value, key)
        self.leaves.add(key)
        node = self.state
        for j, k in enumerate(key[:-1]):
            self.inner.add(key[: j + 1])
            node = node.setdefault(k, {})
        node[key[-1]] = value


# -- JSON in place of pickle -----------------------------------------------------------------
def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray) or is_jax_array(obj):
        return np.asarray(obj).tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def save_json(obj: Any, path: str | os.PathLike[str], *, overwrite: bool = True,
              storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: what this module writes where fjformer
    pickles (metadata, dataset state). numpy and jax scalars and arrays become numbers and
    lists; anything else JSON cannot hold, or a document larger than :func:`load_json`
    reads (``MAX_RECORD_BYTES``, 64 MiB), raises :class:`~atomicstore.InvalidArgumentError`
    before anything is written."""
    _check_bool(overwrite, "overwrite")
    try:
        data = json.dumps(obj, default=_json_default).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"not JSON-serialisable (atomicstore never pickles): {exc}") from None
    if len(data) > MAX_RECORD_BYTES:
        raise InvalidArgumentError(f"{len(data)} bytes of JSON: at most {MAX_RECORD_BYTES} (the most load_json reads)")
    st, name = _locate(path, storage_options, writing=True)
    st.write_file(name, data, overwrite=overwrite)


def load_json(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> Any:
    """Read a file written by :func:`save_json` (any JSON file of at most 64 MiB)."""
    st, name = _locate(path, storage_options, writing=False)
    where = st.driver.describe(name)
    for _ in range(3):  # (replaced by a larger file between its size and its read: look again)
        size = st.driver.info(name).size
        if size > MAX_RECORD_BYTES:
            raise CorruptionError(f"{where}: {size} bytes of JSON, more than {MAX_RECORD_BYTES}", path=name)
        raw = _read_bounded(st, name, size)
        if raw is not None:
            break
    else:
        raise PreconditionFailedError(f"{where} was replaced three times while being read: load it again")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptionError(f"{where}: not JSON: {exc}", path=name) from None


# -- fjformer's class -----------------------------------------------------------------------------
class CheckpointManager:
    """fjformer's ``CheckpointManager`` (streaming format), with atomic commits and JSON
    where fjformer pickles. Same constructor and methods; ``save_pickle`` is refused
    (use :meth:`save_json`); ``save_all`` writes ``metadata[_<step>].json`` and
    ``dataset[_<step>].json`` instead of ``.pkl`` files. With ``enable=False`` nothing is
    written but every gather function still runs (as in fjformer, whose other processes
    of a multi-host job must join the gathers)."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        enable: bool = True,
        float_dtype: Any = "bf16",
        save_optimizer_state: bool = True,
        verbose: bool = False,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.checkpoint_dir = path_argument(checkpoint_dir, "checkpoint_dir")
        self.enable = _check_bool(enable, "enable")
        _float_dtype(float_dtype)
        self.float_dtype = float_dtype
        self.save_optimizer_state = _check_bool(save_optimizer_state, "save_optimizer_state")
        self.verbose = _check_bool(verbose, "verbose")
        self.storage_options = _check_options(storage_options)

    save_state_to_file = staticmethod(save_state_to_file)
    load_checkpoint = staticmethod(load_checkpoint)

    def _path(self, filename: str | os.PathLike[str]) -> str:
        f = path_argument(filename, "filename")
        d = self.checkpoint_dir
        return os.path.join(d, f) if is_local(d) else f"{d.rstrip('/')}/{f}"

    def save_checkpoint(self, state: PyTree, filename: str | os.PathLike[str], gather_fns: PyTree | None = None,
                        mismatch_allowed: bool = True) -> None:
        """Save ``state`` to ``<checkpoint_dir>/<filename>`` with the manager's
        ``float_dtype``, atomically (nothing is written when disabled)."""
        path = self._path(filename) if self.enable else os.devnull
        save_state_to_file(state, path, gather_fns, self.float_dtype, self.verbose, mismatch_allowed,
                           storage_options=self.storage_options)

    def save_json(self, obj: Any, filename: str | os.PathLike[str]) -> None:
        """Write ``obj`` as JSON to ``<checkpoint_dir>/<filename>`` (see :func:`save_json`)."""
        if self.enable:
            save_json(obj, self._path(filename), storage_options=self.storage_options)

    def save_pickle(self, obj: Any, filename: str | os.PathLike[str]) -> None:
        """Refused: atomicstore never pickles (a pickle runs code when it is loaded)."""
        raise InvalidArgumentError("atomicstore never pickles: use save_json (JSON-serialisable objects)")

    def save_all(self, state: PyTree, gather_fns: PyTree, metadata: Any = None, dataset: Any = None,
                 milestone: bool = False) -> None:
        """fjformer's ``save_all``: metadata, dataset state and the train state (or only
        ``state.params["params"]`` without ``save_optimizer_state``), as
        ``<name>_<step>`` for a milestone or ``<name>`` otherwise; JSON in place of pickle."""
        _check_bool(milestone, "milestone")
        try:
            step = int(np.asarray(state.step))
            if self.save_optimizer_state:
                ckpt_state, ckpt_name, ckpt_gather = state, "streaming_state", gather_fns
            else:
                ckpt_state, ckpt_name = state.params["params"], "streaming_params"
                ckpt_gather = gather_fns.params["params"] if gather_fns is not None else None
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"save_all needs a train state with .step and .params['params']: {exc}") from None
        suffix = f"_{step}" if milestone else ""
        for what, obj in (("metadata", metadata), ("dataset", dataset)):  # (validated before anything is written)
            try:
                json.dumps(obj, default=_json_default)
            except (TypeError, ValueError, RecursionError) as exc:
                raise InvalidArgumentError(f"{what} is not JSON-serialisable (atomicstore never pickles): {exc}") \
                    from None
        self.save_json(metadata, f"metadata{suffix}.json")
        self.save_json(dataset, f"dataset{suffix}.json")
        self.save_checkpoint(ckpt_state, f"{ckpt_name}{suffix}", ckpt_gather)


__all__ = [
    "FLOAT_DTYPE_NAMES",
    "RECORD_FORMAT",
    "CheckpointManager",
    "load_checkpoint",
    "load_json",
    "save_json",
    "save_state_to_file",
]
