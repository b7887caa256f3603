"""Interleaved A/B runs of cloud-link cases (``cloud.py``'s ``measure``): each round runs
every variant once, in turn, each with a fresh server and shaper, so a slow spell of this
shared machine hits every variant alike; then the median of each.

    python benchmarks/ab.py ROUNDS LABEL:GROUP:CLIENT:OP:OBJECTS[:SRC] ...

GROUP is ``s3``, ``gcs`` or ``dcp``; OP ``save`` or ``restore``; SRC a source tree to
import atomicstore from (e.g. ``git archive``'s of another commit; default: the installed
one). ``--stats-dir DIR`` keeps the shaper's log of each run as ``DIR/LABEL-ROUND.json``
(``python benchmarks/shaper.py --show FILE`` prints its requests). For example, a change
against the tree before it and boto3, 16 objects, three rounds::

    git archive HEAD~1 atomicstore | tar -x -C /tmp/before
    python benchmarks/ab.py 3 before:s3:atomicstore:restore:16:/tmp/before \\
        after:s3:atomicstore:restore:16 boto3:s3:boto3:restore:16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import cloud


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", type=int)
    ap.add_argument("variants", nargs="+", help="LABEL:GROUP:CLIENT:OP:OBJECTS[:SRC]")
    ap.add_argument("--mib", type=int, default=256, help="MiB per case")
    ap.add_argument("--stats-dir", default=None)
    args = ap.parse_args()
    variants = []
    for spec in args.variants:
        label, group, client, op, objects, *src = spec.split(":", 5)
        variants.append((label, group, client, op, int(objects), os.path.abspath(src[0]) if src else None))
    crt = cloud.crt_python() if any(v[2] == "crt" for v in variants) else None
    runs: dict[str, list[float]] = {v[0]: [] for v in variants}
    for r in range(args.rounds):
        for label, group, client, op, objects, src in variants:
            cloud.SRC = src
            stats: list = []
            res = cloud.measure(group, client, op, args.mib * cloud.MiB, objects,
                                python=crt if client == "crt" else None, stats_out=stats)
            if args.stats_dir and stats:
                os.makedirs(args.stats_dir, exist_ok=True)
                with open(os.path.join(args.stats_dir, f"{label}-{r}.json"), "w") as f:
                    json.dump(stats[0], f)
            if "error" in res:
                print(f"round {r} {label}: FAILED {res['error']}", flush=True)
                continue
            runs[label].append(args.mib / res["time"])
            print(f"round {r} {label:20s} {runs[label][-1]:7.1f} MiB/s  conns {res['max_open']}", flush=True)
    for label, got in runs.items():
        med = f"{statistics.median(got):7.1f}" if got else "    n/a"
        print(f"{label:20s} median {med} MiB/s  runs {[round(x, 1) for x in got]}")


if __name__ == "__main__":
    main()
