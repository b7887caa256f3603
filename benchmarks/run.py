"""Benchmarks, side by side in one run: atomicstore against raw I/O and the anchors.

Each case runs in its own process so that its peak memory can be measured (peak RSS
during the operation minus RSS before it). Prints a Markdown table with ratios.

    nox -s bench                  # everything
    nox -s bench -- --quick       # smaller sizes, for a smoke run
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


def arrays(total: int) -> list[np.ndarray]:
    n = max(1, total // ARRAY_BYTES)
    rng = np.random.default_rng(0)
    return [rng.standard_normal(ARRAY_BYTES // 4, dtype=np.float32) for _ in range(n)]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)


# -- cases: each returns a callable doing the measured work -------------------------------
def case_raw_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    def run() -> None:
        d = os.path.join(work, "raw")
        os.makedirs(d)
        for i, a in enumerate(data):
            fd = os.open(f"{d}/{i}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            mv = memoryview(a).cast("B")
            while mv:
                mv = mv[os.write(fd, mv):]
            os.fsync(fd)
            os.close(fd)
        fsync_dir(d)
        fsync_dir(work)

    return run


def case_raw_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    case_raw_save(work, data)()
    outs = [np.empty_like(a) for a in data]

    def run() -> None:
        for i, o in enumerate(outs):
            with open(f"{work}/raw/{i}.bin", "rb", buffering=0) as f:
                f.readinto(memoryview(o).cast("B"))

    return run


def case_atomicstore_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import atomicstore

    store = atomicstore.open_store(os.path.join(work, "as"))

    def run() -> None:
        with store.transaction("step_1") as txn:
            for i, a in enumerate(data):
                with txn.open(f"{i}.bin") as f:
                    f.write(a)

    return run


def case_atomicstore_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import atomicstore

    case_atomicstore_save(work, data)()
    store = atomicstore.open_store(os.path.join(work, "as"))
    outs = [np.empty_like(a) for a in data]

    def run() -> None:
        ckpt = store.open("step_1")
        for i, o in enumerate(outs):
            ckpt.read_into(f"{i}.bin", o)

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
    store = atomicstore.open_store(f"s3://{bucket}/as", **opts)

    def run() -> None:
        with store.transaction("step_1") as txn:
            for i, a in enumerate(data):
                with txn.open(f"{i}.bin") as f:
                    f.write(a)

    return run


CASES = {
    "raw_save": case_raw_save,
    "atomicstore_save": case_atomicstore_save,
    "raw_restore": case_raw_restore,
    "atomicstore_restore": case_atomicstore_restore,
    "boto3_s3_save": case_boto3_s3_save,
    "atomicstore_s3_save": case_atomicstore_s3_save,
}


def child(case: str, total: int) -> None:
    work = tempfile.mkdtemp(prefix="asbench-", dir=os.environ.get("BENCH_DIR"))
    try:
        data = arrays(total)
        run = CASES[case](work, data)
        before = rss()
        t0 = time.perf_counter()
        run()
        elapsed = time.perf_counter() - t0
        extra = max(0, peak_rss() - before)
        print(json.dumps({"time": elapsed, "extra": extra}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(case: str, total: int, repeat: int) -> dict[str, float]:
    times, extras = [], []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, __file__, "--child", case, "--bytes", str(total)],
            capture_output=True, text=True, check=True,
        )
        res = json.loads(out.stdout.strip().splitlines()[-1])
        times.append(res["time"])
        extras.append(res["extra"])
    return {"time": statistics.median(times), "extra": statistics.median(extras)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--bytes", type=int, default=2**30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.bytes)
        return
    total = 256 * MiB if args.quick else args.bytes
    s3_total = min(total, 256 * MiB)
    rows = []
    groups = [
        ("durable save, local", total, "raw_save", ["atomicstore_save"]),
        ("restore, local (warm cache)", total, "raw_restore", ["atomicstore_restore"]),
        ("save to S3 fake (moto)", s3_total, "boto3_s3_save", ["atomicstore_s3_save"]),
    ]
    for title, size, anchor, others in groups:
        base = measure(anchor, size, args.repeat)
        rows.append((title, anchor, size, base, 1.0))
        for o in others:
            r = measure(o, size, args.repeat)
            rows.append((title, o, size, r, r["time"] / base["time"]))
    print(f"\nmedian of {args.repeat}, each case in its own process\n")
    print("| benchmark | case | bytes | time (s) | × anchor | extra peak RSS (MiB) |")
    print("|---|---|---:|---:|---:|---:|")
    for title, case, size, r, ratio in rows:
        print(f"| {title} | {case} | {size // MiB} MiB | {r['time']:.3f} | {ratio:.2f} | {r['extra'] / MiB:.0f} |")


if __name__ == "__main__":
    main()
