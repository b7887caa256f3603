"""atomicstore.compat.flax against the real flax.training.checkpoints (issue: manager/compat)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import flax
import flax.serialization
import flax.struct
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_backend
from crashsim import Crasher, CrashingDriver, PosixModel, PosixModelDriver, SimulatedCrash
from flax.training import checkpoints as fck

import atomicstore
from atomicstore.commit.strategies import STAGING
from atomicstore.compat import flax as ck
from atomicstore.drivers.local import LOCK_KEY

flax.config.update("flax_use_orbax_checkpointing", False)  # flax's legacy format
pytestmark = pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")
FUTURE = time.time() + 10**7


@flax.struct.dataclass
class TrainState:
    step: int
    params: dict
    opt: tuple


def tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {"dense": {"kernel": rng.standard_normal((8, 4)).astype(np.float32),
                             "bias": np.zeros(4, np.float32)},
                   "emb": jnp.asarray(rng.standard_normal((5, 3)), dtype=jnp.bfloat16)},
        "step": np.int64(seed),
        "lr": 0.5,
        "name": "run",
        "hist": [1, 2.5, "x"],
    }


def assert_same(a, b) -> None:
    assert flax.serialization.to_bytes(a) == flax.serialization.to_bytes(b)


def object_dir(kind: str, request, tmp_path) -> tuple[str, dict]:
    b = make_backend(kind, request, tmp_path)
    return b.url, b.options


# -- interop -------------------------------------------------------------------------------
def test_our_file_is_byte_identical_to_flax_and_flax_restores_it(tmp_path):
    t = tree(3)
    ours = ck.save_checkpoint(tmp_path / "ours", t, 7)
    theirs = fck.save_checkpoint(str(tmp_path / "flax"), t, 7)
    assert ours == str(tmp_path / "ours" / "checkpoint_7")
    assert Path(ours).read_bytes() == Path(theirs).read_bytes()
    assert_same(fck.restore_checkpoint(str(tmp_path / "ours"), None), fck.restore_checkpoint(theirs, None))
    assert_same(fck.restore_checkpoint(str(tmp_path / "ours"), t), t)
    assert fck.latest_checkpoint(str(tmp_path / "ours")) == ours  # flax sees no staging litter
    assert fck.available_steps(str(tmp_path / "ours")) == [7]


def test_we_restore_flax_checkpoints(tmp_path):
    d = str(tmp_path / "flax")
    st = TrainState(step=3, params=tree(1)["params"], opt=(np.ones(3, np.float32), {"mu": np.arange(4.0)}))
    fck.save_checkpoint(d, st, 3)
    fck.save_checkpoint(d, st.replace(step=4), 4, keep=2)
    assert ck.available_steps(d) == [3, 4]
    got = ck.restore_checkpoint(d, st)
    assert isinstance(got, TrainState) and got.step == 4
    assert_same(got, st.replace(step=4))
    assert_same(ck.restore_checkpoint(d, None, step=3), fck.restore_checkpoint(d, None, step=3))
    assert_same(ck.restore_checkpoint(os.path.join(d, "checkpoint_3"), None), fck.restore_checkpoint(d, None, step=3))


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_object_store_interop_with_flax_bytes(kind, request, tmp_path):
    """flax cannot open s3:// itself here (no TensorFlow): the object's bytes are what
    flax writes and reads, and a flax file uploaded as is restores through us."""
    url, opts = object_dir(kind, request, tmp_path)
    t = tree(5)
    path = ck.save_checkpoint(url, t, 2, storage_options=opts)
    assert path == f"{url}/checkpoint_2"
    st = atomicstore.open_store(url, **opts)
    local = fck.save_checkpoint(str(tmp_path / "flax"), t, 2)
    assert st.driver.read("checkpoint_2") == Path(local).read_bytes()
    assert_same(fck.restore_checkpoint(local, None), ck.restore_checkpoint(url, None, storage_options=opts))
    # a file flax wrote, uploaded unchanged, is a checkpoint for us
    fck.save_checkpoint(str(tmp_path / "flax"), tree(6), 9)
    st.driver.put("checkpoint_9", Path(tmp_path / "flax" / "checkpoint_9").read_bytes())
    assert ck.available_steps(url, storage_options=opts) == [2, 9]
    assert_same(ck.restore_checkpoint(url, tree(0), storage_options=opts), tree(6))
    assert ck.latest_checkpoint(url, storage_options=opts) == f"{url}/checkpoint_9"
    assert st.driver.find("") .keys() == {"checkpoint_2", "checkpoint_9"}  # no litter


# -- flax's rules, checked side by side with flax ----------------------------------------------
SEQUENCES = [
    ("keep", [dict(step=s, keep=2) for s in range(1, 7)]),
    ("keep_every_n", [dict(step=s, keep=1, keep_every_n_steps=3) for s in range(1, 11)]),
    ("float_steps", [dict(step=s, keep=10) for s in (0.001, 0.01, 0.1, 1.0, 1e1, 2e1)]),
    ("negative", [dict(step=s, keep=10) for s in (-3, -1.5, -0.2, 0, 2)]),
    ("overwrite_removes_newer", [*(dict(step=s, keep=10) for s in (1, 2, 3, 4)), dict(step=2, keep=10, overwrite=True)]),
    ("overwrite_same", [dict(step=1, keep=3), dict(step=2, keep=3), dict(step=2, keep=3, overwrite=True)]),
    ("outdated", [dict(step=5), dict(step=3)]),
    ("same_step", [dict(step=5), dict(step=5)]),
    ("prefix", [dict(step=s, keep=2, prefix="ckpt-") for s in (1, 2, 3)]),
]


def _run(save, d: str, seq: list[dict]) -> list:
    out = []
    for i, kw in enumerate(seq):
        try:
            save(d, tree(i), **kw)
            out.append("ok")
        except (ck.InvalidCheckpointError, flax.errors.InvalidCheckpointError) as exc:
            out.append(str(exc).split(" (https://")[0].replace(d, "D"))  # flax appends a docs link
    return out


@pytest.mark.parametrize("name,seq", SEQUENCES, ids=[s[0] for s in SEQUENCES])
def test_retention_and_overwrite_match_flax(name, seq, tmp_path):
    a, b = str(tmp_path / "flax"), str(tmp_path / "ours")
    ra, rb = _run(fck.save_checkpoint, a, seq), _run(ck.save_checkpoint, b, seq)
    assert ra == rb
    files_a = sorted(os.listdir(a))
    files_b = sorted(n for n in os.listdir(b) if n != atomicstore.commit.names.RESERVED_DIR)
    assert files_a == files_b
    for f in files_a:  # same bytes: the same step was kept with the same content
        assert Path(os.path.join(a, f)).read_bytes() == Path(os.path.join(b, f)).read_bytes(), f
    prefix = seq[0].get("prefix", "checkpoint_")
    assert ck.available_steps(b, prefix, float) == fck.available_steps(a, prefix, float)
    assert ck.latest_checkpoint(b, prefix).replace(b, "D") == fck.latest_checkpoint(a, prefix).replace(a, "D")


def test_restore_edge_cases_match_flax(tmp_path):
    d = tmp_path / "d"
    sentinel = {"x": 1}
    assert ck.restore_checkpoint(d, sentinel) is sentinel  # missing directory
    os.makedirs(d)
    assert ck.restore_checkpoint(d, sentinel) is sentinel  # no checkpoints
    with pytest.raises(ValueError, match="Matching checkpoint not found"):
        ck.restore_checkpoint(d, None, step=3)
    ck.save_checkpoint(d, tree(1), 1)
    ck.save_checkpoint(d, tree(2), 2, keep=5)
    # relative, non-normalised directory paths
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        p = ck.save_checkpoint("./d//", tree(3), 3, keep=5)
        assert p == os.path.join("d", "checkpoint_3") == fck.latest_checkpoint("d")
        assert_same(ck.restore_checkpoint("d/./", None), fck.restore_checkpoint("./d", None))
        assert ck.available_steps("d") == fck.available_steps("d") == [1, 2, 3]
    finally:
        os.chdir(cwd)
    assert_same(ck.restore_checkpoint(d, None, step=1), tree(1))
    assert_same(ck.restore_checkpoint(d / "checkpoint_2", None), tree(2))  # a file path
    # flax's own leftover staging file is no checkpoint
    (d / "checkpoint_tmp").write_bytes(b"half a checkpoint")
    assert ck.available_steps(d) == [1, 2, 3]
    assert_same(ck.restore_checkpoint(d, None), tree(3))


def test_helpers_match_flax():
    names = ["c_1", "c_10", "c_2", "c_-0.2", "c_0.1", "c_1e1", "c_9", "c_tmp", "c_+3"]
    assert ck.natural_sort(names) == fck.natural_sort(names)
    assert ck.natural_sort(names, signed=False) == fck.natural_sort(names, signed=False)
    for p in ["gs://a//b/./c/", "./x//y/..", "/abs//p/", "s3://bucket/k/../l"]:
        assert ck.safe_normpath(p) == fck.safe_normpath(p)
    pre = {"Conv_0": {"k": 1}, "Dense_1": {"k": 2}, "Dense_3": {"Dense_5": {"b": 3}}, "other": 4}
    assert ck.convert_pre_linen(pre) == fck.convert_pre_linen(pre)
    frozen = flax.core.freeze(pre)
    assert ck.convert_pre_linen(frozen) == fck.convert_pre_linen(frozen)


# -- safety flax lacks --------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "s3", "seaweed", "gcs"])
def test_a_native_save_in_flight_is_no_flax_step(kind, request, tmp_path):
    """A directory-layout save of checkpoint_5 that has written its data but not committed
    (or was killed before recovery ran) leaves a prefix checkpoint_5/ on an object store:
    that is no step (attacker finding G1). Before the fix flax's latest_checkpoint named
    it, a save of an older step was refused as outdated, and a save of step 5 with
    overwrite=True was told it committed and then deleted its own file as a "newer"
    duplicate."""
    b = make_backend(kind, request, tmp_path)
    st = b.open()
    o = b.options
    txn = st.transaction("checkpoint_5")
    txn.write_bytes("state.bin", b"native, in flight")
    assert ck.latest_checkpoint(b.url, storage_options=o) is None
    assert ck.available_steps(b.url, storage_options=o) == []
    ck.save_checkpoint(b.url, {"v": 3}, 3, storage_options=o)  # not "outdated"
    assert ck.latest_checkpoint(b.url, storage_options=o) == f"{b.url}/checkpoint_3"
    if kind == "seaweed":
        # its keys are a filesystem's: checkpoint_5 cannot be created while checkpoint_5/…
        # exists, so the flax save of step 5 loses at once, and nothing of it is left
        with pytest.raises(atomicstore.AlreadyExistsError):
            ck.save_checkpoint(b.url, {"v": 5}, 5, overwrite=True, storage_options=o)
        assert ck.available_steps(b.url, storage_options=o) == [3]
        txn.abort()  # (its lease would be renewed for the rest of the session)
        return
    path = ck.save_checkpoint(b.url, {"v": 5}, 5, overwrite=True, keep=10, storage_options=o)
    assert path == f"{b.url}/checkpoint_5"
    assert ck.available_steps(b.url, storage_options=o) == [3, 5]
    assert ck.restore_checkpoint(b.url, None, storage_options=o) == {"v": 5}, "the committed save was deleted"
    with pytest.raises(atomicstore.AlreadyExistsError):
        txn.commit()  # the native save of the same name never commits beside it
    assert ck.restore_checkpoint(b.url, None, storage_options=o) == {"v": 5}


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_two_writers_of_one_step_cannot_both_commit(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    for rnd in range(6):
        barrier = threading.Barrier(2)
        results: list = [None, None]

        def write(i: int, rnd: int = rnd, barrier: threading.Barrier = barrier, results: list = results) -> None:
            st = b.open()
            try:
                with st.one_file(f"checkpoint_{rnd}") as f:
                    f.write(bytes([i]) * 1000)
                    barrier.wait(timeout=30)  # both staged before either commits
                results[i] = "won"
            except atomicstore.CommitConflictError:
                results[i] = "lost"

        ts = [threading.Thread(target=write, args=(i,)) for i in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        assert sorted(results) == ["lost", "won"], results
        winner = results.index("won")
        assert b.open().driver.read(f"checkpoint_{rnd}") == bytes([winner]) * 1000


def test_concurrent_flax_saves_of_one_step(tmp_path):
    d = tmp_path / "d"
    errors: list = []

    def save(i: int) -> None:
        try:
            ck.save_checkpoint(d, {"w": np.full(1000, i)}, 1)
        except (atomicstore.CommitConflictError, ck.InvalidCheckpointError) as exc:
            errors.append(exc)

    ts = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(errors) == 3
    w = ck.restore_checkpoint(d, None)["w"]
    assert (w == w[0]).all()


ONE_V1, ONE_V2 = b"\x01" * 3000, b"\x02" * 5000


def _one(st: atomicstore.Store, name: str, data: bytes, overwrite: bool = False) -> None:
    with st.one_file(name, overwrite=overwrite) as f:
        for i in range(0, len(data), 1000):
            f.write(data[i:i + 1000])


@pytest.mark.parametrize("overwrite", [False, True], ids=["save", "overwrite"])
@pytest.mark.parametrize("kind", ["posix-model", "local", "memory", "s3", "gcs"])
def test_one_file_commit_every_crash_point(kind, overwrite, request, tmp_path):
    """Crash before each mutating operation of a one-file save; after recovery the file is
    the old state or the new one, nothing else is left, and flax's listing agrees."""
    name = "checkpoint_1" if overwrite else "checkpoint_2"
    before = {"checkpoint_1": ONE_V1}
    after = {"checkpoint_1": ONE_V2} if overwrite else {"checkpoint_1": ONE_V1, "checkpoint_2": ONE_V2}
    counter = iter(range(10**6))
    if kind == "posix-model":
        def fresh():
            return {"m": PosixModel()}

        def plain(s, crasher=None):
            return atomicstore.Store(PosixModelDriver(s["m"], crasher or Crasher()), lease_ttl=3600)

        def survivor(s):
            s["m"] = s["m"].crash()
            return plain(s)
    else:
        if kind in ("local", "memory"):
            opts: dict = {}
            base = str(tmp_path) if kind == "local" else f"memory://one-{secrets.token_hex(4)}"
        else:
            server = request.getfixturevalue(f"{kind}_server")
            base, opts = server.url(server.new_bucket()), server.storage_options()

        def fresh():
            return f"{base}/s{next(counter)}"

        def plain(s, crasher=None):
            st = atomicstore.open_store(s, **opts)
            return atomicstore.Store(CrashingDriver(st.driver, crasher), lease_ttl=3600) if crasher else st

        survivor = plain
    probe = Crasher()
    s = fresh()
    _one(plain(s), "checkpoint_1", ONE_V1)
    _one(plain(s, probe), name, ONE_V2, overwrite)
    assert probe.count > 0
    for k in range(probe.count + 1):
        s = fresh()
        _one(plain(s), "checkpoint_1", ONE_V1)
        c = Crasher(crash_at=k if k < probe.count else None)
        try:
            _one(plain(s, c), name, ONE_V2, overwrite)
        except SimulatedCrash:
            pass
        st = survivor(s)
        st.recover(now=FUTURE, flax_prefix="checkpoint_")
        keys = set(st.driver.find("")) - {LOCK_KEY}
        state = {key: st.driver.read(key) for key in keys}
        where = f"{kind}: crash before op {k}/{probe.count} ({c.log[-1] if c.log else 'start'})"
        assert state in ([after] if k == probe.count else [before, after]), f"{where}: {sorted(state)}"
        if st.driver.capabilities.directories:
            assert st.driver.listdir(STAGING) == [], where
        if st.driver.capabilities.multipart_uploads:
            assert st.driver.list_incomplete_uploads("") == [], where
        assert not st.recover(now=FUTURE, flax_prefix="checkpoint_").actions, where


# -- async --------------------------------------------------------------------------------
def test_async_manager_snapshots_orders_and_surfaces_errors(tmp_path):
    am = ck.AsyncManager()
    d = tmp_path / "d"
    arr = np.zeros(1 << 20, np.float32)
    for step in range(1, 5):
        arr[:] = step
        ck.save_checkpoint(d, {"a": arr}, step, keep=10, async_manager=am)
        arr[:] = -1  # mutation after save returns must not reach the checkpoint
    am.wait_previous_save()
    assert ck.available_steps(d) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert (ck.restore_checkpoint(d, None, step=step)["a"] == step).all()
    # an error in the background is raised by the next call, never lost
    ck.save_checkpoint(d, {"a": arr, "bad": object()}, 5, async_manager=am)  # fails in the background
    with pytest.raises(atomicstore.InvalidArgumentError, match="bad"):
        ck.save_checkpoint(d, {"a": arr}, 6, async_manager=am)
    assert ck.available_steps(d) == [1, 2, 3, 4]  # nothing half-written became a step
    ck.save_checkpoint(d, {"a": arr}, 6, keep=10, async_manager=am)
    am.wait_previous_save()
    assert ck.available_steps(d) == [1, 2, 3, 4, 6]


def test_bad_arguments_raise_before_writing(tmp_path):
    d = tmp_path / "d"
    for kwargs in (dict(keep=0), dict(keep="2"), dict(prefix=""), dict(prefix="a/b"), dict(keep_every_n_steps=0),
                   dict(orbax_checkpointer=object()), dict(async_manager=object())):
        with pytest.raises(atomicstore.InvalidArgumentError):
            ck.save_checkpoint(d, tree(), 1, **kwargs)
    for step in ("1", None, float("nan"), True):
        with pytest.raises(atomicstore.InvalidArgumentError):
            ck.save_checkpoint(d, tree(), step)
    with pytest.raises(atomicstore.InvalidArgumentError):
        ck.save_checkpoint("", tree(), 1)
    assert not d.exists() or os.listdir(d) in ([], [atomicstore.commit.names.RESERVED_DIR])


def test_corrupt_file_raises_our_error_naming_the_file(tmp_path):
    d = tmp_path / "d"
    p = ck.save_checkpoint(d, tree(), 1)
    data = Path(p).read_bytes()
    Path(p).write_bytes(data[: len(data) // 2])
    with pytest.raises(atomicstore.CorruptionError, match="checkpoint_1"):
        ck.restore_checkpoint(d, None)


def test_orbax_checkpoints_written_by_flax_restore(tmp_path):
    """flax >= 0.8 writes Orbax step directories by default: after swapping the import,
    every one of them still restores (through Orbax), by latest, by step and by path."""
    d = str(tmp_path / "orbax")
    state = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.int32)}, "n": 3}
    flax.config.update("flax_use_orbax_checkpointing", True)
    try:
        fck.save_checkpoint(d, state, 1)
        fck.save_checkpoint(d, {**state, "n": 4}, 2, keep=2)
    finally:
        flax.config.update("flax_use_orbax_checkpointing", False)
    assert os.path.isdir(os.path.join(d, "checkpoint_2"))
    target = {"params": {"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.int32)}, "n": 0}
    got = ck.restore_checkpoint(d, target)
    assert got["n"] == 4 and np.array_equal(got["params"]["w"], state["params"]["w"])
    assert got["params"]["b"].dtype == np.int32 and np.array_equal(got["params"]["b"], state["params"]["b"])
    assert ck.restore_checkpoint(d, None, step=1)["n"] == 3
    assert ck.restore_checkpoint(os.path.join(d, "checkpoint_1"), target)["n"] == 3
    assert ck.latest_checkpoint(d) == os.path.join(d, "checkpoint_2")


def test_a_damaged_orbax_directory_raises_our_error_naming_it(tmp_path):
    d = tmp_path / "d" / "checkpoint_1"
    os.makedirs(d)
    (d / "_METADATA").write_text("{}")
    with pytest.raises(atomicstore.CorruptionError, match="checkpoint_1.*Orbax") as info:
        ck.restore_checkpoint(tmp_path / "d", None)
    assert info.value.path.endswith("checkpoint_1")


def test_an_orbax_directory_without_orbax_installed_names_the_package(tmp_path):
    d = tmp_path / "d" / "checkpoint_1"
    os.makedirs(d)
    (d / "_METADATA").write_text("{}")
    code = ("import sys; sys.modules['orbax'] = None; sys.modules['orbax.checkpoint'] = None\n"
            "import atomicstore\nfrom atomicstore.compat import flax as ck\n"
            "try:\n    ck.restore_checkpoint(sys.argv[1], None)\n"
            "except atomicstore.InvalidArgumentError as exc:\n    print('REFUSED', exc)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], capture_output=True, text=True,
                         timeout=120)
    assert "REFUSED" in out.stdout and "orbax-checkpoint" in out.stdout, out.stdout + out.stderr


def test_invalid_checkpoint_error_is_caught_as_flax_s(tmp_path):
    """Resume code written for flax catches ``flax.errors.InvalidCheckpointError``: after
    swapping the import, it must still catch ours (and ours stays an atomicstore error)."""
    import pickle

    d = str(tmp_path / "ck")
    ck.save_checkpoint(d, {"a": np.ones(2)}, 5)
    try:
        ck.save_checkpoint(d, {"a": np.ones(2)}, 3)
    except flax.errors.InvalidCheckpointError as exc:
        err = exc
    assert isinstance(err, ck.InvalidCheckpointError) and isinstance(err, atomicstore.InvalidArgumentError)
    assert isinstance(err, ValueError) and err.step == 3 and err.path.endswith("checkpoint_3")
    assert str(err) == f'Trying to save an outdated checkpoint at step: "3" and path: "{err.path}".'
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is ck.InvalidCheckpointError and str(again) == str(err)



# -- issue 21 row 14: what the writer accepts, the reader reads back (nesting) ---------------------
def nest(depth: int, leaf) -> dict:
    """``leaf`` under ``depth`` nested dicts (the leaf sits at depth ``depth``)."""
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


_LIMIT_LEAVES = {
    "small array": lambda: np.arange(3, dtype=np.float32),  # inlined by the writer's fast path
    "large array": lambda: np.arange(20_000, dtype=np.float32),  # 80 KB: the general path
    "int": lambda: 7,
    "none": lambda: None,
    "empty dict": lambda: {},
}


@pytest.mark.parametrize("leaf", sorted(_LIMIT_LEAVES))
@pytest.mark.parametrize("api", ["compat.flax", "atomicstore"])
def test_row14_the_nesting_limit_is_one_for_writer_and_reader(api, leaf, tmp_path):
    """At the limit (a leaf 200 dicts deep) the tree saves and restores; one deeper, the
    save refuses up front with InvalidArgumentError naming depth and limit, and nothing is
    committed. (A small array 201 deep used to be committed, then refused by restore.)"""
    from atomicstore.pytree import msgpack_io

    limit = msgpack_io.MAX_DEPTH
    d = tmp_path / "ck"

    def save(t):
        if api == "compat.flax":
            ck.save_checkpoint(d, t, 1, overwrite=True)
        else:
            atomicstore.save(d / "checkpoint_1", t, overwrite=True)

    def restore():
        return ck.restore_checkpoint(d, None) if api == "compat.flax" else atomicstore.restore(d / "checkpoint_1")

    ok = nest(limit, _LIMIT_LEAVES[leaf]())
    save(ok)
    assert_same(restore(), ok)
    with pytest.raises(atomicstore.InvalidArgumentError, match=rf"{limit + 1} levels.*at most {limit}"):
        save(nest(limit + 1, _LIMIT_LEAVES[leaf]()))
    assert_same(restore(), ok)  # the refused save committed nothing


def test_row14_a_chunked_array_counts_the_two_levels_flax_nests_it_in(tmp_path):
    """flax stores an array over 1 GiB as a map of chunks, two levels below the leaf: at
    depth 199 its chunks would sit at 201, which no reader accepts. Refused before a byte
    is written (np.zeros is never touched)."""
    from atomicstore.pytree import msgpack_io

    limit = msgpack_io.MAX_DEPTH
    huge = np.zeros((1 << 28) + 1, np.float32)  # 1 GiB + 4 bytes
    with pytest.raises(atomicstore.InvalidArgumentError, match=rf"{limit + 1} levels.*at most {limit}"):
        ck.save_checkpoint(tmp_path, nest(limit - 1, huge), 1)
    assert ck.latest_checkpoint(tmp_path) is None


def test_row14_async_save_refuses_too_deep_a_tree_before_returning(tmp_path):
    am = ck.AsyncManager()
    from atomicstore.pytree import msgpack_io

    with pytest.raises(atomicstore.InvalidArgumentError, match="at most"):
        ck.save_checkpoint(tmp_path, nest(msgpack_io.MAX_DEPTH + 1, np.ones(2, np.float32)), 1, async_manager=am)
    am.wait_previous_save()
    assert ck.latest_checkpoint(tmp_path) is None
