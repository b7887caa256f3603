"""The pytree layer: format, interop with real flax, partial restore, targets, options."""

from __future__ import annotations

import collections
import dataclasses
import os

import flax
import flax.serialization
import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.training import checkpoints as flax_ckpt

import atomicstore
from atomicstore.pytree import INDEX_FILE, STATE_FILE

NT = collections.namedtuple("NT", "x y")


@flax.struct.dataclass
class TrainState:
    step: int
    params: dict
    opt: tuple
    tag: str = flax.struct.field(pytree_node=False, default="static")


@dataclasses.dataclass
class Plain:
    a: np.ndarray
    b: list


# the fields named: jax < 0.4.36 cannot infer them (register_dataclass as a bare decorator)
jax.tree_util.register_dataclass(Plain, data_fields=["a", "b"], meta_fields=[])


def sample_tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "dense": {"kernel": rng.standard_normal((64, 32), dtype=np.float32),
                      "bias": np.zeros(32, np.float32)},
            "embed": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        },
        "fp8": rng.standard_normal(10).astype(ml_dtypes.float8_e4m3fn),
        "ints": np.arange(7, dtype=np.int16),
        "bools": np.array([True, False]),
        "cplx": np.array([1 + 2j, 3 - 4j], np.complex64),
        "empty_arr": np.zeros((0, 3), np.float32),
        "scalar": np.float64(2.5),
        "step": 12,
        "lr": 3e-4,
        "big_int": 2**40,
        "flag": True,
        "name": "run-1",
        "raw": b"\x00\x01\xff",
        "z": 1 - 1j,
        "nothing": None,
        "empty_dict": {},
        "empty_list": [],
        "seq": [np.ones(2, np.uint8), (3, 4.0)],
        "nt": NT(x=np.int32(5), y="why"),
    }


def assert_same(a, b, path="root"):
    """Bit-identical comparison of two restored trees."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert type(a) is type(b) and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, set(a) ^ set(b) if isinstance(b, dict) else b)
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def expected_plain(tree):
    """What target=None restore returns: namedtuples become dicts."""
    if isinstance(tree, NT):
        return {f: expected_plain(getattr(tree, f)) for f in tree._fields}
    if isinstance(tree, dict):
        return {k: expected_plain(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [expected_plain(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(expected_plain(v) for v in tree)
    return tree


def test_round_trip_every_backend(backend):
    tree = sample_tree()
    url = f"{backend.url}/step_1"
    manifest = atomicstore.save(url, tree, metadata={"step": 1}, **backend.options)
    assert set(manifest.files) == {STATE_FILE, INDEX_FILE}
    assert manifest.metadata == {"step": 1}
    restored = atomicstore.restore(url, **backend.options)
    assert_same(expected_plain(tree), restored)
    with_target = atomicstore.restore(url, target=tree, **backend.options)
    assert isinstance(with_target["nt"], NT)
    assert_same(tree, with_target)


def test_flax_reads_what_we_write_byte_identical(tmp_path):
    tree = sample_tree()
    atomicstore.save(tmp_path / "s" / "step_1", tree)
    raw = (tmp_path / "s" / "step_1" / STATE_FILE).read_bytes()
    assert raw == flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(tree))
    theirs = flax.serialization.msgpack_restore(raw)
    ours = atomicstore.restore(tmp_path / "s" / "step_1")
    assert theirs["params"]["dense"]["kernel"].tobytes() == tree["params"]["dense"]["kernel"].tobytes()
    assert theirs["params"]["embed"].dtype == ml_dtypes.bfloat16
    assert theirs["seq"]["1"]["1"] == 4.0 and ours["seq"][1] == (3, 4.0)
    # the real flax checkpoint API restores it as well, with a target
    state = TrainState(step=3, params={"w": np.arange(6.0).reshape(2, 3)}, opt=(np.ones(2), 0.5))
    atomicstore.save(tmp_path / "s" / "step_2", state)
    flax_state = flax.serialization.from_bytes(
        TrainState(step=0, params={"w": np.zeros((2, 3))}, opt=(np.zeros(2), 0.0)),
        (tmp_path / "s" / "step_2" / STATE_FILE).read_bytes(),
    )
    assert flax_state.step == 3 and np.array_equal(flax_state.params["w"], state.params["w"])


def test_arrays_in_the_other_byte_order_keep_their_values(backend):
    """Big-endian leaves (small ones, which take the inlined path, and large, C and
    Fortran order, in a list) restore with the same values, in the machine's byte order.
    The stored dtype is a name without a byte order (flax's format), so raw big-endian
    bytes read back as other values: they are written converted, a block at a time (found
    by an attack: ``>i4`` [1, 2] restored as [16777216, 33554432])."""
    tree = {
        "small": np.arange(1, 6, dtype=">f8"),
        "i4": np.arange(3, dtype=">i4"),
        "c8": (np.arange(4) + 1j).astype(">c8"),
        "big": np.arange(300_000, dtype=">f4").reshape(300, 1000),
        "fortran": np.asfortranarray(np.arange(40_000, dtype=">u2").reshape(200, 200)),
        "seq": [np.arange(3, dtype=">i8"), np.arange(3, dtype="<i8")],
    }
    url = f"{backend.url}/step_1"
    atomicstore.save(url, tree, **backend.options)
    back = atomicstore.restore(url, **backend.options)
    flat = {**{k: v for k, v in tree.items() if k != "seq"}, "seq0": tree["seq"][0], "seq1": tree["seq"][1]}
    got = {**{k: v for k, v in back.items() if k != "seq"}, "seq0": back["seq"][0], "seq1": back["seq"][1]}
    for k, want in flat.items():
        assert got[k].dtype == want.dtype.newbyteorder("="), (k, got[k].dtype)
        np.testing.assert_array_equal(got[k], want, err_msg=k)
    assert tree["small"].dtype == np.dtype(">f8") and tree["small"][1] == 2.0  # the caller's own, untouched


def test_we_read_flax_legacy_checkpoints(tmp_path):
    flax.config.update("flax_use_orbax_checkpointing", False)
    tree = sample_tree(1)
    flax_ckpt.save_checkpoint(str(tmp_path), tree, step=5, prefix="checkpoint_", keep=2)
    path = tmp_path / "checkpoint_5"
    assert path.is_file()
    ours = atomicstore.restore(path)
    theirs = flax_ckpt.restore_checkpoint(str(tmp_path), target=None)
    assert_same(theirs, ours)
    typed = atomicstore.restore(path, target=tree)
    assert_same(tree, typed)
    assert isinstance(typed["nt"], NT)
    part = atomicstore.restore(path, subtree="params/dense")
    assert set(part) == {"kernel", "bias"}


@pytest.mark.slow
def test_flax_chunked_arrays_over_one_gib(tmp_path):
    """flax splits arrays over 1 GiB into chunks; both directions must agree."""
    big = np.arange(2**30 + 4096, dtype=np.uint8)
    big[::4097] = 7
    atomicstore.save(tmp_path / "s" / "big", {"e": big, "small": np.ones(3)})
    back = atomicstore.restore(tmp_path / "s" / "big")
    assert back["e"].shape == big.shape and np.array_equal(back["e"], big)
    raw = (tmp_path / "s" / "big" / STATE_FILE).read_bytes()
    theirs = flax.serialization.msgpack_restore(raw)
    assert np.array_equal(theirs["e"], big)
    del raw, theirs
    legacy = tmp_path / "legacy"
    legacy.write_bytes(flax.serialization.msgpack_serialize({"e": big}))
    assert np.array_equal(atomicstore.restore(legacy)["e"], big)


def test_custom_nodes_and_jax_arrays(tmp_path):
    state = TrainState(
        step=7,
        params={"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16)},
        opt=(Plain(np.arange(3), [1, 2.0]), jnp.float32(0.1)),
    )
    atomicstore.save(tmp_path / "s" / "x", state)
    plain = atomicstore.restore(tmp_path / "s" / "x")
    assert set(plain) == {"step", "params", "opt"} and plain["opt"][0]["b"] == [1, 2.0]
    target = jax.tree_util.tree_map(jnp.zeros_like, state)
    back = atomicstore.restore(tmp_path / "s" / "x", target=target)
    assert isinstance(back, TrainState) and isinstance(back.opt[0], Plain)
    assert isinstance(back.params["w"], jax.Array)
    assert back.params["b"].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(back.params["w"]), np.asarray(state.params["w"]))
    assert back.step == 7 and back.tag == "static"


def test_partial_restore_reads_only_the_subtree(tmp_path):
    tree = {"params": {"a": np.ones(1000), "b": np.zeros(10)}, "opt": {"mu": np.full(10**6, 3.0)}}
    atomicstore.save(tmp_path / "s" / "p", tree)
    ckpt_dir = tmp_path / "s" / "p"
    # damage the optimiser state: reading only params must not notice
    state = bytearray((ckpt_dir / STATE_FILE).read_bytes())
    state[len(state) // 2] ^= 0xFF  # inside opt/mu (keys are sorted: opt before params)
    (ckpt_dir / STATE_FILE).write_bytes(bytes(state))
    sub = atomicstore.restore(ckpt_dir, subtree=("params",))
    assert set(sub) == {"a", "b"} and np.array_equal(sub["a"], np.ones(1000))
    only = atomicstore.restore(ckpt_dir, target={"params": {"b": np.empty(10)}})
    assert set(only["params"]) == {"b"}
    with pytest.raises(atomicstore.CorruptionError, match="opt/mu") as info:
        atomicstore.restore(ckpt_dir)
    assert info.value.leaf == "opt/mu" and info.value.path == STATE_FILE
    with pytest.raises(atomicstore.NotFoundError, match="no subtree"):
        atomicstore.restore(ckpt_dir, subtree="nope")


def test_missing_keys_error_or_fill(tmp_path):
    atomicstore.save(tmp_path / "s" / "m", {"a": np.ones(2)})
    target = {"a": np.zeros(2), "new_head": {"w": np.full(3, 9.0)}}
    with pytest.raises(atomicstore.NotFoundError, match="new_head/w"):
        atomicstore.restore(tmp_path / "s" / "m", target=target)
    got = atomicstore.restore(tmp_path / "s" / "m", target=target, allow_missing=True)
    assert np.array_equal(got["a"], np.ones(2)) and np.array_equal(got["new_head"]["w"], np.full(3, 9.0))


@pytest.mark.parametrize("chunked", [False, True], ids=["array", "flax-chunked"])
def test_converted_leaves_are_written_piece_by_piece_byte_identical(tmp_path, monkeypatch, chunked):
    """A cast or non-contiguous leaf is converted a block at a time (the block size, and
    for the chunked case flax's 1 GiB chunk size, made small so that pieces split at
    every level of the shape and straddle chunk boundaries): the bytes are exactly what
    flax writes for the converted arrays, and they restore equal."""
    from atomicstore.pytree import writer

    monkeypatch.setattr(writer, "CONVERT_BLOCK", 70_000 if chunked else 1000)
    if chunked:
        monkeypatch.setattr(writer, "FLAX_MAX_CHUNK", 300_000)
        monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 300_000)  # the reference, alike
    rng = np.random.default_rng(0)
    base = rng.standard_normal((1000, 700) if chunked else (37, 41, 13)).astype(np.float32)
    leaves = {"T": base.T, "strided": base[:, ::3], "fortran": np.asfortranarray(base)}
    if not chunked:
        leaves |= {"3d": base.transpose(2, 0, 1), "1d": base.reshape(-1)[::7],
                   "scalar": np.float32(3.5), "int": np.arange(1000).reshape(10, 100).T}
    for cast in (None, "bfloat16", np.float16):
        name = f"c_{np.dtype(cast).name if cast else 'none'}"
        atomicstore.save(tmp_path / "s" / name, leaves, cast_dtype=cast)

        def conv(v, cast=cast):
            if cast is None or not np.issubdtype(np.asarray(v).dtype, np.floating):
                return np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v
            return np.ascontiguousarray(v.astype(cast)) if isinstance(v, np.ndarray) else v.astype(cast)

        want = {k: conv(v) for k, v in leaves.items()}
        raw = (tmp_path / "s" / name / STATE_FILE).read_bytes()
        assert raw == flax.serialization.msgpack_serialize(want), name
        for k, v in want.items():
            got = atomicstore.restore(tmp_path / "s" / name, subtree=k)
            assert np.asarray(got).dtype == np.asarray(v).dtype and np.array_equal(got, v), (name, k)
        assert atomicstore.open_store(tmp_path / "s").verify(name) is not None


def test_save_options_cast_gather_and_shard_fns(tmp_path):
    tree = {"w": np.linspace(0, 1, 8, dtype=np.float32), "i": np.arange(4)}
    atomicstore.save(tmp_path / "s" / "c", tree, cast_dtype="bfloat16",
                     gather_fns={"i": lambda x: x * 10})
    back = atomicstore.restore(tmp_path / "s" / "c")
    assert back["w"].dtype == ml_dtypes.bfloat16 and back["i"].dtype == tree["i"].dtype
    assert np.array_equal(back["i"], np.arange(4) * 10)
    seen = []
    placed = atomicstore.restore(tmp_path / "s" / "c",
                                 shard_fns=lambda path, x: seen.append(path) or jax.device_put(x))
    assert isinstance(placed["w"], jax.Array) and sorted(seen) == [("i",), ("w",)]
    calls = []
    atomicstore.save(tmp_path / "s" / "prog", {"x": np.zeros(2**20)}, progress=calls.append)
    assert calls and calls[-1] >= 8 * 2**20


def test_many_small_leaves_are_three_files(tmp_path):
    tree = {f"layer_{i:05d}": np.full(256, i, np.float32) for i in range(10_000)}
    manifest = atomicstore.save(tmp_path / "s" / "many", tree)
    assert set(manifest.files) == {STATE_FILE, INDEX_FILE}
    assert sorted(os.listdir(tmp_path / "s" / "many")) == sorted([STATE_FILE, INDEX_FILE, "manifest.json"])
    back = atomicstore.restore(tmp_path / "s" / "many")
    assert len(back) == 10_000 and np.array_equal(back["layer_09999"], tree["layer_09999"])


def test_hostile_keys_stay_data(tmp_path):
    tree = {"../../etc/passwd": np.ones(1), "a/b": 1, "nul\x00key": 2, b"\xff\xfe": 3, 7: "int key"}
    store_dir = tmp_path / "s"
    atomicstore.save(store_dir / "k", tree)
    assert sorted(os.listdir(store_dir / "k")) == sorted([STATE_FILE, INDEX_FILE, "manifest.json"])
    assert not (tmp_path / "etc").exists()
    back = atomicstore.restore(store_dir / "k")
    assert set(back) == set(tree)
    assert back[b"\xff\xfe"] == 3 and back["a/b"] == 1 and back[7] == "int key"
    typed = atomicstore.restore(store_dir / "k", target=tree)
    assert typed["nul\x00key"] == 2


@pytest.mark.parametrize("bad", [
    {"x": object()},
    {"x": np.array([object()])},
    {"x": 2**70},
    {1: 1, "1": 2},
])
def test_unsupported_leaves_are_clear_errors_and_write_nothing(tmp_path, bad):
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.save(tmp_path / "s" / "bad", bad)
    assert atomicstore.open_store(tmp_path / "s").list() == []


def test_bad_arguments(tmp_path):
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.save("", {})
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.save(tmp_path / "s" / "x", {}, cast_dtype="no-such-dtype")
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.save(tmp_path / "s" / "x", {}, gather_fns=3)
    atomicstore.save(tmp_path / "s" / "x", {"a": 1})
    with pytest.raises(atomicstore.InvalidArgumentError):
        atomicstore.restore(tmp_path / "s" / "x", threads=0)
    with pytest.raises(atomicstore.NotFoundError):
        atomicstore.restore(tmp_path / "s" / "missing")
    with pytest.raises(atomicstore.CommitConflictError):
        atomicstore.save(tmp_path / "s" / "x", {"a": 2})
    atomicstore.save(tmp_path / "s" / "x", {"a": 2}, overwrite=True)
    assert atomicstore.restore(tmp_path / "s" / "x") == {"a": 2}
