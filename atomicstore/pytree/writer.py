"""Writing a pytree: :func:`save` and :class:`StateWriter`.

The state is streamed leaf after leaf in flax's msgpack format straight from each
array's buffer (no bytes object of the whole state, no second copy), while the index
(:mod:`.format`) is recorded. In a multi-host ``jax.distributed`` job every process calls
:func:`save`: arrays sharded across processes are written as shard files by the
processes holding them, coordinated by :mod:`.coordination`, and process 0 writes the
rest and commits once every process has reported.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import google_crc32c
import msgpack
import numpy as np

from ..commit import Manifest, Store, Transaction
from ..commit.locator import checkpoint_name, split_location, store_at
from ..commit.manifest import crc32c, crc32c_combine
from ..errors import InvalidArgumentError
from . import msgpack_io as mp
from .coordination import (
    DEFAULT_TIMEOUT,
    Session,
    check_timeout,
    coordinated_parts,
    coordinated_save,
)
from .dtypes import is_float, is_storable
from .format import (
    EXT_COMPLEX,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    FLAX_MAX_CHUNK,
    INDEX_FILE,
    INDEX_FORMAT,
    PARTS_FILE,
    SHARD_BLOCK,
    SHARDED_PH,
    STATE_FILE,
    LeafKind,
    Shard,
    bytes_view,
    shard_file,
)
from .sharded import LocalShard, ShardedLeaf, local_shards, replica_shards, split_tree
from .tree import Path, children, is_jax_array, path_str, per_leaf_fn, snapshot_tree, walk_leaves

#: leaves smaller than this are buffered before they are written
SMALL_LEAF = 1 << 20


# -- saving --------------------------------------------------------------------------------
class _Emitter:
    """Appends msgpack bytes to a transaction file: small pieces buffered, array data
    written straight from its buffer with its CRC32C already known.

    Where the file takes borrowed buffers (``accepts_borrowed``), the leaves' own buffers
    and the filled small-piece buffers (never changed once handed over: a fresh one takes
    the next bytes) are lent to it, so an object-store upload sends them without copying.
    """

    def __init__(self, f: Any, progress: Callable[[int], None] | None) -> None:
        self.f, self.buf, self.flushed, self.progress = f, bytearray(), 0, progress
        self.pack = msgpack.Packer(use_bin_type=True, strict_types=True).pack
        self.lend = bool(getattr(f, "accepts_borrowed", False))

    @property
    def offset(self) -> int:
        """Bytes emitted so far (flushed + buffered)."""
        return self.flushed + len(self.buf)

    def small(self, b: bytes) -> None:
        self.buf += b
        if len(self.buf) >= SMALL_LEAF:
            self.flush()

    def big(self, mv: memoryview, crc: int, lend: bool = False) -> None:
        """``lend``: ``mv`` is a leaf's own buffer, alive and unchanged during the save."""
        self.flush()
        if lend and self.lend:
            self.f.write(mv, crc32c=crc, borrow=True)
        else:
            self.f.write(mv, crc32c=crc)
        self.flushed += mv.nbytes
        if self.progress:
            self.progress(self.flushed)

    def flush(self) -> None:
        if self.buf:
            if self.lend:
                self.f.write(self.buf, borrow=True)  # never changed again: a new one follows
            else:
                self.f.write(self.buf)
            self.flushed += len(self.buf)
            self.buf = bytearray()


@dataclass
class _SaveOptions:
    cast_dtype: Any
    gather: Callable[[Path, Any], Any] | None
    sort_keys: bool = True


def _to_numpy(path: Path, x: Any, opts: _SaveOptions) -> Any:
    if type(x) is np.ndarray and opts.gather is None and opts.cast_dtype is None:
        return x
    if opts.gather is not None:
        x = opts.gather(path, x)
    if is_jax_array(x):
        if not getattr(x, "is_fully_addressable", True):
            raise InvalidArgumentError(
                f"leaf {path_str(path)} is a jax.Array sharded across processes, but this "
                "process is not part of a jax.distributed job (call jax.distributed.initialize)"
            )
        x = np.asarray(x)
    if opts.cast_dtype is not None and isinstance(x, np.generic) and is_float(x.dtype):
        x = x.astype(opts.cast_dtype)  # (arrays are cast block by block as they are written)
    return x


#: a leaf that must be converted to be written (cast, or made C-contiguous) is converted
#: in pieces of about this many bytes, so the extra memory does not grow with the leaf
CONVERT_BLOCK = 8 << 20


def _c_order_blocks(arr: np.ndarray, dtype: np.dtype, block: int = CONVERT_BLOCK) -> Any:
    """``arr`` converted to ``dtype``, in C order, as consecutive C-contiguous arrays of
    about ``block`` bytes each (slices along the leading axes; none is a whole copy of a
    large leaf)."""
    row = arr.size // arr.shape[0] * dtype.itemsize if arr.ndim and arr.shape[0] else 0
    if arr.ndim == 0 or arr.size * dtype.itemsize <= block or row == 0:
        yield np.ascontiguousarray(arr, dtype=dtype)
        return
    if row > block:  # one row is too big already: go down a level
        for i in range(arr.shape[0]):
            yield from _c_order_blocks(arr[i], dtype, block)
        return
    per = block // row
    for i in range(0, arr.shape[0], per):
        yield np.ascontiguousarray(arr[i : i + per], dtype=dtype)


_HEADS: dict[tuple[Any, tuple[int, ...], int], tuple[bytes, str]] = {}


def _array_head(arr: np.ndarray, code: int, dtype: np.dtype | None = None) -> tuple[bytes, str]:
    """(ext header + ndarray tuple header up to the data, dtype name) of ``arr`` (as
    ``dtype``, if given), cached per dtype and shape: leaves of one model share a handful
    of them."""
    return _head_for(arr.dtype if dtype is None else dtype, arr.shape, code)


def _head_for(dt: np.dtype, shape: tuple[int, ...], code: int) -> tuple[bytes, str]:
    key = (dt, shape, code)
    hit = _HEADS.get(key)
    if hit is None:
        name = dt.name
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        head = mp.array_header(3) + mp.pack(list(shape)) + mp.pack(name) + mp.bin_header(nbytes)
        hit = (mp.ext_header(code, len(head) + nbytes) + head, name)
        if len(_HEADS) < 4096:
            _HEADS[key] = hit
    return hit


class _Converted:
    """The C-order bytes of ``arr`` as ``dtype``, converted a block at a time
    (:func:`_c_order_blocks`) and written on demand: :meth:`emit` writes the next
    ``nbytes`` of them (a block may end in one call and go on in the next)."""

    def __init__(self, arr: np.ndarray, dtype: np.dtype) -> None:
        self._blocks = (bytes_view(b) for b in _c_order_blocks(arr, dtype))
        self._rest = memoryview(b"")

    def emit(self, em: _Emitter, nbytes: int) -> int:
        """Write the next ``nbytes`` bytes; their CRC32C."""
        crc = 0
        while nbytes:
            if not self._rest:
                self._rest = next(self._blocks)
            data, self._rest = self._rest[:nbytes], self._rest[nbytes:]
            if data.nbytes < 65536:
                raw = data.tobytes()
                em.small(raw)
                part = google_crc32c.value(raw)
            else:
                part = crc32c(data)
                em.big(data, part)  # a temporary: copied (not lent) by the writer
            crc = crc32c_combine(crc, part, data.nbytes)
            nbytes -= data.nbytes
        return crc


def _ndarray_ext(em: _Emitter, arr: np.ndarray, code: int, lend: bool = False,
                 dtype: np.dtype | None = None) -> tuple[int, int, int, str]:
    """Write ``arr`` (cast to ``dtype``, if given) as flax's ndarray ext; return (data
    offset, nbytes, crc32c, dtype name). ``lend``: ``arr`` is (a view of) a leaf of the
    tree, not a temporary: its buffer may be uploaded from as is."""
    if (dtype is not None and dtype != arr.dtype) or not arr.flags.c_contiguous:
        dt = arr.dtype if dtype is None else dtype
        head, name = _array_head(arr, code, dt)
        em.small(head)
        off, n = em.offset, arr.size * dt.itemsize
        # converted piece by piece: no whole converted copy of the leaf at any time
        return off, n, _Converted(arr, dt).emit(em, n), name
    head, name = _array_head(arr, code)
    em.small(head)
    off = em.offset
    if arr.nbytes < 65536:
        raw = arr.tobytes()
        em.small(raw)
        return off, len(raw), google_crc32c.value(raw), name
    data = bytes_view(arr)
    crc = crc32c(data)
    em.big(data, crc, lend)
    return off, arr.nbytes, crc, name


def _check_array(path: Path, arr: np.ndarray) -> None:
    if not is_storable(arr.dtype):  # what restore could not read back is refused now
        raise InvalidArgumentError(
            f"leaf {path_str(path)}: dtype {arr.dtype} cannot be saved (numeric, bool, datetime, "
            "timedelta and ml_dtypes arrays can; not object, str, bytes, void or structured)"
        )


def _too_deep(path: Path, depth: int) -> None:
    """Refuse what no reader would read back: msgpack nested deeper than ``mp.MAX_DEPTH``."""
    raise InvalidArgumentError(f"tree nested {depth} levels deep at {path_str(path)}: at most {mp.MAX_DEPTH} "
                               "(the deepest nesting a reader accepts)")


def _write_node(em: _Emitter, node: Any, path: Path, index: list[list[Any]], opts: _SaveOptions, depth: int) -> None:
    if depth > mp.MAX_DEPTH:
        _too_deep(path, depth)
    kids = children(node, opts.sort_keys)
    if kids is None or kids[0] == "none":
        _write_value(em, node, path, index, opts, depth)
        return
    kind, items = kids
    _check_keys(items, path)
    index.append([0, list(path), kind])
    em.small(mp.map_header(len(items)))
    plain = opts.gather is None and opts.cast_dtype is None
    lpath = list(path)
    pack, crc_of, heads, ndarray, nd = em.pack, google_crc32c.value, _HEADS, np.ndarray, LeafKind.ND
    for k, child in items:
        kb = pack(k if type(k) is str else k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k))
        hit = None
        if plain and depth < mp.MAX_DEPTH and type(child) is ndarray and child.nbytes < 65536 \
                and child.flags.c_contiguous and child.dtype.isnative:
            # (only storable dtypes ever get a head: others go the checked way below)
            hit = heads.get((child.dtype, child.shape, EXT_NDARRAY))
            if hit is None and is_storable(child.dtype):
                hit = _array_head(child, EXT_NDARRAY)
        if hit is not None:
            # the common case of many small arrays, inlined: straight into the buffer
            raw = child.tobytes()
            buf = em.buf
            buf += kb
            buf += hit[0]
            off = em.flushed + len(buf)
            buf += raw
            index.append([1, [*lpath, k], nd, hit[1], list(child.shape), off, len(raw), crc_of(raw)])
            if len(buf) >= SMALL_LEAF:
                em.flush()
            continue
        em.small(kb)
        _write_node(em, child, (*path, k), index, opts, depth + 1)


def _check_keys(items: list[tuple[Any, Any]], path: Path) -> None:
    """The keys of a container's ``items`` are str, int or bytes, distinct as strings."""
    keys = set()
    for k, _ in items:
        if not isinstance(k, str | int | bytes):
            raise InvalidArgumentError(f"key {k!r} under {path_str(path)} must be str, int or bytes")
        sk = k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k)
        if sk in keys:
            raise InvalidArgumentError(f"keys under {path_str(path)} collide as strings: {sk!r}")
        keys.add(sk)


def _write_value(em: _Emitter, node: Any, path: Path, index: list[list[Any]], opts: _SaveOptions,
                 depth: int) -> None:
    """Write ``node``, which is not a container: a leaf, a sharded array's placeholder, or
    None."""
    if isinstance(node, ShardedLeaf):  # its bytes are in shard files; the index lists them
        index.append([1, list(path), LeafKind.SH, node.dtype.name, list(node.shape), node])
        em.small(mp.pack(SHARDED_PH + node.key))
        return
    if node is None:
        index.append([0, list(path), "none"])
        em.small(b"\xc0")
        return
    x = _to_numpy(path, node, opts)
    if isinstance(x, np.ndarray):
        _write_array(em, x, x is node, path, index, opts, depth)
    elif isinstance(x, np.generic):
        arr = np.asarray(x)
        _check_array(path, arr)
        off, n, crc, name = _ndarray_ext(em, arr, EXT_NPSCALAR)
        index.append([1, list(path), LeafKind.SC, name, [], off, n, crc])
    elif isinstance(x, complex):
        payload = msgpack.packb((x.real, x.imag))  # as flax packs it
        _write_py(em, mp.ext_header(EXT_COMPLEX, len(payload)) + payload, path, index)
    elif isinstance(x, bool | int | float | str | bytes):
        try:
            blob = mp.pack(x)
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"leaf {path_str(path)} cannot be encoded: {exc}") from None
        _write_py(em, blob, path, index)
    else:
        raise InvalidArgumentError(
            f"leaf {path_str(path)} has unsupported type {type(node).__name__}: use arrays, numbers, "
            "str, bytes, None, or containers registered as jax pytree nodes"
        )


def _write_array(em: _Emitter, x: np.ndarray, is_own: bool, path: Path, index: list[list[Any]],
                 opts: _SaveOptions, depth: int) -> None:
    """Write the array leaf ``x`` (``is_own``: the tree's own array, not a converted copy),
    cast as ``opts`` says; chunked as flax does when over :data:`FLAX_MAX_CHUNK` bytes."""
    _check_array(path, x)
    cast = opts.cast_dtype
    if cast is None or cast == x.dtype or not is_float(x.dtype):
        cast = None
    if cast is None and not x.dtype.isnative:
        # written in the machine's byte order, a block at a time: the stored dtype is a
        # name without one (flax's too), so raw big-endian bytes would read back as other
        # values; the values are kept, the byte order is not
        cast = x.dtype.newbyteorder("=")
    own = is_own and cast is None  # the tree's own array (not a converted temporary)
    if x.size * (cast or x.dtype).itemsize > FLAX_MAX_CHUNK:
        if depth + 2 > mp.MAX_DEPTH:  # flax's chunked layout: two maps below the leaf
            _too_deep(path, depth + 2)
        _write_chunked(em, x, path, index, own, cast)
        return
    off, n, crc, name = _ndarray_ext(em, x, EXT_NDARRAY, own, cast)
    index.append([1, list(path), LeafKind.ND, name, list(x.shape), off, n, crc])


def _write_py(em: _Emitter, blob: bytes, path: Path, index: list[list[Any]]) -> None:
    """Write a leaf that is not an array: ``blob`` is its complete msgpack encoding."""
    index.append([1, list(path), LeafKind.PY, None, None, em.offset, len(blob), crc32c(blob)])
    em.small(blob)


def _write_chunked(em: _Emitter, arr: np.ndarray, path: Path, index: list[list[Any]], own: bool = False,
                   dtype: np.dtype | None = None) -> None:
    """flax's chunked-array convention for arrays over 1 GiB (as ``dtype``, if given: cast
    and, for a non-contiguous array, reordered piece by piece, never as a whole copy)."""
    dt = arr.dtype if dtype is None else dtype
    per = max(1, FLAX_MAX_CHUNK // dt.itemsize)
    starts = list(range(0, arr.size, per))
    em.small(mp.map_header(3) + mp.pack("__msgpack_chunked_array__") + mp.pack(True) + mp.pack("shape"))
    em.small(mp.map_header(arr.ndim) + b"".join(mp.pack(str(i)) + mp.pack(d) for i, d in enumerate(arr.shape)))
    em.small(mp.pack("chunks") + mp.map_header(len(starts)))
    chunks = []
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1)  # a view
        for i, s in enumerate(starts):
            em.small(mp.pack(str(i)))
            off, n, crc, _ = _ndarray_ext(em, flat[s : s + per], EXT_NDARRAY, own, dtype)
            chunks.append([off, n, crc])
    else:
        stream = _Converted(arr, dt)
        for i, s in enumerate(starts):
            count = min(per, arr.size - s)
            em.small(mp.pack(str(i)) + _head_for(dt, (count,), EXT_NDARRAY)[0])
            off, want = em.offset, count * dt.itemsize
            chunks.append([off, want, stream.emit(em, want)])
    index.append([1, list(path), LeafKind.NDC, dt.name, list(arr.shape), chunks])


def _progress_printer(total: int) -> Callable[[int], None]:
    start = time.monotonic()
    tty = sys.stderr.isatty()

    def show(done: int) -> None:
        if tty:
            rate = done / max(1e-9, time.monotonic() - start) / 2**20
            print(f"\rsaving {done / 2**20:,.0f}/{total / 2**20:,.0f} MiB ({rate:,.0f} MiB/s)", end="", file=sys.stderr)

    return show


def _cast_dtype(cast_dtype: Any) -> np.dtype | None:
    if cast_dtype is None:
        return None
    import ml_dtypes  # noqa: F401 - registers "bfloat16", "float8_*"... (a dependency, imported lazily)

    try:
        dt: np.dtype = np.dtype(cast_dtype)
    except (TypeError, ValueError, SyntaxError) as exc:
        raise InvalidArgumentError(f"cast_dtype: {cast_dtype!r} is not a dtype ({exc})") from None
    if not is_float(dt) or not is_storable(dt):
        raise InvalidArgumentError(f"cast_dtype must be a floating-point dtype (it casts floating-point "
                                   f"leaves), not {dt}")
    return dt


class StateWriter:
    """Streams ``tree`` in flax's msgpack format into a file-like object with
    ``write(data, crc32c=None)``, recording the index as it goes. Arguments as for
    :func:`save`; validated here, before anything is written. ``sort_keys=False`` keeps
    dicts in insertion order, byte-identical to flax's ``to_bytes``/``save_checkpoint``
    (the default matches ``msgpack_serialize``, which sorts them like jax)."""

    def __init__(self, tree: Any, *, cast_dtype: Any = None, gather_fns: Any = None,
                 progress: bool | Callable[[int], None] = False, sort_keys: bool = True) -> None:
        cast_dtype = _cast_dtype(cast_dtype)
        self.tree = tree
        self.opts = _SaveOptions(cast_dtype, per_leaf_fn(gather_fns, "gather_fns"), sort_keys)
        self.index: list[list[Any]] = []
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


def _sharded_nodes(index: list[list[Any]], shards: dict[int, list[Shard]]) -> list[list[Any]]:
    """The index with each sharded array's placeholder replaced by its shard list."""
    return [[*n[:5], [s.to_index() for s in shards[n[5].n]]] if n[0] == 1 and n[2] == LeafKind.SH else n
            for n in index]


def check_depth(tree: Any, what: str = "tree", limit: int = mp.MAX_DEPTH) -> None:
    """Refuse (:class:`InvalidArgumentError`) a tree nested deeper than ``limit`` (by default
    what any reader reads back, ``msgpack_io.MAX_DEPTH``), or cyclic (its nesting never
    ends), without recursion: before a save that is not written at once (an async save's
    snapshot) or a conversion that recurses into it."""
    stack: list[tuple[Any, int, Path]] = [(tree, 0, ())]
    while stack:
        node, depth, at = stack.pop()
        if depth > limit:
            raise InvalidArgumentError(
                f"{what} nested more than {limit} levels deep at {path_str(at[:8])}/... "
                f"(or cyclic: a container inside itself): at most {mp.MAX_DEPTH}, the deepest a reader accepts")
        kids = children(node, False)
        if kids is not None:
            stack.extend((child, depth + 1, (*at, k)) for k, child in kids[1])


class PreparedSave:
    """A tree made ready to be saved by :meth:`run`, possibly in another thread.

    Arguments are checked here. In a multi-host job (``session``), the arrays sharded
    across processes are split out and this process's shards picked (each distinct shard
    once, by the process holding ``replica_id`` 0); only process 0 writes the rest. With
    ``snapshot`` (an async save), later changes to the caller's arrays cannot reach the
    checkpoint: jax arrays and this process's shards are copied to host now (all
    transfers started first), numpy arrays copied unless ``copy=False``.
    """

    def __init__(self, tree: Any, *, cast_dtype: Any = None, gather_fns: Any = None,
                 progress: bool | Callable[[int], None] = False, sort_keys: bool = True,
                 session: Session | None = None, snapshot: bool = False, copy: bool = True,
                 every_process: bool = False) -> None:
        # every_process: every process writes the state (not only process 0), for
        # :meth:`run_part`
        cast_dtype = _cast_dtype(cast_dtype)
        if snapshot:  # (copied now, recursively: refuse a too deep or cyclic tree first)
            check_depth(tree)
        self.session = session
        self.leaves: list[ShardedLeaf] = []
        self.shards: list[LocalShard] = []
        self.replicas: list[LocalShard] = []  # (every_process: the shards held only as replicas)
        gather = gather_fns
        if session is not None:
            tree, self.leaves, arrays = split_tree(tree, cast_dtype=cast_dtype,
                                                   gather=per_leaf_fn(gather_fns, "gather_fns"))
            self.shards = local_shards(self.leaves, arrays, to_host=snapshot)
            if every_process:
                self.replicas = replica_shards(self.leaves, arrays, to_host=snapshot)
            gather = None  # applied by split_tree
        self.writer: StateWriter | None = None
        if session is None or session.main or every_process:
            if snapshot:
                tree = snapshot_tree(tree, copy)
            self.writer = StateWriter(tree, cast_dtype=cast_dtype, gather_fns=gather, progress=progress,
                                      sort_keys=sort_keys)

    def write_state(self, txn: Transaction, shards: dict[int, list[Shard]]) -> None:
        """Write ``state.msgpack`` and ``index.msgpack`` into ``txn`` (the shard files of
        sharded arrays, ``shards``, are already in it)."""
        assert self.writer is not None
        f = txn.open(STATE_FILE)
        try:
            state_size = self.writer.write(f)
            f.close(wait=False)  # its last parts fly while the index is written
        except BaseException:
            f.abort()
            raise
        nodes = _sharded_nodes(self.writer.index, shards)
        str_keys = all(type(k) is str for node in nodes for k in node[1])
        doc: dict[str, Any] = {"format": INDEX_FORMAT, "state_size": state_size, "str_keys": str_keys,
                               "nodes": nodes}
        if shards:
            doc["shard_block"] = SHARD_BLOCK
        f = txn.open(INDEX_FILE)
        try:
            f.write(msgpack.packb(doc, use_bin_type=True))
            f.close(wait=False)  # both files' fsyncs (or last parts) finish together
        except BaseException:
            f.abort()
            raise

    def run(self, st: Store, name: str, *, overwrite: bool = False, metadata: dict[str, Any] | None = None,
            after: Callable[[], None] | None = None) -> Manifest:
        """Write and commit checkpoint ``name`` of ``st``; the committed manifest. In a
        multi-host job every process calls it and gets the manifest once the checkpoint
        is committed. ``after()`` (retention) runs once committed, in process 0, before
        the others return."""
        s = self.session
        if s is None:
            with st.transaction(name, metadata=metadata, overwrite=overwrite) as txn:
                self.write_state(txn, {})
            assert self.writer is not None and txn.manifest is not None
            self.writer.done()
            if after is not None:
                after()
            return txn.manifest
        s.restart_clock()

        def begin() -> Transaction:
            return st.transaction(name, metadata=metadata, overwrite=overwrite)

        def finish(txn: Transaction, shards: dict[int, list[Shard]], can_commit: Callable[[], None]) -> Any:
            self.write_state(txn, shards)
            return txn.commit(check=can_commit)

        out = coordinated_save(s, st, self.leaves, self.shards, begin=begin, finish=finish,
                               name=shard_file, after=after)
        if isinstance(out, Manifest):
            return out
        return Manifest.from_bytes(out["manifest"].encode(), where=st.driver.describe(name))


    def run_part(self, st: Store, name: str, *, overwrite: Callable[[dict[str, Any]], bool],
                 decide: Callable[[], dict[str, Any]],
                 metadata: Callable[[dict[str, Any]], dict[str, Any]]) -> Manifest:
        """Multi-host, with ``every_process``: every process commits checkpoint ``name``
        in its own store ``st``, holding the state, the index, its own shard files, a
        copy of each shard it holds only as a replica, and :data:`~.format.PARTS_FILE`
        (every process's shard files with their sizes, CRC32Cs and writer; see
        :func:`~.coordination.coordinated_parts`), with ``metadata(decision)`` of
        process 0's ``decide()``, replacing a committed ``name`` if
        ``overwrite(decision)``; this process's manifest, once every process committed."""
        s = self.session
        assert s is not None and self.writer is not None
        s.restart_clock()

        def begin(decision: dict[str, Any]) -> Transaction:
            return st.transaction(name, metadata=metadata(decision), overwrite=overwrite(decision))

        def finish(txn: Transaction, shards: dict[int, list[Shard]], files: list[dict[str, Any]]) -> Manifest:
            self.write_state(txn, shards)
            txn.write_bytes(PARTS_FILE, json.dumps({"files": files}).encode())
            return txn.commit()

        out: Manifest = coordinated_parts(s, st, self.leaves, self.shards, decide=decide, begin=begin,
                                          finish=finish, name=shard_file, replicas=self.replicas)
        self.writer.done()
        return out


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
    timeout: float = DEFAULT_TIMEOUT,
    **storage_options: Any,
) -> Manifest:
    """Save ``tree`` atomically as checkpoint ``<store>/<name>``; returns its manifest.

    Leaves are streamed one after another straight from their buffers: no bytes object of
    the whole state and no second copy of it exist; extra memory is one write buffer plus
    a device-to-host copy of one ``jax.Array`` leaf at a time.

    In a multi-host ``jax.distributed`` job, every process calls it with the same
    arguments: each writes the shards it holds of the arrays sharded across processes
    (each distinct shard once), process 0 writes everything else and commits once every
    process has reported. A process that fails, dies or does not report within
    ``timeout`` seconds means no commit, and every surviving process raises
    :class:`~atomicstore.CoordinationError`.

    Args:
        url_or_path: ``<store root>/<checkpoint name>`` (local path or URL); with
            ``store``, the checkpoint's name alone, or a URL under ``store``'s root (any
            other raises :class:`~atomicstore.InvalidArgumentError`, nothing written).
        tree: a pytree of arrays (numpy, ml_dtypes, jax, sharded or not), Python scalars,
            str, bytes, None, in dicts/lists/tuples/namedtuples/registered nodes.
        overwrite: replace an existing checkpoint of that name atomically.
        metadata: JSON metadata stored in the manifest.
        cast_dtype: cast floating-point leaves to this dtype (e.g. ``"bfloat16"``).
        gather_fns: per-leaf function(s) applied before writing: a callable
            ``(path, leaf) -> leaf`` or a mapping ``"a/b/c" -> fn(leaf)``.
        progress: True for a progress line on stderr (when it is a terminal), or a
            callable receiving the bytes written so far.
        store: an already opened :class:`Store` to save into.
        timeout: multi-host only: seconds to wait for the other processes.
        **storage_options: passed to :func:`open_store` (a store is opened once per process
            for its root and options, then reused).
    """
    session = Session.begin(f"save of {url_or_path}", check_timeout(timeout))
    try:
        if store is not None:
            name = checkpoint_name(url_or_path, store)
        else:
            root, name = split_location(url_or_path)
        job = PreparedSave(tree, cast_dtype=cast_dtype, gather_fns=gather_fns, progress=progress, session=session)
        st = store if store is not None else store_at(root, **storage_options)
    except BaseException as exc:
        if session is not None:
            session.fail(exc)
        raise
    return job.run(st, name, overwrite=overwrite, metadata=metadata)
