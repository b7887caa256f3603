"""``atomicstore.save`` / ``atomicstore.restore`` held to the contract of every entry point
(issue 21): a URL of another store (row 15), the checkpoint overwritten or deleted between
two of the call's requests, a read-only store, a forked process.

Actors are put between two requests of a call by a hook on the reading store's driver
(the first read of a chosen file runs the other job first) or by ``gather_fns`` (user code
that runs in the middle of a save): never by sleeping.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Backend, make_backend

import atomicstore
from atomicstore import (
    CommitConflictError,
    InvalidArgumentError,
    PreconditionFailedError,
    StorageError,
)
from atomicstore.testing.faults import FaultPlan, is_mutation


def tree(v: float) -> dict[str, Any]:
    return {"w": np.full((64, 256), v, np.float32),  # 64 KiB: read by itself
            "b": np.arange(10, dtype=np.float64) + v, "step": int(v * 10), "tag": f"v{v}"}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in ("w", "b"))
            and a["step"] == b["step"] and a["tag"] == b["tag"])


# -- row 15: a URL that is not under the store's root ------------------------------------------
def two_stores(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[Backend, Backend]:
    a = make_backend(kind, request, tmp_path / "a")
    b = make_backend(kind, request, tmp_path / "b")  # (s3: another bucket; memory: another root)
    return a, b


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_row15_a_url_of_another_store_is_refused_not_redirected(kind, request, tmp_path):
    A, B = two_stores(kind, request, tmp_path)
    st_a, st_b = A.open(), B.open()
    atomicstore.save(f"{A.url}/step_1", tree(1.0), store=st_a)
    atomicstore.save(f"{B.url}/step_1", tree(2.0), store=st_b)
    for url in (f"{B.url}/step_1", f"{A.url}/run-42/step_1", f"{A.url}-other/step_1"):
        # another store; a store nested under A's root; a sibling whose name starts like A's
        with pytest.raises(InvalidArgumentError, match="not in the store") as exc:
            atomicstore.restore(url, store=st_a)
        assert st_a.url in str(exc.value)
        with pytest.raises(InvalidArgumentError, match="not in the store"):
            atomicstore.save(url.replace("step_1", "step_2"), tree(3.0), store=st_a)
    assert st_a.list() == ["step_1"] and st_b.list() == ["step_1"]  # nothing written anywhere
    assert same(atomicstore.restore(f"{B.url}/step_1", store=st_b), tree(2.0))
    # fine: a bare name, a URL under the store's root (with a trailing slash too)
    assert same(atomicstore.restore("step_1", store=st_a), tree(1.0))
    assert same(atomicstore.restore(f"{A.url}/step_1/", store=st_a), tree(1.0))
    atomicstore.save("step_2", tree(4.0), store=st_a)
    atomicstore.save(f"{A.url}/step_3", tree(5.0), store=st_a)
    assert st_a.list() == ["step_1", "step_2", "step_3"] and st_b.list() == ["step_1"]
    assert same(atomicstore.restore(f"{A.url}/step_2", **A.options), tree(4.0))
    with pytest.raises(InvalidArgumentError):  # a bare name without a store names no store
        atomicstore.restore("step_1")


def test_row15_local_spellings_of_the_same_root_are_accepted(tmp_path, monkeypatch):
    root = tmp_path / "store"
    st = atomicstore.open_store(str(root))
    atomicstore.save(str(root / "s1"), tree(1.0), store=st)
    os.symlink(root, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    for url in ("store/s1", "./store/s1", f"file://{root}/s1", str(tmp_path / "link" / "s1"),
                str(tmp_path / "x" / ".." / "store" / "s1")):
        assert same(atomicstore.restore(url, store=st), tree(1.0)), url
    with pytest.raises(InvalidArgumentError, match="not in the store"):
        atomicstore.restore("s1/x", store=st)  # relative to the working directory: another root
    with pytest.raises(InvalidArgumentError, match="not in the store"):
        atomicstore.restore(f"memory://{root}/s1", store=st)  # another protocol


# -- restore: overwritten or deleted between two of its requests --------------------------------
def before_first_read(store: atomicstore.Store, file: str, action: Callable[[], None]) -> list[str]:
    """Run ``action`` (another job) right before ``store``'s first read of a key ending in
    ``/<file>``: after the restore read the manifest (and the index), before the state.
    Returns the list the hook appends the key to when it fired."""
    drv = store.driver
    fired: list[str] = []

    def wrap(name: str) -> None:
        orig = getattr(drv, name)

        def hooked(key: str, *args: Any, **kwargs: Any) -> Any:
            if not fired and key.endswith("/" + file):
                fired.append(key)
                action()
            return orig(key, *args, **kwargs)

        setattr(drv, name, hooked)

    for name in ("read", "read_into", "read_ranges_into", "iter_read"):
        wrap(name)
    return fired


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
@pytest.mark.parametrize("other", ["overwrite", "delete"])
@pytest.mark.parametrize("with_target", [False, True])
def test_restore_of_a_checkpoint_replaced_mid_read_raises_precondition_failed(kind, other, with_target,
                                                                             request, tmp_path):
    """Another job overwrites (or deletes) the checkpoint after the restore read its
    manifest and index and before it read the state: the restore raises
    ``PreconditionFailedError`` (read it again), never a mix, never a false
    ``ChecksumMismatchError``/``NotFoundError`` for a checkpoint that is healthy."""
    b = make_backend(kind, request, tmp_path)
    atomicstore.save(f"{b.url}/s", tree(1.0), **b.options)
    reader, job = b.open(), b.open()

    def act() -> None:
        if other == "overwrite":
            atomicstore.save(f"{b.url}/s", tree(2.0), overwrite=True, store=job)
        else:
            job.delete("s")

    fired = before_first_read(reader, "state.msgpack", act)
    with pytest.raises(PreconditionFailedError, match="while it was being read"):
        atomicstore.restore(f"{b.url}/s", tree(0.0) if with_target else None, store=reader)
    assert fired
    if other == "overwrite":  # read again: the new one, whole
        assert same(atomicstore.restore(f"{b.url}/s", store=reader), tree(2.0))


# -- save: the name committed by another job between two of its requests ------------------------
@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_save_loses_cleanly_to_a_job_that_commits_the_name_mid_save(kind, overwrite, request, tmp_path):
    """The other job commits (or, with ``overwrite``, replaces) the checkpoint while this
    save streams its leaves (``gather_fns`` runs it): this save raises
    ``CommitConflictError`` and the checkpoint is entirely the other job's."""
    b = make_backend(kind, request, tmp_path)
    st, job = b.open(), b.open()
    if overwrite:
        atomicstore.save(f"{b.url}/s", tree(0.0), store=st)
    ran: list[bool] = []

    def other_job(path: Any, leaf: Any) -> Any:
        if not ran:
            ran.append(True)
            atomicstore.save(f"{b.url}/s", tree(2.0), overwrite=overwrite, store=job)
        return leaf

    with pytest.raises(CommitConflictError):
        atomicstore.save(f"{b.url}/s", tree(1.0), overwrite=overwrite, gather_fns=other_job, store=st)
    assert ran and st.list() == ["s"]
    assert same(atomicstore.restore(f"{b.url}/s", store=st), tree(2.0))
    st.verify("s")


# -- a read-only store -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_read_only_credentials_restore_and_a_save_is_refused_writing_nothing(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    atomicstore.save(f"{b.url}/s", tree(1.0), **b.options)
    b.faults(FaultPlan(deny=is_mutation))  # what read-only credentials get
    st = b.open()
    assert same(atomicstore.restore(f"{b.url}/s", store=st), tree(1.0))
    assert same(atomicstore.restore(f"{b.url}/s", tree(0.0), store=st), tree(1.0))
    with pytest.raises(StorageError):
        atomicstore.save(f"{b.url}/t", tree(2.0), store=st)
    b.faults(None)
    assert st.list() == ["s"]


# -- a forked process (local disk; S3/GCS: tests/drivers/test_fork_drivers.py) -------------------------
def test_a_forked_child_restores_and_saves_through_its_parents_local_store(tmp_path):
    """In a fresh interpreter (no jax threads to fork under): the parent opens the store
    and saves; a forked child restores and saves through the parent's store object."""
    url = str(tmp_path / "store")
    script = textwrap.dedent(f"""
        import os, numpy as np, atomicstore
        st = atomicstore.open_store({url!r})
        atomicstore.save("s", {{"w": np.arange(5.0)}}, store=st)
        pid = os.fork()
        if pid == 0:
            try:
                ok = np.array_equal(atomicstore.restore("s", store=st)["w"], np.arange(5.0))
                atomicstore.save("from-child", {{"w": np.arange(3.0)}}, store=st)
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        print("CHILD", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), st.list())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                                          os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0 and out.stdout.strip() == "CHILD 0 ['from-child', 's']", out
    assert np.array_equal(atomicstore.restore(f"{url}/from-child")["w"], np.arange(3.0))


def test_a_read_only_local_mount_restores_and_a_save_is_refused(tmp_path):
    """The store's directory bind-mounted read-only (in a private mount namespace of a
    child process, gone when it exits): restore works, save raises ``StorageError``."""
    src, ro = tmp_path / "store", tmp_path / "ro"
    ro.mkdir()
    atomicstore.save(f"{src}/s", tree(1.0))
    script = textwrap.dedent(f"""
        import numpy as np, atomicstore
        got = atomicstore.restore({str(ro / 's')!r})
        assert np.array_equal(got["w"], np.full((64, 256), 1.0, np.float32)) and got["tag"] == "v1.0", got
        try:
            atomicstore.save({str(ro / 't')!r}, got)
        except atomicstore.StorageError as exc:
            print("REFUSED", "Read-only file system" in str(exc))
    """)
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount --bind "{src}" "{ro}" && mount -o remount,bind,ro "{ro}" && exec "{sys.executable}" -c "$0"',
         script], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                          os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0 and out.stdout.split() == ["REFUSED", "True"], out
    assert atomicstore.open_store(str(src)).list() == ["s"]  # nothing left by the refused save
