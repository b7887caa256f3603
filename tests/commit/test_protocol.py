"""The commit protocol, the same suite on local disk, memory, S3 and GCS."""

from __future__ import annotations

import concurrent.futures
import os
import secrets

import numpy as np
import pytest
from conftest import uncarried

import atomicstore
from atomicstore import (
    ChecksumMismatchError,
    CommitConflictError,
    InvalidArgumentError,
    NotFoundError,
    TransactionError,
)
from atomicstore.drivers.local import LOCK_KEY

MiB = 2**20


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def all_keys(store: atomicstore.Store) -> set[str]:
    """Every object under the root but the store's lock file (local disk keeps it)."""
    return set(store.driver.find("")) - {LOCK_KEY}


# -- acceptance 1: commit, list, read back, verify, delete --------------------------------
def test_commit_list_read_verify_delete(backend):
    store = backend.open(block_size=5 * MiB)
    big = payload(11 * MiB + 7, seed=1)  # several blocks: multipart / resumable upload
    small = b"hello"
    with store.transaction("step_1", metadata={"step": 1, "note": "first"}) as txn:
        with txn.open("state/big.bin") as f:
            for i in range(0, len(big), 3 * MiB + 1):  # odd-sized writes
                f.write(memoryview(big)[i : i + 3 * MiB + 1])
        txn.write_bytes("meta.json", small)
    assert txn.committed
    assert store.list() == ["step_1"]
    assert store.exists("step_1")

    other = backend.open()  # a fresh handle sees the same
    ckpt = other.open("step_1")
    assert ckpt.metadata == {"step": 1, "note": "first"}
    assert set(ckpt.files) == {"state/big.bin", "meta.json"}
    assert ckpt.files["state/big.bin"].size == len(big)
    assert ckpt.files["state/big.bin"].crc32c == atomicstore.commit.crc32c(big)
    assert ckpt.read_bytes("state/big.bin") == big
    assert ckpt.read_bytes("meta.json") == small
    assert ckpt.read_range("state/big.bin", 5 * MiB, 5 * MiB + 100) == big[5 * MiB : 5 * MiB + 100]
    with ckpt.open("state/big.bin") as f:
        head = f.read(1000)
        rest = f.read()
    assert head + rest == big
    assert other.verify("step_1").files == ckpt.files

    store.delete("step_1")
    assert store.list() == []
    assert not store.exists("step_1")
    with pytest.raises(NotFoundError):
        store.open("step_1")
    leftovers = {k for k in all_keys(store) if not k.startswith(".atomicstore/")}
    assert leftovers == set()
    with pytest.raises(NotFoundError):
        store.delete("step_1")


def test_exception_inside_transaction_leaves_nothing(backend):
    store = backend.open()
    with pytest.raises(RuntimeError, match="boom"):
        with store.transaction("step_2") as txn:
            txn.write_bytes("a.bin", b"partial data")
            with txn.open("b.bin") as f:
                f.write(b"more")
            raise RuntimeError("boom")
    assert store.list() == []
    assert not store.exists("step_2")
    with pytest.raises(NotFoundError):
        store.read_bytes("step_2", "a.bin")
    assert all_keys(store) == set()  # the staged data was removed too
    # the name is free again
    with store.transaction("step_2") as txn:
        txn.write_bytes("a.bin", b"second try")
    assert store.read_bytes("step_2", "a.bin") == b"second try"


def test_exception_inside_open_file_aborts(backend):
    store = backend.open()
    with pytest.raises(ValueError):
        with store.transaction("s") as txn, txn.open("x.bin") as f:
            f.write(b"abc")
            raise ValueError("inner")
    assert store.list() == []


def test_many_files_written_from_threads(backend):
    store = backend.open()
    files = {f"shard/{i:03d}.bin": payload(1000 + i, seed=i) for i in range(24)}
    with store.transaction("par") as txn:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda kv: txn.write_bytes(*kv), files.items()))
    ckpt = store.open("par")
    assert set(ckpt.files) == set(files)
    for p, data in files.items():
        assert ckpt.read_bytes(p) == data


def test_empty_checkpoint_and_empty_file(backend):
    store = backend.open()
    with store.transaction("empty"):
        pass
    with store.transaction("zero") as txn:
        txn.write_bytes("z", b"")
    assert store.list() == ["empty", "zero"]
    assert store.open("empty").files == {}
    assert store.read_bytes("zero", "z") == b""
    store.verify("zero")


def test_list_is_natural_and_committed_only(backend):
    store = backend.open()
    for step in ["11", "9", "1e1", "-0.2", "0.1", "100"]:
        with store.transaction(f"ckpt_{step}") as txn:
            txn.write_bytes("x", step.encode())
    pending = store.transaction("ckpt_5")
    pending.write_bytes("x", b"not yet")
    assert store.list() == ["ckpt_-0.2", "ckpt_0.1", "ckpt_9", "ckpt_1e1", "ckpt_11", "ckpt_100"]
    pending.abort()


def test_transaction_state_errors(backend):
    store = backend.open()
    txn = store.transaction("t")
    f = txn.open("a")
    with pytest.raises(TransactionError, match="still open"):
        txn.commit()
    f.write(b"1")
    f.close()
    with pytest.raises(InvalidArgumentError, match="already written"):
        txn.open("a")
    txn.commit()
    with pytest.raises(TransactionError, match="committed"):
        txn.open("b")
    with pytest.raises(TransactionError, match="committed"):
        txn.commit()
    txn.abort()  # no-op after commit
    assert store.read_bytes("t", "a") == b"1"


def test_conflict_is_detected_early_and_at_commit(backend):
    store = backend.open()
    first = store.transaction("same")
    second = backend.open().transaction("same")
    first.write_bytes("who", b"first")
    second.write_bytes("who", b"second")
    first.commit()
    with pytest.raises(CommitConflictError) as info:
        second.commit()
    assert info.value.name == "same"
    assert isinstance(info.value, FileExistsError)
    assert store.read_bytes("same", "who") == b"first"
    with pytest.raises(CommitConflictError):
        store.transaction("same")
    # the loser left nothing behind
    ckpt = store.open("same")
    expected = {ckpt.key(p) for p in [*ckpt.files, "manifest.json"]}
    if store.strategy.kind == "marker":
        expected.add("same/commit_success.txt")
    assert {k for k in all_keys(store) if not k.startswith(".atomicstore/")} == expected


# -- acceptance 3: a flipped byte ---------------------------------------------------------
# (the shipped driver contract checks it on every driver: DriverContract's
# test_store_a_flipped_byte_is_caught, run by tests/drivers/test_contract.py)


def test_truncated_and_missing_files_are_reported(backend):
    store = backend.open()
    with store.transaction("c") as txn:
        txn.write_bytes("a.bin", b"0123456789")
        txn.write_bytes("b.bin", b"x")
    ckpt = store.open("c")
    store.driver.put(ckpt.key("a.bin"), b"01234")
    with pytest.raises(ChecksumMismatchError, match="a.bin.*size 5"):
        store.read_bytes("c", "a.bin")
    store.driver.delete(ckpt.key("b.bin"))
    with pytest.raises(ChecksumMismatchError, match="a.bin|b.bin"):
        store.verify("c")


def test_corrupt_manifest_is_a_corruption_error(backend):
    """A manifest that cannot be read is a CorruptionError naming it. On object stores the
    commit marker carries a copy, checked against the digest the marker names: open uses
    it (the data is intact and readable), and verify, which reads every stored file,
    reports the damaged stored manifest. Without the copy (a marker written before markers
    carried one), open reports it."""
    store = backend.open()
    with store.transaction("m") as txn:
        txn.write_bytes("a", b"1")
    ckpt = store.open("m")
    store.driver.put(f"{ckpt.prefix}/manifest.json", b'{"format": "atomicstore.manifest/1", "files": 3}')
    if store.strategy.kind == "marker":
        assert store.read_bytes("m", "a") == b"1"
        with pytest.raises(atomicstore.CorruptionError, match="manifest") as info:
            store.verify("m")
        assert info.value.path.endswith("manifest.json"), info.value
        uncarried(store, "m")
    with pytest.raises(atomicstore.CorruptionError, match="manifest"):
        store.open("m")


# -- acceptance 6: bad arguments fail before anything is written -------------------------
@pytest.mark.parametrize("name", ["", "a/b", "..", "a..b", ".hidden", "x\x00y", "a b", "é", 7, None])
def test_bad_checkpoint_names(backend, name):
    store = backend.open()
    with pytest.raises(InvalidArgumentError):
        store.transaction(name)
    assert all_keys(store) == set()


@pytest.mark.parametrize(
    "path", ["", "/abs", "../escape", "a/../../b", "a//b", "./a", "a/./b", "a\\b", "nul\x00", "manifest.json",
             "commit_success.txt", ".atomicstore/x", "a/" + "x" * 300]
)
def test_bad_file_paths(backend, path):
    store = backend.open()
    txn = store.transaction("p")
    with pytest.raises(InvalidArgumentError):
        txn.open(path)
    txn.abort()
    assert store.list() == []
    assert all_keys(store) == set()


def test_bad_metadata(backend):
    store = backend.open()
    with pytest.raises(InvalidArgumentError):
        store.transaction("m", metadata={"x": object()})
    with pytest.raises(InvalidArgumentError):
        store.transaction("m", metadata=["not", "a", "dict"])  # type: ignore[arg-type]
    assert all_keys(store) == set()


def test_nested_reserved_names_are_fine(backend):
    store = backend.open()
    with store.transaction("n") as txn:
        txn.write_bytes("sub/manifest.json", b"user file")
    assert store.read_bytes("n", "sub/manifest.json") == b"user file"


# -- single files ----------------------------------------------------------------------
def test_write_file_replaces_or_refuses(backend):
    store = backend.open()
    store.write_file("trainer_state.json", b'{"step": 1}')
    assert store.read_file("trainer_state.json") == b'{"step": 1}'
    store.write_file("trainer_state.json", b'{"step": 2}')
    assert store.read_file("trainer_state.json") == b'{"step": 2}'
    with pytest.raises(atomicstore.AlreadyExistsError):
        store.write_file("trainer_state.json", b'{"step": 3}', overwrite=False)
    assert store.read_file("trainer_state.json") == b'{"step": 2}'
    store.write_file("fresh.json", b"{}", overwrite=False)
    assert store.read_file("fresh.json") == b"{}"
    with pytest.raises(InvalidArgumentError):
        store.write_file("../up.json", b"{}")
    with pytest.raises(NotFoundError):
        store.read_file("missing.json")
    assert store.list() == []  # single files are not checkpoints


def test_write_file_race_has_one_winner(backend):
    store = backend.open()
    name = f"lock-{secrets.token_hex(3)}"

    def attempt(i: int) -> bool:
        try:
            backend.open().write_file(name, str(i).encode(), overwrite=False)
            return True
        except atomicstore.AlreadyExistsError:
            return False

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(attempt, range(8)))
    assert results.count(True) == 1
    assert store.read_file(name) == str(results.index(True)).encode()


# -- local durability details ------------------------------------------------------------
def test_local_layout_has_no_staging_leftovers(tmp_path):
    store = atomicstore.open_store(tmp_path / "s")
    with store.transaction("a") as txn:
        txn.write_bytes("x/y/z.bin", b"deep")
    assert sorted(os.listdir(tmp_path / "s")) == [".atomicstore", "a"]
    assert os.listdir(tmp_path / "s" / ".atomicstore" / "staging") == []
    assert sorted(os.listdir(tmp_path / "s" / "a")) == ["manifest.json", "x"]


def test_local_root_that_is_a_file_is_rejected(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        atomicstore.open_store(f)


def test_writes_take_arrays_and_refuse_non_contiguous(backend):
    store = backend.open()
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    txn = store.transaction("arr")
    with txn.open("a.bin") as f:
        assert f.write(arr) == arr.nbytes
        with pytest.raises(InvalidArgumentError, match="C-contiguous"):
            f.write(arr[:, ::2])
        with pytest.raises(InvalidArgumentError):
            f.write("text")  # type: ignore[arg-type]
    txn.commit()
    out = np.empty_like(arr)
    store.open("arr").read_into("a.bin", out)
    assert np.array_equal(out, arr)
    with pytest.raises(InvalidArgumentError, match="writable buffer"):
        store.open("arr").read_into("a.bin", np.empty(5))
