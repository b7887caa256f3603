"""save/restore of pytrees on top of the commit layer.

A checkpoint (native layout) is one transaction with three files:

* ``state.msgpack``: the state in flax's msgpack checkpoint format (flax's
  ``msgpack_restore`` reads it as is);
* ``index.msgpack``: every container and leaf with its key path, kind, dtype, shape,
  byte range in ``state.msgpack`` and CRC32C, so one leaf or subtree can be read without
  touching the rest, and corruption is reported per leaf;
* ``manifest.json``: the commit layer's manifest (sizes and CRC32C of both files).

``docs/format.md`` specifies both files.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import google_crc32c
import msgpack
import numpy as np

from ..commit import Manifest, Store, open_store
from ..commit.manifest import crc32c, crc32c_slices
from ..commit.store import Checkpoint
from ..errors import (
    AtomicStoreError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
)
from . import msgpack_io as mp
from .dtypes import parse_dtype
from .tree import Path, children, is_jax_array, path_str, rebuild, walk_leaves

log = logging.getLogger("atomicstore.pytree")

STATE_FILE = "state.msgpack"
INDEX_FILE = "index.msgpack"
INDEX_FORMAT = "atomicstore.pytree/1"
#: flax splits arrays larger than this into chunks (its msgpack bin limit is 2**31 - 1)
FLAX_MAX_CHUNK = 2**30
#: leaves smaller than this are read in coalesced batches
SMALL_LEAF = 1 << 20
BATCH_BYTES = 8 << 20

EXT_NDARRAY, EXT_COMPLEX, EXT_NPSCALAR = 1, 2, 3
Selector = str | Sequence[Any] | None


# -- saving --------------------------------------------------------------------------------
class _Emitter:
    """Appends msgpack bytes to a transaction file: small pieces buffered, array data
    written straight from its buffer with its CRC32C already known."""

    def __init__(self, f: Any, progress: Callable[[int], None] | None) -> None:
        self.f, self.buf, self.flushed, self.progress = f, bytearray(), 0, progress
        self.pack = msgpack.Packer(use_bin_type=True, strict_types=True).pack

    @property
    def offset(self) -> int:
        """Bytes emitted so far (flushed + buffered)."""
        return self.flushed + len(self.buf)

    def small(self, b: bytes) -> None:
        self.buf += b
        if len(self.buf) >= SMALL_LEAF:
            self.flush()

    def big(self, mv: memoryview, crc: int) -> None:
        self.flush()
        self.f.write(mv, crc32c=crc)
        self.flushed += mv.nbytes
        if self.progress:
            self.progress(self.flushed)

    def flush(self) -> None:
        if self.buf:
            self.f.write(self.buf)
            self.flushed += len(self.buf)
            self.buf = bytearray()


@dataclass
class _SaveOptions:
    cast_dtype: Any
    gather: Callable[[Path, Any], Any] | None
    sort_keys: bool = True


def _as_fn(fns: Any, what: str) -> Callable[[Path, Any], Any] | None:
    """A per-leaf function from a callable(path, leaf) or a mapping path-string -> fn."""
    if fns is None:
        return None
    if callable(fns):
        return fns
    if isinstance(fns, Mapping):
        table = dict(fns)

        def apply(path: Path, leaf: Any) -> Any:
            fn = table.get(path_str(path), table.get(path))  # type: ignore[call-overload]
            return fn(leaf) if fn is not None else leaf

        return apply
    raise InvalidArgumentError(f"{what} must be a callable(path, leaf) or a mapping of key path to callable")


def _to_numpy(path: Path, x: Any, opts: _SaveOptions) -> Any:
    if type(x) is np.ndarray and opts.gather is None and opts.cast_dtype is None:
        return x
    if opts.gather is not None:
        x = opts.gather(path, x)
    if is_jax_array(x):
        if not getattr(x, "is_fully_addressable", True):
            raise InvalidArgumentError(
                f"leaf {path_str(path)} is a jax.Array sharded across processes; "
                "save it with the multi-process path"
            )
        x = np.asarray(x)
    if opts.cast_dtype is not None and isinstance(x, np.ndarray | np.generic) and np.issubdtype(x.dtype, np.floating):
        x = np.asarray(x).astype(opts.cast_dtype) if isinstance(x, np.ndarray) else x.astype(opts.cast_dtype)
    return x


_HEADS: dict[tuple[Any, tuple[int, ...], int], tuple[bytes, str]] = {}


def _array_head(arr: np.ndarray, code: int) -> tuple[bytes, str]:
    """(ext header + ndarray tuple header up to the data, dtype name), cached per dtype
    and shape: leaves of one model share a handful of them."""
    key = (arr.dtype, arr.shape, code)
    hit = _HEADS.get(key)
    if hit is None:
        name = arr.dtype.name
        head = mp.array_header(3) + mp.pack(list(arr.shape)) + mp.pack(name) + mp.bin_header(arr.nbytes)
        hit = (mp.ext_header(code, len(head) + arr.nbytes) + head, name)
        if len(_HEADS) < 4096:
            _HEADS[key] = hit
    return hit


def _ndarray_ext(em: _Emitter, arr: np.ndarray, code: int) -> tuple[int, int, int, str]:
    """Write ``arr`` as flax's ndarray ext; return (data offset, nbytes, crc32c, dtype name)."""
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)  # (keeps 0-d arrays 0-d, unlike calling it always)
    head, name = _array_head(arr, code)
    em.small(head)
    off = em.offset
    if arr.nbytes < 65536:
        raw = arr.tobytes()
        em.small(raw)
        return off, len(raw), google_crc32c.value(raw), name
    data = _bytes_view(arr)
    crc = crc32c(data)
    em.big(data, crc)
    return off, arr.nbytes, crc, name


def _bytes_view(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (ml_dtypes arrays included,
    which do not export the buffer protocol themselves)."""
    if not arr.nbytes:
        return memoryview(bytearray())
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _check_array(path: Path, arr: np.ndarray) -> None:
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise InvalidArgumentError(f"leaf {path_str(path)}: object and structured dtypes cannot be saved ({arr.dtype})")


def _write_node(em: _Emitter, node: Any, path: Path, index: list, opts: _SaveOptions, depth: int) -> None:
    if depth > mp.MAX_DEPTH:
        raise InvalidArgumentError(f"tree deeper than {mp.MAX_DEPTH} levels at {path_str(path)}")
    kids = children(node, opts.sort_keys)
    if kids is not None and kids[0] != "none":
        kind, items = kids
        keys = set()
        for k, _ in items:
            if not isinstance(k, str | int | bytes):
                raise InvalidArgumentError(f"key {k!r} under {path_str(path)} must be str, int or bytes")
            sk = k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k)
            if sk in keys:
                raise InvalidArgumentError(f"keys under {path_str(path)} collide as strings: {sk!r}")
            keys.add(sk)
        index.append([0, list(path), kind])
        em.small(mp.map_header(len(items)))
        plain = opts.gather is None and opts.cast_dtype is None
        lpath = list(path)
        pack, crc_of, heads, ndarray = em.pack, google_crc32c.value, _HEADS, np.ndarray
        for k, child in items:
            kb = pack(k if type(k) is str else k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k))
            if plain and type(child) is ndarray and child.nbytes < 65536 and child.flags.c_contiguous \
                    and not child.dtype.hasobject and child.dtype.fields is None:
                # the common case of many small arrays, inlined: straight into the buffer
                hit = heads.get((child.dtype, child.shape, EXT_NDARRAY)) or _array_head(child, EXT_NDARRAY)
                raw = child.tobytes()
                buf = em.buf
                buf += kb
                buf += hit[0]
                off = em.flushed + len(buf)
                buf += raw
                index.append([1, [*lpath, k], "nd", hit[1], list(child.shape), off, len(raw), crc_of(raw)])
                if len(buf) >= SMALL_LEAF:
                    em.flush()
                continue
            em.small(kb)
            _write_node(em, child, (*path, k), index, opts, depth + 1)
        return
    if node is None:
        index.append([0, list(path), "none"])
        em.small(b"\xc0")
        return
    x = _to_numpy(path, node, opts)
    if isinstance(x, np.ndarray):
        _check_array(path, x)
        if x.nbytes > FLAX_MAX_CHUNK:
            _write_chunked(em, x, path, index)
            return
        off, n, crc, name = _ndarray_ext(em, x, EXT_NDARRAY)
        index.append([1, list(path), "nd", name, list(x.shape), off, n, crc])
    elif isinstance(x, np.generic):
        arr = np.asarray(x)
        _check_array(path, arr)
        off, n, crc, name = _ndarray_ext(em, arr, EXT_NPSCALAR)
        index.append([1, list(path), "sc", name, [], off, n, crc])
    elif isinstance(x, complex):
        payload = msgpack.packb((x.real, x.imag))  # as flax packs it
        blob = mp.ext_header(EXT_COMPLEX, len(payload)) + payload
        index.append([1, list(path), "py", None, None, em.offset, len(blob), crc32c(blob)])
        em.small(blob)
    elif isinstance(x, bool | int | float | str | bytes):
        try:
            blob = mp.pack(x)
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"leaf {path_str(path)} cannot be encoded: {exc}") from None
        index.append([1, list(path), "py", None, None, em.offset, len(blob), crc32c(blob)])
        em.small(blob)
    else:
        raise InvalidArgumentError(
            f"leaf {path_str(path)} has unsupported type {type(node).__name__}: use arrays, numbers, "
            "str, bytes, None, or containers registered as jax pytree nodes"
        )


def _write_chunked(em: _Emitter, arr: np.ndarray, path: Path, index: list) -> None:
    """flax's chunked-array convention for arrays over 1 GiB."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    per = max(1, FLAX_MAX_CHUNK // arr.dtype.itemsize)
    starts = list(range(0, flat.size, per))
    em.small(mp.map_header(3) + mp.pack("__msgpack_chunked_array__") + mp.pack(True) + mp.pack("shape"))
    em.small(mp.map_header(arr.ndim) + b"".join(mp.pack(str(i)) + mp.pack(d) for i, d in enumerate(arr.shape)))
    em.small(mp.pack("chunks") + mp.map_header(len(starts)))
    chunks = []
    for i, s in enumerate(starts):
        em.small(mp.pack(str(i)))
        off, n, crc, _ = _ndarray_ext(em, flat[s : s + per], EXT_NDARRAY)
        chunks.append([off, n, crc])
    index.append([1, list(path), "ndc", arr.dtype.name, list(arr.shape), chunks])


def split_url(url_or_path: str | os.PathLike[str]) -> tuple[str, str]:
    """(store root, checkpoint name) of ``<root>/<name>``."""
    s = os.fspath(url_or_path) if isinstance(url_or_path, os.PathLike) else url_or_path
    if not isinstance(s, str) or not s.strip():
        raise InvalidArgumentError("expected a checkpoint path or URL '<store>/<name>'")
    s = s.rstrip("/")
    root, _, name = s.rpartition("/")
    if not root or not name or root.endswith(":/"):
        raise InvalidArgumentError(f"{s!r} does not name a checkpoint inside a store ('<store>/<name>')")
    return root, name


def _progress_printer(total: int) -> Callable[[int], None]:
    start = time.monotonic()
    tty = sys.stderr.isatty()

    def show(done: int) -> None:
        if tty:
            rate = done / max(1e-9, time.monotonic() - start) / 2**20
            print(f"\rsaving {done / 2**20:,.0f}/{total / 2**20:,.0f} MiB ({rate:,.0f} MiB/s)", end="", file=sys.stderr)

    return show


def save(
    url_or_path: str | os.PathLike[str],
    tree: Any,
    *,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    cast_dtype: Any = None,
    gather_fns: Any = None,
    progress: bool | Callable[[int], None] = False,
    store: Store | None = None,
    **storage_options: Any,
) -> Manifest:
    """Save ``tree`` atomically as checkpoint ``<store>/<name>``.

    Leaves are streamed one after another straight from their buffers: no bytes object of
    the whole state and no second copy of it exist; extra memory is one write buffer plus
    a device-to-host copy of one ``jax.Array`` leaf at a time.

    Args:
        url_or_path: ``<store root>/<checkpoint name>`` (local path or URL).
        tree: a pytree of arrays (numpy, ml_dtypes, fully addressable jax), Python
            scalars, str, bytes, None, in dicts/lists/tuples/namedtuples/registered nodes.
        overwrite: replace an existing checkpoint of that name atomically.
        metadata: JSON metadata stored in the manifest.
        cast_dtype: cast floating-point leaves to this dtype (e.g. ``"bfloat16"``).
        gather_fns: per-leaf function(s) applied before writing: a callable
            ``(path, leaf) -> leaf`` or a mapping ``"a/b/c" -> fn(leaf)``.
        progress: True for a progress line on stderr (when it is a terminal), or a
            callable receiving the bytes written so far.
        store: an already opened :class:`Store` whose root is ``<store root>``.
        **storage_options: passed to :func:`open_store`.
    """
    root, name = split_url(url_or_path)
    writer = StateWriter(tree, cast_dtype=cast_dtype, gather_fns=gather_fns, progress=progress)
    st = store or open_store(root, **storage_options)
    with st.transaction(name, metadata=metadata, overwrite=overwrite) as txn:
        with txn.open(STATE_FILE) as f:
            state_size = writer.write(f)
        str_keys = all(type(k) is str for node in writer.index for k in node[1])
        doc = {"format": INDEX_FORMAT, "state_size": state_size, "str_keys": str_keys, "nodes": writer.index}
        txn.write_bytes(INDEX_FILE, msgpack.packb(doc, use_bin_type=True))
    writer.done()
    assert txn.manifest is not None  # the with block committed
    return txn.manifest


class StateWriter:
    """Streams ``tree`` in flax's msgpack format into a file-like object with
    ``write(data, crc32c=None)``, recording the index as it goes. Arguments as for
    :func:`save`; validated here, before anything is written. ``sort_keys=False`` keeps
    dicts in insertion order, byte-identical to flax's ``to_bytes``/``save_checkpoint``
    (the default matches ``msgpack_serialize``, which sorts them like jax)."""

    def __init__(self, tree: Any, *, cast_dtype: Any = None, gather_fns: Any = None,
                 progress: bool | Callable[[int], None] = False, sort_keys: bool = True) -> None:
        if cast_dtype is not None:
            try:
                cast_dtype = np.dtype(cast_dtype)
            except TypeError as exc:
                raise InvalidArgumentError(f"cast_dtype: {exc}") from None
        self.tree = tree
        self.opts = _SaveOptions(cast_dtype, _as_fn(gather_fns, "gather_fns"), sort_keys)
        self.index: list = []
        self.show: Callable[[int], None] | None = None
        self._printer = False
        if callable(progress):
            self.show = progress
        elif progress:
            total = sum(getattr(leaf, "nbytes", 0) for _, leaf in walk_leaves(tree))
            self.show, self._printer = _progress_printer(total), True

    def write(self, f: Any) -> int:
        """Write the state; return its size in bytes."""
        em = _Emitter(f, self.show)
        _write_node(em, self.tree, (), self.index, self.opts, 0)
        em.flush()
        return em.offset

    def done(self) -> None:
        if self._printer and sys.stderr.isatty():
            print(file=sys.stderr)


# -- the index -------------------------------------------------------------------------------
class Leaf:
    """Where one leaf is and what it is.

    ``kind``: "nd" array, "sc" numpy scalar, "ndc" chunked array, "py" msgpack value,
    "lit" a literal already decoded (legacy files). ``ranges``: (offset, length, CRC32C or
    None) in the state file.
    """

    __slots__ = ("path", "kind", "dtype", "shape", "ranges", "value", "nbytes")

    def __init__(self, path: Path, kind: str, dtype: np.dtype | None, shape: tuple[int, ...],
                 ranges: list[tuple[int, int, int | None]], value: Any = None) -> None:
        self.path, self.kind, self.dtype, self.shape, self.ranges, self.value = path, kind, dtype, shape, ranges, value
        self.nbytes = ranges[0][1] if len(ranges) == 1 else sum(r[1] for r in ranges)


@dataclass
class Index:
    containers: dict[Path, str]
    leaves: dict[Path, Leaf]
    order: list[tuple[int, Path]]


def _shape(shape: Any, where: str) -> tuple[int, ...]:
    if type(shape) is not list and type(shape) is not tuple or len(shape) > 64:
        raise CorruptionError(f"{where}: invalid shape {shape!r}", leaf=where)
    for d in shape:
        if type(d) is not int or not 0 <= d < 2**62:
            raise CorruptionError(f"{where}: invalid shape {shape!r}", leaf=where)
    return tuple(shape)


def _path(raw: Any, where: str) -> Path:
    if type(raw) is not list or len(raw) > mp.MAX_DEPTH:
        raise CorruptionError(f"{where}: invalid key path", path=INDEX_FILE)
    for k in raw:
        if type(k) is not str and type(k) is not int and type(k) is not bytes:
            raise CorruptionError(f"{where}: invalid key path", path=INDEX_FILE)
    return tuple(raw)


def parse_index(raw: bytes, state_size: int, where: str) -> Index:
    """Validate ``index.msgpack`` (hostile input) against the state file's size."""
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_ext_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise CorruptionError(f"{where}: unreadable index ({exc})", path=INDEX_FILE) from None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or not isinstance(doc.get("nodes"), list):
        raise CorruptionError(f"{where}: not an {INDEX_FORMAT} index", path=INDEX_FILE)
    if doc.get("state_size") != state_size:
        raise CorruptionError(f"{where}: index describes a state of {doc.get('state_size')} bytes, "
                              f"the state file has {state_size}", path=INDEX_FILE)
    idx = Index({}, {}, [])
    for node in doc["nodes"]:
        try:
            if not isinstance(node, list) or not node:
                raise TypeError("node is not a list")
            if node[0] == 0:
                _, rawpath, kind = node
                p = _path(rawpath, where)
                if kind not in ("dict", "list", "tuple", "none"):
                    raise TypeError(f"container kind {kind!r}")
                idx.containers[p] = kind
                idx.order.append((0, p))
                continue
            p = _path(node[1], where)
            kind = node[2]
            if kind in ("nd", "sc", "py"):
                _, _, _, dtn, shp, off, n, crc = node
                ranges = [(off, n, crc)]
                dt = parse_dtype(dtn, path=INDEX_FILE, leaf=p, where=where) if kind != "py" else None
                shape = _shape(shp, where) if kind != "py" else ()
            elif kind == "ndc":
                _, _, _, dtn, shp, chunks = node
                dt, shape = parse_dtype(dtn, path=INDEX_FILE, leaf=p, where=where), _shape(shp, where)
                if not isinstance(chunks, list):
                    raise TypeError("chunks is not a list")
                ranges = [tuple(c) for c in chunks]  # type: ignore[misc]
            else:
                raise TypeError(f"leaf kind {kind!r}")
            for r in ranges:
                if len(r) != 3 or type(r[0]) is not int or type(r[1]) is not int or type(r[2]) is not int:
                    raise TypeError(f"bad byte range at {path_str(p)}")
                off, n, crc = r
                if off < 0 or n < 0 or off + n > state_size or not 0 <= crc < 2**32:
                    leaf_where = f"{where} leaf {path_str(p)}"
                    raise CorruptionError(f"{leaf_where}: byte range [{off}, {off + n}) outside the "
                                          f"{state_size}-byte state file", path=STATE_FILE, leaf=path_str(p))
            leaf = Leaf(p, kind, dt, shape, list(ranges))  # type: ignore[arg-type]
            if dt is not None and math.prod(shape) * dt.itemsize != leaf.nbytes:
                raise CorruptionError(f"{where} leaf {path_str(p)}: shape {shape} of {dt} does not match "
                                      f"{leaf.nbytes} bytes", path=STATE_FILE, leaf=path_str(p))
            idx.leaves[p] = leaf
            idx.order.append((1, p))
        except CorruptionError:
            raise
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            raise CorruptionError(f"{where}: malformed index node ({exc!r})", path=INDEX_FILE) from None
    _check_structure(idx, where)
    return idx


def _check_structure(idx: Index, where: str) -> None:
    """Every node but the root hangs from a declared dict/list/tuple (list and tuple
    children by integer position), and no path is declared twice."""
    seen: set[Path] = set()
    for _, p in idx.order:
        if p in seen:
            raise CorruptionError(f"{where}: {path_str(p)!r} is declared twice", path=INDEX_FILE,
                                  leaf=path_str(p))
        seen.add(p)
        if not p:
            continue
        parent = idx.containers.get(p[:-1])
        if parent in (None, "none") or (parent in ("list", "tuple") and type(p[-1]) is not int):
            raise CorruptionError(f"{where}: {path_str(p)!r} has no container to hang from",
                                  path=INDEX_FILE, leaf=path_str(p))


def index_of_msgpack(read: Callable[[int, int], bytes], size: int, where: str) -> Index:
    """Build an index by scanning a msgpack state file (a flax checkpoint has none)."""
    src = mp.Source(read, size)
    try:
        value, end = mp.scan(src)
    except RecursionError:
        raise CorruptionError(f"{where}: nesting too deep", path=where) from None
    except CorruptionError as exc:
        raise CorruptionError(f"{where}: {exc}", path=where) from None
    if end != size:
        raise CorruptionError(f"{where}: {size - end} trailing bytes after the state", path=where)
    idx = Index({}, {}, [])

    def ndarray_leaf(p: Path, span: mp.Span, kind: str) -> Leaf:
        sub = mp.Source(lambda a, b: read(span.start + a, span.start + b), span.end - span.start)
        try:
            val, _ = mp.scan(sub)
        except CorruptionError as exc:
            raise CorruptionError(f"{where} leaf {path_str(p)}: {exc}", path=where, leaf=path_str(p)) from None
        if not (isinstance(val, list) and len(val) == 3):
            raise CorruptionError(f"{where} leaf {path_str(p)}: malformed ndarray", path=where, leaf=path_str(p))
        shape, dtn, data = val
        lw = f"{where} leaf {path_str(p)}"
        dt, shp = parse_dtype(dtn, path=where, leaf=p), _shape(shape, lw)
        if isinstance(data, mp.Span):
            rng = (span.start + data.start, data.end - data.start, None)
        elif isinstance(data, bytes):
            rng = (span.start + span.end - span.start - len(data), len(data), None)
        else:
            raise CorruptionError(f"{lw}: array data is not bytes", path=where, leaf=path_str(p))
        leaf = Leaf(p, kind, dt, shp, [rng])
        if math.prod(shp) * dt.itemsize != leaf.nbytes:
            raise CorruptionError(f"{lw}: shape {shp} of {dt} does not match {leaf.nbytes} bytes",
                                  path=where, leaf=path_str(p))
        return leaf

    def visit(v: Any, p: Path) -> None:
        if isinstance(v, dict) and v.get("__msgpack_chunked_array__") is True:
            try:
                shape = tuple(v["shape"][str(i)] for i in range(len(v["shape"])))
                parts = [v["chunks"][str(i)] for i in range(len(v["chunks"]))]
            except (KeyError, TypeError):
                raise CorruptionError(f"{where} leaf {path_str(p)}: malformed chunked array",
                                      path=where, leaf=path_str(p)) from None
            leaves = [ndarray_leaf(p, c.payload, "nd") for c in parts if isinstance(c, mp.ExtLeaf)]
            if len(leaves) != len(parts) or not leaves:
                raise CorruptionError(f"{where} leaf {path_str(p)}: malformed chunked array", path=where)
            dt = leaves[0].dtype
            leaf = Leaf(p, "ndc", dt, _shape(list(shape), where), [r for lf in leaves for r in lf.ranges])
            assert dt is not None
            if math.prod(leaf.shape) * dt.itemsize != leaf.nbytes:
                raise CorruptionError(f"{where} leaf {path_str(p)}: chunks do not add up", path=where)
            idx.leaves[p] = leaf
            idx.order.append((1, p))
        elif isinstance(v, dict):
            idx.containers[p] = "dict"
            idx.order.append((0, p))
            for k, child in v.items():
                visit(child, (*p, k))
        elif v is None:
            idx.containers[p] = "none"
            idx.order.append((0, p))
        elif isinstance(v, mp.ExtLeaf):
            if v.code in (EXT_NDARRAY, EXT_NPSCALAR):
                idx.leaves[p] = ndarray_leaf(p, v.payload, "nd" if v.code == EXT_NDARRAY else "sc")
            elif v.code == EXT_COMPLEX:
                try:
                    pair = msgpack.unpackb(read(v.payload.start, v.payload.end))
                    if not (isinstance(pair, list) and len(pair) == 2):
                        raise ValueError("not a pair")
                    value = complex(pair[0], pair[1])
                except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
                    raise CorruptionError(f"{where} leaf {path_str(p)}: malformed complex ({exc})", path=where,
                                          leaf=path_str(p)) from None
                idx.leaves[p] = Leaf(p, "lit", None, (), [], value)
            else:
                raise CorruptionError(f"{where} leaf {path_str(p)}: unknown ext type {v.code}", path=where)
            idx.order.append((1, p))
        elif isinstance(v, list):
            raise CorruptionError(f"{where} at {path_str(p)}: arrays are not part of flax's format", path=where)
        else:
            if isinstance(v, mp.Span):
                v = read(v.start, v.end)
            idx.leaves[p] = Leaf(p, "lit", None, (), [], v)
            idx.order.append((1, p))

    visit(value, ())
    return idx


# -- restoring -------------------------------------------------------------------------------
def _select(sel: Selector) -> Path | None:
    if sel is None:
        return None
    if isinstance(sel, str):
        return tuple(p for p in sel.split("/") if p)
    if isinstance(sel, Sequence):
        return tuple(sel)
    raise InvalidArgumentError("subtree must be a 'a/b' string or a sequence of keys")


def _match(path: Path, want: Path) -> bool:
    """Does ``path`` (from the file) equal ``want`` (from the caller), comparing keys as
    strings where the file's types differ (flax writes every key as a string)?"""
    if len(path) != len(want):
        return False
    return all(a == b or str(a) == str(b) for a, b in zip(path, want, strict=True))


class _Reader:
    """Reads selected leaves of one state file, in parallel, into fresh arrays."""

    def __init__(self, read_into: Callable[[int, memoryview], None], where: str, threads: int) -> None:
        self.read_into, self.where, self.threads = read_into, where, threads

    def _check(self, leaf: Leaf, data: memoryview, crc: int | None, part: int) -> None:
        if crc is not None and crc32c(data) != crc:
            raise CorruptionError(
                f"{self.where}: leaf {path_str(leaf.path)}"
                + (f" (chunk {part})" if leaf.kind == "ndc" else "")
                + " fails its CRC32C check",
                path=STATE_FILE,
                leaf=path_str(leaf.path),
            )

    def _fetch(self, off: int, mv: memoryview, leaf: Leaf) -> None:
        try:
            self.read_into(off, mv)
        except CorruptionError as exc:
            raise CorruptionError(f"{self.where}: leaf {path_str(leaf.path)}: {exc}",
                                  path=STATE_FILE, leaf=path_str(leaf.path)) from None

    def read(self, leaves: list[Leaf]) -> dict[Path, Any]:
        out: dict[Path, Any] = {}
        jobs: list[Callable[[], None]] = []
        batch: list[Leaf] = []

        def run_batch(group: list[Leaf]) -> Callable[[], None]:
            start = group[0].ranges[0][0]
            end = max(r[0] + r[1] for lf in group for r in lf.ranges)

            def job() -> None:
                buf = bytearray(end - start)
                try:
                    self.read_into(start, memoryview(buf))
                except CorruptionError:
                    for lf in group:  # find the leaf the damage is in
                        off, n, _ = lf.ranges[0]
                        self._fetch(off, memoryview(buf)[off - start : off - start + n], lf)
                    raise
                spans = [(lf.ranges[0][0] - start, lf.ranges[0][1]) for lf in group]
                crcs = crc32c_slices(buf, spans)
                base = np.frombuffer(buf, dtype=np.uint8)
                for lf, (rel, n), got in zip(group, spans, crcs, strict=True):
                    want = lf.ranges[0][2]
                    if want is not None and got != want:
                        self._check(lf, memoryview(buf)[rel : rel + n], want, 0)
                    if lf.kind == "py":
                        out[lf.path] = self._decode(lf, memoryview(buf)[rel : rel + n])
                        continue
                    assert lf.dtype is not None
                    arr = base[rel : rel + n].view(lf.dtype).reshape(lf.shape)
                    if not arr.flags.aligned:
                        arr = arr.copy()
                    out[lf.path] = arr[()] if lf.kind == "sc" else arr

            return job

        def big(lf: Leaf) -> Callable[[], None]:
            def job() -> None:
                assert lf.dtype is not None
                arr = np.empty(lf.shape, lf.dtype)
                flat = _bytes_view(arr)
                pos = 0
                for i, (off, n, crc) in enumerate(lf.ranges):
                    self._fetch(off, flat[pos : pos + n], lf)
                    self._check(lf, flat[pos : pos + n], crc, i)
                    pos += n
                out[lf.path] = arr[()] if lf.kind == "sc" else arr

            return job

        for lf in sorted(leaves, key=lambda lf: lf.ranges[0][0] if lf.ranges else -1):
            if lf.kind == "lit":
                out[lf.path] = lf.value
            elif lf.kind in ("nd", "ndc") and lf.nbytes >= SMALL_LEAF:
                jobs.append(big(lf))
            else:
                if batch and (lf.ranges[0][0] - (batch[-1].ranges[0][0] + batch[-1].ranges[0][1]) > 65536
                              or lf.ranges[0][0] + lf.ranges[0][1] - batch[0].ranges[0][0] > BATCH_BYTES):
                    jobs.append(run_batch(batch))
                    batch = []
                batch.append(lf)
        if batch:
            jobs.append(run_batch(batch))
        if len(jobs) <= 1 or self.threads <= 1:
            for j in jobs:
                j()
        else:
            with concurrent.futures.ThreadPoolExecutor(min(self.threads, len(jobs))) as pool:
                for fut in [pool.submit(j) for j in jobs]:
                    fut.result()
        return out

    def _decode(self, lf: Leaf, view: memoryview) -> Any:
        if lf.kind == "py":
            try:
                return msgpack.unpackb(bytes(view), raw=False, ext_hook=_complex_hook, max_bin_len=view.nbytes)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, TypeError) as exc:
                raise CorruptionError(f"{self.where}: leaf {path_str(lf.path)} cannot be decoded ({exc})",
                                      path=STATE_FILE, leaf=path_str(lf.path)) from None
        assert lf.dtype is not None
        arr = np.frombuffer(view, dtype=lf.dtype).reshape(lf.shape).copy()
        return arr[()] if lf.kind == "sc" else arr


def _complex_hook(code: int, data: bytes) -> Any:
    if code == EXT_COMPLEX:
        pair = msgpack.unpackb(data)
        return complex(pair[0], pair[1])
    raise ValueError(f"unexpected ext type {code}")


def _build(idx: Index, values: dict[Path, Any], root: Path) -> Any:
    """Plain containers (dict/list/tuple) from the index, below ``root``."""
    n = len(root)
    made: dict[Path, Any] = {}
    kinds: dict[Path, str] = {}
    result: Any = None
    for is_leaf, p in idx.order:
        if p[:n] != root:
            continue
        if is_leaf:
            v = values[p]
        else:
            kind = idx.containers[p]
            v = None if kind == "none" else {}
            if kind != "none":
                made[p] = v
                kinds[p] = kind
        if p == root:
            result = v
        else:
            parent = made.get(p[:-1])
            if parent is not None:
                parent[p[-1]] = v
    # lists and tuples were collected as dicts keyed by position
    for p in sorted(made, key=len, reverse=True):
        kind = kinds[p]
        if kind in ("list", "tuple"):
            d = made[p]
            seq = [d[k] for k in sorted(d, key=lambda k: int(k))]
            conv: Any = seq if kind == "list" else tuple(seq)
            if p == root:
                result = conv
            else:
                made[p[:-1]][p[-1]] = conv
    return result


#: states up to this size may be restored by one verified read and msgpack's C decoder
FAST_RESTORE_BYTES = 64 << 20
_NO_FAST_PATH = object()


def _fast_ext(code: int, data: bytes) -> Any:
    if code == EXT_COMPLEX:
        pair = msgpack.unpackb(data)
        return complex(pair[0], pair[1])
    shape, name, buf = msgpack.unpackb(data, raw=False)
    dt = parse_dtype(name, path=STATE_FILE, leaf="?")  # any error: the indexed path names the leaf
    arr = np.frombuffer(buf, dtype=dt).reshape(shape).copy()
    return arr[()] if code == EXT_NPSCALAR else arr


def _restore_whole(ckpt: Checkpoint, raw_index: bytes, state_size: int) -> Any:
    """Small states of many leaves: read the whole state once (its CRC32C checked against
    the manifest), decode it with msgpack's C decoder as flax does, then give lists and
    tuples back their type from the index. Anything unexpected falls back to the indexed
    path, which names the damaged leaf."""
    try:
        doc = msgpack.unpackb(raw_index, raw=False, strict_map_key=False, max_ext_len=0)
        if not (isinstance(doc, dict) and doc.get("format") == INDEX_FORMAT and doc.get("str_keys") is True
                and doc.get("state_size") == state_size and isinstance(doc.get("nodes"), list)):
            return _NO_FAST_PATH
        shaped = [(n[1], n[2]) for n in doc["nodes"] if n[0] == 0 and n[2] in ("list", "tuple")]
        value = msgpack.unpackb(ckpt.read_bytes(STATE_FILE), raw=False, strict_map_key=False,
                                ext_hook=_fast_ext)
        for path, kind in sorted(shaped, key=lambda pk: len(pk[0]), reverse=True):
            parent, node = None, value
            for k in path:
                parent, node = node, node[k]
            seq = [node[str(i)] for i in range(len(node))]
            conv = seq if kind == "list" else tuple(seq)
            if parent is None:
                value = conv
            else:
                parent[path[-1]] = conv
        return value
    except (AtomicStoreError, ValueError, TypeError, KeyError, IndexError, msgpack.ExtraData,
            msgpack.FormatError, msgpack.StackError):
        return _NO_FAST_PATH


def _open_checkpoint(url_or_path: Any, store: Store | None, storage_options: dict) -> tuple[Checkpoint | None, Any]:
    root, name = split_url(url_or_path)
    st = store or open_store(root, **storage_options)
    try:
        return st.open(name), st
    except NotFoundError:
        # not one of ours: maybe a legacy flax checkpoint file
        if st.driver.exists(name):
            return None, (st, name)
        raise


def restore(
    url_or_path: str | os.PathLike[str],
    target: Any = None,
    *,
    subtree: Selector = None,
    allow_missing: bool = False,
    shard_fns: Any = None,
    threads: int = 8,
    store: Store | None = None,
    **storage_options: Any,
) -> Any:
    """Restore the checkpoint at ``<store>/<name>`` (ours, or a legacy flax msgpack file).

    Args:
        target: ``None`` returns plain containers (dicts, lists, tuples as saved); a pytree
            returns that structure and types (dataclasses, namedtuples, registered nodes),
            reading only the leaves it names. A target that is a subtree of the checkpoint
            restores just that.
        subtree: a key-path prefix (``"params/dense"`` or ``("params", "dense")``): only
            leaves below it are read, and the subtree is returned (the target, if given,
            describes the subtree).
        allow_missing: with a target, fill leaves the checkpoint lacks from the target
            instead of raising :class:`~atomicstore.NotFoundError`.
        shard_fns: per-leaf function(s) applied after reading (e.g. ``jax.device_put`` with
            a sharding): a callable ``(path, array) -> value`` or a mapping
            ``"a/b/c" -> fn(array)``.
        threads: parallel reads.

    Raises :class:`~atomicstore.CorruptionError` naming the file and leaf for damaged data.
    """
    if not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError("threads must be a positive int")
    if not isinstance(allow_missing, bool):
        raise InvalidArgumentError("allow_missing must be a bool")
    post = _as_fn(shard_fns, "shard_fns")
    root = _select(subtree) or ()
    ckpt, st = _open_checkpoint(url_or_path, store, storage_options)
    if ckpt is not None:
        where = ckpt.where(STATE_FILE)
        if STATE_FILE not in ckpt.files or INDEX_FILE not in ckpt.files:
            raise CorruptionError(f"{ckpt.where('')}: not a pytree checkpoint (no {STATE_FILE}/{INDEX_FILE})")
        state_size = ckpt.files[STATE_FILE].size
        raw_index = ckpt.read_bytes(INDEX_FILE)
        if target is None and not root and post is None and state_size <= FAST_RESTORE_BYTES:
            fast = _restore_whole(ckpt, raw_index, state_size)
            if fast is not _NO_FAST_PATH:
                return fast
        idx = parse_index(raw_index, state_size, ckpt.where(INDEX_FILE))

        def read_into(off: int, mv: memoryview) -> None:
            ckpt.read_range_into(STATE_FILE, off, mv)
    else:
        store_, name = st
        drv = store_.driver
        where = drv.describe(name)
        size = drv.info(name).size

        def read_into(off: int, mv: memoryview) -> None:
            if off + mv.nbytes > size:
                raise CorruptionError(f"{where}: read past the end", path=where)
            if mv.nbytes and drv.read_into(name, off, mv) != mv.nbytes:
                raise CorruptionError(f"{where}: short read at byte {off}", path=where)

        def read(a: int, b: int) -> bytes:
            buf = bytearray(b - a)
            read_into(a, memoryview(buf))
            return bytes(buf)

        idx = index_of_msgpack(read, size, where)

    reader = _Reader(read_into, where, threads)
    if target is None:
        if root and root not in idx.containers and root not in idx.leaves:
            # flax writes every key as a string
            cand = [p for p in [*idx.containers, *idx.leaves] if _match(p, root)]
            if not cand:
                raise NotFoundError(f"{where}: no subtree {path_str(root)}")
            root = cand[0]
        wanted = [lf for p, lf in idx.leaves.items() if p[: len(root)] == root]
        values = reader.read(wanted)
        if post is not None:
            values = {p: post(p[len(root):], v) for p, v in values.items()}
        return _build(idx, values, root)

    # with a target: its leaves name what to read
    by_str = {tuple(str(k) for k in p): lf for p, lf in idx.leaves.items()}
    containers_str = {tuple(str(k) for k in p) for p in idx.containers}
    missing: list[str] = []
    plan: dict[Path, Leaf | None] = {}

    def note(path: Path, leaf: Any) -> Any:
        full = (*root, *path)
        lf = idx.leaves.get(full) or by_str.get(tuple(str(k) for k in full))
        if lf is None:
            if leaf is None and tuple(str(k) for k in full) in containers_str:
                plan[path] = None
                return leaf
            missing.append(path_str(full))
        plan[path] = lf
        return leaf

    rebuild(target, note)
    if missing and not allow_missing:
        raise NotFoundError(
            f"{where}: the checkpoint lacks {len(missing)} key(s) the target has: "
            + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
            + " (pass allow_missing=True to keep the target's values)"
        )
    leaves = [lf for lf in plan.values() if lf is not None]
    values = reader.read(leaves)

    def fill(path: Path, leaf: Any) -> Any:
        lf = plan.get(path)
        if lf is None:
            return leaf
        v = values[lf.path]
        if is_jax_array(leaf) and isinstance(v, np.ndarray) and post is None:
            import jax

            sharding = getattr(leaf, "sharding", None)
            # v was just read into a buffer nobody else holds: the device may use it as is
            v = jax.device_put(v, sharding, may_alias=True) if sharding is not None else jax.numpy.asarray(v)
        elif isinstance(leaf, np.ndarray) and isinstance(v, np.ndarray) and leaf.dtype != v.dtype:
            raise CorruptionError(f"{where}: leaf {path_str(lf.path)} is {v.dtype}, the target has {leaf.dtype}",
                                  path=STATE_FILE, leaf=path_str(lf.path))
        return post(path, v) if post is not None else v

    return rebuild(target, fill)


__all__ = ["StateWriter", "restore", "save", "split_url"]
