"""The Store's public writers keep the checkpoint layout intact (issue rows B2, B3, B7, B8).

B3: a transaction (or one-file commit) belongs to the process that began it: a forked
child can neither commit nor abort it, and its exit leaves storage alone.
B7: ``write_file`` and the other name-taking writers refuse names inside a committed
checkpoint or reserved by the layout (so no checkpoint is damaged or forged).
B2: ``verify`` of a checkpoint replaced while it is read is PreconditionFailedError, not damage.
B8: a store root inside a checkpoint or another store's reserved layout is refused.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import Backend

import atomicstore
from atomicstore.errors import (
    ChecksumMismatchError,
    InvalidArgumentError,
    PreconditionFailedError,
    TransactionError,
)


def _fork(child: Any) -> int:
    """Run ``child()`` in a forked process; its exit code (0 only if it returned True)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = 0 if child() else 2
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# -- B3: a forked child cannot commit or abort its parent's transaction --------------------
@pytest.mark.parametrize("how", ["leave", "commit", "abort", "raise", "write"])
def test_forked_child_cannot_end_parents_transaction(backend: Backend, how: str) -> None:
    st = backend.open()
    with st.transaction("n1") as txn:
        txn.write_bytes("a.bin", b"parent-a")

        def child() -> bool:
            if how == "raise":
                try:
                    with txn:  # leaving the parent's block with an error: storage untouched
                        raise KeyError("child")
                except KeyError:
                    return True
            try:
                if how == "leave":
                    txn.__exit__(None, None, None)
                elif how == "commit":
                    txn.commit()
                elif how == "abort":
                    txn.abort()
                else:
                    txn.write_bytes("c.bin", b"child")
            except TransactionError as exc:
                return "belongs to process" in str(exc)
            return False

        assert _fork(child) == 0
        txn.write_bytes("b.bin", b"parent-b")
    assert txn.committed
    assert st.list() == ["n1"]
    assert set(st.verify("n1").files) == {"a.bin", "b.bin"}
    assert st.read_bytes("n1", "b.bin") == b"parent-b"


@pytest.mark.parametrize("how", ["leave", "abort", "write"])
def test_forked_child_cannot_end_parents_one_file_commit(backend: Backend, how: str) -> None:
    st = backend.open()
    with st.one_file("flax_1") as w:
        w.write(b"parent-1")

        def child() -> bool:
            try:
                if how == "leave":
                    w.__exit__(None, None, None)
                elif how == "abort":
                    w.abort()
                else:
                    w.write(b"child")
            except TransactionError as exc:
                return "belongs to process" in str(exc)
            return False

        assert _fork(child) == 0
        w.write(b"parent-2")
    assert st.driver.read("flax_1") == b"parent-1parent-2"


# -- B7: public writers never touch a checkpoint's layout ----------------------------------
def test_write_file_refuses_checkpoint_and_reserved_paths(backend: Backend) -> None:
    st = backend.open()
    with st.transaction("step_1") as txn:
        txn.write_bytes("state.bin", b"state")
    attempt = txn.attempt
    for path in ["step_1/manifest.json", "step_1/commit_success.txt", "step_1/state.bin", "step_1/new.txt",
                 f"step_1/attempt-{attempt}/state.bin", "forged/commit_success.txt", "forged/manifest.json",
                 "manifest.json", "commit_success.txt", "attempt-1/x", "logs/.atomicstore/x"]:
        with pytest.raises(InvalidArgumentError):
            st.write_file(path, b"x", overwrite=True)
    # a file under a committed checkpoint's own name: on object stores the object step_1
    # would sit beside step_1/commit_success.txt (attacker finding G4); on local disk a
    # file cannot replace the directory
    with pytest.raises(atomicstore.AtomicStoreError):
        st.write_file("step_1", b"x", overwrite=True)
    st.write_file("notes.txt", b"ok")  # the root and plain directories stay writable
    st.write_file("logs/run.txt", b"ok")
    assert st.read_file("logs/run.txt") == b"ok"
    assert st.list() == ["step_1"]
    assert st.verify("step_1").files.keys() == {"state.bin"}
    assert not st.driver.exists("step_1") or st.driver.capabilities.atomic_rename, "a file beside step_1/"


def test_name_taking_writers_refuse_reserved_names(backend: Backend) -> None:
    st = backend.open()
    for name in ["manifest.json", "commit_success.txt", "attempt-20260101T000000-abcdefabcdef"]:
        with pytest.raises(InvalidArgumentError):
            st.transaction(name)
        with pytest.raises(InvalidArgumentError):
            st.one_file(name)
        with pytest.raises(InvalidArgumentError):
            st.delete(name)
        with pytest.raises(InvalidArgumentError):
            st.delete_one_file(name)
    assert st.list() == []


# -- B2: a checkpoint replaced during verify is not damage ---------------------------------
def _save(st: atomicstore.Store, data: bytes, *, overwrite: bool) -> None:
    with st.transaction("ck", overwrite=overwrite) as txn:
        txn.write_bytes("a.bin", data)
        txn.write_bytes("b.bin", data)


def test_verify_of_checkpoint_replaced_meanwhile_is_precondition_failed(backend: Backend) -> None:
    reader, writer = backend.open(), backend.open()
    _save(writer, b"one", overwrite=False)
    plain = reader.driver.iter_read
    calls = []

    def read_after_replacement(key: str, *args: Any, **kwargs: Any) -> Any:
        if not calls:  # verify opened the checkpoint; another writer replaces it now
            calls.append(key)
            _save(writer, b"two-two-two", overwrite=True)
        return plain(key, *args, **kwargs)

    reader.driver.iter_read = read_after_replacement  # type: ignore[method-assign]
    with pytest.raises(PreconditionFailedError, match="replaced or deleted while it was being verified"):
        reader.verify("ck")
    assert calls
    reader.driver.iter_read = plain  # type: ignore[method-assign]
    assert reader.verify("ck").files["a.bin"].size == len(b"two-two-two")


def test_verify_still_reports_real_damage(tmp_path: Any) -> None:
    st = atomicstore.open_store(str(tmp_path / "s"))
    _save(st, b"one", overwrite=False)
    (tmp_path / "s" / "ck" / "a.bin").write_bytes(b"bad")
    with pytest.raises(ChecksumMismatchError):
        st.verify("ck")


# -- B8: store roots inside a checkpoint or a reserved directory ---------------------------
def test_store_root_inside_reserved_layout_is_refused(backend: Backend) -> None:
    for sub in [".atomicstore/trash", ".atomicstore/staging/ck", "step_1/attempt-20260101T000000-abcdefabcdef"]:
        with pytest.raises(InvalidArgumentError, match="reserved"):
            atomicstore.open_store(f"{backend.url}/{sub}", **backend.options)
    import numpy as np

    with pytest.raises(InvalidArgumentError):
        atomicstore.save(f"{backend.url}/.atomicstore/trash/ck", {"b": np.arange(4)}, **backend.options)


def test_local_store_root_inside_checkpoint_is_refused(tmp_path: Any) -> None:
    import numpy as np

    root = str(tmp_path / "s")
    atomicstore.save(root + "/step_1", {"a": np.ones(3)})
    for inner in [root + "/step_1", root + "/step_1/sub"]:
        with pytest.raises(InvalidArgumentError, match="inside committed checkpoint"):
            atomicstore.open_store(inner)
        with pytest.raises(InvalidArgumentError):
            atomicstore.CheckpointManager(inner)
    (tmp_path / "s" / "plain").mkdir()
    (tmp_path / "s" / "plain" / "manifest.json").write_text('{"not": "ours"}')  # a user's own file
    atomicstore.open_store(root + "/plain/ckpts")
    assert "step_1" in atomicstore.open_store(root).list()


