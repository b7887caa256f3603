"""Quick start: commit a checkpoint atomically, list it, verify it, read it back.

Runs on the embedded default: a local directory, no credentials. Pass a URL
(``s3://bucket/prefix``, ``gs://bucket/prefix``) as the first argument to use a bucket.
"""

from __future__ import annotations

import json
import sys
import tempfile

import numpy as np

import atomicstore


def main(url: str) -> None:
    store = atomicstore.open_store(url)
    print(f"store: {store.url} (commit strategy: {store.strategy.kind})")
    weights = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)

    # All files of a transaction become visible together, or not at all.
    with store.transaction("step_100", metadata={"step": 100}) as txn:
        with txn.open("weights.bin") as f:
            f.write(weights)  # streamed straight from the array's buffer
        txn.write_bytes("trainer.json", json.dumps({"step": 100, "lr": 3e-4}).encode())

    # A save that fails half-way leaves nothing visible.
    try:
        with store.transaction("step_200") as txn:
            txn.write_bytes("trainer.json", b"{}")
            raise RuntimeError("preempted mid-save")
    except RuntimeError as exc:
        print(f"step_200 aborted: {exc}")

    print("committed:", store.list())
    manifest = store.verify("step_100")  # re-reads every byte, checks CRC32C
    for path, entry in manifest.files.items():
        print(f"  {path}: {entry.size} bytes, crc32c {entry.crc32c:08x}")
    restored = np.frombuffer(store.read_bytes("step_100", "weights.bin"), dtype=np.float32)
    assert np.array_equal(restored.reshape(weights.shape), weights)
    assert store.list() == ["step_100"]
    print("restored weights are bit-identical: OK")

    # A pytree (numpy here; jax arrays and dataclasses work the same) in flax's format.
    state = {"params": {"w": weights, "b": np.zeros(1024, np.float32)}, "step": 100}
    atomicstore.save(f"{url}/tree_100", state)
    back = atomicstore.restore(f"{url}/tree_100", target=state)
    assert np.array_equal(back["params"]["w"], weights) and back["step"] == 100
    only_b = atomicstore.restore(f"{url}/tree_100", subtree="params/b")  # reads one leaf
    assert only_b.shape == (1024,)
    print("committed:", store.list())
    print("pytree saved and restored (whole, and one leaf alone): OK")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="atomicstore-"))
