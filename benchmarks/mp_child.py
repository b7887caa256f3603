"""One process of the multi-process benchmark (started by benchmarks/run.py).

usage: mp_child.py PORT NPROC PID DIR BYTES REPEAT OUT_JSON

A float32 array of BYTES, shape (BYTES / 4096, 1024), sharded along its first axis over
one CPU device per process (each process holds 1/NPROC of it), is saved with the native
API (``atomicstore.save``; every process calls it, each writes its own shard) and
restored onto the same sharding (``atomicstore.restore`` with the array as target,
``block_until_ready``). NPROC=1 is the same bytes as one ``jax.Array`` in one process,
through the same calls. REPEAT times, each into a fresh checkpoint:

* ``save``: seconds for ``atomicstore.save`` (all processes start together, after a
  barrier); it returns once the checkpoint is committed (durable);
* ``restore``: seconds to restore onto the same sharding from the page cache (the save
  just wrote it: warm);
* ``restore_cold``: the same after every file of the checkpoint was evicted from the
  page cache (``posix_fadvise(DONTNEED)`` once fsynced: the pages are clean), so the
  bytes come from the disk;
* ``*_extra``: peak resident memory during the call minus the resident memory just
  before it (VmHWM, reset by writing "5" to /proc/self/clear_refs, minus VmRSS);
* ``written`` / ``restore_read``: bytes this process wrote during the save / read during
  the restore (``wchar`` / ``rchar`` of /proc/self/io: every read/write call);
* ``local``: the bytes of the array this process holds (what a restore must allocate);
* process 0 only: ``stored`` (bytes of every file of the committed checkpoint),
  ``shard_bytes`` (of its ``shards/`` files, or of ``state.msgpack`` for NPROC=1) and
  ``files``.

Writes ``{"pid", "local", "runs": [{...}, ...]}`` to OUT_JSON.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
import numpy as np  # noqa: E402

COLS = 1024


def status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Reset VmHWM to the current resident memory; return that."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def io() -> tuple[int, int]:
    """(bytes read, bytes written) by this process's read/write calls so far."""
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["rchar"]), int(d["wchar"])


def measured(fn: Callable[[], Any]) -> tuple[float, int, tuple[int, int], Any]:
    """(seconds, extra peak bytes, (bytes read, bytes written), result) of ``fn()``.
    Garbage of earlier calls is collected first (jax frees host buffers it copied from
    at the next collection), so that the resident memory before is what is in use."""
    gc.collect()
    r0, w0 = io()
    before = reset_peak()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    extra = max(0, status("VmHWM") - before)
    r1, w1 = io()
    return dt, extra, (r1 - r0, w1 - w0), out


def evict(path: str) -> None:
    """Drop the (clean, fsynced) pages of every file below ``path`` from the page cache."""
    for dp, _, fs in os.walk(path):
        for fn in fs:
            fd = os.open(os.path.join(dp, fn), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    port, nproc, pid, root, nbytes, repeat, out = sys.argv[1:8]
    n, i, total, reps = int(nproc), int(pid), int(nbytes), int(repeat)
    client = None
    if n > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=i,
                                   initialization_timeout=120)
        from jax._src import distributed

        client = distributed.global_state.client

    def barrier(name: str) -> None:
        if client is not None:
            client.wait_at_barrier(f"bench/{name}", 600_000)

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import atomicstore

    rows = total // 4 // COLS
    assert rows % n == 0, "BYTES must split evenly over the processes"
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec("x"))
    # this process's rows, random (every byte distinct, nothing a disk could deduplicate)
    local = np.random.default_rng(i).random((rows // n, COLS), dtype=np.float32)
    arr = jax.make_array_from_process_local_data(sharding, local, (rows, COLS))
    jax.block_until_ready(arr)
    del local
    assert arr.is_fully_addressable == (n == 1)
    mine = sum(sh.data.nbytes for sh in arr.addressable_shards)

    # untimed: a small sharded array through the same calls (imports, thread pools, the
    # coordination service's first keys)
    warm = jax.make_array_from_process_local_data(sharding, np.ones((n * 8, COLS), np.float32), (n * 8, COLS))
    barrier("warm")
    atomicstore.save(os.path.join(root, "warmup"), {"w": warm})
    jax.block_until_ready(atomicstore.restore(os.path.join(root, "warmup"), {"w": warm}))
    del warm

    runs = []
    for r in range(reps):
        url = os.path.join(root, f"step_{r}")
        barrier(f"save{r}")
        rss0 = status("VmRSS")
        save_s, save_x, (_, wrote), _ = measured(lambda url=url: atomicstore.save(url, {"w": arr}))
        run = {"rss": rss0, "save": save_s, "save_extra": save_x, "written": wrote}
        barrier(f"saved{r}")
        if i == 0:
            files = [os.path.join(dp, fn) for dp, _, fs in os.walk(url) for fn in fs]
            run["stored"] = sum(os.path.getsize(f) for f in files)
            run["files"] = len(files)
            shards = [f for f in files if os.sep + "shards" + os.sep in f]
            run["shard_bytes"] = sum(os.path.getsize(f) for f in shards) if n > 1 else \
                os.path.getsize(os.path.join(url, "state.msgpack"))
        for kind in ("restore", "restore_cold"):
            if kind == "restore_cold" and i == 0:
                evict(url)
            barrier(f"{kind}{r}")
            dt, extra, (read, _), got = measured(
                lambda url=url: jax.block_until_ready(atomicstore.restore(url, {"w": arr})))
            run[kind], run[kind + "_extra"], run[kind + "_read"] = dt, extra, read
            w = got["w"]
            assert isinstance(w, jax.Array) and w.sharding == arr.sharding and w.shape == arr.shape
            if r == 0 and kind == "restore":  # the bytes came back (outside the timed region)
                same = all(a.index == b.index and np.array_equal(np.asarray(a.data), np.asarray(b.data))
                           for a, b in zip(w.addressable_shards, arr.addressable_shards, strict=True))
                assert same, "the restored array differs from the saved one"
            del got, w
        runs.append(run)
        barrier(f"done{r}")
        if i == 0:
            shutil.rmtree(url)
    with open(out, "w") as f:
        json.dump({"pid": i, "local": mine, "runs": runs}, f)
    if n > 1:
        barrier("exit")
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
