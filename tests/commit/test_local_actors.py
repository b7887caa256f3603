"""Local disk with more than one actor in one process tree: forks while background work
(an fsync, the renameat2 probe, the store lock, an async save) is in flight, a probe
that could not run, storage errors from a background fsync, and the argument checks a
black-box attacker found missing (issue 15's fast path)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import atomicstore


def run_script(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_fork_while_another_thread_holds_the_store_lock(tmp_path):
    """A delete holds the store lock (flock) in one thread while another forks (a data
    loader's worker). The child's copy of the lock's descriptor must not keep the lock
    held after the parent released it, and the child's own locking must work."""
    out = run_script(f"""
        import os, sys, time, threading, signal
        import numpy as np, atomicstore
        root = {str(tmp_path)!r}
        st = atomicstore.open_store(root)
        for n in "abcd":
            atomicstore.save(f"{{root}}/{{n}}", {{"w": np.ones(10)}})
        main_pid, orig_fsync = os.getpid(), os.fsync
        gate, entered = threading.Event(), threading.Event()
        def fsync(fd):  # the scheduler: holds the deleting thread inside the lock
            if os.getpid() == main_pid and threading.current_thread().name == "deleter":
                entered.set(); gate.wait()
            return orig_fsync(fd)
        os.fsync = fsync
        th = threading.Thread(target=st.delete, args=("a",), name="deleter"); th.start()
        assert entered.wait(10)
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            done = threading.Event()
            threading.Thread(target=lambda: (st.delete("c"), done.set()), daemon=True).start()
            ok = done.wait(10)
            os.write(wr, b"ok" if ok else b"blocked")
            time.sleep(30)  # the worker lives on while the parent works
            os._exit(0)
        gate.set(); th.join(); os.fsync = orig_fsync
        done = threading.Event()
        threading.Thread(target=lambda: (st.delete("b"), done.set()), daemon=True).start()
        print("parent", "ok" if done.wait(10) else "blocked", flush=True)
        # the child's answer before it is killed (it was killed before printing, under load)
        import select
        ready = select.select([rd], [], [], 20)[0]
        print("child", os.read(rd, 16).decode() if ready else "silent", flush=True)
        os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
    """)
    assert sorted(out.stdout.split()) == ["child", "ok", "ok", "parent"], out.stdout + out.stderr
    assert atomicstore.open_store(tmp_path).list() == ["d"]


def test_a_forked_child_gets_a_clear_error_from_an_inherited_manager(tmp_path):
    """The parent's async save is in flight at the fork: in the child, that save's thread
    does not exist, so the inherited manager refuses at once instead of waiting forever."""
    out = run_script(f"""
        import os, threading
        import numpy as np, atomicstore
        orig, main = os.fsync, os.getpid()
        gate, entered = threading.Event(), threading.Event()
        def fsync(fd):  # holds the parent's background save in its fsync
            if os.getpid() == main and threading.current_thread().name.startswith("atomicstore-bg"):
                entered.set(); gate.wait()
            return orig(fd)
        os.fsync = fsync
        mgr = atomicstore.CheckpointManager({str(tmp_path)!r}, keep=2, async_save=True)
        mgr.save(1, {{"w": np.ones(1000)}})
        assert entered.wait(10)
        pid = os.fork()
        if pid == 0:
            try:
                mgr.save(2, {{"w": np.ones(1000)}})
                print("saved", flush=True)
            except atomicstore.InvalidArgumentError as exc:
                print("refused:", exc, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        gate.set(); mgr.close()
        print("parent steps", atomicstore.CheckpointManager({str(tmp_path)!r}).all_steps())
    """, timeout=60)
    assert "refused: this CheckpointManager was made in process" in out.stdout, out.stdout + out.stderr
    assert "parent steps [1]" in out.stdout, out.stdout + out.stderr


def test_probe_directories_of_a_killed_process_are_recovered(tmp_path):
    """A process killed while probing renameat2 leaves its scratch directories (in
    ``.atomicstore/``; older versions made them in the root): recovery removes those older
    than its temp-file age, and leaves a probe that may still be running."""
    st = atomicstore.open_store(tmp_path)
    atomicstore.save(tmp_path / "s", {"w": np.ones(3)}, store=st)
    old = [tmp_path / ".atomicstore" / ".probe-123-deadbeefa", tmp_path / ".probe-123-deadbeefb"]
    fresh = tmp_path / ".atomicstore" / ".probe-456-0123abcdc"
    for d in [*old, fresh]:
        d.mkdir()
    for d in old:
        os.utime(d, (time.time() - 3600, time.time() - 3600))
    report = st.recover(grace=0)
    assert sorted(a.target for a in report.actions) == [".atomicstore/.probe-123-deadbeefa", ".probe-123-deadbeefb"]
    assert not any(d.exists() for d in old) and fresh.exists()
    assert st.list() == ["s"] and st.recover(grace=0).actions == []


def test_a_probe_that_could_not_run_is_asked_again(tmp_path):
    """The background probe fails (here ``.atomicstore`` is a file for a moment; a full
    disk does the same): that is no answer, so the driver asks again when it needs one,
    with a StorageError while it still cannot, and the right answer once it can (it was
    cached as "no renameat2 flags", refusing every overwrite for the driver's life). In a
    fresh process: the probe's answer is kept per filesystem and process."""
    out = run_script(f"""
        import concurrent.futures, os, atomicstore
        from atomicstore.drivers.local import LocalDriver
        from atomicstore.drivers.renameat2 import probe_renameat2
        root = {str(tmp_path / "s")!r}
        os.makedirs(root)
        open(root + "/.atomicstore", "w").close()
        d = LocalDriver.from_url("file", root, {{}})
        w = d.open_writer("x/f")  # the first write starts the probe, which fails
        w.abort()
        concurrent.futures.wait([d._probe], timeout=30)  # the background probe has failed
        try:
            d.capabilities.renames()
            print("answered while it could not probe")
        except atomicstore.StorageError as exc:
            print("StorageError", "probe" in str(exc))
        os.unlink(root + "/.atomicstore")
        os.makedirs({str(tmp_path / "t")!r})
        print(d.capabilities.renames() == probe_renameat2({str(tmp_path / "t")!r}))
    """)
    assert out.stdout.split() == ["StorageError", "True", "True"], out.stdout + out.stderr


def test_a_failed_background_fsync_is_a_storage_error_and_leaves_nothing(tmp_path, monkeypatch):
    """EIO from the background fsync of a file: the save fails with atomicstore's
    StorageError (not a raw OSError), nothing is listed or left staged, the next save
    works."""
    st = atomicstore.open_store(tmp_path)
    real = os.fsync

    def eio(fd: int) -> None:  # the fault: the disk fails the background fsyncs
        if threading.current_thread().name.startswith("atomicstore-bg"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(atomicstore.StorageError, match="Input/output error"):
        atomicstore.save(tmp_path / "a", {"w": np.ones(100)}, store=st)
    monkeypatch.setattr(os, "fsync", real)
    assert st.list() == []
    assert not list((tmp_path / ".atomicstore" / "staging").iterdir())
    atomicstore.save(tmp_path / "a", {"w": np.ones(100)}, store=st)
    assert st.list() == ["a"]


@pytest.mark.parametrize("cast", [object, "O", "S4", "U3", "V8", ("f4", 2), "int32", np.int8, "bool"])
def test_cast_dtype_must_be_a_float_dtype(tmp_path, cast):
    with pytest.raises(atomicstore.InvalidArgumentError, match="cast_dtype"):
        atomicstore.save(tmp_path / "a", {"w": np.ones(4, np.float32)}, cast_dtype=cast)
    assert atomicstore.open_store(tmp_path).list() == []


@pytest.mark.parametrize("leaf", [np.array(["ab", "c"]), np.zeros(2, "V3"), np.array([b"x"]),
                                  np.zeros(2, [("a", "f4")]), np.array([1, None], dtype=object)],
                         ids=["str", "void", "bytes", "structured", "object"])
def test_leaves_restore_could_not_read_are_refused_at_save(tmp_path, leaf):
    """A checkpoint restore cannot read back is never committed (str/bytes/void arrays were
    saved, then restore raised CorruptionError 'unknown dtype str96')."""
    with pytest.raises(atomicstore.InvalidArgumentError, match="cannot be saved"):
        atomicstore.save(tmp_path / "a", {"w": leaf})
    with pytest.raises(atomicstore.InvalidArgumentError, match="cannot be saved"):
        atomicstore.save(tmp_path / "b", {f"s{i}": np.ones(2) for i in range(3)} | {"w": leaf})
    assert atomicstore.open_store(tmp_path).list() == []


def test_cast_dtype_casts_ml_dtypes_floats_too(tmp_path):
    """bfloat16 and float8 leaves are floating-point leaves: cast like float32 ones."""
    tree = {"bf": np.ones(8, ml_dtypes.bfloat16), "f8": np.ones(8, ml_dtypes.float8_e4m3fn),
            "f32": np.ones(8, np.float32), "i": np.arange(8), "s": ml_dtypes.bfloat16(2.0)}
    atomicstore.save(tmp_path / "a", tree, cast_dtype="float16")
    back = atomicstore.restore(tmp_path / "a")
    assert {k: np.asarray(v).dtype.name for k, v in back.items()} == {
        "bf": "float16", "f8": "float16", "f32": "float16", "i": tree["i"].dtype.name, "s": "float16"}


def test_other_bad_arguments_are_invalid_argument_errors(tmp_path):
    (tmp_path / "afile").write_text("x")
    bad_calls = [
        lambda: atomicstore.open_store(tmp_path / "afile" / "sub"),
        lambda: atomicstore.save(tmp_path / "afile" / "sub" / "c", {"w": np.ones(2)}),
        lambda: atomicstore.CheckpointManager(str(tmp_path / "afile" / "sub")),
        lambda: atomicstore.open_store(tmp_path / ("a" * 300)),
        lambda: atomicstore.save(tmp_path / "s" / "c", {"w": np.ones(2)}, block_size="8"),
        lambda: atomicstore.open_store(tmp_path / "s", clock=lambda: "x"),
        lambda: atomicstore.open_store(tmp_path / "s", lease_ttl=float("inf")),
        lambda: atomicstore.open_store(tmp_path / "s", lease_ttl=float("nan")),
        lambda: atomicstore.CheckpointManager(str(tmp_path / "m"), storage_options=[1]),  # type: ignore[arg-type]
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(atomicstore.InvalidArgumentError):
            call()
            pytest.fail(f"call {i} was accepted")
