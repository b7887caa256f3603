"""Reading a pytree: :func:`restore`.

Only the leaves asked for are read (by the target, a subtree, or all), from byte ranges
the index (:mod:`.format`) gives, several at once, each checked against its CRC32C.
Small leaves are read in coalesced batches. Arrays sharded across processes are read
from their shard files (:mod:`.sharded`): onto the target's sharding each process reads
only the byte ranges its devices hold, else the whole array as numpy. Legacy flax files
(no index) are scanned first.

A checkpoint replaced or deleted while it is read raises ``PreconditionFailedError``
(its files are gone or fail their checksums, and its commit point confirms it). In a
multi-host job the processes restore the save process 0 opened, or all of them raise
(:mod:`.coordination`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from ..commit import Manifest, Store
from ..commit.locator import locate
from ..commit.manifest import crc32c, crc32c_slices
from ..commit.store import Checkpoint
from ..drivers import FileInfo
from ..drivers.parts import no_huge_pages
from ..errors import (
    AtomicStoreError,
    CoordinationError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
)
from .coordination import DEFAULT_TIMEOUT, Session, agree, check_timeout
from .dtypes import parse_dtype
from .format import (
    EXT_COMPLEX,
    EXT_NPSCALAR,
    INDEX_FILE,
    INDEX_FORMAT,
    STATE_FILE,
    Index,
    Leaf,
    LeafKind,
    aligned_empty,
    bytes_view,
    index_of_msgpack,
    parse_index,
)
from .sharded import ShardReader, restore_array, run_jobs
from .tree import Path, device_put_owned, is_jax_array, path_str, per_leaf_fn, rebuild

#: leaves smaller than this are read in coalesced batches
SMALL_LEAF = 1 << 20
BATCH_BYTES = 8 << 20
Selector = str | Sequence[Any] | None


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

    def __init__(self, read_into: Callable[[int, memoryview], None], where: str, threads: int,
                 read_many: Callable[[list[tuple[int, memoryview]]], None] | None = None) -> None:
        self.read_into, self.where, self.threads, self.read_many = read_into, where, threads, read_many

    def _check(self, leaf: Leaf, data: memoryview, crc: int | None, part: int) -> None:
        if crc is not None and crc32c(data) != crc:
            raise CorruptionError(
                f"{self.where}: leaf {path_str(leaf.path)}"
                + (f" (chunk {part})" if leaf.kind == LeafKind.NDC else "")
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
        """The values of ``leaves`` (none sharded), by path: large ones read each alone,
        small ones in batches of neighbours, all at once on up to ``threads`` threads."""
        out: dict[Path, Any] = {}
        jobs: list[Callable[[], None]] = []
        batch: list[Leaf] = []
        bigs: list[Leaf] = []
        for lf in sorted(leaves, key=lambda lf: lf.ranges[0][0] if lf.ranges else -1):
            if lf.kind == LeafKind.LIT:
                out[lf.path] = lf.value
            elif lf.kind == LeafKind.NDC or (lf.kind == LeafKind.ND and lf.nbytes >= SMALL_LEAF):  # (ndc: several ranges)
                if self.read_many is not None:
                    bigs.append(lf)
                else:
                    jobs.append(functools.partial(self._read_big, lf, out))
            else:
                if batch and (lf.ranges[0][0] - (batch[-1].ranges[0][0] + batch[-1].ranges[0][1]) > 65536
                              or lf.ranges[0][0] + lf.ranges[0][1] - batch[0].ranges[0][0] > BATCH_BYTES):
                    jobs.append(functools.partial(self._read_batch, batch, out))
                    batch = []
                batch.append(lf)
        if batch:
            jobs.append(functools.partial(self._read_batch, batch, out))
        if bigs:
            jobs.insert(0, functools.partial(self._read_bigs, bigs, out))
        run_jobs(jobs, self.threads)
        return out

    def _read_bigs(self, leaves: list[Leaf], out: dict[Path, Any]) -> None:
        """Read the large leaves ``leaves`` into fresh aligned arrays by one call of
        :attr:`read_many` (every range's requests sent before any is awaited), then
        check each range's CRC32C."""
        assert self.read_many is not None
        arrays = []
        pairs: list[tuple[int, memoryview]] = []
        for lf in leaves:
            assert lf.dtype is not None
            arrays.append(arr := aligned_empty(lf.shape, lf.dtype))  # so that a device may alias it
            flat, pos = bytes_view(arr), 0
            no_huge_pages(flat)  # fresh, written once as the ranges come: no compaction
            for off, n, _ in lf.ranges:
                pairs.append((off, flat[pos : pos + n]))
                pos += n
        try:
            self.read_many(pairs)
        except CorruptionError:
            # A short read: a truncated file, or a reply cut short on its way. Read each
            # leaf again into the same array (no second copy of the state), the last in
            # the file first (a truncation cuts the end): the first that is short names
            # the leaf; if none is, the bytes are all here after all.
            for lf, arr in reversed(list(zip(leaves, arrays, strict=True))):
                self._read_big(lf, out, arr)
            return

        def check(lf: Leaf, arr: np.ndarray) -> None:
            flat, pos = bytes_view(arr), 0
            for i, (_, n, crc) in enumerate(lf.ranges):
                self._check(lf, flat[pos : pos + n], crc, i)
                pos += n
            out[lf.path] = arr[()] if lf.kind == LeafKind.SC else arr

        run_jobs([functools.partial(check, lf, arr) for lf, arr in zip(leaves, arrays, strict=True)],
                 min(self.threads, 4))

    def _read_batch(self, group: list[Leaf], out: dict[Path, Any]) -> None:
        """Read the one-range leaves ``group`` (in file order, close together) by one read
        of the span they lie in."""
        start = group[0].ranges[0][0]
        end = max(r[0] + r[1] for lf in group for r in lf.ranges)
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
            if lf.kind == LeafKind.PY:
                out[lf.path] = self._decode(lf, memoryview(buf)[rel : rel + n])
                continue
            assert lf.dtype is not None
            arr = base[rel : rel + n].view(lf.dtype).reshape(lf.shape)
            if not arr.flags.aligned:
                arr = arr.copy()
            out[lf.path] = arr[()] if lf.kind == LeafKind.SC else arr

    def _read_big(self, lf: Leaf, out: dict[Path, Any], arr: np.ndarray | None = None) -> None:
        """Read leaf ``lf`` alone, range by range, into ``arr`` (default: a fresh aligned
        array)."""
        assert lf.dtype is not None
        if arr is None:
            arr = aligned_empty(lf.shape, lf.dtype)  # so that a device may alias it
        flat = bytes_view(arr)
        pos = 0
        for i, (off, n, crc) in enumerate(lf.ranges):
            self._fetch(off, flat[pos : pos + n], lf)
            self._check(lf, flat[pos : pos + n], crc, i)
            pos += n
        out[lf.path] = arr[()] if lf.kind == LeafKind.SC else arr

    def _decode(self, lf: Leaf, view: memoryview) -> Any:
        if lf.kind == LeafKind.PY:
            try:
                return msgpack.unpackb(bytes(view), raw=False, ext_hook=_complex_hook, max_bin_len=view.nbytes)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, TypeError) as exc:
                raise CorruptionError(f"{self.where}: leaf {path_str(lf.path)} cannot be decoded ({exc})",
                                      path=STATE_FILE, leaf=path_str(lf.path)) from None
        assert lf.dtype is not None
        arr = np.frombuffer(view, dtype=lf.dtype).reshape(lf.shape).copy()
        return arr[()] if lf.kind == LeafKind.SC else arr


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
        if any(n[0] == 1 and n[2] == LeafKind.SH for n in doc["nodes"]):
            return _NO_FAST_PATH  # sharded arrays are not in the state file
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




def _open_here(st: Store, name: str) -> tuple[Checkpoint | None, FileInfo | None]:
    """(the committed checkpoint ``name``, None), or (None, the file's info) for a legacy
    flax checkpoint file."""
    try:
        try:
            return st.open(name, read_ahead=[INDEX_FILE]), None  # the index with the manifest
        except CorruptionError:
            # The marker read may name an attempt that an overwrite or a delete removed
            # right after: damage only if opening again, the commit point unchanged, fails
            # the same way (else the checkpoint that is there now, or NotFoundError)
            before = st.strategy.current(name)
            try:
                return st.open(name, read_ahead=[INDEX_FILE]), None
            except CorruptionError:
                if st.strategy.current(name) == before:
                    raise
                raise PreconditionFailedError(
                    f"{st.driver.describe(name)} was replaced or deleted while it was being opened, "
                    "twice: restore it again") from None
    except NotFoundError:
        # not one of ours: maybe a legacy flax checkpoint file
        if st.driver.exists(name):
            return None, st.driver.info(name)
        raise


def _choice(ckpt: Checkpoint | None, found: FileInfo | None) -> dict[str, Any]:
    """What process 0 opened, for the others (JSON)."""
    if ckpt is not None:
        return {"attempt": ckpt.manifest.attempt}
    assert found is not None
    return {"file": found.generation, "size": found.size}


def _open_as(st: Store, name: str, want: dict[str, Any]) -> tuple[Checkpoint | None, FileInfo | None]:
    """Open ``name`` as process 0 opened it (``want``, from :func:`_choice`), or raise
    :class:`PreconditionFailedError`: it was replaced or deleted in between."""
    where = st.driver.describe(name)
    if not isinstance(want, dict) or not ("attempt" in want or {"file", "size"} <= set(want)):
        raise CoordinationError(f"restore of {where}: process 0 published a malformed plan {want!r:.200}")
    try:
        ckpt, found = _open_here(st, name)
    except NotFoundError:
        ckpt, found = None, None
    here = _choice(ckpt, found) if ckpt is not None or found is not None else None
    if here is None or ("attempt" in want and here.get("attempt") != want["attempt"]) \
            or ("file" in want and (here.get("file"), here.get("size")) != (want["file"], want["size"])):
        raise PreconditionFailedError(
            f"{where} was replaced or deleted while it was being read: process 0 read "
            f"{_saved(want)}, this process finds {_saved(here) if here else 'nothing'}; restore it again")
    return ckpt, found


def _saved(choice: dict[str, Any]) -> str:
    return f"attempt {choice['attempt']}" if "attempt" in choice else f"file generation {choice.get('file')}"


def _replaced(ckpt: Checkpoint) -> str | None:
    """What ``ckpt``'s name holds now if that is not ``ckpt`` any more ('nothing' once
    deleted), read afresh; None while it is unchanged (or cannot be told)."""
    try:
        now = ckpt.store.strategy.current(ckpt.name)
    except AtomicStoreError:
        return None
    if now == ckpt.manifest.attempt:
        return None
    return f"attempt {now}" if now else "nothing"


def restore(
    url_or_path: str | os.PathLike[str],
    target: Any = None,
    *,
    subtree: Selector = None,
    allow_missing: bool = False,
    shard_fns: Any = None,
    threads: int | None = None,
    store: Store | None = None,
    collective: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    **storage_options: Any,
) -> Any:
    """Restore the checkpoint at ``<store>/<name>`` (ours, or a legacy flax msgpack file).

    In a multi-host ``jax.distributed`` job every process calls it with the same
    arguments: process 0 opens the checkpoint and the others read the very save it opened
    (shared through JAX's coordination service), so all of them restore one save. If the
    checkpoint is replaced or deleted before every process has read it, every process
    raises :class:`~atomicstore.PreconditionFailedError` (restore it again); if any
    process fails, every process raises.

    Args:
        url_or_path: ``<store root>/<checkpoint name>`` (local path or URL); with
            ``store``, the checkpoint's name alone, or a URL under ``store``'s root (any
            other raises :class:`~atomicstore.InvalidArgumentError`).
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
        threads: reader threads (default: 8 on local disk, each reading a leaf or a
            batch of small ones). On object stores one thread sends every large leaf's
            ranged requests, as many at once as the store's in-flight budget holds (by
            default 256 MiB: 64 of 4 MiB on S3, 32 of 8 MiB on GCS;
            ``max_inflight_bytes`` of :func:`open_store` sets it);
            ``threads`` then bounds the batches of small leaves read beside them.
        store: an already opened :class:`Store` to read from.
        collective: multi-host only: ``False`` reads in this process alone, without the
            others (e.g. in process 0 only); it is then not guaranteed to read the save
            the other processes read.
        timeout: multi-host only: seconds to wait for the other processes (after this
            process's own reading).
        **storage_options: passed to :func:`open_store` (a store is opened once per process
            for its root and options, then reused).

    Raises :class:`~atomicstore.CorruptionError` naming the file and leaf for damaged data,
    :class:`~atomicstore.PreconditionFailedError` when the checkpoint was replaced or
    deleted while it was being read (read it again).
    """
    return restore_with_manifest(url_or_path, target, subtree=subtree, allow_missing=allow_missing,
                                 shard_fns=shard_fns, threads=threads, store=store, collective=collective,
                                 timeout=timeout, **storage_options)[0]


def restore_with_manifest(
    url_or_path: str | os.PathLike[str],
    target: Any = None,
    *,
    subtree: Selector = None,
    allow_missing: bool = False,
    shard_fns: Any = None,
    threads: int | None = None,
    store: Store | None = None,
    collective: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    **storage_options: Any,
) -> tuple[Any, Manifest | None]:
    """:func:`restore`, and the manifest of the checkpoint it read (None for a legacy
    flax file): its metadata belongs to exactly the save the tree came from."""
    if not isinstance(collective, bool):
        raise InvalidArgumentError("collective must be a bool")
    session = Session.begin(f"restore of {url_or_path}", check_timeout(timeout)) if collective else None
    try:
        out = _restore(url_or_path, target, subtree=subtree, allow_missing=allow_missing, shard_fns=shard_fns,
                       threads=threads, store=store, storage_options=storage_options, session=session)
        if session is not None:
            agree(session)
    except BaseException as exc:
        if session is not None:
            session.fail(exc)
        raise
    return out


def _read_options(threads: Any, allow_missing: Any, shard_fns: Any, subtree: Selector
                  ) -> tuple[Callable[[Path, Any], Any] | None, Path]:
    """The read options checked: the per-leaf function and the root of the subtree."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise InvalidArgumentError("threads must be a positive int")
    if not isinstance(allow_missing, bool):
        raise InvalidArgumentError("allow_missing must be a bool")
    return per_leaf_fn(shard_fns, "shard_fns"), _select(subtree) or ()


def _restore(url_or_path: Any, target: Any, *, subtree: Selector, allow_missing: bool, shard_fns: Any,
             threads: int | None, store: Store | None, storage_options: dict[str, Any],
             session: Session | None) -> tuple[Any, Manifest | None]:
    post, root = _read_options(threads, allow_missing, shard_fns, subtree)
    st, name = locate(url_or_path, store=store, **storage_options)
    if session is not None and not session.main:
        ckpt, found = _open_as(st, name, session.await_plan())  # the save process 0 opened
    else:
        ckpt, found = _open_here(st, name)
        if session is not None:
            session.publish_plan(_choice(ckpt, found))
    if threads is None:
        threads = st.driver.capabilities.io_threads
    try:
        return _read(st, name, ckpt, found, target, root, allow_missing, post, threads), (
            ckpt.manifest if ckpt is not None else None)
    except (CorruptionError, NotFoundError) as exc:
        # a checkpoint replaced (or deleted) since it was opened: its files are gone or
        # hold another save's bytes (which fail their checksums): say so, not "damaged"
        if ckpt is None or (now := _replaced(ckpt)) is None:
            raise
        raise PreconditionFailedError(
            f"{st.driver.describe(name)} was replaced or deleted while it was being read (attempt "
            f"{ckpt.manifest.attempt} was read, it holds {now} now): restore it again") from exc


def _read(st: Store, name: str, ckpt: Checkpoint | None, found: FileInfo | None, target: Any, root: Path,
          allow_missing: bool, post: Callable[[Path, Any], Any] | None, threads: int) -> Any:
    """Read the tree of the opened checkpoint (or legacy file ``found``)."""
    read_into: Callable[[int, memoryview], None]
    read_many: Callable[[list[tuple[int, memoryview]]], None] | None = None
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
        files = ckpt.files
        idx = parse_index(raw_index, state_size, ckpt.where(INDEX_FILE),
                          sizes=lambda f: files[f].size if f in files else None)

        def read_state(off: int, mv: memoryview) -> None:
            ckpt.read_range_into(STATE_FILE, off, mv)

        def read_states(pairs: list[tuple[int, memoryview]]) -> None:
            ckpt.read_ranges_into(STATE_FILE, pairs, threads=threads)

        read_into = read_state
        if st.driver.capabilities.batched_reads:
            read_many = read_states
    else:
        assert found is not None
        where, idx, read_into = _legacy_index(st, name, found)
    reader = _Reader(read_into, where, threads, read_many)
    if target is None:
        return _read_subtree(reader, idx, ckpt, root, post)
    return _read_target(reader, idx, ckpt, target, root, allow_missing, post)


def _legacy_index(st: Store, name: str, found: FileInfo) -> tuple[str, Index, Callable[[int, memoryview], None]]:
    """(where, index, ranged reader) of the legacy flax file ``name`` whose info is
    ``found``: its index is built by scanning it."""
    drv = st.driver
    where = drv.describe(name)
    size, generation = found.size, found.generation

    def read_into(off: int, mv: memoryview) -> None:
        if off + mv.nbytes > size:
            raise CorruptionError(f"{where}: read past the end", path=where)
        # a one-file checkpoint is replaced in place: every range from the version whose
        # size we read (else PreconditionFailedError: read it again), never a mix
        if mv.nbytes and drv.read_into(name, off, mv, generation=generation) != mv.nbytes:
            raise CorruptionError(f"{where}: short read at byte {off}", path=where)

    def read(a: int, b: int) -> bytes:
        buf = bytearray(b - a)
        read_into(a, memoryview(buf))
        return bytes(buf)

    return where, index_of_msgpack(read, size, where), read_into


def _read_subtree(reader: _Reader, idx: Index, ckpt: Checkpoint | None, root: Path,
                  post: Callable[[Path, Any], Any] | None) -> Any:
    """Without a target: every leaf below ``root``, in plain containers."""
    if root and root not in idx.containers and root not in idx.leaves:
        # flax writes every key as a string
        cand = [p for p in [*idx.containers, *idx.leaves] if _match(p, root)]
        if not cand:
            raise NotFoundError(f"{reader.where}: no subtree {path_str(root)}")
        root = cand[0]
    wanted = [lf for p, lf in idx.leaves.items() if p[: len(root)] == root]
    values = reader.read([lf for lf in wanted if lf.kind != LeafKind.SH])
    for lf in wanted:
        if lf.kind == LeafKind.SH:  # as numpy, whole
            values[lf.path] = restore_array(_shard_reader(ckpt, lf, reader.threads), None)
    if post is not None:
        values = {p: post(p[len(root):], v) for p, v in values.items()}
    return _build(idx, values, root)


def _plan(idx: Index, target: Any, root: Path) -> tuple[dict[Path, Leaf | None], dict[Path, Any], list[str]]:
    """What to read for ``target`` (a tree below ``root``): (its leaf paths -> the
    checkpoint's leaf, None for a ``None`` the checkpoint holds as a container; its leaf
    paths -> its leaves; the checkpoint paths it lacks)."""
    by_str = {tuple(str(k) for k in p): lf for p, lf in idx.leaves.items()}
    containers_str = {tuple(str(k) for k in p) for p in idx.containers}
    missing: list[str] = []
    plan: dict[Path, Leaf | None] = {}
    targets: dict[Path, Any] = {}

    def note(path: Path, leaf: Any) -> Any:
        targets[path] = leaf
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
    return plan, targets, missing


def _read_target(reader: _Reader, idx: Index, ckpt: Checkpoint | None, target: Any, root: Path,
                 allow_missing: bool, post: Callable[[Path, Any], Any] | None) -> Any:
    """With a target: its leaves name what to read, and the result has its structure."""
    where = reader.where
    plan, targets, missing = _plan(idx, target, root)
    if missing and not allow_missing:
        raise NotFoundError(
            f"{where}: the checkpoint lacks {len(missing)} key(s) the target has: "
            + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
            + " (pass allow_missing=True to keep the target's values)"
        )
    leaves = [lf for lf in plan.values() if lf is not None]
    values = reader.read([lf for lf in leaves if lf.kind != LeafKind.SH])
    for path, planned in plan.items():
        if planned is not None and planned.kind == LeafKind.SH:  # onto the target's sharding, if it has one
            values[planned.path] = restore_array(_shard_reader(ckpt, planned, reader.threads),
                                                 targets.get(path) if post is None else None)

    def fill(path: Path, leaf: Any) -> Any:
        lf = plan.get(path)
        if lf is None:
            return leaf
        v = values[lf.path]
        if isinstance(v, np.ndarray) and post is None and (is_jax_array(leaf) or _has_sharding(leaf)):
            v = _onto(v, leaf)
        elif isinstance(leaf, np.ndarray) and isinstance(v, np.ndarray) and leaf.dtype != v.dtype:
            raise CorruptionError(f"{where}: leaf {path_str(lf.path)} is {v.dtype}, the target has {leaf.dtype}",
                                  path=STATE_FILE, leaf=path_str(lf.path))
        return post(path, v) if post is not None else v

    return rebuild(target, fill)


def _has_sharding(leaf: Any) -> bool:
    """A ``jax.ShapeDtypeStruct`` (or array) naming where the value goes."""
    return getattr(leaf, "sharding", None) is not None and hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _onto(v: np.ndarray, leaf: Any) -> Any:
    """``v`` (read whole) placed like ``leaf``."""
    import jax

    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return jax.numpy.asarray(v)
    if not sharding.is_fully_addressable:  # every process read it whole: each keeps its part
        return jax.make_array_from_callback(v.shape, sharding, lambda idx: v[idx])
    # v was just read into a buffer nobody else holds: the device may use it as is
    return device_put_owned(v, sharding)


def _shard_reader(ckpt: Checkpoint | None, lf: Leaf, threads: int) -> ShardReader:
    assert ckpt is not None and lf.dtype is not None
    return ShardReader(ckpt, path_str(lf.path), lf.dtype, lf.shape, list(lf.value), threads)



def restore_opened(ckpt: Checkpoint, target: Any = None, *, subtree: Selector = None, allow_missing: bool = False,
                   shard_fns: Any = None, threads: int | None = None) -> Any:
    """Restore the tree of an already opened checkpoint, in this process alone (no
    coordination), e.g. one whose manifest the caller completed (a tiered manager's
    local part, :data:`~.format.PARTS_FILE`). Arguments as for :func:`restore`."""
    post, root = _read_options(threads, allow_missing, shard_fns, subtree)
    if threads is None:
        threads = ckpt.store.driver.capabilities.io_threads
    return _read(ckpt.store, ckpt.name, ckpt, None, target, root, allow_missing, post, threads)


__all__ = ["restore", "restore_opened", "restore_with_manifest"]
