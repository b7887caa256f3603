"""Issue 21, row 2: a forked child (a data loader's worker) uses its parent's S3/GCS store.

fsspec's async filesystems refuse to be used in a forked child (their event loop thread
does not exist there). The driver re-creates its filesystem, event loop, session,
in-flight budget and completion threads in the child, so the child lists, restores,
saves and recovers, and the parent keeps working afterwards. Each test runs a script in
a fresh interpreter that forks for real; the stores live on the suite's servers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import make_backend

from atomicstore.testing.faults import FaultPlan, object_key, request_kind

PRELUDE = """
import json, os, signal, sys, threading, time
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
import numpy as np, atomicstore
url, opts = sys.argv[1], json.loads(sys.argv[2])

def in_child(fn):
    # fork, run fn in the child (SIGALRM after 60 s: a hang fails, never blocks the suite),
    # return what the child printed as its last line
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)
        os.close(r)
        try:
            out = fn()
        except BaseException as exc:
            out = f"ERROR {type(exc).__name__}: {exc}"
        os.write(w, (str(out) + "\\n").encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.read().strip()
    os.waitpid(pid, 0)
    return line
"""


def run_script(body: str, url: str, opts: dict, timeout: float = 120,
               stdin: int | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body), url, json.dumps(opts)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True)


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_a_forked_child_uses_its_parents_store_and_manager(kind, request, tmp_path):
    """The child lists, restores, saves, verifies, deletes and recovers through the store
    (and restores through the manager) its parent opened before the fork; the parent's
    store keeps working afterwards; a manager's save in the child is refused with the
    library's error."""
    backend = make_backend(kind, request, tmp_path)
    proc = run_script("""
        bs = 5 * 2**20 if url.startswith("s3") else 2**20  # the smallest part each allows
        st = atomicstore.open_store(url, block_size=bs, **opts)
        atomicstore.save(url + "/a", {"x": np.arange(3)}, store=st)
        mgr = atomicstore.CheckpointManager(url + "/m", storage_options=opts)
        mgr.save(1, {"w": np.ones(4)})

        def child():
            got = atomicstore.restore(url + "/a", store=st)["x"].tolist()
            atomicstore.save(url + "/b", {"x": np.arange(4)}, store=st)
            with st.transaction("big") as txn:  # a multipart / composite upload
                txn.write_bytes("blob", os.urandom(2 * bs + 1))
            st.verify("big")
            st.delete("big")
            st.recover()
            w = mgr.restore(1)["w"].tolist()
            try:
                mgr.save(2, {"w": np.ones(4)})
                refused = "saved"
            except atomicstore.InvalidArgumentError as exc:
                refused = "refused" if "forked child" in str(exc) else repr(exc)
            return json.dumps({"list": st.list(), "restored": got, "manager": w, "save": refused})

        print("CHILD", in_child(child), flush=True)
        atomicstore.save(url + "/c", {"x": np.arange(5)}, store=st)  # the parent, afterwards
        st.recover()
        print("PARENT", json.dumps({"list": st.list(), "b": atomicstore.restore(url + "/b", store=st)["x"].tolist(),
                                    "steps": mgr.all_steps()}), flush=True)
    """, backend.url, backend.options)
    out, err = proc.communicate(timeout=120)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line[:5] in ("CHILD", "PAREN"))
    assert "CHILD" in lines and not lines["CHILD"].startswith("ERROR"), out + err
    child = json.loads(lines["CHILD"])
    assert child == {"list": ["a", "b"], "restored": [0, 1, 2], "manager": [1.0] * 4,
                     "save": "refused"}, child
    parent = json.loads(lines["PARENT"])
    assert parent == {"list": ["a", "b", "c"], "b": [0, 1, 2, 3], "steps": [1]}, parent
    store = backend.open()
    for name in ("a", "b", "c"):
        store.verify(name)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_fork_while_a_parent_thread_is_mid_request(kind, request, tmp_path):
    """A parent thread is inside a restore whose ranged read is held by the server (it
    holds the whole in-flight budget) when the main thread forks. The child restores and
    saves at once (nothing it needs is held by the parent's threads); once the server
    answers, the parent's restore completes and the parent saves again."""
    backend = make_backend(kind, request, tmp_path)
    entered, go = threading.Event(), threading.Event()

    def hold(environ):  # the scheduler: the parent's first read of the blob waits here
        if request_kind(environ) == "get" and (object_key(environ) or "").endswith("/blob") \
                and not entered.is_set():
            entered.set()
            go.wait(60)
        return False

    proc = run_script("""
        st = atomicstore.open_store(url, max_inflight_bytes=2**20, **opts)
        with st.transaction("held") as txn:
            txn.write_bytes("blob", b"b" * 2**20)
        atomicstore.save(url + "/a", {"x": np.arange(3)}, store=st)
        print("SAVED", flush=True)
        result = {}
        th = threading.Thread(target=lambda: result.setdefault("held", st.read_bytes("held", "blob")))
        assert sys.stdin.readline().strip() == "armed"
        th.start()
        assert sys.stdin.readline().strip() == "fork"  # the read is inside the server now

        def child():
            got = atomicstore.restore(url + "/a", store=st)["x"].tolist()
            atomicstore.save(url + "/from-child", {"x": np.arange(2)}, store=st)
            return json.dumps({"restored": got, "list": st.list()})

        print("CHILD", in_child(child), flush=True)
        assert sys.stdin.readline().strip() == "released"
        th.join(60)
        atomicstore.save(url + "/after", {"x": np.arange(1)}, store=st)
        print("PARENT", json.dumps({"held": len(result.get("held", b"")), "list": st.list()}), flush=True)
    """, backend.url, backend.options, stdin=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "SAVED", proc.stderr.read()
        backend.faults(FaultPlan(stalls=[(hold, 0.0)]))
        proc.stdin.write("armed\n")
        proc.stdin.flush()
        assert entered.wait(60), "the parent's read never reached the server"
        proc.stdin.write("fork\n")
        proc.stdin.flush()
        child_line = proc.stdout.readline().strip()
        go.set()
        proc.stdin.write("released\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        go.set()
        proc.kill()
    assert child_line.startswith("CHILD {"), child_line + out + err
    assert json.loads(child_line[6:]) == {"restored": [0, 1, 2], "list": ["a", "from-child", "held"]}
    parent = json.loads(out.split("PARENT ", 1)[1])
    assert parent == {"held": 2**20, "list": ["a", "after", "from-child", "held"]}, out + err


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_store_on_a_filesystem_object_it_cannot_remake_refuses_clearly_in_a_child(kind, request, tmp_path):
    """A driver built on a filesystem object the caller made (not from a URL) cannot make
    it again in a forked child: the child gets the library's StorageError saying what to
    do, instead of fsspec's RuntimeError; the parent's store is unaffected."""
    backend = make_backend(kind, request, tmp_path)
    proc = run_script("""
        from atomicstore.drivers import driver_class
        cls = driver_class(url.split("://")[0])
        root = url.split("://", 1)[1]
        st = atomicstore.Store(cls(cls.make_filesystem(url.split("://")[0], opts), root, url=url))
        atomicstore.save(url + "/a", {"x": np.arange(3)}, store=st)

        def child():
            try:
                return "listed " + repr(st.list())
            except atomicstore.StorageError as exc:
                return "StorageError " + str(exc)

        print("CHILD", in_child(child), flush=True)
        print("PARENT", st.list(), flush=True)
    """, backend.url, backend.options)
    out, err = proc.communicate(timeout=120)
    assert "CHILD StorageError " in out and "open the store again in the child" in out, out + err
    assert "PARENT ['a']" in out, out + err
    assert "testing-secret-key" not in out  # (credentials never appear in an error)


def _restore_in_child(store, q):  # (module level: the forked child runs it)
    import numpy as np

    import atomicstore
    try:
        q.put(("ok", bool(np.array_equal(atomicstore.restore("c", store=store)["w"], np.arange(50.0)))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", repr(exc)))


def test_fork_while_a_parent_thread_looks_up_the_background_pool(request, tmp_path):
    """Attacker finding: a parent thread inside ``background_pool()`` (holding its guard)
    at the fork left the guard locked in the child, whose first restore (the index is
    read ahead on that pool) then hung forever. The child makes its own guard, as it
    makes its own pool."""
    import numpy as np
    from conftest import in_forked_child

    import atomicstore
    from atomicstore.drivers import pools

    store = make_backend("s3", request, tmp_path).open()
    atomicstore.save("c", {"w": np.arange(50.0)}, store=store)
    held, release = threading.Event(), threading.Event()

    def inside_the_lookup() -> None:
        with pools._POOL_GUARD:  # where background_pool() is while it makes the pool
            held.set()
            release.wait(60)

    t = threading.Thread(target=inside_the_lookup)
    t.start()
    held.wait(10)
    try:
        got, code = in_forked_child(_restore_in_child, store, timeout=30)
    finally:
        release.set()
        t.join()
    assert got == ("ok", True) and code == 0, (got, code)
