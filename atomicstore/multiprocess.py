"""Arrays sharded across processes (``jax.distributed``): flax's ``_gda`` case.

Layout, in flax's vocabulary (``docs/multiprocess.md`` has the details)::

    <prefix><step>          the main state, flax's msgpack; a sharded array is the string
                            "//GDAPlaceholder:<key/path>" (flax's placeholder)
    <prefix><step>_gda/     one atomicstore checkpoint (manifest with size + CRC32C per
                            file, committed by rename or by a conditional marker):
        arrays.json         per array: key path, dtype, global shape, its shard files
        a<i>/<offsets>.bin  one file per distinct shard, raw C-order bytes

Save protocol (every process calls it, in the same order):

1. process 0 checks the step against flax's rules, opens the ``_gda`` transaction (its
   lease protects the attempt) and publishes the attempt id in the coordination
   service's key-value store;
2. every process writes the shards it holds whose ``replica_id`` is 0 (so each distinct
   shard is written exactly once) under the attempt's prefix, fsynced, and publishes
   their names, sizes and CRC32C, or its error;
3. process 0 waits for every report, adopts the files into the manifest, commits the
   ``_gda`` checkpoint, then commits the main file (the step's commit point), applies
   retention, and publishes the outcome, which every process waits for and returns or
   raises.

A process that fails reports it; one that dies or hangs is noticed when ``timeout``
runs out. Either way nothing is committed, every process raises
:class:`~atomicstore.CoordinationError`, and recovery later removes the attempt (after
its lease expires) or an orphaned ``_gda`` directory whose main file never appeared.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from .commit import Store
from .commit.manifest import crc32c
from .errors import (
    CommitConflictError,
    CoordinationError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
)
from .pytree.dtypes import parse_dtype
from .pytree.tree import Path, is_jax_array, rebuild, walk_leaves

log = logging.getLogger("atomicstore.multiprocess")

MP_ARRAY_PH = "//GDAPlaceholder:"
MP_ARRAY_POSTFIX = "_gda"
ARRAYS_FILE = "arrays.json"
ARRAYS_FORMAT = "atomicstore.gda/1"
DEFAULT_TIMEOUT = 300.0
_seq = itertools.count()


def is_multiprocess_array(x: Any) -> bool:
    """A ``jax.Array`` that this process cannot see whole."""
    return is_jax_array(x) and not getattr(x, "is_fully_addressable", True)


def _key(path: Path) -> str:
    return "/".join(str(k) for k in path)


def has_placeholders(tree: Any) -> bool:
    return any(isinstance(v, str) and v.startswith(MP_ARRAY_PH) for _, v in walk_leaves(tree))


# -- coordination through jax.distributed's key-value store -------------------------------------
class _Coordinator:
    """Key-value messages between the processes of one save, namespaced by a sequence
    number every process draws in the same order."""

    def __init__(self, what: str, timeout: float) -> None:
        import jax
        from jax._src import distributed

        self.client: Any = distributed.global_state.client
        self.index, self.count = jax.process_index(), jax.process_count()
        if self.count > 1 and self.client is None:
            raise InvalidArgumentError("several JAX processes but no jax.distributed client: "
                                       "call jax.distributed.initialize() first")
        self.ns = f"atomicstore/{what}/{next(_seq)}"
        self.timeout = timeout

    def put(self, key: str, value: Any) -> None:
        if self.count > 1:
            self.client.key_value_set(f"{self.ns}/{key}", json.dumps(value))

    def get(self, key: str, who: str, deadline: float) -> Any:
        ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            return json.loads(self.client.blocking_key_value_get(f"{self.ns}/{key}", ms))
        except Exception as exc:  # noqa: BLE001 - jax raises its runtime error type
            raise CoordinationError(
                f"{who} did not report within {self.timeout:.0f}s (it died, hung or is not "
                f"saving): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None


# -- saving ---------------------------------------------------------------------------------
def _split(target: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """(tree with placeholders, [(key path, array)]) for the arrays sharded across processes."""
    found: list[tuple[str, Any]] = []

    def fn(path: Path, leaf: Any) -> Any:
        if is_multiprocess_array(leaf):
            found.append((_key(path), leaf))
            return MP_ARRAY_PH + _key(path)
        return leaf

    return rebuild(target, fn), found


def _local_shards(arrays: list[tuple[str, Any]]) -> list[dict]:
    """This process's share: every addressable shard with replica_id 0, copied to host
    (all transfers started first)."""
    out = []
    for i, (_, arr) in enumerate(arrays):
        for sh in arr.addressable_shards:
            if sh.replica_id != 0:
                continue
            sh.data.copy_to_host_async()
            start = [s.indices(n)[0] for s, n in zip(sh.index, arr.shape, strict=True)] if arr.ndim else []
            out.append({"array": i, "start": start, "data": sh.data})
    for o in out:
        o["data"] = np.asarray(o["data"])
        o["file"] = f"a{o['array']}/" + ("_".join(map(str, o["start"])) or "0") + ".bin"
    return out


def _write_shards(st: Store, prefix: str, shards: list[dict], threads: int = 8) -> list[dict]:
    def one(o: dict) -> dict:
        data = np.ascontiguousarray(o["data"])
        mv = memoryview(data.view(np.uint8).reshape(-1)) if data.size else memoryview(b"")  # type: ignore[arg-type]
        w = st.driver.open_writer(f"{prefix}/{o['file']}")
        try:
            w.write(mv)
            w.close()  # durable before it is reported
        except BaseException:
            w.abort()
            raise
        return {"file": o["file"], "array": o["array"], "start": o["start"], "shape": list(data.shape),
                "size": mv.nbytes, "crc32c": crc32c(mv)}

    if len(shards) <= 1 or threads <= 1:  # no pool for one shard: it is written right here
        return [one(o) for o in shards]
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(shards))) as pool:
        return list(pool.map(one, shards))


def save_checkpoint_multiprocess(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: int | float,
    prefix: str = "checkpoint_",
    keep: int = 1,
    overwrite: bool = False,
    keep_every_n_steps: int | None = None,
    async_manager: Any = None,
    orbax_checkpointer: Any = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> str:
    """Save ``target`` from every process (see the module docstring). Returns the main
    file's path. Raises :class:`~atomicstore.CoordinationError` on every process if any
    process fails, dies or does not report within ``timeout`` seconds; nothing is
    committed then."""
    import jax

    from .compat import flax as compat
    from .manager import WRITE_EVENT, _check_step, _record, _snapshot, check_retention

    if orbax_checkpointer is not None:
        raise InvalidArgumentError("orbax_checkpointer is not supported: atomicstore writes flax's legacy format")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise InvalidArgumentError("timeout must be a positive number of seconds")
    state, arrays = _split(target)
    if jax.process_count() == 1 and not arrays:
        return compat.save_checkpoint(ckpt_dir, target, step, prefix, keep, overwrite, keep_every_n_steps,
                                      async_manager, storage_options=storage_options)
    check_retention(prefix, keep, keep_every_n_steps)
    step = _check_step(step)
    ckpt_dir = compat.safe_normpath(compat._fspath(ckpt_dir))
    name = f"{prefix}{step}"
    path = compat._join(ckpt_dir, name)
    start = time.monotonic()
    if async_manager:
        async_manager.wait_previous_save()
    coord = _Coordinator(f"save/{name}", float(timeout))
    main = coord.index == 0
    st = compat._store(ckpt_dir, storage_options, prefix if main else None)
    shards = _local_shards(arrays)  # the device-to-host snapshot
    state = _snapshot(state, True) if main and async_manager else state
    meta = {"format": ARRAYS_FORMAT, "arrays": [
        {"key": k, "dtype": np.dtype(a.dtype).name, "shape": list(a.shape)} for k, a in arrays]}

    def task() -> None:
        deadline = time.monotonic() + timeout
        if main:
            _save_main(coord, st, prefix, name, path, state, meta, shards, overwrite, deadline)
            compat._remove_invalid(st, name, prefix, keep, overwrite, keep_every_n_steps)
            coord.put("outcome", {"ok": True})
        else:
            _save_other(coord, st, name, shards, deadline)
        _record(WRITE_EVENT, time.monotonic() - start)

    if async_manager:
        async_manager.save_async(task)
    else:
        task()
    return path


def _save_main(coord: _Coordinator, st: Store, prefix: str, name: str, path: str, state: Any, meta: dict,
               shards: list[dict], overwrite: bool, deadline: float) -> None:
    from .compat import flax as compat
    from .pytree.api import StateWriter

    gda = name + MP_ARRAY_POSTFIX
    txn = None
    try:
        compat._check_newer(st, prefix, name, path, name[len(prefix):], overwrite)
        try:
            txn = st.transaction(gda, overwrite=overwrite)
        except CommitConflictError:
            raise CommitConflictError(
                f"step {name} is being saved (or was saved) by another job: {gda} is committed. "
                "If a crashed save left it without its main file, recovery removes it after "
                "its grace period; pass overwrite=True to replace it",
                name=gda,
            ) from None
        coord.put("plan", {"prefix": txn.prefix})
        reports = [{"files": _write_shards(st, txn.prefix, shards)}]
        for i in range(1, coord.count):
            reports.append(coord.get(f"report/{i}", f"process {i}", deadline))
        for i, rep in enumerate(reports):
            if "error" in rep:
                raise CoordinationError(f"process {i} failed to write its shards: {rep['error']}")
        for a in meta["arrays"]:
            a["shards"] = []
        for rep in reports:
            for e in rep["files"]:
                txn.adopt(e["file"], e["size"], e["crc32c"])
                meta["arrays"][e["array"]]["shards"].append({"file": e["file"], "start": e["start"], "shape": e["shape"]})
        _check_coverage(meta, where=st.driver.describe(gda))
        txn.write_bytes(ARRAYS_FILE, json.dumps(meta).encode())
        txn.commit()
        state = _bind(state, txn.attempt)  # the main file names the arrays' attempt
        with st.one_file(name, overwrite=overwrite) as f:  # the commit point of the step
            StateWriter(state, sort_keys=False).write(f)
    except BaseException as exc:
        why = f"{type(exc).__name__}: {exc}"
        if txn is None:
            coord.put("plan", {"error": why})
        elif not txn.committed:
            txn.abort()
        coord.put("outcome", {"ok": False, "error": why})
        raise


def _bind(state: Any, attempt: str) -> Any:
    """``state`` with every placeholder naming the ``_gda`` attempt its arrays are in."""
    return rebuild(state, lambda _p, v: f"{v}@{attempt}"
                   if isinstance(v, str) and v.startswith(MP_ARRAY_PH) else v)


_BOUND = re.compile(r"(?s)(.*)@(\d{8}T\d{6}-[0-9a-f]{12})")


def _parse_placeholder(leaf: str) -> tuple[str, str | None]:
    """(array key, ``_gda`` attempt or None for files written before attempts were named)."""
    body = leaf[len(MP_ARRAY_PH):]
    m = _BOUND.fullmatch(body)
    return (m.group(1), m.group(2)) if m else (body, None)


def _save_other(coord: _Coordinator, st: Store, name: str, shards: list[dict], deadline: float) -> None:
    plan = coord.get("plan", "process 0", deadline)
    if "error" in plan:
        raise CoordinationError(f"process 0 refused the save of {name}: {plan['error']}")
    try:
        coord.put(f"report/{coord.index}", {"files": _write_shards(st, plan["prefix"], shards)})
    except BaseException as exc:
        coord.put(f"report/{coord.index}", {"error": f"{type(exc).__name__}: {exc}"})
        raise
    outcome = coord.get("outcome", "process 0", deadline)
    if not outcome.get("ok"):
        raise CoordinationError(f"the save of {name} was not committed: {outcome.get('error')}")


def _check_coverage(meta: dict, where: str) -> None:
    """Every array's shards add up to the whole array (no missing or doubled shard)."""
    for a in meta["arrays"]:
        total = int(np.prod(a["shape"], dtype=np.int64))
        got = sum(int(np.prod(s["shape"], dtype=np.int64)) for s in a["shards"])
        starts = [tuple(s["start"]) for s in a["shards"]]
        if got != total or len(set(starts)) != len(starts):
            raise CoordinationError(f"{where}: the shards of {a['key']} cover {got} of {total} elements")


# -- restoring --------------------------------------------------------------------------------
class _Arrays:
    """The ``_gda`` checkpoint of one step: reads (checksummed, whole shard files, in
    parallel) the shards overlapping the regions asked for."""

    def __init__(self, st: Store, name: str, threads: int = 8) -> None:
        gda = name + MP_ARRAY_POSTFIX
        try:
            self.ckpt = st.open(gda)
        except NotFoundError:
            raise CorruptionError(f"{st.driver.describe(name)} has sharded arrays but {gda} is not committed",
                                  path=gda) from None
        where = self.ckpt.where(ARRAYS_FILE)
        try:
            meta = json.loads(self.ckpt.read_bytes(ARRAYS_FILE))
            if meta["format"] != ARRAYS_FORMAT:
                raise ValueError(f"format {meta['format']!r}")
            self.arrays = {a["key"]: a for a in meta["arrays"]}
            for a in self.arrays.values():
                a["dtype_"] = parse_dtype(a["dtype"], path=ARRAYS_FILE, leaf=str(a["key"]), where=where)
                a["shape"] = tuple(_count(n) for n in a["shape"])
                for s in a["shards"]:
                    start, shape = [_count(n) for n in s["start"]], [_count(n) for n in s["shape"]]
                    if len(start) != len(a["shape"]) or len(shape) != len(a["shape"]):
                        raise ValueError(f"shard {s['file']} has the wrong rank")
                    if any(b + n > g for b, n, g in zip(start, shape, a["shape"], strict=True)):
                        raise ValueError(f"shard {s['file']} lies outside its array")
                    entry = self.ckpt.files.get(s["file"])
                    if entry is None:
                        raise ValueError(f"shard {s['file']} is not in the manifest")
                    # every length read from storage is checked before anything is allocated
                    if math.prod(shape) * a["dtype_"].itemsize != entry.size:
                        raise ValueError(f"shard {s['file']} does not have the size of its shape")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise CorruptionError(f"{where}: unreadable array index: {exc}", path=ARRAYS_FILE) from None
        self.threads = threads

    def info(self, key: str) -> dict:
        try:
            return self.arrays[key]
        except KeyError:
            raise CorruptionError(f"{self.ckpt.where(ARRAYS_FILE)}: no array {key!r}", path=ARRAYS_FILE,
                                  leaf=key) from None

    def read(self, key: str, regions: list[tuple[slice, ...]]) -> list[np.ndarray]:
        a = self.info(key)
        shape = a["shape"]
        boxes = [tuple(r.indices(n)[:2] for r, n in zip(reg, shape, strict=True)) for reg in regions]

        def overlaps(s: dict, box: tuple) -> bool:
            return all(st_ < hi and st_ + n > lo for st_, n, (lo, hi) in
                       zip(s["start"], s["shape"], box, strict=True))

        needed = {s["file"]: s for s in a["shards"] if any(overlaps(s, b) for b in boxes)}

        def fetch(s: dict) -> np.ndarray:
            buf = np.empty(s["shape"], a["dtype_"])
            self.ckpt.read_into(s["file"], buf.view(np.uint8).reshape(-1) if buf.size else bytearray())
            return buf

        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.threads, len(needed)))) as pool:
            data = dict(zip(needed, pool.map(fetch, needed.values()), strict=True))
        out = []
        for box in boxes:
            exact = [f for f, s in needed.items()
                     if [list(b) for b in box] == [[st_, st_ + n] for st_, n in zip(s["start"], s["shape"], strict=True)]]
            if exact:  # the region is one saved shard (same sharding as at save time): no copy
                out.append(data[exact[0]])
                continue
            res = np.empty([hi - lo for lo, hi in box], a["dtype_"])
            filled = 0
            for f, s in needed.items():
                if not overlaps(s, box):
                    continue
                src, dst = [], []
                for st_, n, (lo, hi) in zip(s["start"], s["shape"], box, strict=True):
                    a0, a1 = max(st_, lo), min(st_ + n, hi)
                    src.append(slice(a0 - st_, a1 - st_))
                    dst.append(slice(a0 - lo, a1 - lo))
                res[tuple(dst)] = data[f][tuple(src)]
                filled += int(np.prod([d.stop - d.start for d in dst], dtype=np.int64))
            if filled != res.size:
                raise CorruptionError(f"{self.ckpt.where('')}: the shards of {key} do not cover the region "
                                      f"{box}", path=ARRAYS_FILE, leaf=key)
            out.append(res)
        return out


def restore_placeholders(st: Store, name: str, tree: Any, target: Any, *, allow_partial: bool = False,
                         threads: int = 8) -> Any:
    """Replace each placeholder in ``tree`` (restored from main file ``name``) by its
    array: with the target's sharding where the target has a ``jax.Array`` or
    ``jax.ShapeDtypeStruct`` with a sharding there (each process reads only the shards
    its devices need), else as a full numpy array."""
    arrays = _Arrays(st, name, threads)
    targets = dict(walk_leaves(target)) if target is not None else {}
    str_targets = {tuple(str(k) for k in p): v for p, v in targets.items()}

    def fill(path: Path, leaf: Any) -> Any:
        if not (isinstance(leaf, str) and leaf.startswith(MP_ARRAY_PH)):
            return leaf
        key, attempt = _parse_placeholder(leaf)
        if attempt is not None and attempt != arrays.ckpt.manifest.attempt:
            raise CorruptionError(
                f"{st.driver.describe(name)} was saved with the arrays of attempt {attempt}, but "
                f"{name}{MP_ARRAY_POSTFIX} holds attempt {arrays.ckpt.manifest.attempt} (another "
                "job replaced them): refusing to mix two saves", path=name, leaf=key)
        a = arrays.info(key)
        t: Any = str_targets.get(tuple(str(k) for k in path))
        sharding = getattr(t, "sharding", None)
        if sharding is None:
            if target is not None and t is None and allow_partial:
                return leaf
            return arrays.read(key, [tuple(slice(None) for _ in a["shape"])])[0]
        import jax

        if tuple(t.shape) != a["shape"]:
            raise InvalidArgumentError(f"{key}: the target's shape {tuple(t.shape)} is not the saved {a['shape']}")
        index_map = sharding.addressable_devices_indices_map(a["shape"])
        regions = list({_norm(idx, a["shape"]): None for idx in index_map.values() if idx is not None})
        data = dict(zip(regions, arrays.read(key, [tuple(slice(lo, hi) for lo, hi in r) for r in regions]),
                        strict=True))
        # each buffer is ours alone: let the device array use it without another copy
        return jax.make_array_from_single_device_arrays(a["shape"], sharding, [
            jax.device_put(data[_norm(idx, a["shape"])], dev, may_alias=True)
            for dev, idx in index_map.items() if idx is not None])

    return rebuild(tree, fill)


def _count(n: Any) -> int:
    """A non-negative int from storage (a dimension or an offset), else ValueError."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 2**62:
        raise ValueError(f"bad dimension {n!r}")
    return n


def _norm(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    idx = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(idx, shape, strict=True))


__all__ = [
    "MP_ARRAY_PH",
    "MP_ARRAY_POSTFIX",
    "has_placeholders",
    "is_multiprocess_array",
    "restore_placeholders",
    "save_checkpoint_multiprocess",
]
