"""The compat modules held to the contract of every entry point (issue 21, "four questions"):
what if what a call reads is overwritten or deleted between two of its requests, what if the
store is read-only, what if the process forked (hostile and oversized input: the hostile
tests of tests/compat/test_compat_fjformer.py and tests/compat/test_compat_flax.py, and the limits of
row 14 there).

Another job is put between two requests of a call by a rule of the fault layer that runs it
when the reader's chosen request arrives, before that request is served (S3 and GCS), or by
a callback of the call itself (``load_checkpoint``'s ``callback``): never by sleeping.
The table of answers is ``docs/migrating-from-flax.md`` ("Every entry point, four questions").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import flax
import numpy as np
import pytest
from conftest import in_forked_child, make_backend, parse_python

import atomicstore
from atomicstore.compat import fjformer as fj
from atomicstore.compat import flax as ck
from atomicstore.testing.faults import FaultPlan, is_mutation, object_key, request_kind

flax.config.update("flax_use_orbax_checkpointing", False)
pytestmark = pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")


def state(v: float, n: int = 1 << 16) -> dict[str, Any]:
    return {"w": np.full(n, v, np.float32), "b": np.arange(5, dtype=np.float64) + v, "step": int(v), "tag": f"v{v}"}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in ("w", "b"))
            and a["step"] == b["step"] and a["tag"] == b["tag"])


class Between:
    """A fault-layer rule (used as a stall predicate that never stalls): when the
    ``nth`` request that ``pred`` matches arrives, run ``action`` (another job, whose own
    requests the threaded server serves meanwhile), then serve the request."""

    def __init__(self, pred: Callable[[dict[str, Any]], bool], action: Callable[[], None], nth: int = 1) -> None:
        self.pred, self.action, self.left = pred, action, nth
        self.fired = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any]) -> bool:
        with self._lock:
            if self.fired.is_set() or not self.pred(environ):
                return False
            self.left -= 1
            if self.left:
                return False
            self.fired.set()
        try:
            self.action()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        return False


def gets(suffix: str) -> Callable[[dict[str, Any]], bool]:
    """A read of an object's bytes whose key ends with ``/suffix``."""

    def pred(environ: dict[str, Any]) -> bool:
        key = object_key(environ)
        return request_kind(environ) == "get" and key is not None and key.endswith("/" + suffix)

    return pred


def between(b: Any, rule: Between) -> None:
    b.faults(FaultPlan(stalls=[(rule, 0.0)]))


# -- 1. overwritten or deleted between two of the call's requests ---------------------------------
@pytest.mark.parametrize("kind", ["s3", "gcs"])
@pytest.mark.parametrize("other", ["overwrite", "delete"])
def test_flax_restore_of_a_step_replaced_between_two_ranged_reads(kind, other, request, tmp_path):
    """restore_checkpoint listed the steps, chose step 1 and read its first range; another
    job then replaces it (or its retention deletes it): the restore returns one whole
    version or raises PreconditionFailedError saying it was replaced, never a mix."""
    b = make_backend(kind, request, tmp_path)
    opts = {**b.options, "block_size": 5 << 20 if kind == "s3" else 1 << 20}
    n = 3 << 20  # 12 MiB of w: several ranged reads
    ck.save_checkpoint(b.url, state(1.0, n), 1, storage_options=opts)

    def act() -> None:
        if other == "overwrite":
            ck.save_checkpoint(b.url, state(2.0, n), 1, overwrite=True, storage_options=opts)
        else:
            ck.save_checkpoint(b.url, state(3.0, 4), 2, keep=1, storage_options=opts)  # removes step 1

    rule = Between(gets("checkpoint_1"), act, nth=2)
    between(b, rule)
    try:
        got: Any = ck.restore_checkpoint(f"{b.url}/checkpoint_1", None, storage_options=opts)
    except atomicstore.PreconditionFailedError as exc:
        got = exc
    b.faults(None)
    assert rule.fired.is_set() and rule.error is None, rule.error
    if isinstance(got, Exception):
        assert "read" in str(got) and "checkpoint_1" in str(got), got
    else:
        assert same(got, state(1.0, n)) or same(got, state(2.0, n))
    if other == "overwrite":
        assert same(ck.restore_checkpoint(b.url, None, storage_options=opts), state(2.0, n))


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_fjformer_load_of_a_file_replaced_between_two_ranged_reads_reads_it_again(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    opts = {**b.options, "block_size": 5 << 20 if kind == "s3" else 1 << 20}
    path, n = f"{b.url}/s.fjf", 3 << 20
    fj.save_state_to_file(state(1.0, n), path, storage_options=opts)
    rule = Between(gets("s.fjf"), lambda: fj.save_state_to_file(state(2.0, n), path, storage_options=opts))
    between(b, rule)
    got = fj.load_checkpoint(path, storage_options=opts)
    b.faults(None)
    assert rule.fired.is_set() and rule.error is None, rule.error
    assert same(got, state(2.0, n))


@pytest.mark.parametrize("backend_kind", ["local", "memory"])
def test_fjformer_load_of_a_file_deleted_mid_read(backend_kind, request, tmp_path):
    """Deleted after the first leaf was read: a local file is read through its open
    descriptor (one version, whole); elsewhere NotFoundError naming the file, never a
    CorruptionError for a file that was healthy."""
    b = make_backend(backend_kind, request, tmp_path)
    path = f"{b.url}/s.fjf" if backend_kind != "local" else os.path.join(b.url, "s.fjf")
    fj.save_state_to_file(state(1.0, 5 << 20), path)  # 20 MiB: past one read block
    st = b.open()
    calls: list[Any] = []

    def delete_once(leaf: Any, key: Any) -> None:
        calls.append(key)
        if len(calls) == 1:
            st.driver.delete("s.fjf")

    if backend_kind == "local":
        assert same(fj.load_checkpoint(path, callback=delete_once), state(1.0, 5 << 20))
    else:
        with pytest.raises(atomicstore.NotFoundError, match="s.fjf"):
            fj.load_checkpoint(path, callback=delete_once)
    assert calls


@pytest.mark.parametrize("kind", ["s3", "gcs"])
@pytest.mark.parametrize("what", ["load_json", "checksum record"])
def test_a_json_file_replaced_by_a_larger_one_between_its_size_and_its_read(kind, what, request, tmp_path,
                                                                             monkeypatch):
    """load_json (and the checksum record a load reads) looks at the size, then reads:
    replaced in between by one larger than the limit, the read takes at most the limit
    (+1 byte) and the file is refused (load_json) or ignored (record), never read whole.
    The limit is lowered for the test (the replacement would be 64 MiB)."""
    b = make_backend(kind, request, tmp_path)
    st = b.open()
    monkeypatch.setattr(fj, "MAX_RECORD_BYTES", 4096)
    if what == "load_json":
        key, path = "m.json", f"{b.url}/m.json"
        fj.save_json({"a": 1}, path, storage_options=b.options)
    else:
        key, path = ".s.fjf.crc32c.json", f"{b.url}/s.fjf"
        fj.save_state_to_file(state(1.0, 16), path, storage_options=b.options)
    big = json.dumps({"pad": "x" * 8192}).encode()
    rule = Between(gets(key), lambda: st.write_file(key, big))
    between(b, rule)
    with b.server.injector.recording() as log:
        if what == "load_json":
            with pytest.raises(atomicstore.CorruptionError, match="m.json"):
                fj.load_json(path, storage_options=b.options)
        else:
            assert same(fj.load_checkpoint(path, storage_options=b.options), state(1.0, 16))
    b.faults(None)
    assert rule.fired.is_set() and rule.error is None, rule.error
    ranges = [r for r in log if r.kind == "get" and (r.key or "").endswith(key)]
    assert ranges, log.describe()


# -- 3. a read-only store -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_read_only_credentials_restore_and_saves_are_refused_writing_nothing(kind, request, tmp_path):
    """Every mutating request answered 403 (read-only credentials): the compat modules
    restore, list and load; saves raise StorageError and leave nothing behind."""
    b = make_backend(kind, request, tmp_path)
    ck.save_checkpoint(b.url, state(1.0), 1, storage_options=b.options)
    fj.save_state_to_file(state(1.0), f"{b.url}/s.fjf", storage_options=b.options)
    fj.save_json({"a": 1}, f"{b.url}/m.json", storage_options=b.options)
    before = set(b.open().driver.find(""))
    b.faults(FaultPlan(deny=is_mutation))
    o = b.options
    assert same(ck.restore_checkpoint(b.url, None, storage_options=o), state(1.0))
    assert ck.latest_checkpoint(b.url, storage_options=o) == f"{b.url}/checkpoint_1"
    assert ck.available_steps(b.url, storage_options=o) == [1]
    assert same(fj.load_checkpoint(f"{b.url}/s.fjf", storage_options=o), state(1.0))
    assert fj.load_json(f"{b.url}/m.json", storage_options=o) == {"a": 1}
    for save in (lambda: ck.save_checkpoint(b.url, state(2.0), 2, storage_options=o),
                 lambda: fj.save_state_to_file(state(2.0), f"{b.url}/t.fjf", storage_options=o),
                 lambda: fj.save_json({"b": 2}, f"{b.url}/n.json", storage_options=o)):
        with pytest.raises(atomicstore.StorageError):
            save()
    b.faults(None)
    assert set(b.open().driver.find("")) == before


READ_ONLY_CHILD = textwrap.dedent("""
    import errno, os, sys
    import numpy as np, atomicstore
    import flax
    flax.config.update("flax_use_orbax_checkpointing", False)
    from atomicstore.compat import flax as ck, fjformer as fj
    root = sys.argv[1]
    try:
        open(os.path.join(root, "probe"), "w")
        sys.exit("the directory is writable")
    except OSError as exc:
        assert exc.errno == errno.EROFS, exc
    assert ck.restore_checkpoint(root, None)["step"] == 1
    assert ck.latest_checkpoint(root).endswith("checkpoint_1") and ck.available_steps(root) == [1]
    assert fj.load_checkpoint(os.path.join(root, "s.fjf"))["step"] == 1
    assert fj.load_json(os.path.join(root, "m.json")) == {"a": 1}
    for save in (lambda: ck.save_checkpoint(root, {"step": 2}, 2),
                 lambda: fj.save_state_to_file({"step": 2}, os.path.join(root, "t.fjf")),
                 lambda: fj.save_json({"b": 2}, os.path.join(root, "n.json"))):
        try:
            save()
            sys.exit("a save to a read-only directory succeeded")
        except atomicstore.StorageError as exc:
            print("REFUSED", type(exc).__name__)
    print("OK")
""")


def test_a_read_only_mount_restores_and_saves_are_refused(tmp_path):
    """A real EROFS (a bind mount remounted read-only in the child's own mount namespace,
    which root cannot bypass): restore, list and load work and create nothing; every save
    raises StorageError."""
    src, ro = tmp_path / "ckpts", tmp_path / "ro"
    ro.mkdir()
    ck.save_checkpoint(src, {"step": 1}, 1)
    fj.save_state_to_file({"step": np.int32(1)}, src / "s.fjf")
    fj.save_json({"a": 1}, src / "m.json")
    before = sorted(str(p.relative_to(src)) for p in src.rglob("*"))
    script = 'mount --bind "$1" "$2" && mount -o remount,ro,bind "$2" && exec "$3" -c "$4" "$2"'
    out = subprocess.run(["unshare", "-rm", "--propagation", "private", "sh", "-c", script, "sh",
                          str(src), str(ro), sys.executable, READ_ONLY_CHILD],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.endswith("OK\n"), out.stdout + out.stderr
    assert out.stdout.count("REFUSED StorageError") == 3
    assert sorted(str(p.relative_to(src)) for p in src.rglob("*")) == before


# -- 4. a forked process --------------------------------------------------------------------------
def _child(url: str, opts: dict[str, Any], am: ck.AsyncManager, q: Any) -> None:
    try:
        got = ck.restore_checkpoint(url, None, storage_options=opts)
        ck.save_checkpoint(url, state(3.0), 3, async_manager=am, storage_options=opts)
        am.wait_previous_save()  # the parent's worker thread does not exist here
        loaded = fj.load_checkpoint(f"{url}/s.fjf", storage_options=opts)
        fj.save_state_to_file(state(4.0), f"{url}/child.fjf", storage_options=opts)
        q.put(("ok", same(got, state(2.0)) and same(loaded, state(1.0))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", repr(exc)))


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_a_forked_child_uses_the_compat_modules_as_its_parent_left_them(kind, request, tmp_path):
    """A data-loader worker forked after the parent saved (asynchronously, so the
    AsyncManager's worker thread exists, and the module's object-store client is cached):
    the child restores, saves through the same AsyncManager and loads, as the parent."""
    b = make_backend(kind, request, tmp_path)
    url, opts = b.url, b.options
    am = ck.AsyncManager()
    ck.save_checkpoint(url, state(1.0), 1, async_manager=am, storage_options=opts)
    ck.save_checkpoint(url, state(2.0), 2, async_manager=am, storage_options=opts)
    am.wait_previous_save()
    fj.save_state_to_file(state(1.0), f"{url}/s.fjf", storage_options=opts)
    got, exitcode = in_forked_child(_child, url, opts, am)
    assert got == ("ok", True) and exitcode == 0, got
    assert same(ck.restore_checkpoint(url, None, storage_options=opts), state(3.0))
    assert same(fj.load_checkpoint(f"{url}/child.fjf", storage_options=opts), state(4.0))
    ck.save_checkpoint(url, state(5.0), 5, async_manager=am, storage_options=opts)  # the parent's still works
    am.wait_previous_save()


# -- attack report B4, B5, B6 ---------------------------------------------------------------------
def test_flax_restore_with_a_key_the_checkpoint_lacks_names_the_key(tmp_path):
    """A target key the checkpoint lacks is that error, naming the key (as the native restore
    says), not "deleted while it was being read": nothing changed, retrying cannot help (B4)."""
    ck.save_checkpoint(str(tmp_path), {"params": {"w": np.ones(3, np.float32)}}, step=1)
    target = {"params": {"w": np.zeros(3, np.float32)}, "opt": {"mu": np.zeros(3, np.float32)}}
    with pytest.raises(atomicstore.NotFoundError, match="opt/mu") as exc:
        ck.restore_checkpoint(str(tmp_path), target=target)
    assert not isinstance(exc.value, atomicstore.PreconditionFailedError)


def test_flax_save_over_a_native_checkpoint_says_the_layouts_differ(tmp_path):
    """Overwriting a native (directory) step with a flax file is refused up front with the
    reason (the layouts cannot be swapped atomically), not a false "it changed" (B5)."""
    m = atomicstore.CheckpointManager(str(tmp_path))
    m.save(2, {"w": np.ones(2)})
    m.close()
    with pytest.raises(atomicstore.InvalidArgumentError, match="native checkpoint.*layouts"):
        ck.save_checkpoint(str(tmp_path), {"w": np.zeros(2)}, step=2, overwrite=True)
    assert np.array_equal(atomicstore.restore(f"{tmp_path}/checkpoint_2")["w"], np.ones(2))


def test_fjformer_save_of_a_too_deep_or_cyclic_tree_is_refused(tmp_path):
    """No raw RecursionError: InvalidArgumentError naming the depth (and a cycle) (B6)."""
    deep: Any = {"leaf": np.ones(1)}
    for _ in range(5000):
        deep = {"a": deep}
    cyc: list[Any] = []
    cyc.append(cyc)
    for tree in (deep, {"l": cyc}):
        with pytest.raises(atomicstore.InvalidArgumentError, match="levels deep.*cyclic"):
            fj.save_state_to_file(tree, str(tmp_path / "fj.msgpack"))
    assert not (tmp_path / "fj.msgpack").exists()


# -- one locator: every entry point turns a URL into a store the same way (issue 24, item 5) -----
def _opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roots the locator opens a store for from now on (its cache emptied first)."""
    from atomicstore.commit import locator

    opened: list[str] = []
    real = locator.open_store

    def counting(root: Any, **options: Any) -> atomicstore.Store:
        opened.append(str(root))
        return real(root, **options)

    locator.forget_stores()
    monkeypatch.setattr(locator, "open_store", counting)
    return opened


def test_every_entry_point_shares_one_store_per_root_and_options(tmp_path, monkeypatch):
    """flax, fjformer, the top-level save/restore and the CLI ask the same cache: one
    root with one option set is opened once in the process, whoever asks first."""
    from atomicstore.cli import main
    from atomicstore.commit.locator import locate, store_at

    opened = _opens(monkeypatch)
    root = str(tmp_path / "run")
    ck.save_checkpoint(root, state(1.0), 1)
    fj.save_state_to_file(state(2.0), f"{root}/s.fjf")
    atomicstore.save(f"{root}/native_1", {"w": np.ones(3)})
    assert np.array_equal(atomicstore.restore(f"{root}/native_1")["w"], np.ones(3))
    assert same(fj.load_checkpoint(f"{root}/s.fjf"), state(2.0))
    assert main(["ls", root]) == 0
    assert opened == [root]
    st, name = locate(f"{root}/native_1")
    assert (st, name) == (store_at(root), "native_1") and st is store_at(f"file://{root}")


def test_two_option_sets_or_two_protocols_never_share_a_store(tmp_path, monkeypatch):
    from atomicstore.commit.locator import forget_stores, store_at

    opened = _opens(monkeypatch)
    root = str(tmp_path / "s")
    a = store_at(root)
    assert store_at(root) is a
    assert store_at(root, lease_ttl=30) is not a  # another option set
    assert store_at(root, lease_ttl=30) is store_at(root, lease_ttl=30) is not store_at(root, lease_ttl=31)
    assert store_at(f"local://{root}") is not a  # another protocol, the same driver class
    clocks = [lambda: 1e9, lambda: 1e9]
    assert store_at(root, clock=clocks[0]) is not store_at(root, clock=clocks[1])  # by identity
    assert store_at(root, clock=clocks[0]) is store_at(root, clock=clocks[0])
    assert store_at("memory://loc/a", skip_instance_cache=True) is not store_at("memory://loc/a")
    assert len(opened) == 8
    forget_stores(root)  # every store of that root, whatever its options; the others stay
    assert store_at(root) is not a and store_at(f"local://{root}") is store_at(f"local://{root}")
    assert store_at("memory://loc/a/") is store_at("memory://loc/a")
    assert len(opened) == 9


def test_concurrent_lookups_open_one_store(tmp_path, monkeypatch):
    from atomicstore.commit.locator import store_at

    opened = _opens(monkeypatch)
    root = str(tmp_path / "s")
    got: list[atomicstore.Store] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        got.append(store_at(root))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(s is got[0] for s in got) and opened == [root]


def _child_stores(root: str, parent_id: int, q: Any) -> None:
    try:
        from atomicstore.commit.locator import store_at

        st = store_at(root)
        q.put(("ok", id(st) != parent_id and st is store_at(root) and st.list() == ["native_1"]))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", repr(exc)))


def test_a_forked_child_opens_its_own_stores(tmp_path):
    from atomicstore.commit.locator import store_at

    root = str(tmp_path / "s")
    atomicstore.save(f"{root}/native_1", {"w": np.ones(3)})
    got, exitcode = in_forked_child(_child_stores, root, id(store_at(root)))
    assert got == ("ok", True) and exitcode == 0, got


def test_a_bad_location_is_refused_as_before(tmp_path):
    from atomicstore.commit.locator import locate, names_checkpoint, split_location

    for bad in ("", "   ", "s3://bucket", "s3://bucket/", "name", 3):
        with pytest.raises(atomicstore.InvalidArgumentError):
            split_location(bad)  # type: ignore[arg-type]
        assert not names_checkpoint(bad)
    assert split_location("s3://b/run/step_1/") == ("s3://b/run", "step_1")
    assert split_location("step_1", absolute=True) == (os.getcwd(), "step_1")
    with pytest.raises(atomicstore.UnknownProtocolError):
        locate("nosuchproto://b/x")
    with pytest.raises(atomicstore.InvalidArgumentError, match="reserved"):
        locate(f"{tmp_path}/.atomicstore/x/y")


def test_no_adapter_calls_a_drivers_mutating_method():
    """compat/, the CLI and the torch integration change a store only through the commit
    layer (Store's methods, commit.adapters): never ``<...>.driver.put(...)`` and the like,
    directly or through a name bound to a driver."""
    import ast
    from pathlib import Path

    mutating = {"put", "delete", "delete_tree", "rename", "exchange", "open_writer", "abort_upload",
                "complete_upload", "start_upload", "upload_part", "makedirs", "fsync_dir"}
    pkg = Path(atomicstore.__file__).parent
    found = []
    for path in [*sorted((pkg / "compat").glob("*.py")), pkg / "cli.py", pkg / "integrations" / "torch.py"]:
        tree = parse_python(path)
        drivers = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and isinstance(node.value, ast.Attribute) and node.value.attr == "driver"
                   for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutating:
                owner = node.func.value
                if ((isinstance(owner, ast.Attribute) and owner.attr == "driver")
                        or (isinstance(owner, ast.Name) and owner.id in drivers)):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}")
    assert not found, found


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_the_commit_layer_deletes_a_one_file_step_and_its_arrays(kind, tmp_path):
    from atomicstore.commit.adapters import delete_one_file_step

    st = atomicstore.open_store(str(tmp_path / "s") if kind == "local" else f"memory://del-{tmp_path.name}")
    with st.one_file("ck_1") as f:
        f.write(b"\x80")
    with st.transaction("ck_1_gda") as txn:
        txn.write_bytes("arrays.json", b"{}")
        txn.commit()
    with st.transaction("ck_2") as txn:  # a native checkpoint named like a step: never deleted as one
        txn.write_bytes("x", b"1")
        txn.commit()
    assert st.list() == ["ck_1_gda", "ck_2"]
    assert delete_one_file_step(st, "ck_1", "ck_1_gda")
    assert delete_one_file_step(st, "ck_2")
    assert st.list() == ["ck_2"] and not st.driver.exists("ck_1") and not st.driver.listdir("ck_1_gda")


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_file_is_written_into_another_process_attempt_only_through_its_prefix(kind, tmp_path):
    from atomicstore.commit.adapters import open_attempt_file
    from atomicstore.commit.manifest import crc32c

    st = atomicstore.open_store(str(tmp_path / "s") if kind == "local" else f"memory://att-{tmp_path.name}")
    txn = st.transaction("step_1")
    w = open_attempt_file(st, txn.prefix, "__0_0.distcp")
    w.write(b"rank 0")
    w.close()
    txn.adopt("__0_0.distcp", 6, crc32c(b"rank 0"))
    txn.commit()
    assert st.read_bytes("step_1", "__0_0.distcp") == b"rank 0"
    for prefix, path in (("step_1", "x"), ("step_1/manifest.json", "x"), (txn.prefix + "/..", "x"), (txn.prefix, "../x"),
                         ("", "x")):
        with pytest.raises(atomicstore.InvalidArgumentError):
            open_attempt_file(st, prefix, path)
