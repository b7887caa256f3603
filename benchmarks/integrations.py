"""Benchmark cases of the integrations (``nox -s bench -- --only integrations``): the stock
storage of each library against the same library committing through atomicstore.

torch DCP: ``FileSystemWriter`` (local disk; its files are fsynced by DCP, the directory
entries after its final rename are fsynced here so both sides are durable) and
``FsspecWriter`` (the S3 fake) against ``AtomicStorageWriter``, one rank, the state as
16 tensors. Orbax: its default temporary path against ``AtomicTemporaryPath`` (cases in
``orbax_cases.py``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import numpy as np


def _torch_state(data: list[np.ndarray]) -> dict:
    import torch

    return {"model": {f"layer{i}": torch.from_numpy(a) for i, a in enumerate(data)}, "step": 1}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _quiet() -> None:
    warnings.filterwarnings("ignore")  # DCP warns when it runs without a process group


def case_dcpstock_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import torch.distributed.checkpoint as dcp

    _quiet()
    sd = _torch_state(data)
    d = os.path.join(work, "dcp", "step_1")

    def run() -> None:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(d, sync_files=True))
        _fsync(d)  # DCP fsyncs its files, not the directory holding its renamed .metadata
        _fsync(os.path.dirname(d))

    return run


def case_dcpatomic_save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import torch.distributed.checkpoint as dcp

    from atomicstore.integrations.torch import AtomicStorageWriter

    _quiet()
    sd = _torch_state(data)
    url = os.path.join(work, "as", "step_1")

    def run() -> None:
        with AtomicStorageWriter(url) as w:
            dcp.save(sd, storage_writer=w)

    return run


def case_dcpstock_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import torch
    import torch.distributed.checkpoint as dcp

    case_dcpstock_save(work, data)()
    out = {"model": {k: torch.empty_like(v) for k, v in _torch_state(data)["model"].items()}, "step": 0}

    def run() -> None:
        dcp.load(out, storage_reader=dcp.FileSystemReader(os.path.join(work, "dcp", "step_1")))

    return run


def case_dcpatomic_restore(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import torch
    import torch.distributed.checkpoint as dcp

    from atomicstore.integrations.torch import AtomicStorageReader

    case_dcpatomic_save(work, data)()
    out = {"model": {k: torch.empty_like(v) for k, v in _torch_state(data)["model"].items()}, "step": 0}

    def run() -> None:
        dcp.load(out, storage_reader=AtomicStorageReader(os.path.join(work, "as", "step_1")))

    return run


def _s3() -> tuple[object, str, dict]:
    from atomicstore.testing.servers import FakeS3

    srv = FakeS3()
    return srv, srv.new_bucket(), srv.storage_options()


def case_dcpfsspec_s3save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    _quiet()
    srv, bucket, opts = _s3()
    sd = _torch_state(data)

    def run() -> None:
        dcp.save(sd, storage_writer=FsspecWriter(f"s3://{bucket}/dcp/step_1", **opts))

    run.server = srv  # type: ignore[attr-defined]  # kept alive with the case
    return run


def case_dcpatomic_s3save(work: str, data: list[np.ndarray]) -> Callable[[], None]:
    import torch.distributed.checkpoint as dcp

    import atomicstore
    from atomicstore.integrations.torch import AtomicStorageWriter

    _quiet()
    srv, bucket, opts = _s3()
    sd = _torch_state(data)
    atomicstore.open_store(f"s3://{bucket}/as", **opts)  # as the stock side, the client exists first

    def run() -> None:
        with AtomicStorageWriter(f"s3://{bucket}/as/step_1", **opts) as w:
            dcp.save(sd, storage_writer=w)

    run.server = srv  # type: ignore[attr-defined]
    return run


CASES: dict[str, Callable[[str, list[np.ndarray]], Callable[[], object]]] = {
    "dcpstock_save": case_dcpstock_save,
    "dcpatomic_save": case_dcpatomic_save,
    "dcpstock_restore": case_dcpstock_restore,
    "dcpatomic_restore": case_dcpatomic_restore,
    "dcpfsspec_s3save": case_dcpfsspec_s3save,
    "dcpatomic_s3save": case_dcpatomic_s3save,
}
try:  # the Orbax cases live beside these
    from orbax_cases import case_orbaxatomic_save, case_orbaxdefault_save

    CASES["orbaxdefault_save"] = case_orbaxdefault_save
    CASES["orbaxatomic_save"] = case_orbaxatomic_save
except ImportError:  # pragma: no cover - written by the Orbax integration's benchmark
    pass


def groups(total: int) -> list[tuple[str, int, str, list[str]]]:
    """(title, bytes, op, [anchor, atomicstore]) of each table group."""
    mib = total // 2**20
    out = [
        (f"torch DCP durable save, {mib} MiB (16 tensors), local disk", total, "save", ["dcpstock", "dcpatomic"]),
        (f"torch DCP load, {mib} MiB (warm cache), local disk", total, "restore", ["dcpstock", "dcpatomic"]),
        (f"torch DCP save to S3 fake (moto), {min(mib, 256)} MiB", min(total, 256 * 2**20), "s3save",
         ["dcpfsspec", "dcpatomic"]),
    ]
    if "orbaxatomic_save" in CASES:
        out.append((f"Orbax save, {mib} MiB, local disk", total, "save", ["orbaxdefault", "orbaxatomic"]))
    return out
