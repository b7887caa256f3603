"""A training job with tiered checkpoints, killed by tests/manager/test_tiers_crash.py.

usage: tier_worker.py URL OPTIONS_JSON LOCAL_DIR MANAGER_KWARGS_JSON FIRST LAST LOG

Resumes from the latest step the manager restores (checking it is exactly the state saved
as that step), then saves steps up to LAST, appending ``restored S`` / ``saved S`` /
``done`` lines to LOG. The state of step ``s`` is :func:`state` (a few MiB).
"""

from __future__ import annotations

import json
import sys

import numpy as np

N = 1 << 20  # float32: 4 MiB per array


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(N, dtype=np.float32), "b": np.arange(1000, dtype=np.int64) * step,
            "step": step}


def check(tree: dict, step: int) -> None:
    want = state(step)
    assert tree["step"] == step, (tree["step"], step)
    assert tree["w"].dtype == want["w"].dtype and tree["w"].tobytes() == want["w"].tobytes(), step
    assert np.array_equal(tree["b"], want["b"]), step


def main() -> None:
    url, opts, local_dir, kwargs, first, last, log_path = sys.argv[1:8]
    from atomicstore import CheckpointManager, NotFoundError

    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - open until the process ends (or is killed)
    mgr = CheckpointManager(url, local_dir=local_dir, storage_options=json.loads(opts), **json.loads(kwargs))
    start = int(first)
    try:
        tree = mgr.restore()
    except NotFoundError:
        pass
    else:
        check(tree, tree["step"])
        log.write(f"restored {tree['step']}\n")
        start = tree["step"] + 1
    for s in range(start, int(last) + 1):
        mgr.save(s, state(s))
        log.write(f"saved {s}\n")
    mgr.close()
    log.write("done\n")


if __name__ == "__main__":
    main()
