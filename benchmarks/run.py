"""Benchmarks, side by side in one run: atomicstore against raw I/O and the anchors.

Each case runs in its own process so that its peak memory can be measured (peak RSS
during the operation minus RSS before it). Prints a Markdown table with ratios.

    nox -s bench                  # everything
    nox -s bench -- --quick       # smaller sizes, for a smoke run
    nox -s bench -- --only multihost               # only the multi-process table (1 and 4 GiB)
    nox -s bench -- --only multihost --mp-sizes 1024 --mp-procs 1,2
    nox -s bench -- --only integrations            # torch DCP and Orbax: stock storage vs atomicstore
    nox -s bench -- --only cloud --cloud-sizes 256,1024   # S3/GCS clients through a shaped link
    nox -s bench -- --only cluster --quick         # a SeaweedFS cluster losing a volume server (256 MiB)
    nox -s bench -- --only tiers                   # tiered checkpoints on the cloud link (1 GiB, 3 rounds, ~5 min)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

MiB = 2**20
ARRAY_BYTES = 64 * MiB


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def arrays(total: int, leaf_bytes: int = ARRAY_BYTES) -> list[np.ndarray]:
    n = max(1, total // leaf_bytes)
    rng = np.random.default_rng(0)
    return [rng.standard_normal(leaf_bytes // 4, dtype=np.float32) for _ in range(n)]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)


# -- cases: each returns a callable doing the measured work -------------------------------
def case_raw_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    """The floor: the same bytes into one file with os.write, one fsync, fsync the directory."""

    def run() -> None:
        d = os.path.join(work, "raw")
        os.makedirs(d)
        fd = os.open(f"{d}/state.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        for a in data:
            mv = memoryview(a).cast("B")
            while mv:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
        os.close(fd)
        fsync_dir(d)
        fsync_dir(work)

    return run


def case_raw_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    """The floor: read the same bytes into preallocated arrays, one thread."""
    case_raw_save(work, data)()
    outs = [np.empty_like(a) for a in data]

    def run() -> None:
        with open(f"{work}/raw/state.bin", "rb", buffering=0) as f:
            for o in outs:
                f.readinto(memoryview(o).cast("B"))

    return run


def _tree(data: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {f"layer_{i:05d}": a for i, a in enumerate(data)}


def _fsync_tree(path: str) -> None:
    """fsync every file and directory below ``path`` (what a library wrote), and its parent."""
    for dirpath, _dirs, files in os.walk(path):
        for fn in files:
            fd = os.open(os.path.join(dirpath, fn), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fsync_dir(dirpath)
    fsync_dir(os.path.dirname(path))


def case_atomicstore_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import atomicstore

    tree = _tree(data)

    def run() -> None:
        atomicstore.save(os.path.join(work, "as", "step_1"), tree)

    return run


def case_atomicstore_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import atomicstore

    case_atomicstore_save(work, data)()

    def run() -> None:
        atomicstore.restore(os.path.join(work, "as", "step_1"))

    return run


def _flax():
    import flax
    from flax.training import checkpoints

    flax.config.update("flax_use_orbax_checkpointing", False)
    return checkpoints


def case_flax_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    ckpt = _flax()
    tree = _tree(data)
    d = os.path.join(work, "flax")

    def run() -> None:
        ckpt.save_checkpoint(d, tree, step=1, keep=1)
        _fsync_tree(d)

    return run


def case_flax_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    ckpt = _flax()
    case_flax_save(work, data)()

    def run() -> None:
        ckpt.restore_checkpoint(os.path.join(work, "flax"), target=None)

    return run


def case_orbax_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import orbax.checkpoint as ocp

    tree = _tree(data)
    d = os.path.join(work, "orbax", "step_1")
    ckptr = ocp.StandardCheckpointer()

    def run() -> None:
        ckptr.save(d, tree)
        ckptr.wait_until_finished()
        _fsync_tree(d)

    return run


def case_orbax_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import orbax.checkpoint as ocp

    case_orbax_save(work, data)()
    ckptr = ocp.StandardCheckpointer()

    def run() -> None:
        ckptr.restore(os.path.join(work, "orbax", "step_1"))

    return run


def case_safetensors_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    from safetensors.numpy import save_file

    tree = _tree(data)
    d = os.path.join(work, "st")

    def run() -> None:
        os.makedirs(d, exist_ok=True)
        save_file(tree, os.path.join(d, "model.safetensors"))
        _fsync_tree(d)

    return run


def case_safetensors_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    from safetensors.numpy import load_file

    case_safetensors_save(work, data)()

    def run() -> None:
        load_file(os.path.join(work, "st", "model.safetensors"))

    return run


def _s3(total: int) -> tuple[object, str, dict]:
    from atomicstore.testing.servers import FakeS3

    srv = FakeS3()
    return srv, srv.new_bucket(), srv.storage_options()


def case_boto3_s3_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    srv, bucket, opts = _s3(0)
    client = boto3.client(
        "s3", endpoint_url=opts["endpoint_url"], aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"], region_name="us-east-1",
    )
    cfg = TransferConfig(multipart_chunksize=16 * MiB, max_concurrency=4)

    def run() -> None:
        import io

        for i, a in enumerate(data):
            client.upload_fileobj(io.BytesIO(memoryview(a).cast("B")), bucket, f"boto/{i}.bin", Config=cfg)

    return run


def case_atomicstore_s3_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import atomicstore

    srv, bucket, opts = _s3(0)
    tree = _tree(data)
    # the store (its S3 client) is made before timing, as the boto3 anchor's client is
    store = atomicstore.open_store(f"s3://{bucket}/as", **opts)

    def run() -> None:
        atomicstore.save(f"s3://{bucket}/as/step_1", tree, store=store)

    return run


# -- async saving: how long the caller is blocked --------------------------------------------
def case_memcpy_async(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    """The anchor: one copy of the state (what a snapshot must at least cost)."""
    return lambda: [a.copy() for a in data] and None


def case_atomicstore_async(work: str, data: list[np.ndarray]) -> Callable[[], dict]:
    """Time until CheckpointManager(async_save=True).save returns; total until committed."""
    from atomicstore import CheckpointManager

    mgr = CheckpointManager(os.path.join(work, "async"), async_save=True)

    def run() -> dict:
        t0 = time.perf_counter()
        mgr.save(1, _tree(data))
        blocked = time.perf_counter() - t0
        mgr.wait_until_finished()
        return {"time": blocked, "total": time.perf_counter() - t0}

    return run


def _jax_tree(data: list[np.ndarray]) -> dict:
    import jax

    tree = {f"layer_{i:03d}": jax.device_put(a) for i, a in enumerate(data)}
    jax.block_until_ready(tree)
    return tree


def case_d2h_async(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    """The anchor for jax arrays: the device-to-host copy of every leaf."""
    import jax

    tree = _jax_tree(data)
    return lambda: [np.array(x) for x in jax.tree_util.tree_leaves(tree)] and None


def case_atomicstore_jax_async(work: str, data: list[np.ndarray]) -> Callable[[], dict]:
    from atomicstore import CheckpointManager

    tree = _jax_tree(data)
    data.clear()  # only the device copies remain
    mgr = CheckpointManager(os.path.join(work, "async"), async_save=True)

    def run() -> dict:
        t0 = time.perf_counter()
        mgr.save(1, tree)
        blocked = time.perf_counter() - t0
        mgr.wait_until_finished()
        return {"time": blocked, "total": time.perf_counter() - t0}

    return run


LIBS = ["raw", "atomicstore", "flax", "orbax", "safetensors"]
SMALL_LIBS = ["flax", "atomicstore", "orbax", "safetensors"]  # raw: 10,000 fsynced files is no anchor
CASES = {f"{lib}_{op}": globals()[f"case_{lib}_{op}"] for lib in LIBS for op in ("save", "restore")}
CASES["boto3_s3_save"] = case_boto3_s3_save
CASES["atomicstore_s3_save"] = case_atomicstore_s3_save
for _c in ("memcpy_async", "atomicstore_async", "d2h_async", "atomicstore_jax_async"):
    CASES[_c] = globals()[f"case_{_c}"]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import integrations  # noqa: E402  (the torch DCP and Orbax cases: benchmarks/integrations.py)

CASES.update(integrations.CASES)


def measure_multiprocess(total: int, nproc: int, repeat: int) -> dict:
    """Save + restore of a float32 array of ``total`` bytes sharded over ``nproc``
    processes (one CPU device each) through the native API (``benchmarks/mp_child.py``;
    ``nproc`` 1: the same bytes as one jax.Array in one process). All processes run the
    ``repeat`` saves and restores in one job. Times: of the slowest process of each run,
    median over runs. Memory: the largest extra peak of any process in any run. Bytes
    on storage: of the committed checkpoint."""
    import socket

    child_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_child.py")
    work = tempfile.mkdtemp(prefix="asbench-mp-", dir=os.environ.get("BENCH_DIR"))
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        outs = [os.path.join(work, f"out{i}.json") for i in range(nproc)]
        procs = [subprocess.Popen([sys.executable, child_py, str(port), str(nproc), str(i), os.path.join(work, "ckpt"),
                                   str(total), str(repeat), outs[i]]) for i in range(nproc)]
        try:  # one failed or hung process fails the case at once (the others would wait for it)
            deadline = time.monotonic() + 600 + repeat * total / MiB
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if any(p.returncode != 0 for p in procs):
                raise RuntimeError(f"multi-process benchmark failed ({nproc} processes, {total} bytes): "
                                   f"exit codes {[p.returncode for p in procs]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        res = []
        for o in outs:
            with open(o) as f:
                res.append(json.load(f))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runs = [[r["runs"][k] for r in res] for k in range(repeat)]  # runs[k][process]
    out: dict = {"nproc": nproc, "total": total, "local": max(r["local"] for r in res)}
    for key in ("save", "restore", "restore_cold"):
        slowest = [max(p[key] for p in run) for run in runs]
        out[key] = statistics.median(slowest)
        out[key + "_range"] = (min(slowest), max(slowest))
        out[key + "_all"] = [[round(p[key], 3) for p in run] for run in runs]
        out[key + "_extra"] = max(p[key + "_extra"] for run in runs for p in run)
    procs_runs = [(r, p) for run in runs for r, p in zip(res, run, strict=True)]
    # what a restore needs beyond the array it returns (this process's part of it)
    out["restore_overhead"] = max(p[k + "_extra"] - r["local"] for r, p in procs_runs for k in ("restore", "restore_cold"))
    # I/O of each process against its part of the array (1: it touches only its own bytes)
    out["read_ratio"] = max(p[k + "_read"] / r["local"] for r, p in procs_runs for k in ("restore", "restore_cold"))
    out["write_ratio"] = max(p["written"] / r["local"] for r, p in procs_runs)
    first = runs[0][0]
    out |= {"stored": first["stored"], "shard_bytes": first["shard_bytes"], "files": first["files"]}
    return out


def multiprocess_table(sizes: list[int], procs: list[int], repeat: int) -> None:
    """The multi-process benchmark: each size over each process count; a Markdown table."""
    rows = []
    t0 = time.monotonic()
    for size in sizes:
        base = None
        for n in procs:
            r = measure_multiprocess(size, n, repeat)
            base = base or r
            rows.append((r, base))
            print(f"multi-process {size // MiB:6d} MiB x {n} proc: save {r['save']:7.3f} s, restore warm "
                  f"{r['restore']:7.3f} s, cold {r['restore_cold']:7.3f} s; extra save "
                  f"{r['save_extra'] / MiB:.0f} MiB, restore {r['restore_extra'] / MiB:.0f} MiB "
                  f"(own part {r['local'] / MiB:.0f} MiB); per run and process: save {r['save_all']} restore "
                  f"{r['restore_all']} cold {r['restore_cold_all']}", file=sys.stderr, flush=True)

    def t(r: dict, key: str) -> str:
        lo, hi = r[key + "_range"]
        return f"{r[key]:.2f} ({lo:.2f}–{hi:.2f})" if len(r[key + "_all"]) > 1 else f"{r[key]:.2f}"

    print(f"\nmulti-process, native API (`atomicstore.save`, `atomicstore.restore` onto the same sharding, "
          f"`block_until_ready`): one float32 array sharded over N processes x 1 CPU device (N = 1: the same "
          f"bytes as one jax.Array in one process). Time of the slowest process, median (min–max) of {repeat} "
          f"runs; x one process: median / the 1-process median of that size. Extra peak RSS: the largest of any "
          f"process and run (restore: it includes the restored array itself, 1/N of the bytes; \"beyond\" "
          f"subtracts it). I/O: bytes each process wrote / read, over its 1/N. {time.monotonic() - t0:.0f} s in "
          "all.\n")
    print("| array | N | save (s) | restore, warm (s) | restore, cold (s) | x one process (save / warm / cold) "
          "| extra peak RSS, save (MiB) | extra peak RSS, restore (MiB) | restore beyond its result (MiB) "
          "| written / read, ÷ own part | array bytes stored ÷ distinct | other files (bytes) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r, b in rows:
        print(f"| {r['total'] // MiB} MiB | {r['nproc']} | {t(r, 'save')} | {t(r, 'restore')} | "
              f"{t(r, 'restore_cold')} | {r['save'] / b['save']:.2f} / {r['restore'] / b['restore']:.2f} / "
              f"{r['restore_cold'] / b['restore_cold']:.2f} | {r['save_extra'] / MiB:.0f} | "
              f"{r['restore_extra'] / MiB:.0f} | {r['restore_overhead'] / MiB:.0f} | "
              f"{r['write_ratio']:.3f} / {r['read_ratio']:.3f} | "
              f"{r['shard_bytes'] / r['total']:.6f} | {r['stored'] - r['shard_bytes']:,} |")
    sys.stdout.flush()


def child(case: str, total: int, leaf: int) -> None:
    work = tempfile.mkdtemp(prefix="asbench-", dir=os.environ.get("BENCH_DIR"))
    try:
        data = arrays(total, leaf)
        run = CASES[case](work, data)
        before = rss()
        t0 = time.perf_counter()
        more = run()
        elapsed = time.perf_counter() - t0
        extra = max(0, peak_rss() - before)
        print(json.dumps({"time": elapsed, "extra": extra} | (more if isinstance(more, dict) else {})))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(case: str, total: int, repeat: int, leaf: int = ARRAY_BYTES) -> dict[str, float]:
    times, extras, totals = [], [], []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, __file__, "--child", case, "--bytes", str(total), "--leaf", str(leaf)],
            capture_output=True, text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{case} failed:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        times.append(res["time"])
        extras.append(res["extra"])
        totals.append(res.get("total", res["time"]))
    return {"time": statistics.median(times), "extra": statistics.median(extras), "total": statistics.median(totals)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--bytes", type=int, default=2**30)
    ap.add_argument("--leaf", type=int, default=ARRAY_BYTES)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB, no 4 GiB case")
    ap.add_argument("--only", choices=["all", "single", "multihost", "integrations", "cloud", "cluster", "tiers"],
                    default="all",
                    help="single: the one-process cases against the anchors; multihost: the multi-process table; "
                         "integrations: torch DCP and Orbax, stock storage against atomicstore's; "
                         "cloud: S3/GCS clients on a shaped link (benchmarks/cloud.py); cluster: a SeaweedFS "
                         "cluster losing a volume server mid-save and mid-restore (benchmarks/cluster.py); tiers: "
                         "CheckpointManager(url, local_dir=...) against local disk and the bucket on the cloud "
                         "link (benchmarks/tiers.py)")
    ap.add_argument("--cloud-sizes", default="256", help="cloud link table: total MiB per case, comma-separated "
                    "(256: ~12 min per run of every case, 1024: ~40 min)")
    ap.add_argument("--cloud-repeat", type=int, default=1, help="runs per cloud case")
    ap.add_argument("--tiers-size", type=float, default=None,
                    help="tiers: MiB of state (default: --bytes, --quick: 256)")
    ap.add_argument("--tiers-repeat", type=int, default=None, help="tiers: rounds (default: --repeat)")
    ap.add_argument("--mp-sizes", default=None,
                    help="multi-process array sizes in MiB, comma-separated (default: --bytes and 4 x --bytes; "
                         "--quick: 256)")
    ap.add_argument("--mp-procs", default="1,2,4", help="process counts, comma-separated; the first is the baseline")
    ap.add_argument("--mp-repeat", type=int, default=None, help="runs of each multi-process case (default: --repeat)")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.bytes, args.leaf)
        return
    total = 256 * MiB if args.quick else args.bytes
    if args.only in ("all", "single"):
        single_table(args, total)
    if args.only in ("all", "cloud"):
        import cloud  # benchmarks/cloud.py: the link shaper in front of the S3 and GCS fakes

        cloud.cloud_table([int(float(x) * MiB) for x in args.cloud_sizes.split(",")], args.cloud_repeat)
    if args.only in ("all", "cluster"):
        import cluster  # benchmarks/cluster.py: 1 master, 3 volume servers, a filer, the S3 gateway

        if any(str(r["outcome"]).startswith("VIOLATION") for r in cluster.cluster_table(total)):
            raise SystemExit("cluster: the contract was broken (see the table)")
    if args.only in ("all", "tiers"):
        import tiers  # benchmarks/tiers.py: the targets of issue 25 on the cloud link

        tiers.tiers_table(int(args.tiers_size * MiB) if args.tiers_size else total, args.tiers_repeat or args.repeat)
    if args.only in ("all", "integrations"):
        table([(title, size, ARRAY_BYTES, op, libs) for title, size, op, libs in integrations.groups(total)],
              args.repeat, "the stock storage of the same library")
    if args.only in ("all", "multihost"):
        if args.mp_sizes:
            sizes = [int(float(x) * MiB) for x in args.mp_sizes.split(",")]
        else:
            sizes = [total] if args.quick else [total, 4 * total]
        multiprocess_table(sizes, [int(x) for x in args.mp_procs.split(",")], args.mp_repeat or args.repeat)


def single_table(args: argparse.Namespace, total: int) -> None:
    """The one-process cases against raw I/O and the anchor libraries."""
    groups = [
        (f"durable save, {total // MiB} MiB (16 leaves)", total, ARRAY_BYTES, "save", LIBS),
        (f"restore, {total // MiB} MiB (warm cache)", total, ARRAY_BYTES, "restore", LIBS),
        ("durable save, 10,000 x 1 KiB leaves", 10_000 * 1024, 1024, "save", SMALL_LIBS),
        ("restore, 10,000 x 1 KiB leaves", 10_000 * 1024, 1024, "restore", SMALL_LIBS),
    ]
    if not args.quick:
        groups.append((f"durable save, {4 * total // MiB} MiB (scaling)", 4 * total, ARRAY_BYTES, "save",
                       ["raw", "atomicstore"]))
    groups.append((f"save to S3 fake (moto), {min(total, 256 * MiB) // MiB} MiB", min(total, 256 * MiB),
                   ARRAY_BYTES, "s3_save", ["boto3", "atomicstore"]))
    groups.append((f"async save, numpy, {total // MiB} MiB: caller blocked", total, ARRAY_BYTES, "async",
                   ["memcpy", "atomicstore"]))
    groups.append((f"async save, jax, {total // MiB} MiB: caller blocked", total, ARRAY_BYTES, "async",
                   ["d2h", "atomicstore_jax"]))
    table(groups, args.repeat, "raw I/O, flax legacy for small leaves, boto3 for S3")


def table(groups: list[tuple[str, int, int, str, list[str]]], repeat: int, anchor: str) -> None:
    """Measure each group's cases and print a Markdown table of ratios to its first row."""
    rows = []
    for title, size, leaf, op, libs in groups:
        base = None
        for lib in libs:
            r = measure(f"{lib}_{op}", size, repeat, leaf)
            base = base or r["time"]
            rows.append((title, lib, r, r["time"] / base))
            print(f"{title:45s} {lib:12s} {r['time']:8.3f} s  x{r['time'] / base:5.2f}  "
                  f"+{r['extra'] / MiB:6.0f} MiB", file=sys.stderr, flush=True)
    print(f"\nmedian of {repeat} runs, each case in its own process; ratio against the first row "
          f"of each group ({anchor})\n")
    print("| benchmark | library | time (s) | x anchor | extra peak RSS (MiB) |")
    print("|---|---|---:|---:|---:|")
    for title, lib, r, ratio in rows:
        total_s = f" (committed after {r['total']:.3f} s)" if "async" in title and r["total"] != r["time"] else ""
        print(f"| {title} | {lib}{total_s} | {r['time']:.3f} | {ratio:.2f} | {r['extra'] / MiB:.0f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
