"""The CLI holds the contract (issue 21 rows 1, 6, 11, 16, and the four questions for
``cp``, ``rm``, ``ls``, ``verify``, ``inspect``, ``recover``).

Another writer is put exactly between two requests of a command: on the object-store
fakes by the fault layer's hook (a :class:`FaultPlan` stall predicate that runs the other
writer while it holds the command's request), on local disk by :class:`HookedLocal`, a
local driver registered for ``hooked://`` that calls the test's hook before each read and
write (the command, the commit layer and the local driver's pinning run unchanged).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from conftest import Backend, make_backend
from test_cli import opts

import atomicstore
from atomicstore.cli import main
from atomicstore.compat import flax as ck
from atomicstore.drivers import register_driver
from atomicstore.drivers.local import LocalDriver
from atomicstore.testing.faults import FaultPlan, object_key, request_kind

MiB = 2**20
#: float32 elements of the big leaf: 40 MiB, several ranged reads (16 MiB each on S3)
BIG = 10 * MiB


class HookedLocal(LocalDriver):
    """Local disk that calls :attr:`hook` ``(op, path)`` before each read (a ranged read,
    or the next chunk of a streamed one) and each write or delete: the test's scheduler."""

    protocols = ("hooked",)
    hook: ClassVar[Callable[[str, str], None] | None] = None

    def _event(self, op: str, key: str) -> None:
        if HookedLocal.hook is not None:
            HookedLocal.hook(op, self.describe(key))

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self._event("read", key)
        return super().read(key, start, end)

    def read_into(self, key: str, offset: int, out: memoryview, *, generation: str | None = None) -> int:
        self._event("read", key)
        return super().read_into(key, offset, out, generation=generation)

    def iter_read(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        it = super().iter_read(key, chunk_size)
        while True:
            self._event("read", key)
            try:
                chunk = next(it)
            except StopIteration:
                return
            yield chunk

    def open_writer(self, key: str, **kw: Any) -> Any:
        self._event("write", key)
        return super().open_writer(key, **kw)

    def put(self, key: str, data: bytes, **kw: Any) -> str | None:
        self._event("write", key)
        return super().put(key, data, **kw)

    def delete(self, key: str, **kw: Any) -> None:
        self._event("delete", key)
        super().delete(key, **kw)


register_driver(HookedLocal)


@pytest.fixture(autouse=True)
def _no_hook() -> Iterator[None]:
    yield
    HookedLocal.hook = None


def stores(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[Backend, Backend, str]:
    """(source store, destination store, the source's plain URL for the other writer)."""
    if kind == "local":
        for d in ("src", "dst"):
            (tmp_path / d).mkdir()
        return (Backend("local", f"hooked://{tmp_path}/src"), Backend("local", f"hooked://{tmp_path}/dst"),
                str(tmp_path / "src"))
    src = make_backend(kind, request, tmp_path)
    dst = Backend(kind, src.url.rsplit("/", 1)[0] + "/dst", src.options, src.server)
    return src, dst, src.url


def run(*args: str) -> tuple[int, str, str]:
    """``atomicstore ARGS`` in this process (the hooks live here): exit code, out, err."""
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def between_two_reads(b: Backend, reads: Callable[[str], bool], armed_by: Callable[[str], bool] | None,
                      other: Callable[[], None], *, op: str = "read", nth: int = 2) -> threading.Event:
    """Run ``other`` (another writer) once, right before the ``nth`` request of kind ``op``
    ("read", "write" or "delete") whose key ``reads`` accepts, counted once a write whose
    key ``armed_by`` accepts was seen (the command has begun writing; None: from the start).
    Returns the event set once it ran."""
    state = {"armed": armed_by is None, "seen": 0, "busy": False}
    lock, fired = threading.Lock(), threading.Event()

    def step(kind: str, key: str) -> None:
        with lock:
            if fired.is_set() or state["busy"]:
                return
            if not state["armed"]:
                state["armed"] = kind == "write" and armed_by is not None and armed_by(key)
                return
            if kind != op or not reads(key):
                return
            state["seen"] += 1
            if state["seen"] < nth:
                return
            state["busy"] = True
        other()
        fired.set()

    if b.kind == "local":
        HookedLocal.hook = step
    else:
        def pred(environ: dict[str, Any]) -> bool:
            kind = request_kind(environ)
            if kind in ("get", "put", "delete"):
                step({"get": "read", "put": "write"}.get(kind, kind), object_key(environ) or "")
            return False

        b.faults(FaultPlan(stalls=[(pred, 0.0)]))
    return fired


def key_of(b: Backend, rel: str) -> str:
    """How a hook sees ``<store>/rel``: a local path, or ``bucket/prefix/rel``."""
    if b.kind == "local":
        return f"{b.url.removeprefix('hooked://')}/{rel}"
    return f"{b.url.split('://', 1)[1]}/{rel}"


def flax_file(tmp_path: Any, value: float, n: int = BIG) -> bytes:
    d = tmp_path / f"flax-{value}"
    ck.save_checkpoint(d, {"w": np.full(n, value, np.float32), "step": 1}, 1)
    return (d / "checkpoint_1").read_bytes()


def read_or_none(st: atomicstore.Store, name: str) -> bytes | None:
    try:
        return st.driver.read(name)
    except atomicstore.NotFoundError:
        return None


# -- row 1: cp of a source overwritten between two of its reads ---------------------------
@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_cp_of_a_flax_file_overwritten_between_two_reads_copies_one_version(kind, request, tmp_path):
    """Issue 21 row 1: the copy read the source unconditionally and committed bytes of
    both versions (then exited 1 "copy differs", the destination left committed). Every
    read is now conditional on the generation first read: the copy starts again on the
    new version, and the destination holds exactly one version."""
    a, b2 = flax_file(tmp_path, 1.0), flax_file(tmp_path, 2.0)
    src, dst, plain = stores(kind, request, tmp_path)
    with src.open().one_file("checkpoint_1") as f:
        f.write(a)

    def overwrite() -> None:
        with atomicstore.open_store(plain, **src.options).one_file("checkpoint_1", overwrite=True) as f:
            f.write(b2)

    fired = between_two_reads(src, lambda k: k == key_of(src, "checkpoint_1"),
                              lambda k: k.startswith(key_of(dst, "")), overwrite)
    code, out, err = run("cp", f"{src.url}/checkpoint_1", f"{dst.url}/checkpoint_1", *opts(src))
    assert fired.is_set(), "the other writer never ran between two reads of the copy"
    got = read_or_none(dst.open(), "checkpoint_1")
    seen = "absent" if got is None else {a: "A", b2: "B"}.get(got, "bytes of both versions")
    assert seen in ("absent", "A", "B") and (code == 0) == (got is not None), (seen, code, err)
    assert (code, seen) == (0, "B"), (code, err)  # read again at the new version, committed, verified


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_cp_of_a_native_checkpoint_overwritten_between_two_reads_copies_one_version(kind, request, tmp_path):
    """Row 1 for native checkpoints: every file was already checked against the manifest
    read first (so no mix was ever committed), but the copy failed with a false "CRC32C
    does not match" (local) or "not found" (S3/GCS: the replaced attempt's data is
    deleted). Now a source replaced mid-copy is copied again."""
    src, dst, plain = stores(kind, request, tmp_path)
    atomicstore.save(f"{plain}/ck", {"w": np.full(BIG, 1.0, np.float32)}, **src.options)

    def overwrite() -> None:
        atomicstore.save(f"{plain}/ck", {"w": np.full(BIG, 2.0, np.float32)}, overwrite=True, **src.options)

    fired = between_two_reads(src, lambda k: k.startswith(key_of(src, "ck/")) and k.endswith("state.msgpack"),
                              lambda k: k.startswith(key_of(dst, "")), overwrite)
    code, out, err = run("cp", f"{src.url}/ck", f"{dst.url}/ck", *opts(src))
    assert fired.is_set(), "the other writer never ran between two reads of the copy"
    assert code == 0, err
    back = atomicstore.restore(f"{dst.url}/ck", **dst.options)["w"]
    assert float(back[0]) in (1.0, 2.0) and bool((back == back[0]).all())  # exactly one version
    dst.open().verify("ck")


# -- row 6: cp (and verify) of a flax file in bounded memory ------------------------------------
MEASURE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import atomicstore, atomicstore.pytree, atomicstore.compat.flax
    from atomicstore.cli import main

    def status(field):  # kB -> bytes
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field))

    # the peak is reset here: ru_maxrss would keep the high-water mark of the process this
    # one was spawned from (the parent's RSS at fork/exec), hiding what the command adds
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    code = main(sys.argv[1:])
    print(json.dumps({"code": code, "extra": status("VmHWM:") - before}))
""")


def test_cp_and_verify_of_a_big_flax_file_stream_in_bounded_memory(tmp_path):
    """Issue 21 row 6: ``cp`` of a flax legacy file restored the whole tree to check its
    structure and read both files whole to compare them: peak RSS grew by 258 MiB for a
    128 MiB file (``verify`` restored it whole too). Now the structure is scanned with
    ranged reads and the bytes are streamed, pinned to one version: ~34 MiB (one chunk),
    whatever the file's size."""
    ck.save_checkpoint(tmp_path / "src", {"w": np.full(32 * MiB, 1.5, np.float32), "step": 3}, 3)  # 128 MiB
    src = tmp_path / "src" / "checkpoint_3"
    for args in (["cp", str(src), str(tmp_path / "dst" / "checkpoint_3")], ["verify", str(src)]):
        out = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"\n{args[0]} of 128 MiB: peak RSS grew by {r['extra'] / MiB:.1f} MiB")
        assert r["code"] == 0, out.stderr
        assert r["extra"] < 64 * MiB + 16 * MiB, f"{args[0]} added {r['extra'] / MiB:.0f} MiB"
    assert (tmp_path / "dst" / "checkpoint_3").read_bytes() == src.read_bytes()


# -- row 11: rm of a path inside a checkpoint ------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_rm_refuses_a_path_inside_a_checkpoint(kind, request, tmp_path):
    """Issue 21 row 11: ``rm STORE/step_1/<file inside>`` took the file for a flax legacy
    checkpoint and deleted it, exit 0: step_1 stayed listed but no longer restored (or
    was un-published without compare-and-swap). Now refused, exit 2, step_1 intact; rm
    deletes only checkpoints (a committed one, or a flax one-file checkpoint)."""
    b = make_backend(kind, request, tmp_path)
    st = b.open()
    tree = {"w": np.arange(10, dtype=np.float32), "step": 1}
    atomicstore.save(f"{b.url}/step_1", tree, store=st)
    ck.save_checkpoint(b.url, {"w": np.ones(3)}, 5, storage_options=b.options or None)
    st.write_file("notes.txt", b"my notes")  # not a checkpoint
    inside = sorted(st.driver.find("step_1"))
    assert {k.rsplit("/", 1)[-1] for k in inside} >= {"state.msgpack", "manifest.json", "index.msgpack"}
    dirs = sorted({k.rsplit("/", 1)[0] for k in inside if k.count("/") > 1})  # attempt-<id> on S3/GCS
    before = st.driver.find("")
    for rel in [*inside, *dirs]:
        code, _, err = run("rm", f"{b.url}/{rel}", *opts(b))
        assert code == 2, (rel, code, err)
        assert "inside" in err and "not a checkpoint" in err and len(err.strip().splitlines()) == 1, err
    for rel, why in (("notes.txt", "not a checkpoint"), (".atomicstore", "invalid checkpoint name"),
                     ("step_1/..", "invalid checkpoint name")):
        code, _, err = run("rm", f"{b.url}/{rel}", *opts(b))
        assert code == 2 and why in err, (rel, code, err)
    assert st.driver.find("") == before  # nothing was touched
    st.verify("step_1")
    assert np.array_equal(atomicstore.restore(f"{b.url}/step_1", store=st)["w"], tree["w"])
    # what is a checkpoint is deleted: the native one through its commit point, the flax file
    assert run("rm", f"{b.url}/checkpoint_5", *opts(b))[0] == 0
    assert run("rm", f"{b.url}/step_1", *opts(b))[0] == 0
    assert st.list() == [] and not st.driver.exists("checkpoint_5") and st.read_file("notes.txt") == b"my notes"


# -- row 16: cp --force between the two layouts ----------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_cp_force_between_a_native_checkpoint_and_a_flax_file_is_refused(kind, request, tmp_path):
    """Issue 21 row 16: ``cp --force`` from a native checkpoint onto a flax file (or back)
    exited 5 blaming "another writer" (local), or left both layouts under one name (S3).
    The two layouts cannot be swapped in one atomic step: refused, exit 2, saying why."""
    b = make_backend(kind, request, tmp_path)
    st = b.open()
    atomicstore.save(f"{b.url}/step_1", {"w": np.zeros(4)}, store=st)
    ck.save_checkpoint(b.url, {"w": np.ones(3)}, 5, storage_options=b.options or None)
    before = st.driver.find("")
    for src, dst in (("step_1", "checkpoint_5"), ("checkpoint_5", "step_1")):
        code, _, err = run("cp", "--force", f"{b.url}/{src}", f"{b.url}/{dst}", *opts(b))
        assert code == 2, (src, dst, code, err)
        assert "cannot replace" in err and "another writer" not in err and "rm" in err, err
    assert {k: v.generation for k, v in st.driver.find("").items()} == {k: v.generation for k, v in before.items()}
    assert st.list() == ["step_1"] and float(atomicstore.restore(f"{b.url}/checkpoint_5", store=st)["w"][0]) == 1.0


# -- the four questions: overwritten or deleted between two requests ----------------------------
def store_for(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[Backend, str]:
    """A store whose requests the hook sees, and its plain URL for the other writer."""
    if kind == "local":
        (tmp_path / "s").mkdir()
        return Backend("local", f"hooked://{tmp_path}/s"), str(tmp_path / "s")
    b = make_backend(kind, request, tmp_path)
    return b, b.url


def small_tree(version: int) -> dict[str, Any]:
    """Two versions that differ in shape and keys."""
    if version == 1:
        return {"w": np.full(1000, 1.0, np.float32), "step": 1}
    return {"v": {"b": np.full((2, 3), 2.0, np.float64)}, "step": 2}


def put(plain: str, options: dict[str, Any], layout: str, version: int, *, overwrite: bool = False) -> None:
    """Write version ``version`` of checkpoint ``ck_1`` (native or a flax file)."""
    if layout == "native":
        atomicstore.save(f"{plain}/ck_1", small_tree(version), overwrite=overwrite, **options)
        return
    import msgpack

    def ext(obj: Any) -> Any:  # flax's encoding of an array
        if isinstance(obj, np.ndarray):
            return msgpack.ExtType(1, msgpack.packb((obj.shape, obj.dtype.name, obj.tobytes())))
        return obj

    with atomicstore.open_store(plain, **options).one_file("ck_1", overwrite=overwrite) as f:
        f.write(msgpack.packb(small_tree(version), default=ext, use_bin_type=True))


def leaves(doc: dict[str, Any]) -> list[tuple[str, list[int] | None]]:
    return sorted((lf["path"], lf["shape"]) for lf in doc["leaves"])


@pytest.mark.parametrize("layout", ["native", "flax"])
@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_verify_and_inspect_of_a_checkpoint_overwritten_between_two_reads(kind, layout, request, tmp_path):
    """verify and inspect read a checkpoint in several requests. Replaced between two of
    them, they used to report damage (a CRC32C mismatch against the manifest first read,
    a missing file, an index scanned from two versions) or exit 5. Now they read it
    again: ok, and inspect shows exactly one version."""
    b, plain = store_for(kind, request, tmp_path)
    # verify: native reads index.msgpack then state.msgpack; a flax file: the structure, then the bytes
    # inspect: native reads the manifest then index.msgpack; a flax file: the header, then each leaf's
    target = key_of(b, "ck_1")
    for cmd, reads, nth in (("verify", "state.msgpack", 1), ("inspect", "index.msgpack", 1)):
        put(plain, b.options, layout, 1, overwrite=True)
        if layout == "native":
            def pick(k: str, f: str = reads) -> bool:
                return k.startswith(target + "/") and k.endswith(f)
        else:
            def pick(k: str) -> bool:
                return k == target
            nth = 2
        fired = between_two_reads(b, pick, None, lambda: put(plain, b.options, layout, 2, overwrite=True), nth=nth)
        code, out, err = run(cmd, f"{b.url}/ck_1", "--json", *opts(b))
        assert fired.is_set(), f"{cmd}: the other writer never ran"
        assert code == 0, (cmd, code, out, err)
        doc = json.loads(out)
        if cmd == "verify":
            assert doc["ok"] and doc["results"][0]["name"] == "ck_1"
        else:
            assert leaves(doc) == [("step", None), ("v/b", [2, 3])], doc  # version 2, whole


@pytest.mark.parametrize("layout", ["native", "flax"])
@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_cp_of_a_source_deleted_between_two_reads_leaves_no_destination(kind, layout, request, tmp_path):
    """Deleted between the copy's reads (after it began writing the destination): not
    found (exit 3), and nothing is committed at the destination."""
    src, dst, plain = stores(kind, request, tmp_path)
    put(plain, src.options, layout, 1)

    def delete() -> None:
        st = atomicstore.open_store(plain, **src.options)
        st.delete("ck_1") if layout == "native" else st.delete_one_file("ck_1")

    target = key_of(src, "ck_1")
    fired = between_two_reads(src, lambda k: k == target or (k.startswith(target + "/") and k.endswith("state.msgpack")),
                              lambda k: k.startswith(key_of(dst, "")), delete, nth=1)
    code, _, err = run("cp", f"{src.url}/ck_1", f"{dst.url}/ck_1", *opts(src))
    assert fired.is_set() and code == 3 and "ck_1" in err, (code, err)
    d = dst.open()
    assert d.list() == [] and read_or_none(d, "ck_1") is None


@pytest.mark.parametrize(("kind", "layout"), [("local", "flax"), ("s3", "flax"), ("gcs", "flax"),
                                              ("s3", "native"), ("gcs", "native")])
def test_rm_of_a_checkpoint_overwritten_between_its_read_and_its_delete_keeps_the_new_one(
        kind, layout, request, tmp_path):
    """rm reads what it deletes, then deletes only that version. A flax file was deleted
    unconditionally (the newer version lost). Now the delete is conditional on the
    generation checked: exit 6, the newer version intact. (Native checkpoints were
    already deleted marker-first on the generation read; on local disk that read and the
    delete are one step under the store lock.)"""
    b, plain = store_for(kind, request, tmp_path)
    put(plain, b.options, layout, 1)
    target = key_of(b, "ck_1") + ("/commit_success.txt" if layout == "native" else "")
    fired = between_two_reads(b, lambda k: k == target, None,
                              lambda: put(plain, b.options, layout, 2, overwrite=True), op="delete", nth=1)
    code, _, err = run("rm", f"{b.url}/ck_1", *opts(b))
    assert fired.is_set()
    assert code == (6 if layout == "flax" else 0), (code, err)
    if code == 6:
        assert "changed since it was read" in err and len(err.strip().splitlines()) == 1, err
    back = atomicstore.restore(f"{plain}/ck_1", **b.options)
    assert np.array_equal(back["v"]["b"], small_tree(2)["v"]["b"])  # the newer version, intact


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_ls_skips_a_checkpoint_deleted_between_the_listing_and_its_manifest(kind, request, tmp_path):
    b, plain = store_for(kind, request, tmp_path)
    for step in (1, 2, 3):
        atomicstore.save(f"{plain}/step_{step}", {"w": np.ones(3)}, **b.options)
    marker = "manifest.json" if kind == "local" else "commit_success.txt"
    fired = between_two_reads(b, lambda k: k == key_of(b, f"step_2/{marker}"), None,
                              lambda: atomicstore.open_store(plain, **b.options).delete("step_2"), nth=1)
    code, out, err = run("ls", b.url, "--json", *opts(b))
    assert fired.is_set() and code == 0, err
    assert [r["name"] for r in json.loads(out)["checkpoints"]] == ["step_1", "step_3"]


# -- the four questions: hostile or oversized input --------------------------------------------
@pytest.mark.parametrize("kind", ["local", "gcs"])
def test_cp_of_a_hostile_flax_file_is_refused_before_anything_is_written(kind, request, tmp_path):
    """A file that claims a 2 GiB array in a few bytes (or is not msgpack at all): exit 1
    naming it, nothing allocated for the claim, nothing written to the destination."""
    src, dst, plain = stores(kind, request, tmp_path)
    st = atomicstore.open_store(plain, **src.options)
    seen: list[str] = []
    if kind == "local":
        HookedLocal.hook = lambda op, key: seen.append(key) if op != "read" and key.startswith(key_of(dst, "")) else None
    for name, data in (("checkpoint_1", b"\x81\xa1w\xc6\x80\x00\x00\x00" + b"x" * 16),  # bin32 of 2 GiB
                       ("checkpoint_2", b"\x81\xa1w\xc7\xff\x01" + b"\x00" * 8),  # ext past the end
                       ("checkpoint_3", b"\x82\xa1w\x01"),  # a map of two items holding one
                       ("checkpoint_4", b"not msgpack at all")):
        with st.one_file(name) as f:
            f.write(data)
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(src.server.injector.recording()) if kind != "local" else []
            code, _, err = run("cp", f"{src.url}/{name}", f"{dst.url}/{name}", *opts(src))
        assert code == 1 and name in err and len(err.strip().splitlines()) == 1, (name, code, err)
        seen += [r.key for r in log if r.kind in ("put", "delete") and (r.key or "").startswith(key_of(dst, ""))]
    assert seen == [], seen  # nothing was written to the destination (not even a lease)
    assert dst.open().driver.find("") == {}


def test_cp_verify_inspect_recover_refuse_a_path_inside_a_checkpoint(tmp_path):
    root = tmp_path / "s"
    atomicstore.save(f"{root}/step_1", {"w": np.ones(3)})
    inside = [f"{root}/step_1/state.msgpack", f"{root}/step_1/manifest.json"]
    for args in (["cp", inside[0], str(tmp_path / "o" / "x_1")], ["cp", f"{root}/step_1", f"{root}/step_1/x_1"],
                 ["verify", inside[1]], ["inspect", inside[0]], ["recover", f"{root}/step_1"]):
        code, _, err = run(*args)
        assert code == 2 and "inside checkpoint" in err, (args, code, err)
    for args in (["recover", str(root), "--grace", "-1"], ["recover", str(root), "--flax-prefix", "a/b"],
                 ["cp", f"{root}/step_1", f"{root}/step_1"]):
        code, _, err = run(*args)
        assert code == 2 and len(err.strip().splitlines()) == 1, (args, code, err)
    assert atomicstore.open_store(str(root)).list() == ["step_1"] and not (tmp_path / "o").exists()


# -- the four questions: a read-only store -----------------------------------------------------------
READ_ONLY = textwrap.dedent("""
    import contextlib, io, json, sys
    from atomicstore.cli import main
    ro, out = sys.argv[1], sys.argv[2]
    cmds = [["ls", ro], ["ls", ro, "--all"], ["verify", ro], ["inspect", ro + "/step_1"],
            ["inspect", ro + "/checkpoint_5"], ["cp", ro + "/step_1", out + "/step_1"],
            ["cp", ro + "/checkpoint_5", out + "/checkpoint_5"], ["recover", ro, "--dry-run", "--grace", "0"],
            ["rm", ro + "/step_1"], ["rm", ro + "/checkpoint_5"], ["recover", ro, "--grace", "0"],
            ["cp", out + "/step_1", ro + "/step_9"]]
    res = []
    for c in cmds:
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(c)
        res.append([c[0] + " " + " ".join(c[2:]) + (" (into)" if c[-1].endswith("step_9") else ""), code,
                    err.getvalue()])
    print(json.dumps(res))
""")


def test_commands_on_a_read_only_local_store(tmp_path):
    """A read-only mount (an evaluation job's view): every command that only reads works,
    including ``ls --all`` and ``recover --dry-run``; one that must write (rm, recover,
    cp into it) fails with exit 4 and one line naming the read-only filesystem, having
    changed nothing. (A real read-only bind mount in a private mount namespace.)"""
    ro = tmp_path / "ro"
    atomicstore.save(f"{ro}/step_1", {"w": np.ones(10)})
    ck.save_checkpoint(ro, {"w": np.ones(3)}, 5)
    txn = atomicstore.open_store(str(ro), lease_ttl=0.5).transaction("step_3")  # a crashed save's leftovers
    txn.write_bytes("state.msgpack", b"partial")
    txn._lease.stop()
    for p in (ro / ".atomicstore").rglob("*"):  # ... as they look an hour later: stale, to be removed
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    before = {p: p.stat().st_mtime_ns for p in ro.rglob("*")}
    script = tmp_path / "ro.py"
    script.write_text(READ_ONLY)
    r = subprocess.run(["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{ro}" "{ro}" && exec '
                        f'"{sys.executable}" "{script}" "{ro}" "{tmp_path / "out"}"'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = {c: (code, err) for c, code, err in json.loads(r.stdout)}
    for c, (code, err) in got.items():
        if c.startswith(("rm", "recover --grace", "cp step_9")) or c.endswith("(into)"):
            assert code == 4 and "Read-only file system" in err and len(err.strip().splitlines()) == 1, (c, code, err)
        else:
            assert code == 0, (c, code, err)
    assert {p: p.stat().st_mtime_ns for p in ro.rglob("*")} == before
    assert (tmp_path / "out" / "checkpoint_5").read_bytes() == (ro / "checkpoint_5").read_bytes()


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_reading_commands_never_write_to_an_object_store(kind, request, tmp_path):
    """Read-only credentials refuse only writes: ls, verify, inspect and cp from a store
    send it none (recorded at the fake), so they work with such credentials."""
    b = make_backend(kind, request, tmp_path)
    atomicstore.save(f"{b.url}/step_1", {"w": np.ones(10)}, **b.options)
    ck.save_checkpoint(b.url, {"w": np.ones(3)}, 5, storage_options=b.options)
    out = tmp_path / "out"
    with b.server.injector.recording() as log:
        for args in (["ls", b.url, "--all"], ["verify", b.url], ["inspect", f"{b.url}/step_1"],
                     ["inspect", f"{b.url}/checkpoint_5"], ["cp", f"{b.url}/step_1", f"{out}/step_1"],
                     ["cp", f"{b.url}/checkpoint_5", f"{out}/checkpoint_5"], ["recover", b.url, "--dry-run"]):
            code, _, err = run(*args, *opts(b))
            assert code == 0, (args, err)
    assert [r for r in log if r.kind in ("put", "delete")] == []


@pytest.mark.parametrize("kind", ["local", "memory", "gcs"])
def test_store_delete_one_file_deletes_only_a_one_file_checkpoint_at_the_generation_read(kind, request, tmp_path):
    """``Store.delete_one_file`` (what ``rm`` of a flax file uses): refuses a native
    checkpoint, deletes only the version named by ``if_generation``."""
    b = make_backend(kind, request, tmp_path)
    st = b.open()
    atomicstore.save(f"{b.url}/step_1", {"w": np.ones(3)}, store=st)
    with st.one_file("checkpoint_5") as f:
        f.write(b"\x80")
    with pytest.raises(atomicstore.InvalidArgumentError, match="committed checkpoint"):
        st.delete_one_file("step_1")
    with pytest.raises(atomicstore.NotFoundError):
        st.delete_one_file("checkpoint_6")
    gen = st.driver.info("checkpoint_5").generation
    with st.one_file("checkpoint_5", overwrite=True) as f:  # replaced since gen was read
        f.write(b"\x81\xa1a\x01")
    with pytest.raises(atomicstore.PreconditionFailedError):
        st.delete_one_file("checkpoint_5", if_generation=gen)
    assert st.driver.read("checkpoint_5") == b"\x81\xa1a\x01"
    st.delete_one_file("checkpoint_5", if_generation=st.driver.info("checkpoint_5").generation)
    assert not st.driver.exists("checkpoint_5") and st.list() == ["step_1"]


# -- attack report B9, B1, cp of a damaged checkpoint -------------------------------------------
@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_verify_of_a_checkpoint_that_does_not_exist_exits_3(kind, request, tmp_path):
    """``verify STORE/NAME`` of a name never committed is "not found" (exit 3), as
    ``inspect`` and ``rm`` say, not an empty store that "all verifies" (B9); on local disk
    even when a plain directory of that name exists. An existing store with no
    checkpoints (it holds atomicstore's reserved directory) still exits 0 and says so."""
    b = make_backend(kind, request, tmp_path)
    atomicstore.save(f"{b.url}/checkpoint_100", {"a": np.ones(3)}, **b.options)
    if kind == "local":
        os.makedirs(f"{b.url}/checkpoint_200")  # left by some other tool: not a checkpoint
    code, out, err = run("verify", f"{b.url}/checkpoint_200", *opts(b))
    assert code == 3, (out, err)
    assert "checkpoint_200" in err
    code, out, err = run("verify", f"{b.url}/checkpoint_200", "--json", *opts(b))
    assert code == 3 and json.loads(out.splitlines()[-1])["exit"] == 3
    # a store whose only checkpoint was deleted: on local disk its directory (with
    # atomicstore's reserved directory) remains, nothing to verify, said so, exit 0; an
    # object store keeps nothing of an empty prefix: nothing is there, exit 3
    atomicstore.open_store(b.url, **b.options).delete("checkpoint_100")
    if kind == "local":
        os.rmdir(f"{b.url}/checkpoint_200")
    code, out, err = run("verify", b.url, *opts(b))
    if kind == "local":
        assert code == 0 and "no committed checkpoints" in out, (out, err)
    else:
        assert code == 3 and "not a store holding checkpoints" in err, (out, err)


def test_ls_lists_checkpoints_beside_foreign_entries_whose_names_end_in_digits(tmp_path):
    """An empty directory, a FIFO, a dangling symlink or a text file named like
    ``<prefix><step>`` at the root is not a checkpoint: ``ls`` lists the checkpoints and
    skips them (B1); a flax file is one that starts like a flax state (a msgpack map)."""
    d = tmp_path / "s"
    atomicstore.save(f"{d}/step_1", {"a": np.zeros(2)})
    ck.save_checkpoint(str(d), {"w": np.ones(2)}, step=3, prefix="checkpoint_")
    os.mkdir(d / "logs2026")
    os.mkfifo(d / "pipe7")
    os.symlink(d / "nowhere", d / "link5")
    (d / "data1").write_text("hello\n")
    code, out, err = run("ls", str(d), "--json")
    assert code == 0, err
    rows = {r["name"]: r["kind"] for r in json.loads(out)["checkpoints"]}
    assert rows == {"step_1": "checkpoint", "checkpoint_3": "flax file"}
    code, out, err = run("ls", str(d))
    assert code == 0 and "step_1" in out and "checkpoint_3" in out and "data1" not in out, err
    code, out, err = run("verify", str(d))
    assert code == 0 and "data1" not in out, (out, err)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_cp_of_a_checkpoint_whose_manifest_lists_a_missing_file_exits_1(kind, request, tmp_path):
    """A committed checkpoint missing a file its manifest lists is damaged, not absent:
    ``cp`` exits 1 (corrupt) naming the file, as ``verify`` does, and writes nothing."""
    src, dst, plain = stores(kind, request, tmp_path)
    atomicstore.save(f"{plain}/ck_1", {"w": np.ones(3), "b": np.zeros(2)}, **src.options)
    st = atomicstore.open_store(plain, **src.options)
    ckpt = st.open("ck_1")
    victim = next(p for p in ckpt.files if p.endswith("index.msgpack"))
    st.driver.delete(ckpt.key(victim))  # damage: the manifest still lists it
    code, out, err = run("cp", f"{src.url}/ck_1", f"{dst.url}/ck_1", *opts(src))
    assert code == 1, (out, err)
    assert "index.msgpack" in err
    assert atomicstore.open_store(dst.url.replace("hooked://", ""), **dst.options).list() == []
