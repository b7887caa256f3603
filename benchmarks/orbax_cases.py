"""Orbax save through AtomicTemporaryPath against Orbax's default, side by side.

Two cases in the style of ``benchmarks/run.py`` (setup outside, the returned callable does
one durable save):

* ``orbaxdefault``: ``StandardCheckpointer`` with Orbax's default temporary path (atomic
  rename on local disk), then every file and directory fsynced, as ``case_orbax_save``
  does, so that both sides are durable;
* ``orbaxatomic``: the same checkpointer with ``temporary_path_class=AtomicTemporaryPath``:
  staged under ``.atomicstore/staging``, every file read back for its CRC32C and fsynced,
  manifest, directory fsyncs, lease check, ``rename(NOREPLACE)``, root fsynced.

    CASES.update(orbaxdefault_save=case_orbaxdefault_save, orbaxatomic_save=case_orbaxatomic_save)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np


def _tree(data: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {f"layer_{i:05d}": a for i, a in enumerate(data)}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """fsync every file and directory below ``path`` (what Orbax wrote), and its parent."""
    for dirpath, _dirs, files in os.walk(path):
        for fn in files:
            fd = os.open(os.path.join(dirpath, fn), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        _fsync_dir(dirpath)
    _fsync_dir(os.path.dirname(path))


def case_orbaxdefault_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import orbax.checkpoint as ocp

    tree = _tree(data)
    d = os.path.join(work, "orbax", "step_1")
    ckptr = ocp.StandardCheckpointer()

    def run() -> None:
        ckptr.save(d, tree)
        ckptr.wait_until_finished()
        _fsync_tree(d)

    return run


def case_orbaxatomic_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import orbax.checkpoint as ocp

    from atomicstore.integrations.orbax import AtomicTemporaryPath

    tree = _tree(data)
    root = os.path.join(work, "orbax")
    os.makedirs(root)
    AtomicTemporaryPath.open_store(root)  # the store opens once per process, not per save
    ckptr = ocp.StandardCheckpointer(temporary_path_class=AtomicTemporaryPath)

    def run() -> None:
        ckptr.save(os.path.join(root, "step_1"), tree)
        ckptr.wait_until_finished()  # committed and durable when this returns

    return run
