"""One process of the multi-process benchmark (started by benchmarks/run.py).

usage: mp_child.py PORT NPROC PID DIR BYTES OUT_JSON
Saves a float32 array of BYTES sharded over all processes' devices (each holds 1/NPROC)
with save_checkpoint_multiprocess, then restores it into the same sharding; with NPROC=1
the same bytes as one jax.Array through save_checkpoint/restore_checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
import numpy as np  # noqa: E402


def main() -> None:
    port, nproc, pid, root, nbytes, out = sys.argv[1:7]
    n, i, total = int(nproc), int(pid), int(nbytes)
    from atomicstore.compat import flax as ck

    rows = total // 4 // 1024
    if n > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=i)
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec("x"))
        local = np.random.default_rng(i).standard_normal((rows // n, 1024), dtype=np.float32)
        arr = jax.make_array_from_process_local_data(sharding, local, (rows, 1024))
        state = {"w": arr}
    else:
        # the same bytes as one jax.Array on one process, restored into a jax.Array as well
        state = {"w": jax.device_put(np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32))}
    t0 = time.perf_counter()
    ck.save_checkpoint_multiprocess(root, state, 1)  # one process, nothing sharded: save_checkpoint
    save = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = ck.restore_checkpoint(root, state)
    jax.block_until_ready(got["w"])
    restore = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump({"save": save, "restore": restore}, f)
    if n > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
