"""One JAX process of a multi-process test (started by tests/system/test_multiprocess.py).

usage: mp_worker.py PORT NPROC PID MODE ARG URL OPTIONS_JSON OUT_JSON

Each process has 2 CPU devices; a (NPROC*2)-device mesh shards "w" along its first axis
and "r" is replicated on every device; "small" is a plain numpy leaf.

MODE: save STEP | restore STEP | restore_np STEP | die_in_save STEP (the last process is lost) |
      die0_in_save STEP (process 0, which hosts the coordination service, is lost) | save_async STEPS
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROWS = 64


def expected(step: float) -> dict:
    w = (np.arange(ROWS * 6, dtype=np.float32).reshape(ROWS, 6) + step)
    r = np.full((3, 5), step, np.int32)
    return {"w": w, "r": r, "small": np.arange(4) + int(step)}


def main() -> None:
    port, nproc, pid, mode, arg, url, opts, out = sys.argv[1:9]
    nproc_i, pid_i = int(nproc), int(pid)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc_i, process_id=pid_i,
                               initialization_timeout=60, heartbeat_timeout_seconds=60)
    from atomicstore.compat import flax as ck

    opts_d = json.loads(opts)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharded, repl = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    def make(step: float) -> dict:
        e = expected(step)
        return {
            "w": jax.make_array_from_callback(e["w"].shape, sharded, lambda i: e["w"][i]),
            "r": jax.make_array_from_callback(e["r"].shape, repl, lambda i: e["r"][i]),
            "small": e["small"],
        }

    result: dict = {"pid": pid_i}
    try:
        if mode == "save":
            t0 = time.monotonic()
            result["path"] = ck.save_checkpoint_multiprocess(url, make(float(arg)), float(arg), keep=2,
                                                             storage_options=opts_d, timeout=60)
            result["seconds"] = time.monotonic() - t0
        elif mode == "save_async":
            am = ck.AsyncManager()
            for s in arg.split(","):
                ck.save_checkpoint_multiprocess(url, make(float(s)), float(s), keep=10, async_manager=am,
                                                storage_options=opts_d, timeout=60)
            am.wait_previous_save()
            result["ok"] = True
        elif mode in ("die_in_save", "die0_in_save"):
            if pid_i == (0 if mode == "die0_in_save" else nproc_i - 1):
                os._exit(17)  # this process is lost before it writes anything
            t0 = time.monotonic()
            try:
                ck.save_checkpoint_multiprocess(url, make(float(arg)), float(arg), storage_options=opts_d, timeout=8)
                result["error"] = None
            except Exception as exc:  # noqa: BLE001 - reported to the test
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["seconds"] = time.monotonic() - t0
            with open(out, "w") as f:
                json.dump(result, f)
            os._exit(0)  # do not wait for the lost peer at shutdown
        elif mode in ("restore", "restore_np"):
            step = float(arg)
            if mode == "restore":
                target = make(-1.0)
                got = ck.restore_checkpoint(url, target, step=step, storage_options=opts_d)
                for k in ("w", "r"):
                    a = got[k]
                    assert isinstance(a, jax.Array) and a.sharding == target[k].sharding, k
                    for sh in a.addressable_shards:
                        assert np.array_equal(np.asarray(sh.data), expected(step)[k][sh.index]), (k, sh.index)
                result["shards_checked"] = sum(len(got[k].addressable_shards) for k in ("w", "r"))
            else:
                got = ck.restore_checkpoint(url, None, step=step, storage_options=opts_d)
                for k, v in expected(step).items():
                    assert np.array_equal(np.asarray(got[k]), v), k
            assert np.array_equal(np.asarray(got["small"]), expected(step)["small"])
            result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["trace"] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
