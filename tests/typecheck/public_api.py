"""Type-checked uses of atomicstore's public API, as a dependent would write them.

Never run, never collected by pytest (no ``test_`` prefix): ``nox -s lint`` runs
``mypy --strict tests/typecheck``, so an annotation of the library that stops matching
what these uses expect (``assert_type``), or an error class that leaves its place in the
hierarchy, fails lint. The ``# type: ignore[...]`` lines are negative checks: under
``--strict`` (``warn_unused_ignores``) an ignore that is no longer needed is an error, so
a parameter that silently widened to ``Any`` fails too.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from typing import Any, assert_type

import numpy as np
import tenacity
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import atomicstore
from atomicstore import (
    AlreadyExistsError,
    AtomicStoreError,
    Capabilities,
    CheckedReader,
    Checkpoint,
    CheckpointManager,
    ChecksumMismatchError,
    CommitConflictError,
    CommitOutcomeUnknownError,
    CoordinationError,
    CorruptionError,
    Driver,
    ExclusivityWarning,
    FileEntry,
    FileInfo,
    InvalidArgumentError,
    LeaseLostError,
    Manifest,
    NotFoundError,
    PreconditionFailedError,
    RecoveryAction,
    RecoveryReport,
    RetryPolicy,
    StorageError,
    StorageTimeoutError,
    Store,
    Transaction,
    TransactionError,
    TransactionFile,
    UnknownProtocolError,
    Writer,
)
from atomicstore.compat import fjformer
from atomicstore.compat import flax as checkpoints
from atomicstore.integrations import orbax as aorbax
from atomicstore.integrations import torch as atorch

# -- module-level entry points -------------------------------------------------------------


def entry_points(tree: dict[str, Any], path: os.PathLike[str], driver_cls: type[Driver]) -> None:
    assert_type(atomicstore.__version__, str)
    assert_type(atomicstore.save("s3://bucket/run/step_1", tree), Manifest)
    assert_type(atomicstore.save(path, tree, overwrite=True, metadata={"step": 1}, cast_dtype=np.float16,
                                 progress=lambda n: None, timeout=10.0), Manifest)
    assert_type(atomicstore.restore("/tmp/run/step_1"), Any)
    assert_type(atomicstore.restore(path, tree, subtree="params", allow_missing=True, threads=4), Any)
    assert_type(atomicstore.open_store("/tmp/run"), Store)
    assert_type(atomicstore.open_store(path, writer_id="w", retry=RetryPolicy(attempts=3), lease_ttl=5.0,
                                       anon=True), Store)
    assert_type(atomicstore.natural_sort(["step_10", "step_9"]), list[str])
    assert_type(atomicstore.register_driver(driver_cls, ("mem2",)), type[Driver])
    atomicstore.open_store(42)  # type: ignore[arg-type]
    atomicstore.save(b"/tmp/run", tree)  # type: ignore[arg-type]


# -- Store, Transaction, Checkpoint, CheckedReader ------------------------------------------


def store_api(store: Store) -> None:
    assert_type(store.url, str)
    assert_type(store.list(), list[str])
    assert_type(store.committed(), dict[str, str | None])
    assert_type(store.exists("step_1"), bool)
    assert_type(store.open("step_1"), Checkpoint)
    assert_type(store.open("step_1", generation="7"), Checkpoint)
    assert_type(store.manifest("step_1"), Manifest)
    assert_type(store.read_bytes("step_1", "state.msgpack"), bytes)
    assert_type(store.verify("step_1"), Manifest)
    assert_type(store.delete("step_1"), None)
    assert_type(store.recover(), RecoveryReport)
    assert_type(store.recover(dry_run=True, grace=0.0, flax_prefix="checkpoint_"), RecoveryReport)
    assert_type(store.transaction("step_2", metadata={"k": 1}, overwrite=True), Transaction)
    assert_type(store.write_file("notes.txt", b"x"), None)
    assert_type(store.read_file("notes.txt"), bytes)
    assert_type(store.close(), None)
    with store as s:
        assert_type(s, Store)
    store.open(1)  # type: ignore[arg-type]


def transaction_api(store: Store) -> None:
    with store.transaction("step_3") as txn:
        assert_type(txn, Transaction)
        assert_type(txn.prefix, str)
        assert_type(txn.write_bytes("a.bin", b"abc"), None)
        with txn.open("b.bin") as f:
            assert_type(f, TransactionFile)
            assert_type(f.write(b"abc"), int)
            assert_type(f.write(memoryview(b"abc"), crc32c=0, borrow=True), int)
            assert_type(f.bytes_written, int)
        assert_type(txn.adopt("c.bin", 3, 0), None)
        assert_type(txn.files, dict[str, FileEntry])
        assert_type(txn.committed, bool)
        assert_type(txn.commit(), Manifest)
        assert_type(txn.commit(check=lambda: None), Manifest)
        assert_type(txn.abort(), None)


def checkpoint_api(ckpt: Checkpoint, out: bytearray) -> None:
    assert_type(ckpt.name, str)
    assert_type(ckpt.manifest, Manifest)
    assert_type(ckpt.files, dict[str, FileEntry])
    assert_type(ckpt.metadata, dict[str, Any])
    assert_type(ckpt.where("a.bin"), str)
    assert_type(ckpt.open("a.bin"), CheckedReader)
    assert_type(ckpt.read_bytes("a.bin"), bytes)
    assert_type(ckpt.read_range("a.bin", 0, 10), bytes)
    assert_type(ckpt.read_range_into("a.bin", 0, out), None)
    assert_type(ckpt.verify(), Manifest)
    with ckpt.open("a.bin") as reader:
        assert_type(reader.readall(), bytes)
        assert_type(reader.readinto(out), int)
        assert_type(reader.readable(), bool)


def records(m: Manifest, e: FileEntry, r: RecoveryReport, a: RecoveryAction, fi: FileInfo,
            caps: Capabilities, policy: RetryPolicy) -> None:
    assert_type(m.name, str)
    assert_type(m.attempt, str)
    assert_type(m.files, dict[str, FileEntry])
    assert_type(m.metadata, dict[str, Any])
    assert_type(m.committed, float | None)
    assert_type(m.total_bytes, int)
    assert_type(m.to_bytes(), bytes)
    assert_type(Manifest.from_bytes(b"{}", where="x"), Manifest)
    assert_type(e.size, int)
    assert_type(e.crc32c, int)
    assert_type(e.check("a.bin", 3, 0), None)
    assert_type(r.dry_run, bool)
    assert_type(r.actions, list[RecoveryAction])
    assert_type(r.in_flight, list[str])
    assert_type(r.committed, list[str])
    assert_type(r.summary(), str)
    assert_type(a.kind, str)
    assert_type(a.target, str)
    assert_type(fi.size, int)
    assert_type(fi.generation, str | None)
    assert_type(caps.atomic_rename, bool)
    assert_type(policy.attempts, int)
    assert_type(policy.retrying(lambda exc: True), tenacity.Retrying)


def driver_api(d: Driver, w: Writer) -> None:
    assert_type(d.capabilities, Capabilities)
    assert_type(d.open_writer("k", exclusive=True), Writer)
    assert_type(d.read("k", 0, 10), bytes)
    assert_type(d.info("k"), FileInfo)
    assert_type(d.find(""), dict[str, FileInfo])
    assert_type(d.iter_read("k"), Iterator[bytes])
    assert_type(w.write(b"x"), None)
    assert_type(w.close_async(), concurrent.futures.Future[None])


# -- CheckpointManager ---------------------------------------------------------------------


def manager_api(tree: dict[str, Any]) -> None:
    with CheckpointManager("s3://bucket/run", keep=3, keep_every_n_steps=1000, best_fn=lambda m: m["loss"],
                           best_mode="min", async_save=True) as mgr:
        assert_type(mgr, CheckpointManager)
        assert_type(mgr.save(10, tree, metrics={"loss": 0.1}, milestone=True), None)
        assert_type(mgr.all_steps(), list[int | float])
        assert_type(mgr.latest_step(), int | float | None)
        assert_type(mgr.metadata(10), dict[str, Any])
        assert_type(mgr.items(10), dict[str, Any])
        assert_type(mgr.restore(), Any)
        assert_type(mgr.restore(10, tree), Any)
        assert_type(mgr.delete(10), None)
        assert_type(mgr.wait_until_finished(), None)
        assert_type(mgr.close(), None)
        mgr.save("10", tree)  # type: ignore[arg-type]


# -- errors: each class where the docs put it ----------------------------------------------


def e_conflict(e: CommitConflictError) -> AlreadyExistsError:
    return e


def e_lease(e: LeaseLostError) -> CommitConflictError:
    return e


def e_precondition(e: PreconditionFailedError) -> AlreadyExistsError:
    return e


def e_exists(e: AlreadyExistsError) -> FileExistsError:
    return e


def e_exists_base(e: AlreadyExistsError) -> AtomicStoreError:
    return e


def e_not_found(e: NotFoundError) -> FileNotFoundError:
    return e


def e_not_found_base(e: NotFoundError) -> AtomicStoreError:
    return e


def e_storage(e: StorageError) -> OSError:
    return e


def e_storage_base(e: StorageError) -> AtomicStoreError:
    return e


def e_timeout(e: StorageTimeoutError) -> StorageError:
    return e


def e_unknown_outcome(e: CommitOutcomeUnknownError) -> StorageError:
    return e


def e_checksum(e: ChecksumMismatchError) -> CorruptionError:
    return e


def e_corruption(e: CorruptionError) -> AtomicStoreError:
    return e


def e_invalid(e: InvalidArgumentError) -> ValueError:
    return e


def e_invalid_base(e: InvalidArgumentError) -> AtomicStoreError:
    return e


def e_protocol(e: UnknownProtocolError) -> InvalidArgumentError:
    return e


def e_coordination(e: CoordinationError) -> RuntimeError:
    return e


def e_coordination_base(e: CoordinationError) -> AtomicStoreError:
    return e


def e_transaction(e: TransactionError) -> RuntimeError:
    return e


def e_transaction_base(e: TransactionError) -> AtomicStoreError:
    return e


def e_base(e: AtomicStoreError) -> Exception:
    return e


def w_exclusivity(w: ExclusivityWarning) -> UserWarning:
    return w


def e_flax_invalid(e: checkpoints.InvalidCheckpointError) -> InvalidArgumentError:
    return e


def e_orbax_conflict(e: aorbax.StepConflictError) -> CommitConflictError:
    return e


def e_orbax_version(e: aorbax.OrbaxVersionError) -> ImportError:
    return e


def e_orbax_version_base(e: aorbax.OrbaxVersionError) -> AtomicStoreError:
    return e


def e_not_an_error(e: AtomicStoreError) -> CommitConflictError:
    return e  # type: ignore[return-value]


# -- atomicstore.compat.flax ---------------------------------------------------------------


def compat_flax(tree: dict[str, Any]) -> None:
    assert_type(checkpoints.save_checkpoint("/tmp/ckpt", tree, 10, keep=3, overwrite=True), str)
    mgr = checkpoints.AsyncManager()
    assert_type(checkpoints.save_checkpoint("s3://b/ckpt", tree, 11, async_manager=mgr,
                                            storage_options={"anon": True}), str)
    assert_type(mgr.wait_previous_save(), None)
    assert_type(checkpoints.save_checkpoint_multiprocess("/tmp/ckpt", tree, 12), str)
    assert_type(checkpoints.restore_checkpoint("/tmp/ckpt", tree), Any)
    assert_type(checkpoints.restore_checkpoint("/tmp/ckpt", None, step=10, prefix="checkpoint_"), Any)
    assert_type(checkpoints.latest_checkpoint("/tmp/ckpt"), str | None)
    assert_type(checkpoints.available_steps("/tmp/ckpt"), list[int | float])
    assert_type(checkpoints.natural_sort(["a_1", "a_10"]), list[str])
    assert_type(checkpoints.convert_pre_linen(tree), Any)
    checkpoints.save_checkpoint("/tmp/ckpt", tree)  # type: ignore[call-arg]


# -- atomicstore.compat.fjformer -----------------------------------------------------------


def compat_fjformer(state: dict[str, Any], path: os.PathLike[str]) -> None:
    mgr = fjformer.CheckpointManager("gs://bucket/run", float_dtype="bf16", storage_options={"token": "anon"})
    assert_type(mgr.save_checkpoint(state, "step_1.easy"), None)
    assert_type(mgr.save_all(state, gather_fns=None, milestone=True), None)
    assert_type(mgr.save_json({"a": 1}, "meta.json"), None)
    assert_type(mgr.save_pickle({"a": 1}, "meta.pkl"), None)
    assert_type(fjformer.save_state_to_file(state, path, float_dtype="fp16"), None)
    assert_type(fjformer.CheckpointManager.save_state_to_file(state, "/tmp/x.easy"), None)
    assert_type(fjformer.load_checkpoint("/tmp/x.easy"), Any)
    assert_type(fjformer.load_checkpoint(path, target=state, remove_dict_prefix=("params",),
                                         callback=lambda leaf, key: leaf), Any)
    assert_type(fjformer.CheckpointManager.load_checkpoint("/tmp/x.easy"), Any)
    assert_type(fjformer.save_json({"a": 1}, "/tmp/x.json"), None)
    assert_type(fjformer.load_json("/tmp/x.json"), Any)


# -- atomicstore.integrations.torch --------------------------------------------------------


def as_storage_writer(w: atorch.AtomicStorageWriter) -> StorageWriter:
    return w


def as_storage_reader(r: atorch.AtomicStorageReader) -> StorageReader:
    return r


def integration_torch(state_dict: dict[str, Any]) -> None:
    assert_type(atorch.save(state_dict, "s3://bucket/run/step_1", overwrite=True, thread_count=4), Metadata)
    assert_type(atorch.load(state_dict, "s3://bucket/run/step_1", thread_count=8), None)
    with atorch.AtomicStorageWriter("/tmp/run/step_1", overwrite=False) as w:
        assert_type(w, atorch.AtomicStorageWriter)
        assert_type(w.transaction, Transaction | None)
        assert_type(w.abort(), None)
        assert_type(atorch.AtomicStorageWriter.validate_checkpoint_id("/tmp/run/step_1"), bool)
    reader = atorch.AtomicStorageReader("/tmp/run/step_1", thread_count=4)
    assert_type(reader.read_metadata(), Metadata)
    assert_type(atorch.atomicstore_error(RuntimeError()), AtomicStoreError | None)
    atorch.save([1, 2], "/tmp/run/step_2")  # type: ignore[arg-type]


def torch_write_data(w: atorch.AtomicStorageWriter, plan: Any, planner: Any) -> None:
    assert_type(w.write_data(plan, planner), Future[list[WriteResult]])


# -- atomicstore.integrations.orbax --------------------------------------------------------


async def integration_orbax(directory: str) -> None:
    tmp_cls = aorbax.AtomicTemporaryPath.with_options(lease_ttl=30.0)
    assert_type(tmp_cls, type[aorbax.AtomicTemporaryPath])
    assert_type(aorbax.AtomicTemporaryPath.open_store(directory), Store)
    assert_type(aorbax.AtomicTemporaryPath.check_final(f"{directory}/1"), Manifest)
    assert_type(aorbax.AtomicTemporaryPath.verify(f"{directory}/1"), Manifest)
    assert_type(aorbax.AtomicTemporaryPath.recover(directory, dry_run=True), RecoveryReport)
    assert_type(aorbax.AtomicTemporaryPath.judge(f"{directory}/1.orbax-checkpoint-tmp"), aorbax.Judgement)
    tmp = aorbax.AtomicTemporaryPath.from_final(f"{directory}/1")
    assert_type(tmp, aorbax.AtomicTemporaryPath)
    assert_type(tmp.is_item, bool)
    assert_type(tmp.name, str | None)
    assert_type(await tmp.create(), Any)
    assert_type(await tmp.finalize(), None)
    assert_type(tmp.abort(), None)
    mgr = aorbax.AtomicCheckpointManager(directory)
    assert_type(mgr.save(1, args=None), bool)
    assert_type(aorbax.check_orbax_version(aorbax.ORBAX_VERSION), None)
