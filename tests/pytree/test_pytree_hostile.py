"""Hostile input: corrupt, truncated, oversized or absurd checkpoints raise the library's
own errors naming the file (and leaf); property and fuzz tests."""

from __future__ import annotations

import random
import struct

import flax.serialization
import hypothesis.extra.numpy as hnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atomicstore
from atomicstore.pytree import INDEX_FILE, STATE_FILE
from atomicstore.pytree.format import parse_index


def legacy(tmp_path, data: bytes, name="ckpt_1"):
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


def restore_err(path, **kw):
    with pytest.raises(atomicstore.AtomicStoreError) as info:
        atomicstore.restore(path, **kw)
    return info.value


def test_truncated_native_state_names_file_and_leaf(tmp_path):
    atomicstore.save(tmp_path / "s" / "t", {"a": np.ones(10), "b": np.arange(100000.0)})
    state = tmp_path / "s" / "t" / STATE_FILE
    state.write_bytes(state.read_bytes()[:-1000])
    err = restore_err(tmp_path / "s" / "t")
    assert isinstance(err, atomicstore.CorruptionError)
    assert err.leaf == "b" and STATE_FILE in str(err)


def test_damaged_index_is_caught_by_the_manifest(tmp_path):
    atomicstore.save(tmp_path / "s" / "i", {"a": np.ones(10)})
    (tmp_path / "s" / "i" / INDEX_FILE).write_bytes(b"garbage, not msgpack")
    err = restore_err(tmp_path / "s" / "i")
    assert isinstance(err, atomicstore.ChecksumMismatchError) and INDEX_FILE in str(err)


@pytest.mark.parametrize("data, what", [
    (b"\xc1", "invalid msgpack type byte"),                                  # wrong magic
    (b"\x81\xa1a\xc6\xff\xff\xff\xff" + b"x" * 10, "past the end"),          # bin of 4 GiB in 19 bytes
    (b"\xdf\xff\xff\xff\xff", "more than the file holds"),                  # map of 2**32-1 entries
    (b"\xdd\xff\xff\xff\xff", "more than the file holds"),                  # array of 2**32-1 items
    (b"\x81\xa1a" * 100_000 + b"\x01", "nesting deeper"),                    # absurdly deep
    (b"\x81\xa1a\xc9\x7f\xff\xff\xff\x01", "past the end"),                 # ext of 2 GiB
    (b"\x81\xa1a\x01\x02", "trailing bytes"),
    (b"", "past the end"),
])
def test_malformed_legacy_files(tmp_path, data, what):
    err = restore_err(legacy(tmp_path, data))
    assert isinstance(err, atomicstore.CorruptionError), repr(err)
    assert what in str(err) and "ckpt_1" in str(err)


def _ext_ndarray(shape, dtype, payload: bytes) -> bytes:
    inner = msgpack.packb((shape, dtype, payload), use_bin_type=True)
    return b"\x81\xa1w" + msgpack.packb(msgpack.ExtType(1, inner))


@pytest.mark.parametrize("shape, dtype, payload, what", [
    ([10**12], "float32", b"\0" * 16, "does not match"),      # declares a terabyte, holds 16 bytes
    ([2], "object", b"\0" * 16, "not a plain array dtype"),
    ([2], "no_such_dtype", b"\0" * 16, "unknown dtype"),
    ([-1], "float32", b"\0" * 4, "invalid shape"),
    ([2], "float32", 5, "not bytes"),
])
def test_malformed_arrays_name_the_leaf(tmp_path, shape, dtype, payload, what):
    err = restore_err(legacy(tmp_path, _ext_ndarray(shape, dtype, payload)))
    assert isinstance(err, atomicstore.CorruptionError)
    assert what in str(err) and "leaf w" in str(err)


def test_index_lying_about_ranges(tmp_path):
    raw = msgpack.packb({"format": "atomicstore.pytree/1", "state_size": 100,
                         "nodes": [[1, ["x"], "nd", "float32", [1000], 0, 4000, 0]]})
    with pytest.raises(atomicstore.CorruptionError, match="outside"):
        parse_index(raw, 100, "idx")
    raw = msgpack.packb({"format": "atomicstore.pytree/1", "state_size": 100,
                         "nodes": [[1, ["x"], "nd", "float32", [10], 0, 4, 0]]})
    with pytest.raises(atomicstore.CorruptionError, match="does not match"):
        parse_index(raw, 100, "idx")


# -- fuzzing ---------------------------------------------------------------------------------
def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if op < 0.5 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.7 and b:
            cut = rng.randrange(len(b))
            b = b[:cut]
        elif op < 0.85:
            pos = rng.randrange(len(b) + 1)
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif len(b) > 4:
            pos = rng.randrange(len(b) - 4)
            b[pos : pos + 4] = struct.pack(">I", rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32)]))
    return bytes(b)


FUZZ_TREE = {
    "params": {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(3, ml_dtypes.bfloat16)},
    "step": 3, "name": "x", "c": 1 + 2j, "s": np.int8(4), "l": [1, {"z": None}], "raw": b"\x00" * 70000,
}


def test_fuzz_legacy_files(tmp_path):
    seed_bytes = flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(FUZZ_TREE))
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for i in range(3000):
        path = legacy(tmp_path, _mutate(rng, seed_bytes), name=f"f{i % 7}")
        try:
            atomicstore.restore(path)
            outcomes["ok"] += 1
        except atomicstore.AtomicStoreError:
            outcomes["error"] += 1
    assert outcomes["error"] > 1000, outcomes  # most mutations are caught...
    print(f"\nfuzzed 3000 legacy files: {outcomes}")  # ...and nothing else was ever raised


def test_fuzz_native_index_and_state(tmp_path):
    atomicstore.save(tmp_path / "s" / "seed", FUZZ_TREE)
    index = (tmp_path / "s" / "seed" / INDEX_FILE).read_bytes()
    state_size = (tmp_path / "s" / "seed" / STATE_FILE).stat().st_size
    rng = random.Random(99)
    caught = 0
    for _ in range(2000):
        try:
            parse_index(_mutate(rng, index), state_size, "index")
        except atomicstore.CorruptionError:
            caught += 1
    assert caught > 500
    # damaged state bytes: every leaf is checked against its CRC32C
    state_path = tmp_path / "s" / "seed" / STATE_FILE
    good = state_path.read_bytes()
    for _ in range(300):
        b = bytearray(good)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        state_path.write_bytes(bytes(b))
        try:
            out = atomicstore.restore(tmp_path / "s" / "seed")
        except atomicstore.CorruptionError as exc:
            assert exc.leaf or exc.path
            continue
        # a flip in framing bytes that no leaf reads leaves every leaf intact
        assert out["params"]["w"].tobytes() == FUZZ_TREE["params"]["w"].tobytes()
        assert out["raw"] == FUZZ_TREE["raw"]


# -- property: random trees round-trip bit-identically ---------------------------------------
DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64, np.uint8,
          np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128,
          ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
                          elements=st.integers(0, 1) if np.dtype(dt).kind == "b" else None)
    if dt not in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2) else
    hnp.arrays(np.dtype(f"u{np.dtype(dt).itemsize}"), hnp.array_shapes(min_dims=0, max_dims=2)).map(
        lambda a, dt=dt: a.view(dt))
)
scalars = st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False), st.booleans(),
                    st.text(max_size=20), st.binary(max_size=20), st.none(),
                    st.complex_numbers(allow_nan=False, allow_infinity=False))
keys = st.one_of(st.text(max_size=8), st.binary(max_size=4))
trees = st.recursive(
    st.one_of(arrays, scalars),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4),
                               st.tuples(children, children)),
    max_leaves=12,
)


def _same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    return type(a) is type(b) and a == b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees)
def test_random_trees_round_trip(tree):
    import secrets

    url = f"memory://prop-{secrets.token_hex(6)}/t"
    atomicstore.save(url, tree)
    back = atomicstore.restore(url)
    assert _same(tree, back), (tree, back)


# -- hostile dtype strings (issue 11, row 11) -------------------------------------------------
#: each must be refused as data: no SyntaxError, ValueError, UnicodeDecodeError or TypeError
HOSTILE_DTYPES = ["(,)f4", "(2**3,)f4", "f4,f4", "V8", "O", "<U5", b"\xff\xfe", 5, None, ["f4"],
                  "float32 ", "a5", "S5", "void", "datetime64[", "f4" * 40]


def _committed(st, name: str, files: dict[str, bytes]) -> None:
    """Commit ``files`` as checkpoint ``name`` (a hostile writer whose manifest is right)."""
    txn = st.transaction(name)
    for path, data in files.items():
        txn.write_bytes(path, data)
    txn.commit()


@pytest.mark.parametrize("dtype", HOSTILE_DTYPES, ids=repr)
def test_hostile_dtype_in_the_index_names_file_and_leaf(tmp_path, dtype):
    atomicstore.save(tmp_path / "s" / "good", {"w": np.zeros(2, np.float32)})
    good = tmp_path / "s" / "good"
    doc = msgpack.unpackb((good / INDEX_FILE).read_bytes(), raw=False)
    node = next(n for n in doc["nodes"] if n[0] == 1)
    node[3] = dtype
    st = atomicstore.open_store(str(tmp_path / "s"))
    _committed(st, "bad", {STATE_FILE: (good / STATE_FILE).read_bytes(),
                           INDEX_FILE: msgpack.packb(doc, use_bin_type=True)})
    err = restore_err(tmp_path / "s" / "bad", target={"w": np.zeros(2, np.float32)})
    assert type(err) is atomicstore.CorruptionError, repr(err)
    assert err.path == INDEX_FILE and err.leaf == "w", (err.path, err.leaf, err)
    assert INDEX_FILE in str(err) and "leaf w" in str(err)


@pytest.mark.parametrize("dtype", HOSTILE_DTYPES, ids=repr)
def test_hostile_dtype_in_a_legacy_file_names_file_and_leaf(tmp_path, dtype):
    err = restore_err(legacy(tmp_path, _ext_ndarray([2], dtype, b"\0" * 8)))
    assert type(err) is atomicstore.CorruptionError, repr(err)
    assert "ckpt_1" in err.path and err.leaf == "w", (err.path, err.leaf, err)
    assert "ckpt_1" in str(err) and "leaf w" in str(err)


def test_non_utf8_dtype_strings(tmp_path):
    """A msgpack *str* (not bin) that is not UTF-8: a legacy file names the leaf; in an
    index msgpack cannot decode the document at all, so the index file is named."""
    inner = b"\x93\x91\x02\xa2\xff\xfe" + msgpack.packb(b"\0" * 8, use_bin_type=True)
    err = restore_err(legacy(tmp_path, b"\x81\xa1w" + msgpack.packb(msgpack.ExtType(1, inner))))
    assert type(err) is atomicstore.CorruptionError and err.leaf == "w" and "ckpt_1" in err.path
    raw = msgpack.packb({"format": "atomicstore.pytree/1", "state_size": 8,
                         "nodes": [[1, ["w"], "nd", "f4", [2], 0, 8, 0]]}).replace(b"\xa2f4", b"\xa2\xff\xfe")
    with pytest.raises(atomicstore.CorruptionError) as info:
        parse_index(raw, 8, "idx")
    assert info.value.path == INDEX_FILE


@pytest.mark.parametrize("dtype", [d for d in HOSTILE_DTYPES if not isinstance(d, bytes)], ids=repr)
def test_hostile_dtype_in_arrays_json_names_file_and_leaf(dtype):
    import json
    import secrets

    from atomicstore.compat.flax import ARRAYS_FILE, ARRAYS_FORMAT, gda_arrays

    st = atomicstore.open_store(f"memory://hostile-{secrets.token_hex(6)}")
    meta = {"format": ARRAYS_FORMAT, "arrays": [{"key": "w", "dtype": dtype, "shape": [2], "shards": []}]}
    _committed(st, "ck_gda", {ARRAYS_FILE: json.dumps(meta).encode()})
    with pytest.raises(atomicstore.AtomicStoreError) as info:
        gda_arrays(st, "ck", threads=1)
    err = info.value
    assert type(err) is atomicstore.CorruptionError, repr(err)
    assert err.path == ARRAYS_FILE and err.leaf == "w" and ARRAYS_FILE in str(err)


def test_every_dtype_the_library_writes_still_parses():
    from atomicstore.pytree.dtypes import parse_dtype

    written = [*DTYPES, ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float8_e4m3b11fnuz, "datetime64[s]",
               "timedelta64[ns]"]
    for dt in written:
        name = np.dtype(dt).name
        assert parse_dtype(name, path="p", leaf="l") == np.dtype(dt)
        assert parse_dtype(name.encode(), path="p", leaf="l") == np.dtype(dt)
    assert parse_dtype(">i8", path="p", leaf=("a", 1)) == np.dtype(">i8")
    assert parse_dtype("|b1", path="p", leaf="l") == np.dtype(bool)
    with pytest.raises(atomicstore.CorruptionError, match=r"^f leaf a/1: ") as info:
        parse_dtype("O", path="p", leaf=("a", 1), where="f")
    assert info.value.path == "p" and info.value.leaf == "a/1"


def _with_index(tmp_path, mutate):
    """A committed checkpoint whose index.msgpack is ``mutate(valid index)``: the manifest
    matches its bytes, so only the index parser stands between it and the caller."""
    d = str(tmp_path / "ix")
    st = atomicstore.open_store(d)
    atomicstore.save(f"{d}/good", {"lst": [1, 2], "w": np.ones(2, np.float32)})
    state = st.read_bytes("good", "state.msgpack")
    doc = msgpack.unpackb(st.read_bytes("good", "index.msgpack"), raw=False, strict_map_key=False)
    with st.transaction("bad") as t:
        t.write_bytes("state.msgpack", state)
        t.write_bytes("index.msgpack", msgpack.packb(mutate(doc), use_bin_type=True))
    return d, st


@pytest.mark.parametrize(
    "mutate",
    [
        lambda doc: {**doc, "nodes": doc["nodes"] + [[1]]},  # a leaf node with no path
        lambda doc: {**doc, "nodes": doc["nodes"] + [[1, ["x"]]]},  # a leaf node with no kind
        lambda doc: {
            **doc,
            "nodes": [n for n in doc["nodes"] if not (n[0] == 0 and n[1] == [])],
        },  # no root
        lambda doc: {**doc, "nodes": doc["nodes"] + [doc["nodes"][-1]]},  # a leaf declared twice
    ],
    ids=["short-leaf", "no-kind", "orphan-container", "twice"],
)
def test_structurally_hostile_index_is_corruption(tmp_path, mutate):
    d, st = _with_index(tmp_path, mutate)
    st.verify("bad")
    with pytest.raises(atomicstore.CorruptionError, match="index"):
        atomicstore.restore(
            f"{d}/bad", store=st, target={"lst": [0, 0], "w": np.zeros(2, np.float32)}
        )


@pytest.mark.parametrize("byte", [0x91, 0x93])  # a complex's pair as an array of 1 or of 3
def test_a_damaged_complex_in_a_legacy_file_is_corruption(tmp_path, byte):
    from atomicstore.compat import flax as ck

    d = str(tmp_path)
    ck.save_checkpoint(d, {"c": complex(1, 2), "x": 1}, 0)
    st = atomicstore.open_store(d)
    raw = bytearray(st.driver.read("checkpoint_0"))
    raw[raw.index(bytes([0xC7, 0x13, 0x02, 0x92])) + 3] = byte
    st.driver.put("checkpoint_1", bytes(raw))
    with pytest.raises(atomicstore.CorruptionError, match="complex"):
        atomicstore.restore(f"{d}/checkpoint_1")
    with pytest.raises(atomicstore.CorruptionError):
        ck.restore_checkpoint(d, None, step=1)
