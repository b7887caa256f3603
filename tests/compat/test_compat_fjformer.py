"""atomicstore.compat.fjformer against files written by the real fjformer (issue: compat.fjformer).

The ``*.fjf`` files in ``tests/fixtures/fjformer/`` were written by fjformer 0.0.91's own
code paths, and ``expected_loads.msgpack`` holds what its ``load_checkpoint`` returned
for each call of ``cases.LOADS`` (``make_fixtures.py``, run in a separate environment:
fjformer 0.0.91 needs jax 0.4.35, this suite runs a newer one). The property tests compare
with :func:`fjformer_bytes`/:func:`fjformer_load`, fjformer 0.0.91's
``save_state_to_file``/``load_checkpoint`` (``fjformer/checkpoint/streamer.py``) copied
with only the file I/O and progress bar taken out.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import secrets
import sys
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
from flax.serialization import (
    from_bytes,
    msgpack_restore,
    msgpack_serialize,
    to_bytes,
    to_state_dict,
)
from flax.traverse_util import flatten_dict, unflatten_dict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atomicstore
from atomicstore.compat import fjformer as fj

FIX = Path(__file__).parents[1] / "fixtures" / "fjformer"
_spec = importlib.util.spec_from_file_location("fjformer_cases", FIX / "cases.py")
assert _spec is not None and _spec.loader is not None
cases = importlib.util.module_from_spec(_spec)
sys.modules["fjformer_cases"] = cases
_spec.loader.exec_module(cases)

EXPECTED = msgpack_restore((FIX / "expected_loads.msgpack").read_bytes())


def canon(tree: Any) -> bytes:
    """Values and types of a loaded tree, comparable by bytes (flax's encoding)."""
    return msgpack_serialize(to_state_dict(tree))


# -- fjformer 0.0.91, copied (fjformer/checkpoint/streamer.py) ---------------------------------
def fjformer_get_dtype(tensor: Any, dtype: Any) -> Any:
    if dtype is None or dtype == "":
        return tensor
    if isinstance(dtype, str):
        dtype = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16,
                 "fp32": jnp.float32, "float32": jnp.float32, "fp64": jnp.float64, "float64": jnp.float64}[dtype]
    float_dtypes = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
    if getattr(tensor, "dtype", None) in float_dtypes:
        tensor = tensor.astype(dtype)
    return tensor


def fjformer_bytes(state: Any, gather_fns: Any = None, float_dtype: Any = None) -> bytes:
    """``CheckpointManager.save_state_to_file`` (mismatch_allowed=True), into memory."""
    state = to_state_dict(state)
    packer = msgpack.Packer()
    flatten_state = flatten_dict(state)
    if gather_fns is not None:
        gather_fns = flatten_dict(to_state_dict(gather_fns))
    stream = io.BytesIO()
    for key, value in flatten_state.items():
        if gather_fns is not None:
            try:
                callable_func = gather_fns[key]
                value = callable_func(value) if callable_func is not None else value
            except KeyError:
                pass
        value = fjformer_get_dtype(value, float_dtype)
        stream.write(packer.pack((key, to_bytes(value))))
    return stream.getvalue()


def fjformer_load(data: bytes, remove_dict_prefix: tuple | None = None) -> Any:
    """``CheckpointManager.load_checkpoint`` without target and shard_fns, from memory."""
    flatten_state = {}
    unpacker = msgpack.Unpacker(io.BytesIO(data), read_size=83886080, max_buffer_size=0)
    for key, value in unpacker:
        key = tuple(key)
        if remove_dict_prefix is not None:
            if key[: len(remove_dict_prefix)] == remove_dict_prefix:
                key = key[len(remove_dict_prefix):]
            else:
                continue
        flatten_state[key] = from_bytes(None, value)
    return unflatten_dict(flatten_state)


# -- interop with the real fjformer's files ---------------------------------------------------
@pytest.mark.parametrize("name", sorted(cases.WRITES))
def test_our_bytes_equal_the_file_fjformer_wrote(tmp_path, name):
    """Same state, gather_fns and float_dtype ("fp16", "bf16" through the manager's
    default, jnp.float32): the same bytes as fjformer 0.0.91 wrote, through each of its
    code paths (save_state_to_file, CheckpointManager.save_checkpoint, save_ckpt)."""
    how, builder, kwargs = cases.WRITES[name]
    state, kw = cases.state_of(builder), cases.resolve(kwargs)
    if how == "CheckpointManager.save_checkpoint":
        fj.CheckpointManager(tmp_path).save_checkpoint(state, name, **kw)
    else:
        fj.save_state_to_file(state, tmp_path / name, **kw)
    ours = (tmp_path / name).read_bytes()
    assert ours == (FIX / name).read_bytes()
    assert ours == fjformer_bytes(state, kw.get("gather_fns"),
                                  kw.get("float_dtype", "bf16" if how.startswith("CheckpointManager") else None))
    record = json.loads((tmp_path / f".{name}.crc32c.json").read_text())
    assert record["format"] == fj.RECORD_FORMAT and record["size"] == len(ours)
    assert len(record["items"]) == sum(1 for _ in msgpack.Unpacker(io.BytesIO(ours)))
    assert {p.name for p in tmp_path.iterdir()} <= {name, f".{name}.crc32c.json", ".atomicstore"}


@pytest.mark.parametrize("load", sorted(cases.LOADS))
def test_fjformer_files_load_as_fjformer_loads_them(tmp_path, load):
    """What fjformer's load_checkpoint returned for each call (target through
    from_state_dict, shard_fns per leaf, remove_dict_prefix, the target's empty dicts),
    from fjformer's file (no checksum record) and from ours."""
    file, kwargs = cases.LOADS[load]
    got = fj.load_checkpoint(FIX / file, **cases.load_kwargs(kwargs))
    assert canon(got) == EXPECTED[load]
    if "target" in kwargs:
        assert type(got) is type(cases.load_kwargs(kwargs)["target"])
    (tmp_path / file).write_bytes((FIX / file).read_bytes())
    ours = fj.load_checkpoint(str(tmp_path / file), **cases.load_kwargs(kwargs))
    assert canon(ours) == EXPECTED[load]


def test_object_stores_commit_and_read_fjformer_bytes(backend):
    """Local, memory, S3 and GCS: the object holds fjformer's bytes, committed with its
    checksum record and nothing else; a file fjformer wrote, uploaded as is, loads; a
    missing one is NotFoundError; a truncated one CorruptionError naming it."""
    opts = backend.options
    url = backend.url.rstrip("/")
    fj.save_state_to_file(cases.train_state(), f"{url}/train_state.fjf", storage_options=opts)
    st = backend.open()
    assert st.driver.read("train_state.fjf") == (FIX / "train_state.fjf").read_bytes()
    listed = {k for k in st.driver.find("") if not k.startswith(".atomicstore/")}
    assert listed == {"train_state.fjf", ".train_state.fjf.crc32c.json"}
    got = fj.load_checkpoint(f"{url}/train_state.fjf", target=cases.train_target(), shard_fns=cases.shard_fns(),
                             storage_options=opts)
    assert canon(got) == EXPECTED["train_target_shard"]
    st.driver.put("theirs.fjf", (FIX / "basic.fjf").read_bytes())
    assert canon(fj.load_checkpoint(f"{url}/theirs.fjf", storage_options=opts)) == EXPECTED["basic"]
    assert canon(fj.load_checkpoint(f"{url}/theirs.fjf", remove_dict_prefix=("params", "dense"),
                                    storage_options=opts)) == EXPECTED["basic_prefix"]
    with pytest.raises(atomicstore.NotFoundError):
        fj.load_checkpoint(f"{url}/missing.fjf", storage_options=opts)
    st.driver.put("cut.fjf", (FIX / "basic.fjf").read_bytes()[:-3])  # inside the last leaf
    with pytest.raises(atomicstore.CorruptionError, match="cut.fjf") as info:
        fj.load_checkpoint(f"{url}/cut.fjf", storage_options=opts)
    assert info.value.leaf == "ints/2"


# -- byte compatibility and round trip, as properties ------------------------------------------------
_DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.uint64, np.bool_,
           np.complex64, ml_dtypes.float8_e4m3fn]
_arrays = st.builds(
    lambda dt, shape, seed: (np.random.default_rng(seed).standard_normal(int(np.prod(shape))) * 4)
    .astype(dt).reshape(shape),
    st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple), st.integers(0, 1000))
_leaves = st.one_of(
    _arrays, _arrays.map(lambda a: a[()] if a.ndim == 0 else a.reshape(-1)[0] if a.size else np.float32(2)),
    st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=5), st.binary(max_size=8), st.none(),
    st.booleans(), st.complex_numbers(allow_nan=False))
_keys = st.text(min_size=1, max_size=6)
_trees = st.recursive(_leaves, lambda c: st.one_of(st.dictionaries(_keys, c, max_size=4), st.lists(c, max_size=3),
                                                   st.tuples(c, c)), max_leaves=14)
_states = st.dictionaries(_keys, _trees, max_size=5)
_float_dtypes = st.sampled_from([None, "", "bf16", "bfloat16", "fp16", "fp32", "fp64", jnp.float16, np.float32])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=_states, float_dtype=_float_dtypes, gather=st.booleans())
def test_random_states_byte_identical_and_round_trip(state, float_dtype, gather):
    """Any state fjformer can write: our bytes are fjformer's, and our load returns what
    fjformer's load returns (values, dtypes and Python types)."""
    gather_fns = {k: (lambda x: x * 2) if isinstance(v, np.ndarray) and v.dtype.kind in "if" else None
                  for k, v in state.items()} if gather else None
    url = f"memory://fjprop-{secrets.token_hex(6)}"
    fj.save_state_to_file(state, f"{url}/s.fjf", gather_fns, float_dtype)
    data = atomicstore.open_store(url).driver.read("s.fjf")
    assert data == fjformer_bytes(state, gather_fns, float_dtype)
    assert canon(fj.load_checkpoint(f"{url}/s.fjf")) == canon(fjformer_load(data))
    if state:
        first = next(iter(state))
        if (first,) in flatten_dict(to_state_dict(state)):  # a leaf: fjformer fails (IndexError)
            with pytest.raises(atomicstore.InvalidArgumentError, match="names the leaf"):
                fj.load_checkpoint(f"{url}/s.fjf", remove_dict_prefix=[first])
        else:
            assert canon(fj.load_checkpoint(f"{url}/s.fjf", remove_dict_prefix=[first])) == canon(
                fjformer_load(data, (first,)))


# -- hostile input -----------------------------------------------------------------------------
def _arr(shape: Any, name: Any, data: Any, code: int = 1) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb([shape, name, data]))


def _item(key: Any, leaf_bytes: bytes) -> bytes:
    return msgpack.packb([key, leaf_bytes])


def _leaf(value: Any) -> bytes:
    return msgpack.packb(value)


_GOOD = _item(["a"], _leaf(_arr([2], "float32", b"\0" * 8)))
#: name -> (file bytes, the leaf the error must name, or None where no key was read)
HOSTILE: dict[str, tuple[bytes, str | None]] = {
    "truncated_in_key": (_GOOD[:4], None),
    "truncated_in_value": (_GOOD[:-3], "a"),
    "truncated_second_item": (_GOOD + _GOOD[:9], None),
    "invalid_type_byte": (b"\xc1", None),
    "garbage_text": (b"this is not msgpack at all", None),
    "item_is_int": (msgpack.packb(5), None),
    "item_is_map": (msgpack.packb({"a": b"x"}), None),
    "item_of_three": (msgpack.packb([["a"], b"\xc0", 1]), None),
    "key_is_a_string": (msgpack.packb(["a/b", b"\xc0"]), None),
    "key_int_component": (_item(["a", 1], b"\xc0"), None),
    "key_bytes_component": (_item(["a", b"b"], b"\xc0"), None),
    "empty_key_path": (_item([], b"\xc0"), None),
    "invalid_utf8_key": (b"\x92\x91\xa2\xff\xfe\xc4\x01\xc0", None),
    "value_is_int": (msgpack.packb([["a"], 3]), "a"),
    "value_is_str": (msgpack.packb([["a"], "x"]), "a"),
    "huge_bin": (b"\x92\x91\xa1a\xc6\xff\xff\xff\xff" + b"\0" * 16, "a"),
    "huge_key_count": (b"\x92\xdd\xff\xff\xff\xff", None),
    "huge_key_string": (b"\x92\x91\xdb\xff\xff\xff\xf0", None),
    "huge_item_count": (b"\xdd\xff\xff\xff\xff", None),
    "unknown_ext_type": (_item(["a"], _leaf(msgpack.ExtType(7, b"abc"))), "a"),
    "dtype_object": (_item(["a"], _leaf(_arr([1], "object", b"\0" * 8))), "a"),
    "dtype_unicode": (_item(["a"], _leaf(_arr([1], "<U2", b"\0" * 8))), "a"),
    "dtype_code": (_item(["a"], _leaf(_arr([1], "float32;__import__('os')", b"\0" * 4))), "a"),
    "dtype_void": (_item(["a"], _leaf(_arr([1], "V8", b"\0" * 8))), "a"),
    "dtype_subarray": (_item(["a"], _leaf(_arr([1], "(2,)f4", b"\0" * 8))), "a"),
    "dtype_not_ascii": (_item(["a"], _leaf(_arr([1], b"\xff\xfe", b"\0" * 8))), "a"),
    "dtype_not_a_name": (_item(["a"], _leaf(_arr([1], 5, b"\0" * 8))), "a"),
    "shape_mismatch": (_item(["a"], _leaf(_arr([1000], "float32", b"\0" * 4))), "a"),
    "shape_negative": (_item(["a"], _leaf(_arr([-1], "float32", b""))), "a"),
    "shape_bool": (_item(["a"], _leaf(_arr([True], "float32", b"\0" * 4))), "a"),
    "shape_huge": (_item(["a"], _leaf(_arr([2**40, 2**40], "float32", b"\0" * 4))), "a"),
    "shape_astronomic_empty": (_item(["a"], _leaf(_arr([0, 2**63], "float32", b""))), "a"),
    "array_not_a_triple": (_item(["a"], _leaf(msgpack.ExtType(1, msgpack.packb([[1], "float32"])))), "a"),
    "array_payload_garbage": (_item(["a"], _leaf(msgpack.ExtType(1, b"\xc1\xc1"))), "a"),
    "scalar_payload_garbage": (_item(["a"], _leaf(msgpack.ExtType(3, b"\x93"))), "a"),
    "trailing_bytes_in_leaf": (_item(["a"], _leaf(5) + b"\0"), "a"),
    "deep_nesting_in_leaf": (_item(["a"], b"\x91" * 1000 + b"\xc0"), "a"),
    "complex_not_numbers": (_item(["a"], _leaf(msgpack.ExtType(2, msgpack.packb(["1", "2"])))), "a"),
    "chunked_array_bad_size": (_item(["a"], _leaf({"__msgpack_chunked_array__": True, "shape": {"0": 5},
                                                   "chunks": {"0": _arr([2], "float32", b"\0" * 8)}})), "a"),
    "array_as_map_key": (_item(["a"], _leaf({_arr([1], "float32", b"\0" * 4): 1})), "a"),
    "duplicate_leaf": (_GOOD + _GOOD, "a"),
    "leaf_then_subtree": (_item(["a"], b"\xc0") + _item(["a", "b"], b"\xc0"), "a/b"),
    "subtree_then_leaf": (_item(["a", "b"], b"\xc0") + _item(["a"], b"\xc0"), "a"),
    "garbage_after_items": (_GOOD + b"\xc1", None),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_raise_our_error_naming_file_and_leaf(tmp_path, case):
    data, leaf = HOSTILE[case]
    (tmp_path / "hostile.fjf").write_bytes(data)
    with pytest.raises(atomicstore.CorruptionError) as info:
        fj.load_checkpoint(tmp_path / "hostile.fjf")
    assert "hostile.fjf" in str(info.value) and info.value.path == "hostile.fjf"
    if leaf is not None:
        assert info.value.leaf == leaf, info.value


def test_a_huge_declared_length_allocates_nothing(tmp_path):
    (tmp_path / "h.fjf").write_bytes(b"\x92\x91\xa1a\xc6\xff\xff\xff\x00" + b"\0" * 64)
    tracemalloc.start()
    try:
        with pytest.raises(atomicstore.CorruptionError, match="past the end"):
            fj.load_checkpoint(tmp_path / "h.fjf")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20  # the driver's 16 MiB read block, nothing sized from the 4 GiB declared


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _rewrite_keeping_generation(path: Path, data: bytes) -> None:
    """Change a file's bytes as bit rot does: same inode, same modification time."""
    stat = path.stat()
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_ino == stat.st_ino


_OURS = fjformer_bytes(cases.basic_state())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(pos=st.integers(0, len(_OURS) - 1), delta=st.integers(1, 255), cut=st.booleans())
def test_any_damage_to_our_file_is_caught_by_its_checksums(fuzz_dir, pos, delta, cut):
    """Our file with its checksum record: any flipped byte (or cut) raises, naming the file."""
    p = fuzz_dir / f"ours-{secrets.token_hex(4)}.fjf"
    fj.save_state_to_file(cases.basic_state(), p)
    data = bytearray(p.read_bytes())
    assert bytes(data) == _OURS
    if cut:
        del data[pos:]
    else:
        data[pos] = (data[pos] + delta) % 256
    _rewrite_keeping_generation(p, bytes(data))
    with pytest.raises(atomicstore.CorruptionError) as info:
        fj.load_checkpoint(p)
    assert p.name in str(info.value)


def test_a_flipped_byte_in_array_data_names_the_leaf(tmp_path):
    p = tmp_path / "s.fjf"
    fj.save_state_to_file(cases.basic_state(), p)
    data = bytearray(p.read_bytes())
    at = data.index(np.linspace(-1, 1, 12, dtype=np.float32).tobytes()) + 5  # params/dense/kernel's data
    data[at] ^= 0x10
    _rewrite_keeping_generation(p, bytes(data))
    with pytest.raises(atomicstore.ChecksumMismatchError, match="CRC32C") as info:
        fj.load_checkpoint(p)
    assert info.value.leaf == "params/dense/kernel" and info.value.path == "s.fjf"
    fjformer_would_load = fjformer_load(bytes(data))  # fjformer returns the damaged value silently
    assert not np.array_equal(fjformer_would_load["params"]["dense"]["kernel"], cases.basic_state()["params"]
                              ["dense"]["kernel"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(file=st.sampled_from(sorted(n for n in cases.WRITES if n != "empty.fjf")), data=st.data())
def test_fjformer_files_mutated_load_or_raise_our_error(fuzz_dir, file, data):
    """A file fjformer wrote (no checksums) with random damage: it loads (damage inside
    array data cannot be seen) or raises CorruptionError; never another exception."""
    raw = bytearray((FIX / file).read_bytes())
    kind = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
    pos = data.draw(st.integers(0, len(raw) - 1))
    if kind == "flip":
        raw[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "cut":
        del raw[pos:]
    elif kind == "insert":
        raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
    else:
        del raw[pos : pos + data.draw(st.integers(1, 9))]
    p = fuzz_dir / f"m-{secrets.token_hex(4)}.fjf"
    p.write_bytes(bytes(raw))
    try:
        fj.load_checkpoint(p)
    except atomicstore.CorruptionError as exc:
        assert p.name in str(exc)


def test_a_checksum_record_of_another_generation_is_ignored_a_damaged_one_is_not(tmp_path):
    p = tmp_path / "s.fjf"
    fj.save_state_to_file(cases.basic_state(), p)
    p.write_bytes((FIX / "train_state.fjf").read_bytes())  # fjformer itself overwrote it
    assert canon(fj.load_checkpoint(p, target=cases.train_target(), shard_fns=cases.shard_fns())) == EXPECTED[
        "train_target_shard"]
    (tmp_path / ".s.fjf.crc32c.json").write_text("{not json")
    with pytest.raises(atomicstore.CorruptionError, match=r"\.s\.fjf\.crc32c\.json"):
        fj.load_checkpoint(p)


def test_reading_is_streamed_and_writing_copies_no_leaf(tmp_path):
    """24 leaves of 4 MiB: saving allocates no copy of them; loading holds one leaf at a
    time (each turned into a scalar by its shard function)."""
    state = {f"l{i}": np.full(1 << 20, i, np.float32) for i in range(24)}
    tracemalloc.start()
    try:
        fj.save_state_to_file(state, tmp_path / "big.fjf")
        save_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        got = fj.load_checkpoint(tmp_path / "big.fjf", shard_fns={k: lambda x: float(x[0]) for k in state})
        load_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == {k: float(i) for i, k in enumerate(state)}
    assert (tmp_path / "big.fjf").stat().st_size > 96 << 20
    assert save_peak < 8 << 20, save_peak
    assert load_peak < 40 << 20, load_peak  # one 16 MiB read block + one 4 MiB leaf, not 96 MiB
    assert fj.load_checkpoint(tmp_path / "big.fjf", remove_dict_prefix=["none"]) == {}
    whole = fj.load_checkpoint(tmp_path / "big.fjf")
    assert whole["l23"].ctypes.data % 64 == 0 and whole["l23"].flags.writeable
    assert np.array_equal(whole["l23"], state["l23"])


# -- atomicity ---------------------------------------------------------------------------------
def test_readers_see_the_old_file_until_the_new_one_is_committed(tmp_path):
    p = tmp_path / "s.fjf"
    fj.save_state_to_file(cases.train_state(), p)
    old = p.read_bytes()
    seen = []

    def peek(x):
        seen.append(p.read_bytes())
        return x

    fj.save_state_to_file(cases.basic_state(), p, gather_fns={"params": {"dense": {"bias": peek}}})
    assert seen == [old]  # mid-save, the path holds the old file, whole
    assert p.read_bytes() == (FIX / "basic.fjf").read_bytes()

    def fail(x):
        raise RuntimeError("preempted")

    with pytest.raises(RuntimeError, match="preempted"):
        fj.save_state_to_file(cases.train_state(), p, gather_fns={"opt_state": {"1": {"count": fail}}})
    assert p.read_bytes() == (FIX / "basic.fjf").read_bytes()  # nothing of the failed save is visible
    assert canon(fj.load_checkpoint(p)) == EXPECTED["basic"]  # and its checksum record still fits
    assert sorted(x.name for x in tmp_path.iterdir()) == [".atomicstore", ".s.fjf.crc32c.json", "s.fjf"]
    with pytest.raises(atomicstore.CommitConflictError):
        fj.save_state_to_file(cases.train_state(), p, overwrite=False)
    assert p.read_bytes() == (FIX / "basic.fjf").read_bytes()


@pytest.mark.parametrize("writer", ["atomicstore", "fjformer"])
def test_a_file_replaced_while_being_read_is_read_again(writer):
    """Object stores are read in ranges: a file replaced mid-read (by our save, or in
    place by fjformer, leaving no checksum record) must not give a mix of both."""
    url = f"memory://fjrace-{secrets.token_hex(6)}"
    st = atomicstore.open_store(url)
    a = {"first": np.int32(1), "w": np.zeros(5 << 20, np.float32)}  # 20 MiB: past the 16 MiB read block
    b = {"first": np.int32(2), "w": np.ones(5 << 20, np.float32)}

    def write(state: dict) -> None:
        if writer == "atomicstore":
            fj.save_state_to_file(state, f"{url}/s.fjf")
        else:
            st.driver.put("s.fjf", fjformer_bytes(state))

    write(a)
    calls = []

    def replace_once(leaf, key):
        calls.append(key)
        if len(calls) == 1:
            write(b)

    got = fj.load_checkpoint(f"{url}/s.fjf", callback=replace_once)
    assert got["first"] == 2 and np.array_equal(got["w"], b["w"])
    assert calls[0] == ("first",) and calls.count(("first",)) == 2  # read again from the start


# -- fjformer's manager, JSON in place of pickle --------------------------------------------------
def test_checkpoint_manager_save_all_writes_json_never_pickle(tmp_path):
    state = cases.train_state()
    calls = []
    gather = cases.TrainState(step=lambda x: calls.append("step") or x,
                              params={"params": {"w": lambda x: calls.append("w") or x, "b": None}},
                              opt_state=({"mu": None}, {"count": None}))
    mgr = fj.CheckpointManager(tmp_path, float_dtype=None)
    meta = {"loss": np.float32(0.5), "lr": jnp.asarray(1e-3), "hist": np.arange(3), "name": "run"}
    mgr.save_all(state, gather, metadata=meta, dataset={"epoch": 2}, milestone=True)
    assert {p.name for p in tmp_path.iterdir()} == {
        "metadata_11.json", "dataset_11.json", "streaming_state_11", ".streaming_state_11.crc32c.json",
        ".atomicstore"}
    assert fj.load_json(tmp_path / "metadata_11.json") == {"loss": 0.5, "lr": pytest.approx(1e-3), "hist": [0, 1, 2],
                                                           "name": "run"}
    assert fj.load_json(tmp_path / "dataset_11.json") == {"epoch": 2}
    assert (tmp_path / "streaming_state_11").read_bytes() == (FIX / "train_state.fjf").read_bytes()
    assert sorted(calls) == ["step", "w"]
    params_only = fj.CheckpointManager(tmp_path, save_optimizer_state=False)
    params_only.save_all(state, gather)
    got = fj.load_checkpoint(tmp_path / "streaming_params")
    assert got["w"].dtype == ml_dtypes.bfloat16 and set(got) == {"w", "b"}
    assert fj.load_json(tmp_path / "metadata.json") is None
    with pytest.raises(atomicstore.InvalidArgumentError, match="never pickles"):
        mgr.save_pickle({"a": 1}, "x.pkl")
    with pytest.raises(atomicstore.InvalidArgumentError, match="JSON"):
        mgr.save_all(state, gather, metadata={"opaque": object()})
    assert not list(tmp_path.glob("*.pkl"))
    calls.clear()
    off = fj.CheckpointManager(tmp_path / "off", enable=False)
    off.save_checkpoint(state, "never", gather_fns=gather)
    off.save_json({"a": 1}, "never.json")
    assert sorted(calls) == ["step", "w"] and not (tmp_path / "off").exists()  # gathers ran, nothing written
    fj.save_state_to_file(state, os.devnull, gather)
    assert sorted(calls) == ["step", "step", "w", "w"]


def test_shard_fns_callback_and_prefix_edge_cases(tmp_path):
    p = tmp_path / "t.fjf"
    fj.save_state_to_file(cases.train_state(), p)
    seen = []
    got = fj.load_checkpoint(p, callback=lambda leaf, key: seen.append((key, type(leaf).__name__)) or "ignored")
    assert seen[0] == (("step",), "int32") and len(seen) == 5
    assert got["params"]["params"]["w"].shape == (2, 3)  # the callback's result is ignored, as in fjformer
    with pytest.raises(atomicstore.InvalidArgumentError, match="no function for leaf params/params/b"):
        fj.load_checkpoint(p, shard_fns={"step": lambda x: x, "params": {"params": {"w": lambda x: x}}},
                           mismatch_allowed=False)
    with pytest.raises(atomicstore.InvalidArgumentError, match="names the leaf step"):
        fj.load_checkpoint(p, remove_dict_prefix=("step",))
    with pytest.raises(atomicstore.InvalidArgumentError, match="does not fit the target"):
        fj.load_checkpoint(p, target=cases.TrainState(step=0, params={"other": 1}, opt_state=()))
    with pytest.raises(atomicstore.InvalidArgumentError, match="no function for leaf step"):
        fj.save_state_to_file(cases.train_state(), tmp_path / "u.fjf", gather_fns={"params": {}},
                              mismatch_allowed=False)
    assert not (tmp_path / "u.fjf").exists()


@pytest.mark.parametrize("call", [
    lambda d: fj.save_state_to_file({"a": 1}, ""),
    lambda d: fj.save_state_to_file({"a": 1}, None),
    lambda d: fj.save_state_to_file({"a": 1}, d / "bad name!"),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", float_dtype="bf17"),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", float_dtype=object),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", float_dtype=np.str_),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", gather_fns=5),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", gather_fns={"a": 3}),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", verbose="yes"),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", mismatch_allowed=1),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", overwrite=None),
    lambda d: fj.save_state_to_file({"a": 1}, d / "x", storage_options=[("k", 1)]),
    lambda d: fj.save_state_to_file(np.ones(3), d / "x"),
    lambda d: fj.save_state_to_file({"a": object()}, d / "x"),
    lambda d: fj.save_state_to_file({"a": 2**64}, d / "x"),
    lambda d: fj.save_state_to_file({"a": np.array([object()])}, d / "x"),
    lambda d: fj.save_state_to_file({"a": 1}, "s3://bucket-only"),
    lambda d: fj.load_checkpoint(FIX / "basic.fjf", remove_dict_prefix="params"),
    lambda d: fj.load_checkpoint(FIX / "basic.fjf", remove_dict_prefix=[1]),
    lambda d: fj.load_checkpoint(FIX / "basic.fjf", shard_fns={"a": 3}),
    lambda d: fj.load_checkpoint(FIX / "basic.fjf", callback=3),
    lambda d: fj.load_checkpoint(FIX / "basic.fjf", verbose=None),
    lambda d: fj.load_checkpoint(FIX / "basic.fjf", mismatch_allowed="no"),
    lambda d: fj.load_checkpoint(""),
    lambda d: fj.CheckpointManager(d, float_dtype="x"),
    lambda d: fj.CheckpointManager(d, enable="no"),
    lambda d: fj.CheckpointManager(""),
    lambda d: fj.save_json({"a": {1, 2}}, d / "m.json"),
    lambda d: fj.save_json({"a": 1}, d / "m.json", overwrite=1),
], ids=lambda f: str(f.__code__.co_firstlineno))
def test_bad_arguments_raise_invalid_argument_before_writing(tmp_path, call):
    with pytest.raises(atomicstore.InvalidArgumentError):
        call(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name != ".atomicstore"]


def test_missing_files_and_json_errors(tmp_path):
    with pytest.raises(atomicstore.NotFoundError):
        fj.load_checkpoint(tmp_path / "nope.fjf")
    with pytest.raises(atomicstore.NotFoundError):
        fj.load_checkpoint(tmp_path)  # a directory
    assert not (tmp_path / ".atomicstore").exists()  # reading created nothing
    (tmp_path / "m.json").write_bytes(b"\x80not json")
    with pytest.raises(atomicstore.CorruptionError, match="m.json"):
        fj.load_json(tmp_path / "m.json")
    fj.save_json({"x": [1.5, None, "s"], "n": np.int64(3)}, tmp_path / "m.json")
    assert fj.load_json(tmp_path / "m.json") == {"x": [1.5, None, "s"], "n": 3}


def test_a_reader_slower_than_the_writer_gets_a_clear_error_a_local_reader_one_version(tmp_path):
    """A file replaced during every read attempt: after three, PreconditionFailedError
    (not corruption). A local file is read through one open descriptor, so a replacement
    mid-read leaves the reader with one whole version and nothing to read again."""
    url = f"memory://fjrace-{secrets.token_hex(6)}"
    states = [{"first": np.int32(i), "w": np.full(5 << 20, i, np.float32)} for i in range(6)]
    fj.save_state_to_file(states[0], f"{url}/s.fjf")
    n = iter(range(1, 6))

    def replace_each_time(leaf, key):
        if key == ("first",):
            fj.save_state_to_file(states[next(n)], f"{url}/s.fjf", overwrite=True)

    with pytest.raises(atomicstore.PreconditionFailedError, match="replaced three times"):
        fj.load_checkpoint(f"{url}/s.fjf", callback=replace_each_time)

    path = str(tmp_path / "s.fjf")
    fj.save_state_to_file(states[0], path)
    calls = []

    def replace_once(leaf, key):
        calls.append(key)
        if len(calls) == 1:
            fj.save_state_to_file(states[1], path, overwrite=True)

    got = fj.load_checkpoint(path, callback=replace_once)
    assert got["first"] == 0 and np.array_equal(got["w"], states[0]["w"])  # the version opened, whole
    assert calls.count(("first",)) == 1  # not read again
    assert fj.load_checkpoint(path)["first"] == 1


# -- issue 21 row 7: the checksum record is bound to the generation its own commit produced ------
class _PauseAfterCommit(logging.Handler):
    """Holds the thread ``who`` right after its one-file commit (the commit layer's
    "committed <name>" line, logged once the file is visible and before the save goes
    on to its checksum record) until ``resume`` is set: the save is descheduled at that
    exact point, with no sleep."""

    def __init__(self, who: str) -> None:
        super().__init__(logging.INFO)
        self.who = who
        self.arrived = threading.Event()
        self.resume = threading.Event()

    def handle(self, record: logging.LogRecord) -> bool:  # (no handler lock: other threads log on)
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if (threading.current_thread().name == self.who and record.getMessage().startswith("committed ")
                and not self.arrived.is_set()):
            self.arrived.set()
            self.resume.wait(60)


@pytest.mark.parametrize(("kind", "upload"), [("local", "one"), ("s3", "one"), ("gcs", "one"), ("s3", "parts"),
                                              ("gcs", "parts")])
def test_row7_a_save_paused_after_its_commit_never_binds_its_checksums_to_a_later_save(kind, upload, request,
                                                                                        tmp_path):
    """Job A commits the file and is descheduled before writing its checksum record; job
    B saves the same file completely (same size, other values); A resumes. The record
    must describe the generation A's own commit produced (or not be written): the file
    B committed loads, with B's values, and its own record stays (it is still checked).
    ``parts``: the commit is a multipart completion (S3) or a compose (GCS), not one PUT."""
    from conftest import make_backend

    backend = make_backend(kind, request, tmp_path)
    url, opts = backend.url.rstrip("/"), dict(backend.options)
    path = f"{url}/s.fjf" if kind != "local" else os.path.join(url, "s.fjf")
    n = 4096
    if upload == "parts":  # two parts of 5 MiB (S3's minimum), four components of 256 KiB (GCS)
        opts["block_size"], n = (5 << 20, 7 << 18) if kind == "s3" else (1 << 18, 1 << 18)
    a = {"w": np.full(n, 1.0, np.float32), "step": np.int32(1)}
    b = {"w": np.full(n, 2.0, np.float32), "step": np.int32(2)}
    fj.save_state_to_file({"w": np.zeros(n, np.float32), "step": np.int32(0)}, path, storage_options=opts)
    pause = _PauseAfterCommit("job-A")
    commit_log = logging.getLogger("atomicstore.commit")
    old_level = commit_log.level
    commit_log.setLevel(logging.INFO)
    commit_log.addHandler(pause)
    errors: list[BaseException] = []

    def job_a() -> None:
        try:
            fj.save_state_to_file(a, path, storage_options=opts)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=job_a, name="job-A", daemon=True)
    try:
        t.start()
        assert pause.arrived.wait(60), "job A never committed"
        fj.save_state_to_file(b, path, storage_options=opts)  # job B, start to end
    finally:
        pause.resume.set()
        t.join(60)
        commit_log.removeHandler(pause)
        commit_log.setLevel(old_level)
    assert not t.is_alive() and not errors, errors
    got = fj.load_checkpoint(path, storage_options=opts)
    assert got["step"] == 2 and np.array_equal(got["w"], b["w"])
    st = backend.open()
    record = json.loads(st.driver.read(".s.fjf.crc32c.json"))
    assert record["generation"] == st.driver.info("s.fjf").generation  # B's record kept: still checked


# -- issue 21 row 14, for this format: every limit of the reader is refused by the writer ----------
def _nest(depth: int, leaf: Any) -> dict:
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


_KEY_LIMITS = {  # name -> (state at the limit, state one past it, what the refusal names)
    "key path depth": (lambda: _nest(fj.MAX_KEY_DEPTH, np.int32(1)), lambda: _nest(fj.MAX_KEY_DEPTH + 1, np.int32(1)),
                       rf"{fj.MAX_KEY_DEPTH + 1} keys.*at most {fj.MAX_KEY_DEPTH}"),
    "key bytes": (lambda: {"k" * fj.MAX_KEY_BYTES: np.int32(1)}, lambda: {"k" * fj.MAX_KEY_BYTES + "x": np.int32(1)},
                  rf"{fj.MAX_KEY_BYTES + 1} bytes.*at most {fj.MAX_KEY_BYTES}"),
    "key bytes, utf-8": (lambda: {"é" * (fj.MAX_KEY_BYTES // 2): np.int32(1)},
                         lambda: {"k" * (fj.MAX_KEY_BYTES - 1) + "é": np.int32(1)},
                         rf"{fj.MAX_KEY_BYTES + 1} bytes.*at most {fj.MAX_KEY_BYTES}"),
}


@pytest.mark.parametrize("limit", sorted(_KEY_LIMITS))
def test_row14_key_limits_are_one_for_writer_and_reader(tmp_path, limit):
    """A key path as deep, or a key as long, as the reader accepts saves and loads; one
    more and the save refuses up front (InvalidArgumentError naming the size and the
    limit), nothing written. (Both used to be written, then refused by every load.)"""
    at, past, names = _KEY_LIMITS[limit]
    p = tmp_path / "s.fjf"
    fj.save_state_to_file(at(), p)
    assert canon(fj.load_checkpoint(p)) == canon(to_state_dict(at()))
    q = tmp_path / "past.fjf"
    with pytest.raises(atomicstore.InvalidArgumentError, match=names):
        fj.save_state_to_file(past(), q)
    assert not q.exists()


def test_row14_json_files_as_large_as_load_json_reads_and_no_larger(tmp_path):
    """save_json writes what load_json reads back: a document of exactly the limit
    (64 MiB) round-trips; one byte more is refused before anything is written."""
    at = "x" * (fj.MAX_RECORD_BYTES - 2)  # '"' + ... + '"'
    fj.save_json(at, tmp_path / "m.json")
    assert (tmp_path / "m.json").stat().st_size == fj.MAX_RECORD_BYTES
    assert fj.load_json(tmp_path / "m.json") == at
    del at
    with pytest.raises(atomicstore.InvalidArgumentError, match=rf"{fj.MAX_RECORD_BYTES + 1} bytes.*at most"):
        fj.save_json("x" * (fj.MAX_RECORD_BYTES - 1), tmp_path / "n.json")
    assert not (tmp_path / "n.json").exists()


def test_row14_a_checksum_record_past_the_readers_limit_is_not_written(tmp_path, monkeypatch):
    """The checksum record is read whole, up to ``MAX_RECORD_BYTES``; a state with so many
    leaves that its record is larger (about six million at 64 MiB) is saved without one
    (it loads unchecked) instead of with one that makes every load fail. The limit is
    lowered to this state's record size here (six million leaves take minutes): writer and
    reader read the same constant, so at the limit the record is written and used, one
    byte below it is not written and the file loads."""
    state = {f"leaf{i}": np.int32(i) for i in range(50)}
    p = tmp_path / "s.fjf"
    fj.save_state_to_file(state, p)
    size = (tmp_path / ".s.fjf.crc32c.json").stat().st_size
    monkeypatch.setattr(fj, "MAX_RECORD_BYTES", size)
    fj.save_state_to_file(state, p)
    assert (tmp_path / ".s.fjf.crc32c.json").stat().st_size == size
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    _rewrite_keeping_generation(p, bytes(data))
    with pytest.raises(atomicstore.ChecksumMismatchError, match="leaf49"):  # the record is used
        fj.load_checkpoint(p)
    monkeypatch.setattr(fj, "MAX_RECORD_BYTES", size - 1)
    fj.save_state_to_file(state, p)
    st = atomicstore.open_store(tmp_path)
    assert json.loads(st.driver.read(".s.fjf.crc32c.json"))["generation"] != st.driver.info("s.fjf").generation
    assert canon(fj.load_checkpoint(p)) == canon(state)  # (the old record, too large now, is ignored)
