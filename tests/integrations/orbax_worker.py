"""A training job that saves through Orbax and AtomicTemporaryPath, and blocks mid-save.

    python tests/integrations/orbax_worker.py <root> <gcs endpoint or "-">

Saves step 1 (committed; prints ``COMMITTED 1``), then starts step 2: the ``params``
item (real Orbax/TensorStore arrays) is written, then the ``tail`` item writes its first
file, prints ``MIDWRITE 2`` and blocks before its second file, so the parent can SIGKILL
the process in the middle of the save.

    python tests/integrations/orbax_worker.py <root> <gcs endpoint or "-"> hold <step> <seed> <gate file>

Saves ``<step>`` (the tree of ``<seed>``, as the tests' ``tree``) through an
``AtomicCheckpointManager`` (async): once everything is written it prints ``HELD`` and
waits, right before its commit, until ``<gate file>`` exists; then prints ``RESULT ok`` or
``RESULT <exception type names of the chain>``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time


def main() -> None:
    root, endpoint = sys.argv[1], sys.argv[2]
    options: dict = {"lease_ttl": 3.0}
    if endpoint != "-":
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = endpoint
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        import fsspec

        fsspec.config.conf["gcs"] = {"endpoint_url": endpoint, "token": "anon", "project": "test",
                                     "use_listings_cache": False}
        options.update(endpoint_url=endpoint, token="anon", project="test")

    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath

    from atomicstore.integrations.orbax import AtomicTemporaryPath

    class TailHandler(ocp.AsyncCheckpointHandler):
        """Writes ``part-0.bin`` and ``part-1.bin``; with ``block``, stops in between."""

        async def async_save(self, directory: epath.Path, args: TailSave) -> list:
            class Commit:
                def result(self, timeout: float | None = None) -> None:
                    (epath.Path(directory) / "part-0.bin").write_bytes(b"0" * 65536)
                    if args.block:
                        print("MIDWRITE 2", flush=True)
                        while True:
                            time.sleep(60)
                    (epath.Path(directory) / "part-1.bin").write_bytes(b"1" * 65536)

            return [Commit()]

        def save(self, directory: epath.Path, args: TailSave) -> None:
            raise NotImplementedError("Orbax's composite handler calls async_save")

        def restore(self, directory: epath.Path, args: TailSave | None = None) -> bytes:
            return (epath.Path(directory) / "part-1.bin").read_bytes()

    @ocp.args.register_with_handler(TailHandler, for_save=True, for_restore=True)
    @dataclasses.dataclass
    class TailSave(ocp.args.CheckpointArgs):
        block: bool = False

    cls = AtomicTemporaryPath.with_options(**options)
    if sys.argv[3:4] == ["hold"]:
        hold(cls, int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
        return
    mgr = ocp.CheckpointManager(root, item_names=("params", "tail"), options=ocp.CheckpointManagerOptions(
        temporary_path_class=cls, enable_async_checkpointing=False))
    params = {"w": np.arange(65536, dtype=np.float32), "b": np.ones(16)}
    mgr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params), tail=TailSave()))
    mgr.wait_until_finished()
    print("COMMITTED 1", flush=True)
    mgr.save(2, args=ocp.args.Composite(params=ocp.args.StandardSave(params), tail=TailSave(block=True)))
    print("UNREACHABLE", flush=True)


def hold(cls: type, step: int, seed: int, gate: str) -> None:
    import numpy as np
    import orbax.checkpoint as ocp

    from atomicstore.integrations.orbax import AtomicCheckpointManager

    def wait_for_gate() -> None:
        print("HELD", flush=True)
        while not os.path.exists(gate):
            time.sleep(0.05)

    rng = np.random.default_rng(seed)
    state = {"w": rng.standard_normal((64, 32), dtype=np.float32), "b": rng.standard_normal(32)}
    mgr = AtomicCheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(
        temporary_path_class=cls, async_options=ocp.AsyncOptions(post_finalization_callback=wait_for_gate)))
    try:
        mgr.save(step, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
        print("RESULT ok", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        chain: list[str] = []
        e: BaseException | None = exc
        while e is not None and len(chain) < 10:
            chain.append(type(e).__name__)
            e = e.__cause__ or e.__context__
        print("RESULT " + " ".join(chain), flush=True)


if __name__ == "__main__":
    main()
