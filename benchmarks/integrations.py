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
from typing import Any

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


# -- torch DCP on the cloud link (run by cloud.py: ``--only dcp``) ------------------------------
# Each takes cloud.py's ``env`` (bucket, storage options, ``direct``: the server's own
# endpoint, ``endpoint``: the shaped link) and the leaves, and returns (run, check) as
# cloud.py's cases do. A load first saves through ``direct`` (untimed).

def _dcp_state(data: list[np.ndarray]) -> dict:
    return _torch_state(data)


def _dcp_empty(data: list[np.ndarray]) -> dict:
    import torch

    return {"model": {f"layer{i}": torch.empty(a.shape, dtype=torch.float32) for i, a in enumerate(data)},
            "step": 0}


def _dcp_check(data: list[np.ndarray]) -> Callable[[dict], None]:
    def check(out: dict) -> None:
        got = out["model"]
        for i, a in enumerate(data):
            if not np.array_equal(got[f"layer{i}"].numpy().view(np.uint32), a.view(np.uint32)):
                raise AssertionError(f"layer{i}: loaded bytes differ from the bytes saved")
        if out["step"] != 1:
            raise AssertionError("step not loaded")

    return check


def _as_opts(env: dict, endpoint: str) -> dict:
    return dict(env["options"], endpoint_url=endpoint)


def cloud_dcpatomicstore_save(env: dict, data: list[np.ndarray]) -> tuple[Callable[[], object], None]:
    """``AtomicStorageWriter`` (its defaults: one file per rank, ``thread_count=1``)."""
    import torch.distributed.checkpoint as dcp

    import atomicstore
    from atomicstore.integrations.torch import AtomicStorageWriter

    _quiet()
    sd = _dcp_state(data)
    url = f"s3://{env['bucket']}/dcp-as/step_1"
    from cloud import conformance_check

    # the clients loaded, and the store's conformance check done (cached for the process),
    # before timing, as in cloud.py's atomicstore case
    conformance_check(atomicstore.open_store(f"s3://{env['bucket']}/dcp-as", **_as_opts(env, env["endpoint"])))

    def run() -> None:
        with AtomicStorageWriter(url, **_as_opts(env, env["endpoint"])) as w:
            dcp.save(sd, storage_writer=w)

    return run, None


def cloud_dcpatomicstore_restore(env: dict, data: list[np.ndarray]) -> tuple[Callable[[], object], Any]:
    import torch.distributed.checkpoint as dcp

    from atomicstore.integrations.torch import AtomicStorageReader, AtomicStorageWriter

    _quiet()
    url = f"s3://{env['bucket']}/dcp-as/step_1"
    with AtomicStorageWriter(url, **_as_opts(env, env["direct"])) as w:
        dcp.save(_dcp_state(data), storage_writer=w)
    out = _dcp_empty(data)
    reader = AtomicStorageReader(url, **_as_opts(env, env["endpoint"]))

    def run() -> dict:
        dcp.load(out, storage_reader=reader)
        return out

    return run, _dcp_check(data)


def _s3torch_env(env: dict, endpoint: str) -> None:
    """s3torchconnector's client (the Mountpoint CRT client) takes a custom endpoint only
    from ``AWS_ENDPOINT_URL``, read when it is first used; credentials from the environment.
    (This process runs only this case.)"""
    o = env["options"]
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=o["key"], AWS_SECRET_ACCESS_KEY=o["secret"],
                      AWS_REGION="us-east-1")


def _s3torch_config() -> Any:
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)  # (its defaults otherwise: 8 MiB parts, 10 Gbps target)


def cloud_dcps3torch_save(env: dict, data: list[np.ndarray]) -> tuple[Callable[[], object], None]:
    """``s3torchconnector.dcp.S3StorageWriter`` (its defaults: ``thread_count=1``)."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageWriter

    _quiet()
    _s3torch_env(env, env["endpoint"])
    sd = _dcp_state(data)
    writer = S3StorageWriter("us-east-1", f"s3://{env['bucket']}/dcp-s3t/step_1", s3client_config=_s3torch_config())
    writer.fs._client._client  # noqa: B018 - the native client is made on first use: before timing

    def run() -> None:
        dcp.save(sd, storage_writer=writer)

    return run, None


def cloud_dcps3torch_restore(env: dict, data: list[np.ndarray]) -> tuple[Callable[[], object], Any]:
    """``s3torchconnector.dcp.S3StorageReader`` (its default reader: ``dcp_optimized``)."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    _quiet()
    path = f"s3://{env['bucket']}/dcp-s3t/step_1"
    _s3torch_env(env, env["direct"])
    dcp.save(_dcp_state(data), storage_writer=S3StorageWriter("us-east-1", path, s3client_config=_s3torch_config()))
    _s3torch_env(env, env["endpoint"])
    out = _dcp_empty(data)
    reader = S3StorageReader("us-east-1", path, s3client_config=_s3torch_config())
    reader.fs._client._client  # noqa: B018 - made before timing (it reads AWS_ENDPOINT_URL now)

    def run() -> dict:
        dcp.load(out, storage_reader=reader)
        return out

    return run, _dcp_check(data)


CLOUD_CASES: dict[str, Callable[[dict, list[np.ndarray]], tuple[Callable[[], object], Any]]] = {
    "dcp-atomicstore_save": cloud_dcpatomicstore_save,
    "dcp-atomicstore_restore": cloud_dcpatomicstore_restore,
    "dcp-s3torch_save": cloud_dcps3torch_save,
    "dcp-s3torch_restore": cloud_dcps3torch_restore,
}


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
