"""Arrays sharded across processes: writing each process's shards, reading any region.

A ``jax.Array`` that no process holds whole is stored as one file per distinct shard
(raw C-order bytes). Of the copies of a shard on several devices only the one with
``replica_id == 0`` is written, so the bytes on storage are the array's bytes. Each file
is checksummed whole (CRC32C, in the manifest) and per block of :data:`SHARD_BLOCK`
bytes (in the index), so a reader can fetch just the byte range a region needs, in
parallel, and still verify every byte it uses.

Nothing here coordinates processes (:mod:`.coordination` does) or knows a layout (the
writer and ``compat.flax`` name the files).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..commit.adapters import open_attempt_file
from ..commit.manifest import crc32c, crc32c_combine
from ..commit.store import Checkpoint, Store
from ..errors import ChecksumMismatchError, CorruptionError, InvalidArgumentError
from .dtypes import is_float
from .format import SHARD_BLOCK, Shard, aligned_empty, bytes_view
from .tree import Path, device_put_owned, is_jax_array, path_str, rebuild

#: ranged reads of one shard are split into pieces of about this size, read in parallel
READ_PIECE = 4 * SHARD_BLOCK


def is_multiprocess_array(x: Any) -> bool:
    """A ``jax.Array`` that this process cannot see whole."""
    return is_jax_array(x) and not getattr(x, "is_fully_addressable", True)


@dataclass(frozen=True)
class ShardedLeaf:
    """Stands in the host tree for an array sharded across processes: the ``n``-th such
    array of the tree, at key path ``key``."""

    n: int
    key: str
    dtype: np.dtype
    shape: tuple[int, ...]

    def describe(self) -> list[Any]:
        return [self.n, self.key, self.dtype.name, list(self.shape)]


@dataclass
class LocalShard:
    """A shard this process writes: of sharded array ``n``, at ``start``; ``data`` a
    jax single-device array until :meth:`host` copies it (or a numpy array)."""

    n: int
    start: tuple[int, ...]
    data: Any
    cast: np.dtype | None = None

    def host(self) -> np.ndarray:
        arr = np.asarray(self.data)
        if self.cast is not None and arr.dtype != self.cast:
            arr = arr.astype(self.cast)
        # (not np.ascontiguousarray, which turns a 0-d array into a 1-d one)
        return arr if arr.flags.c_contiguous else np.array(arr, order="C")


def split_tree(tree: Any, *, cast_dtype: np.dtype | None = None,
               gather: Callable[[Path, Any], Any] | None = None) -> tuple[Any, list[ShardedLeaf], list[Any]]:
    """(``tree`` with each array sharded across processes replaced by a
    :class:`ShardedLeaf`, those leaves, the arrays). ``gather`` runs first (a leaf it
    gathers to host is not sharded any more); floating arrays are recorded with
    ``cast_dtype``."""
    leaves: list[ShardedLeaf] = []
    arrays: list[Any] = []

    def fn(path: Path, leaf: Any) -> Any:
        if gather is not None:
            leaf = gather(path, leaf)
        if not is_multiprocess_array(leaf):
            return leaf
        dt = np.dtype(leaf.dtype)
        if cast_dtype is not None and is_float(dt):
            dt = cast_dtype
        if dt.hasobject or dt.fields is not None:
            raise InvalidArgumentError(f"leaf {path_str(path)}: object and structured dtypes cannot be saved")
        sl = ShardedLeaf(len(leaves), path_str(path), dt, tuple(int(d) for d in leaf.shape))
        leaves.append(sl)
        arrays.append(leaf)
        return sl

    return rebuild(tree, fn), leaves, arrays


def _start(sh: Any, arr: Any) -> tuple[int, ...]:
    return tuple(s.indices(n)[0] for s, n in zip(sh.index, arr.shape, strict=True)) if arr.ndim else ()


def _picked(leaves: list[ShardedLeaf], arrays: list[Any], to_host: bool,
            pick: Callable[[Any], list[tuple[tuple[int, ...], Any]]]) -> list[LocalShard]:
    """The shards ``pick(array)`` gives (``(start, data)`` pairs), as LocalShards;
    with ``to_host`` copied to host now (all transfers started first)."""
    out = []
    for leaf, arr in zip(leaves, arrays, strict=True):
        cast = leaf.dtype if leaf.dtype != np.dtype(arr.dtype) else None
        for start, data in pick(arr):
            if to_host:
                data.copy_to_host_async()
            out.append(LocalShard(leaf.n, start, data, cast))
    if to_host:
        for o in out:
            o.data = o.host()
            o.cast = None
    return out


def local_shards(leaves: list[ShardedLeaf], arrays: list[Any], *, to_host: bool) -> list[LocalShard]:
    """This process's share: every addressable shard with ``replica_id`` 0. With
    ``to_host`` they are copied to host now (all transfers started first: the snapshot
    of an async save); otherwise each is copied when it is written."""
    return _picked(leaves, arrays, to_host,
                   lambda arr: [(_start(sh, arr), sh.data) for sh in arr.addressable_shards if sh.replica_id == 0])


def replica_shards(leaves: list[ShardedLeaf], arrays: list[Any], *, to_host: bool) -> list[LocalShard]:
    """The shards this process holds only as replicas (``replica_id`` != 0 on every one
    of its devices: another process writes them), one per distinct index: what a process
    needs besides its own share to read the arrays back alone, as laid out (a tiered
    manager's local part)."""

    def pick(arr: Any) -> list[tuple[tuple[int, ...], Any]]:
        seen: dict[tuple[int, ...], Any] = {}
        mine = set()
        for sh in arr.addressable_shards:
            start = _start(sh, arr)
            if sh.replica_id == 0:
                mine.add(start)
            seen.setdefault(start, sh.data)
        return [(start, data) for start, data in seen.items() if start not in mine]

    return _picked(leaves, arrays, to_host, pick)


def write_shard(store: Store, prefix: str, file: str, data: np.ndarray, block: int = SHARD_BLOCK
                ) -> tuple[int, int, list[int]]:
    """Write ``data``'s bytes to ``<prefix>/<file>`` (a file of the attempt staged at
    ``prefix``, through the commit layer) straight from its buffer, durable when this
    returns; (size, CRC32C, per-block CRC32C)."""
    mv = bytes_view(data)
    blocks = [crc32c(mv[i : i + block]) for i in range(0, mv.nbytes, block)]
    whole = 0
    for i, c in enumerate(blocks):
        whole = crc32c_combine(whole, c, min(block, mv.nbytes - i * block))
    w = open_attempt_file(store, prefix, file)
    try:
        for i in range(0, max(mv.nbytes, 1), block):
            w.write(mv[i : i + block])
        w.close()
    except BaseException:
        w.abort()
        raise
    return mv.nbytes, whole, blocks


def write_shards(store: Store, prefix: str, shards: list[LocalShard], name: Callable[[int, tuple[int, ...]], str],
                 threads: int = 8) -> list[dict[str, Any]]:
    """Write each shard to ``<prefix>/<name(n, start)>`` (several at once); their reports:
    ``{"n", "file", "start", "shape", "size", "crc32c", "blocks"}``."""

    def one(o: LocalShard) -> dict[str, Any]:
        data = o.host()  # copied to host here, one shard per thread at a time
        file = name(o.n, o.start)
        size, crc, blocks = write_shard(store, prefix, file, data)
        return {"n": o.n, "file": file, "start": list(o.start), "shape": list(data.shape), "size": size,
                "crc32c": crc, "blocks": blocks}

    if len(shards) <= 1 or threads <= 1:
        return [one(o) for o in shards]
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(shards))) as pool:
        return list(pool.map(one, shards))


def assemble(reports: list[dict[str, Any]], leaves: list[ShardedLeaf]) -> dict[int, list[Shard]]:
    """The shards of each sharded array from every process's reports."""
    out: dict[int, list[Shard]] = {leaf.n: [] for leaf in leaves}
    for r in reports:
        if r["n"] not in out:
            raise ValueError(f"a report names array {r['n']}, which is not sharded")
        out[r["n"]].append(Shard(r["file"], tuple(r["start"]), tuple(r["shape"]), r["crc32c"],
                                 tuple(r["blocks"]) if r.get("blocks") is not None else None))
    return out


# -- reading ---------------------------------------------------------------------------------
def run_jobs(jobs: list[Callable[[], None]], threads: int) -> None:
    """Run ``jobs`` on up to ``threads`` threads (in this thread when there is one job);
    the first error is raised."""
    if len(jobs) <= 1 or threads <= 1:
        for j in jobs:
            j()
        return
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(jobs))) as pool:
        for fut in [pool.submit(j) for j in jobs]:
            fut.result()


Box = tuple[tuple[int, int], ...]


def norm_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A device's index (tuple of slices) as ((lo, hi), ...) per axis."""
    idx = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(idx, shape, strict=True))


class ShardReader:
    """Reads regions of one sharded array of a committed checkpoint: only the byte
    ranges of the shard files a region needs, several at once, each block verified."""

    def __init__(self, ckpt: Checkpoint, leaf: str, dtype: np.dtype, shape: tuple[int, ...],
                 shards: list[Shard], threads: int = 8) -> None:
        self.ckpt, self.leaf, self.dtype, self.shape = ckpt, leaf, dtype, shape
        self.shards, self.threads = shards, threads

    # one job: fill ``out`` with bytes [lo, hi) of a shard file
    def _span(self, s: Shard, lo: int, hi: int, out: memoryview) -> None:
        if s.blocks is None:  # no block checksums (older _gda): the whole file, checked whole
            whole = bytearray(math.prod(s.shape) * self.dtype.itemsize)
            self.ckpt.read_into(s.file, whole)
            out[:] = memoryview(whole)[lo:hi]
            return
        b0, b1 = lo // s.block, -(-hi // s.block)
        a, z = b0 * s.block, min(b1 * s.block, math.prod(s.shape) * self.dtype.itemsize)
        direct = a == lo and z == hi
        buf = out if direct else memoryview(bytearray(z - a))
        self.ckpt.read_range_into(s.file, a, buf)
        for i in range(b0, b1):
            part = buf[i * s.block - a : min((i + 1) * s.block, z) - a]
            if crc32c(part) != s.blocks[i]:
                raise ChecksumMismatchError(
                    f"{self.ckpt.where(s.file)}: block {i} of array {self.leaf} fails its CRC32C check",
                    path=s.file, leaf=self.leaf)
        if not direct:
            out[:] = buf[lo - a : hi - a]

    def read(self, regions: list[Box]) -> list[np.ndarray]:
        """One fresh array per region ((lo, hi) per axis)."""
        rank = len(self.shape)
        outs = [aligned_empty([hi - lo for lo, hi in box], self.dtype) for box in regions]
        jobs: list[Callable[[], None]] = []
        copies: list[Callable[[], None]] = []
        item = self.dtype.itemsize
        for box, res in zip(regions, outs, strict=True):
            filled = 0
            for s in self.shards:
                inter = [(max(st, lo), min(st + n, hi)) for st, n, (lo, hi) in zip(s.start, s.shape, box, strict=True)]
                if any(a >= b for a, b in inter) and rank:
                    continue
                count = math.prod(b - a for a, b in inter)
                if not count:
                    continue
                filled += count
                if rank == 0 or [list(b) for b in box] == [[st, st + n] for st, n in zip(s.start, s.shape, strict=True)]:
                    # the region is this shard (the same sharding as at save time): read into place
                    flat = bytes_view(res)
                    jobs += self._pieces(s, 0, flat.nbytes, flat)
                    continue
                # rows [r0, r1) of the shard's first axis hold the intersection
                r0, r1 = inter[0][0] - s.start[0], inter[0][1] - s.start[0]
                row = math.prod(s.shape[1:]) * item
                tmp = np.empty((r1 - r0, *s.shape[1:]), self.dtype)
                jobs += self._pieces(s, r0 * row, r1 * row, bytes_view(tmp))
                src = (slice(None),) + tuple(slice(a - st, b - st) for (a, b), st in zip(inter[1:], s.start[1:], strict=True))
                dst = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, box, strict=True))
                copies.append(functools.partial(_copy, res, dst, tmp, src))
            if filled != res.size:
                raise CorruptionError(f"{self.ckpt.where('')}: the shards of {self.leaf} do not cover the region "
                                      f"{box}", leaf=self.leaf)
        run_jobs(jobs, self.threads)
        for c in copies:
            c()
        return outs

    def _pieces(self, s: Shard, lo: int, hi: int, out: memoryview) -> list[Callable[[], None]]:
        """Jobs reading [lo, hi) of ``s`` into ``out``, in block-aligned pieces."""
        if s.blocks is None or hi - lo <= READ_PIECE:
            return [functools.partial(self._span, s, lo, hi, out)]
        cuts = [lo, *range((lo // READ_PIECE + 1) * READ_PIECE, hi, READ_PIECE), hi]
        return [functools.partial(self._span, s, a, b, out[a - lo : b - lo]) for a, b in zip(cuts, cuts[1:], strict=False)]


def _copy(res: np.ndarray, dst: tuple[slice, ...], tmp: np.ndarray, src: tuple[slice, ...]) -> None:
    res[dst] = tmp[src]


def restore_array(reader: ShardReader, target: Any) -> Any:
    """The array onto ``target``'s sharding when it has one (a ``jax.Array`` or a
    ``jax.ShapeDtypeStruct`` with a sharding): each process reads only what its devices
    hold; otherwise the whole array as numpy."""
    sharding = getattr(target, "sharding", None) if target is not None else None
    shape = reader.shape
    if sharding is None:
        return reader.read([tuple((0, n) for n in shape)])[0]
    import jax

    if tuple(target.shape) != shape:
        raise InvalidArgumentError(f"{reader.leaf}: the target's shape {tuple(target.shape)} is not the saved {shape}")
    index_map = sharding.addressable_devices_indices_map(shape)
    regions = list({norm_index(idx, shape): None for idx in index_map.values() if idx is not None})
    data = dict(zip(regions, reader.read(regions), strict=True))
    # each buffer is ours alone: let the device array use it without another copy
    return jax.make_array_from_single_device_arrays(shape, sharding, [
        device_put_owned(data[norm_index(idx, shape)], dev)
        for dev, idx in index_map.items() if idx is not None])


__all__ = [
    "LocalShard",
    "ShardReader",
    "ShardedLeaf",
    "assemble",
    "is_multiprocess_array",
    "local_shards",
    "restore_array",
    "run_jobs",
    "split_tree",
    "write_shard",
    "write_shards",
]
