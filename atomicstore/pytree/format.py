"""The native checkpoint format: file names, the index and how to parse it.

A checkpoint (native layout) is one transaction of the commit layer holding:

* ``state.msgpack``: the state in flax's msgpack checkpoint format (flax's
  ``msgpack_restore`` reads it as is, except that an array sharded across processes is
  the string ``"//atomicstore.sharded:<key/path>"``);
* ``index.msgpack``: every container and leaf with its key path, kind, dtype, shape,
  byte range in ``state.msgpack`` and CRC32C, so one leaf or subtree can be read without
  touching the rest, and corruption is reported per leaf; a sharded array (kind ``"sh"``)
  lists its shard files instead, each with its index range, CRC32C and one CRC32C per
  block of :data:`SHARD_BLOCK` bytes (so a reader can read and verify any part of it);
* ``shards/<n>/<start0>_<start1>....bin``: one file per distinct shard of the ``n``-th
  sharded array, raw C-order bytes, written by the process that holds it;
* ``manifest.json``: the commit layer's manifest (sizes and CRC32C of every file).

``docs/format.md`` specifies all of them. Nothing here writes or reads storage: the
writer (:mod:`.writer`) and the reader (:mod:`.reader`) do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np

from ..commit.names import validate_path
from ..errors import CorruptionError, InvalidArgumentError
from . import msgpack_io as mp
from .dtypes import parse_dtype
from .tree import Path, path_str

STATE_FILE = "state.msgpack"
INDEX_FILE = "index.msgpack"
#: a multi-host local part (a tiered manager's local tier): the whole step's shard files,
#: ``{"files": [{"file", "size", "crc32c", ...}, ...]}``, of which the part holds its own
PARTS_FILE = "parts.json"
INDEX_FORMAT = "atomicstore.pytree/1"
#: flax splits arrays larger than this into chunks (its msgpack bin limit is 2**31 - 1)
FLAX_MAX_CHUNK = 2**30
EXT_NDARRAY, EXT_COMPLEX, EXT_NPSCALAR = 1, 2, 3
#: shard files are checksummed per block of this many bytes as well as whole
SHARD_BLOCK = 8 << 20
#: what ``state.msgpack`` holds in place of an array sharded across processes
SHARDED_PH = "//atomicstore.sharded:"
SHARDS_DIR = "shards"


def bytes_view(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (ml_dtypes arrays included,
    which do not export the buffer protocol themselves)."""
    if not arr.nbytes:
        return memoryview(bytearray())
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


#: restored arrays start on this boundary: jax aliases a host buffer for a CPU device
#: (``device_put(..., may_alias=True)``) only if it is 64-byte aligned, and copies it
#: otherwise (numpy's large allocations start 16 bytes past a page boundary)
ALIGN = 64


def aligned_empty(shape: tuple[int, ...] | list[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts on an :data:`ALIGN` boundary."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off : off + n].view(dtype).reshape(shape)


# -- sharded arrays --------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """One distinct shard of an array sharded across processes: the file holding its raw
    C-order bytes, where it sits in the global array, its CRC32C, and (when recorded)
    the CRC32C of each ``block``-byte block of the file."""

    file: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    crc32c: int | None = None
    blocks: tuple[int, ...] | None = None
    block: int = SHARD_BLOCK

    def to_index(self) -> list[Any]:
        return [self.file, list(self.start), list(self.shape), self.crc32c, list(self.blocks or [])]


def shard_file(n: int, start: tuple[int, ...] | list[int]) -> str:
    """The file name of the shard of sharded array ``n`` that starts at ``start``."""
    return f"{SHARDS_DIR}/{n}/" + ("_".join(map(str, start)) or "0") + ".bin"


def dimension(n: Any) -> int:
    """A dimension or offset read from storage: a non-negative int, else ValueError."""
    if type(n) is not int or not 0 <= n < 2**62:
        raise ValueError(f"bad dimension or offset {n!r}")
    return n


def check_shards(shards: list[Shard], shape: tuple[int, ...], itemsize: int,
                 sizes: Callable[[str], int | None]) -> None:
    """Raise ValueError unless ``shards`` tile an array of ``shape`` exactly (in bounds,
    no overlap, no hole) and each file has the size of its shape (``sizes(file)``: the
    manifest's size, None when the file is not in the manifest)."""
    total = math.prod(shape)
    got = 0
    files = set()
    for s in shards:
        if len(s.start) != len(shape) or len(s.shape) != len(shape):
            raise ValueError(f"shard {s.file} has the wrong rank")
        if any(b + n > g for b, n, g in zip(s.start, s.shape, shape, strict=True)):
            raise ValueError(f"shard {s.file} lies outside its array")
        if s.file in files:
            raise ValueError(f"shard {s.file} is listed twice")
        files.add(s.file)
        size = sizes(s.file)
        if size is None:
            raise ValueError(f"shard {s.file} is not in the manifest")
        if math.prod(s.shape) * itemsize != size:  # checked before anything is allocated
            raise ValueError(f"shard {s.file} does not have the size of its shape")
        if s.blocks is not None and len(s.blocks) != -(-size // s.block):
            raise ValueError(f"shard {s.file} has {len(s.blocks)} block checksums for {size} bytes")
        got += math.prod(s.shape)
    if got != total:
        raise ValueError(f"the shards cover {got} of {total} elements")
    _check_tiling(shards, shape)


#: the coverage grid of a sharding may have at most this many cells (a jax sharding's
#: grid has one cell per shard)
MAX_GRID_CELLS = 1 << 22


def _check_tiling(shards: list[Shard], shape: tuple[int, ...]) -> None:
    """Every element is covered exactly once: count coverage on the grid the shards'
    edges cut the array into (as many cells as shards for any jax sharding)."""
    live = [s for s in shards if 0 not in s.shape]
    if not shape or not live:
        if len(live) > 1:
            raise ValueError("the shards overlap")
        return
    cuts = [sorted({0, dim, *(s.start[a] for s in live), *(s.start[a] + s.shape[a] for s in live)})
            for a, dim in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > max(MAX_GRID_CELLS, 4 * len(live)):
        raise ValueError(f"the shards do not form a grid ({cells} cells for {len(live)} shards)")
    cover = np.zeros([len(c) - 1 for c in cuts], np.int32)
    for s in live:
        box = tuple(slice(np.searchsorted(c, st), np.searchsorted(c, st + n))
                    for c, st, n in zip(cuts, s.start, s.shape, strict=True))
        cover[box] += 1
    if cover.max(initial=0) > 1:
        raise ValueError("the shards overlap")
    if cover.min(initial=1) < 1:
        raise ValueError("the shards leave a hole")


def parse_shards(raw: Any, block: Any) -> list[Shard]:
    """The shard list of a ``"sh"`` index node (hostile input); ValueError if malformed."""
    if type(raw) is not list or len(raw) > 1 << 20:
        raise ValueError("shards is not a list")
    if type(block) is not int or not 0 < block < 2**40:
        raise ValueError(f"bad shard block size {block!r}")
    out = []
    for s in raw:
        if type(s) is not list or len(s) != 5:
            raise ValueError("malformed shard")
        file, start, shape, crc, blocks = s
        if type(file) is not str:
            raise ValueError("shard file is not a string")
        try:
            validate_path(file)
        except InvalidArgumentError as exc:
            raise ValueError(str(exc)) from None
        if type(start) is not list or type(shape) is not list or len(start) > 64 or len(shape) > 64:
            raise ValueError(f"shard {file}: bad start or shape")
        if type(crc) is not int or not 0 <= crc < 2**32:
            raise ValueError(f"shard {file}: bad CRC32C")
        if type(blocks) is not list or any(type(c) is not int or not 0 <= c < 2**32 for c in blocks):
            raise ValueError(f"shard {file}: bad block checksums")
        out.append(Shard(file, tuple(dimension(n) for n in start), tuple(dimension(n) for n in shape), crc,
                         tuple(blocks), block))
    return out


# -- the index -------------------------------------------------------------------------------
class LeafKind(StrEnum):
    """What a leaf of the index is. The values are the kind strings of ``index.msgpack``
    (``docs/format.md``): a member is the very string on disk and compares equal to it."""

    #: an array: its C-order bytes are one byte range of the state file
    ND = "nd"
    #: a numpy scalar, laid out like an array
    SC = "sc"
    #: a chunked array (flax's layout for arrays over 1 GiB): one range per chunk
    NDC = "ndc"
    #: any other leaf: its complete msgpack encoding is the byte range
    PY = "py"
    #: a literal already decoded (legacy files; never in an index)
    LIT = "lit"
    #: an array sharded across processes: its bytes are in shard files
    SH = "sh"


#: the leaf kinds an ``index.msgpack`` may hold (a tuple: a hostile kind may be unhashable)
_INDEXED_KINDS = (LeafKind.ND, LeafKind.SC, LeafKind.PY, LeafKind.SH, LeafKind.NDC)


class Leaf:
    """Where one leaf is and what it is.

    ``kind``: a :class:`LeafKind`: "nd" array, "sc" numpy scalar, "ndc" chunked array,
    "py" msgpack value, "lit" a literal already decoded (legacy files), "sh" an array
    sharded across processes (``value``: its :class:`Shard` list; no range in the state
    file). ``ranges``: (offset, length, CRC32C or None) in the state file.
    """

    __slots__ = ("path", "kind", "dtype", "shape", "ranges", "value", "nbytes")

    def __init__(self, path: Path, kind: LeafKind, dtype: np.dtype | None, shape: tuple[int, ...],
                 ranges: list[tuple[int, int, int | None]], value: Any = None) -> None:
        self.path, self.kind, self.dtype, self.shape, self.ranges, self.value = path, kind, dtype, shape, ranges, value
        if kind == LeafKind.SH:
            assert dtype is not None
            self.nbytes = math.prod(shape) * dtype.itemsize
        else:
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


def parse_index(raw: bytes, state_size: int, where: str,
                sizes: Callable[[str], int | None] | None = None) -> Index:
    """Validate ``index.msgpack`` (hostile input) against the state file's size and, for
    sharded arrays, against the sizes of their files (``sizes(file)``: the manifest's
    size, None when the file is not in it; without ``sizes`` no sharded array is
    accepted)."""
    doc = _index_doc(raw, state_size, where)
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
            leaf = _index_leaf(node, doc, state_size, where, sizes)
            idx.leaves[leaf.path] = leaf
            idx.order.append((1, leaf.path))
        except CorruptionError:
            raise
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            raise CorruptionError(f"{where}: malformed index node ({exc!r})", path=INDEX_FILE) from None
    _check_structure(idx, where)
    return idx


def _index_doc(raw: bytes, state_size: int, where: str) -> dict[Any, Any]:
    """The decoded index, checked to be one of ours for a state of ``state_size`` bytes."""
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_ext_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise CorruptionError(f"{where}: unreadable index ({exc})", path=INDEX_FILE) from None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or not isinstance(doc.get("nodes"), list):
        raise CorruptionError(f"{where}: not an {INDEX_FORMAT} index", path=INDEX_FILE)
    if doc.get("state_size") != state_size:
        raise CorruptionError(f"{where}: index describes a state of {doc.get('state_size')} bytes, "
                              f"the state file has {state_size}", path=INDEX_FILE)
    return doc


def _index_leaf(node: list[Any], doc: dict[Any, Any], state_size: int, where: str,
                sizes: Callable[[str], int | None] | None) -> Leaf:
    """The leaf of index node ``node`` (``[1, path, kind, ...]``); TypeError, ValueError,
    IndexError or KeyError for a malformed one (reported as such by the caller)."""
    p = _path(node[1], where)
    kind = node[2]
    if kind not in _INDEXED_KINDS:
        raise TypeError(f"leaf kind {kind!r}")
    kind = LeafKind(kind)
    if kind is LeafKind.SH:
        return _sharded_leaf(node, p, doc, where, sizes)
    dt: np.dtype | None
    if kind is LeafKind.NDC:
        _, _, _, dtn, shp, chunks = node
        dt, shape = parse_dtype(dtn, path=INDEX_FILE, leaf=p, where=where), _shape(shp, where)
        if not isinstance(chunks, list):
            raise TypeError("chunks is not a list")
        ranges = [tuple(c) for c in chunks]
    else:  # nd, sc, py: one range
        _, _, _, dtn, shp, off, n, crc = node
        ranges = [(off, n, crc)]
        dt = parse_dtype(dtn, path=INDEX_FILE, leaf=p, where=where) if kind != LeafKind.PY else None
        shape = _shape(shp, where) if kind != LeafKind.PY else ()
    _check_ranges(ranges, p, state_size, where)
    leaf = Leaf(p, kind, dt, shape, list(ranges))
    if dt is not None and math.prod(shape) * dt.itemsize != leaf.nbytes:
        raise CorruptionError(f"{where} leaf {path_str(p)}: shape {shape} of {dt} does not match "
                              f"{leaf.nbytes} bytes", path=STATE_FILE, leaf=path_str(p))
    return leaf


def _sharded_leaf(node: list[Any], p: Path, doc: dict[Any, Any], where: str,
                  sizes: Callable[[str], int | None] | None) -> Leaf:
    """The leaf of a ``"sh"`` index node, its shards checked against the files' sizes."""
    _, _, _, dtn, shp, raw_shards = node
    dt, shape = parse_dtype(dtn, path=INDEX_FILE, leaf=p, where=where), _shape(shp, where)
    try:
        if sizes is None:
            raise ValueError("a sharded array where none is expected")
        shards = parse_shards(raw_shards, doc.get("shard_block", SHARD_BLOCK))
        check_shards(shards, shape, dt.itemsize, sizes)
    except ValueError as exc:
        raise CorruptionError(f"{where} leaf {path_str(p)}: {exc}", path=INDEX_FILE,
                              leaf=path_str(p)) from None
    return Leaf(p, LeafKind.SH, dt, shape, [], shards)


def _check_ranges(ranges: list[Any], p: Path, state_size: int, where: str) -> None:
    """Each of a leaf's byte ranges is (offset, length, CRC32C) inside the state file."""
    for r in ranges:
        if len(r) != 3 or type(r[0]) is not int or type(r[1]) is not int or type(r[2]) is not int:
            raise TypeError(f"bad byte range at {path_str(p)}")
        off, n, crc = r
        if off < 0 or n < 0 or off + n > state_size or not 0 <= crc < 2**32:
            leaf_where = f"{where} leaf {path_str(p)}"
            raise CorruptionError(f"{leaf_where}: byte range [{off}, {off + n}) outside the "
                                  f"{state_size}-byte state file", path=STATE_FILE, leaf=path_str(p))


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
    indexer = _MsgpackIndexer(read, where)
    indexer.visit(value, ())
    return indexer.idx


class _MsgpackIndexer:
    """Builds the index of a scanned msgpack state (:func:`msgpack_io.scan`'s value),
    reading what the scan left in place (arrays' headers, large literals) through
    ``read(start, end)``."""

    def __init__(self, read: Callable[[int, int], bytes], where: str) -> None:
        self.read, self.where = read, where
        self.idx = Index({}, {}, [])

    def visit(self, v: Any, p: Path) -> None:
        where = self.where
        if isinstance(v, dict) and v.get("__msgpack_chunked_array__") is True:
            self._add(p, self._chunked_leaf(v, p))
        elif isinstance(v, dict):
            self.idx.containers[p] = "dict"
            self.idx.order.append((0, p))
            for k, child in v.items():
                self.visit(child, (*p, k))
        elif v is None:
            self.idx.containers[p] = "none"
            self.idx.order.append((0, p))
        elif isinstance(v, mp.ExtLeaf):
            self._add(p, self._ext_leaf(v, p))
        elif isinstance(v, list):
            raise CorruptionError(f"{where} at {path_str(p)}: arrays are not part of flax's format", path=where)
        else:
            if isinstance(v, mp.Span):
                v = self.read(v.start, v.end)
            self._add(p, Leaf(p, LeafKind.LIT, None, (), [], v))

    def _add(self, p: Path, leaf: Leaf) -> None:
        self.idx.leaves[p] = leaf
        self.idx.order.append((1, p))

    def _ndarray_leaf(self, p: Path, span: mp.Span, kind: LeafKind) -> Leaf:
        where, read = self.where, self.read
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

    def _chunked_leaf(self, v: dict[Any, Any], p: Path) -> Leaf:
        """flax's chunked array (``{"__msgpack_chunked_array__": True, "shape": ...,
        "chunks": ...}``), as one leaf of the chunks' ranges."""
        where = self.where
        try:
            shape = tuple(v["shape"][str(i)] for i in range(len(v["shape"])))
            parts = [v["chunks"][str(i)] for i in range(len(v["chunks"]))]
        except (KeyError, TypeError):
            raise CorruptionError(f"{where} leaf {path_str(p)}: malformed chunked array",
                                  path=where, leaf=path_str(p)) from None
        leaves = [self._ndarray_leaf(p, c.payload, LeafKind.ND) for c in parts if isinstance(c, mp.ExtLeaf)]
        if len(leaves) != len(parts) or not leaves:
            raise CorruptionError(f"{where} leaf {path_str(p)}: malformed chunked array", path=where)
        dt = leaves[0].dtype
        leaf = Leaf(p, LeafKind.NDC, dt, _shape(list(shape), where), [r for lf in leaves for r in lf.ranges])
        assert dt is not None
        if math.prod(leaf.shape) * dt.itemsize != leaf.nbytes:
            raise CorruptionError(f"{where} leaf {path_str(p)}: chunks do not add up", path=where)
        return leaf

    def _ext_leaf(self, v: mp.ExtLeaf, p: Path) -> Leaf:
        """An ext value: an array, a numpy scalar or a complex number."""
        where = self.where
        if v.code in (EXT_NDARRAY, EXT_NPSCALAR):
            return self._ndarray_leaf(p, v.payload, LeafKind.ND if v.code == EXT_NDARRAY else LeafKind.SC)
        if v.code != EXT_COMPLEX:
            raise CorruptionError(f"{where} leaf {path_str(p)}: unknown ext type {v.code}", path=where)
        try:
            pair = msgpack.unpackb(self.read(v.payload.start, v.payload.end))
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError("not a pair")
            value = complex(pair[0], pair[1])
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise CorruptionError(f"{where} leaf {path_str(p)}: malformed complex ({exc})", path=where,
                                  leaf=path_str(p)) from None
        return Leaf(p, LeafKind.LIT, None, (), [], value)


__all__ = [
    "EXT_COMPLEX", "EXT_NDARRAY", "EXT_NPSCALAR", "FLAX_MAX_CHUNK", "INDEX_FILE", "INDEX_FORMAT",
    "SHARDED_PH", "SHARD_BLOCK", "STATE_FILE", "Index", "Leaf", "LeafKind", "Shard", "aligned_empty", "bytes_view",
    "check_shards", "dimension", "index_of_msgpack", "parse_index", "parse_shards", "shard_file",
]
