"""Restoring onto jax targets on every supported jax (issue 23): jax 0.4.30, the lowest
declared, has no ``device_put(..., may_alias=)``, which restore used to pass
unconditionally (a raw ``TypeError``); it is asked once whether this jax has the option.
Only jax, numpy and atomicstore (and the suite's conftest) are imported here, so the file
runs in a venv with the lowest declared versions too."""

from __future__ import annotations

import google_crc32c
import jax
import jax.numpy as jnp
import msgpack
import numpy as np

import atomicstore
from atomicstore.pytree.format import INDEX_FILE, INDEX_FORMAT, SHARD_BLOCK, STATE_FILE, shard_file
from atomicstore.pytree.sharded import ShardedLeaf
from atomicstore.pytree.writer import StateWriter


def test_restore_onto_jax_arrays_and_shape_dtype_structs(tmp_path):
    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    url = f"{tmp_path}/s"
    atomicstore.save(url, {"w": jnp.arange(6.0).reshape(2, 3), "s": np.full(4, 2.5, np.float32), "n": np.ones(3)})
    target = {"w": jnp.zeros((2, 3)), "s": jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding),
              "n": np.zeros(3)}
    got = atomicstore.restore(url, target)
    assert isinstance(got["w"], jax.Array) and np.array_equal(np.asarray(got["w"]), np.arange(6.0).reshape(2, 3))
    assert isinstance(got["s"], jax.Array) and got["s"].sharding == sharding
    assert np.array_equal(np.asarray(got["s"]), np.full(4, 2.5, np.float32))
    assert isinstance(got["n"], np.ndarray) and np.array_equal(got["n"], np.ones(3))


def test_restore_of_an_array_sharded_across_processes_onto_a_sharding(tmp_path):
    """A checkpoint holding an array saved as two shard files (as two processes write
    it), restored in one process onto a one-device sharding: the region reads are put on
    the device (the path that passed ``may_alias``)."""
    st = atomicstore.open_store(str(tmp_path))
    w = np.arange(48, dtype=np.float32).reshape(8, 6)
    writer = StateWriter({"w": ShardedLeaf(0, "w", w.dtype, w.shape), "step": 7})
    with st.transaction("ck") as txn:
        with txn.open(STATE_FILE) as f:
            size = writer.write(f)
        nodes = []
        for node in writer.index:
            if node[0] == 1 and node[2] == "sh":
                shards = []
                for r in (0, 4):
                    data = w[r : r + 4].tobytes()
                    txn.write_bytes(shard_file(0, (r, 0)), data)
                    shards.append([shard_file(0, (r, 0)), [r, 0], [4, 6], google_crc32c.value(data),
                                   [google_crc32c.value(data)]])
                node = [*node[:5], shards]
            nodes.append(node)
        txn.write_bytes(INDEX_FILE, msgpack.packb({"format": INDEX_FORMAT, "state_size": size, "str_keys": True,
                                                   "nodes": nodes, "shard_block": SHARD_BLOCK}, use_bin_type=True))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = atomicstore.restore(f"{tmp_path}/ck", {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding),
                                                 "step": 0})
    assert isinstance(got["w"], jax.Array) and got["w"].sharding == sharding
    assert np.array_equal(np.asarray(got["w"]), w) and got["step"] == 7
