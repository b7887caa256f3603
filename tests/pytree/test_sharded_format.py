"""Arrays sharded across processes in the native format, on checkpoints built by hand
(no jax.distributed): single-process restore, hostile indexes, damaged shard files,
ranged reads verified per block.

:func:`build` commits a checkpoint the way ``PreparedSave.write_state`` lays it out
(``docs/format.md``, "Arrays sharded across processes"): ``state.msgpack`` with the
placeholder string for each sharded leaf, one raw C-order file per shard under
``shards/<n>/``, and ``index.msgpack`` listing them with their CRC32C and block CRC32Cs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.serialization
import google_crc32c
import jax
import msgpack
import numpy as np
import pytest

import atomicstore
from atomicstore.pytree.format import (
    INDEX_FILE,
    INDEX_FORMAT,
    SHARD_BLOCK,
    SHARDED_PH,
    STATE_FILE,
    parse_index,
    shard_file,
)
from atomicstore.pytree.sharded import ShardedLeaf, ShardReader
from atomicstore.pytree.tree import path_str
from atomicstore.pytree.writer import StateWriter

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape) of one shard


class Sharded:
    """In a tree given to :func:`build`: an array stored as the shards ``boxes``."""

    def __init__(self, array: np.ndarray, boxes: list[Box]) -> None:
        self.array, self.boxes = array, boxes


def build(st: atomicstore.Store, name: str, tree: Any, *, block: int = SHARD_BLOCK,
          mutate: Callable[[dict, dict[str, bytes]], None] | None = None) -> None:
    """Commit checkpoint ``name`` of ``st`` holding ``tree`` (nested dicts); each
    :class:`Sharded` leaf is written as shard files. ``mutate(index_doc, files)`` may
    damage the index or the shard files (file -> bytes) before they are written."""
    sharded: dict[int, Sharded] = {}

    def swap(node: Any, path: tuple) -> Any:
        if isinstance(node, dict):
            return {k: swap(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, Sharded):
            leaf = ShardedLeaf(len(sharded), path_str(path), node.array.dtype, node.array.shape)
            sharded[leaf.n] = node
            return leaf
        return node

    writer = StateWriter(swap(tree, ()))
    with st.transaction(name) as txn:
        with txn.open(STATE_FILE) as f:
            state_size = writer.write(f)
        files: dict[str, bytes] = {}
        nodes = []
        for node in writer.index:
            if node[0] == 1 and node[2] == "sh":
                n = node[5].n
                shards = []
                for start, shape in sharded[n].boxes:
                    region = tuple(slice(a, a + k) for a, k in zip(start, shape, strict=True))
                    data = np.ascontiguousarray(sharded[n].array[region]).tobytes()
                    file = shard_file(n, start)
                    files[file] = data
                    shards.append([file, list(start), list(shape), google_crc32c.value(data),
                                   [google_crc32c.value(data[i : i + block]) for i in range(0, len(data), block)]])
                node = [*node[:5], shards]
            nodes.append(node)
        doc = {"format": INDEX_FORMAT, "state_size": state_size, "str_keys": True, "nodes": nodes,
               "shard_block": block}
        if mutate is not None:
            mutate(doc, files)
        for file, data in files.items():
            txn.write_bytes(file, data)
        txn.write_bytes(INDEX_FILE, msgpack.packb(doc, use_bin_type=True))


W = np.arange(48, dtype=np.float32).reshape(8, 6)
ROWS: list[Box] = [((0, 0), (4, 6)), ((4, 0), (4, 6))]           # two shards of 4 rows
GRID: list[Box] = [((r, c), (4, 3)) for r in (0, 4) for c in (0, 3)]  # 2 x 2 blocks


def tree_of(boxes: list[Box] = ROWS, w: np.ndarray = W) -> dict:
    return {"params": {"w": Sharded(w, boxes), "b": np.ones(3, np.float32)}, "step": 7}


@pytest.fixture
def store(tmp_path) -> atomicstore.Store:
    return atomicstore.open_store(str(tmp_path / "store"))


def shard_path(st: atomicstore.Store, name: str, file: str) -> Path:
    return Path(st.url.removeprefix("file://")) / name / file


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


# -- single-process restore ------------------------------------------------------------------
@pytest.mark.parametrize("boxes", [ROWS, GRID, [((0, 0), (8, 6))]], ids=["rows", "grid", "one"])
def test_restore_in_one_process_returns_the_full_numpy_array(store, boxes):
    build(store, "ck", tree_of(boxes))
    got = atomicstore.restore(f"{store.url}/ck")
    assert isinstance(got["params"]["w"], np.ndarray) and got["params"]["w"].dtype == np.float32
    assert np.array_equal(got["params"]["w"], W)
    assert np.array_equal(got["params"]["b"], np.ones(3, np.float32)) and got["step"] == 7
    files = set(store.open("ck").files)
    assert {shard_file(0, start) for start, _ in boxes} <= files


def test_layout_on_disk_and_flax_sees_the_placeholder(store):
    build(store, "ck", tree_of(GRID))
    d = shard_path(store, "ck", "")
    assert sorted(str(p.relative_to(d)) for p in d.rglob("*.bin")) == [
        "shards/0/0_0.bin", "shards/0/0_3.bin", "shards/0/4_0.bin", "shards/0/4_3.bin"]
    # each file: the raw C-order bytes of its block of the global array
    assert (d / "shards/0/4_3.bin").read_bytes() == np.ascontiguousarray(W[4:8, 3:6]).tobytes()
    state = flax.serialization.msgpack_restore((d / STATE_FILE).read_bytes())
    assert state["params"]["w"] == SHARDED_PH + "params/w" == "//atomicstore.sharded:params/w"
    assert np.array_equal(state["params"]["b"], np.ones(3, np.float32))
    doc = msgpack.unpackb((d / INDEX_FILE).read_bytes(), raw=False)
    node = next(n for n in doc["nodes"] if n[1] == ["params", "w"])
    assert node[:5] == [1, ["params", "w"], "sh", "float32", [8, 6]] and len(node[5]) == 4
    assert doc["shard_block"] == SHARD_BLOCK


def test_restore_onto_a_single_device_sharding_or_numpy_target(store):
    build(store, "ck", tree_of(GRID))
    dev = jax.devices()[0]
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 6), np.float32,
                                                   sharding=jax.sharding.SingleDeviceSharding(dev)),
                         "b": np.zeros(3, np.float32)}, "step": 0}
    got = atomicstore.restore(f"{store.url}/ck", target=target)
    w = got["params"]["w"]
    assert isinstance(w, jax.Array) and w.shape == (8, 6) and w.dtype == np.float32
    assert w.sharding.device_set == {dev} and np.array_equal(np.asarray(w), W)
    got = atomicstore.restore(f"{store.url}/ck", target={"params": {"w": np.zeros((8, 6), np.float32)}},
                              subtree=())
    assert isinstance(got["params"]["w"], np.ndarray) and np.array_equal(got["params"]["w"], W)
    # a jax.Array target: the same sharding back
    arr = jax.device_put(np.zeros((8, 6), np.float32), dev)
    got = atomicstore.restore(f"{store.url}/ck", target={"params": {"w": arr}})
    assert isinstance(got["params"]["w"], jax.Array) and np.array_equal(np.asarray(got["params"]["w"]), W)


def test_a_target_of_another_shape_or_dtype_is_refused(store):
    build(store, "ck", tree_of())
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(atomicstore.InvalidArgumentError, match="shape"):
        atomicstore.restore(f"{store.url}/ck",
                            target={"params": {"w": jax.ShapeDtypeStruct((6, 8), np.float32, sharding=sharding)}})
    with pytest.raises(atomicstore.CorruptionError, match="float64"):
        atomicstore.restore(f"{store.url}/ck", target={"params": {"w": np.zeros((8, 6), np.float64)}})


def test_subtree_restore_reads_the_sharded_leaf(store):
    build(store, "ck", tree_of(GRID))
    params = atomicstore.restore(f"{store.url}/ck", subtree="params")
    assert set(params) == {"w", "b"} and np.array_equal(params["w"], W)
    assert np.array_equal(atomicstore.restore(f"{store.url}/ck", subtree="params/w"), W)
    # a subtree without the sharded leaf never opens a shard file
    build(store, "ck2", {"params": {"w": Sharded(W, ROWS)}, "other": {"x": np.arange(3)}},
          mutate=lambda doc, files: files.update({k: b"\xff" * len(v) for k, v in files.items()}))
    assert np.array_equal(atomicstore.restore(f"{store.url}/ck2", subtree="other")["x"], np.arange(3))


def test_shard_fns_and_zero_size_and_scalar_sharded_arrays(store):
    z = np.zeros((0, 4), np.int32)
    s = np.array(3.5, np.float64)
    build(store, "ck", {"z": Sharded(z, [((0, 0), (0, 4))]), "s": Sharded(s, [((), ())]),
                        "w": Sharded(W, GRID)})
    got = atomicstore.restore(f"{store.url}/ck", shard_fns=lambda path, v: ("seen", v))
    assert got["z"][0] == "seen" and got["z"][1].shape == (0, 4) and got["z"][1].dtype == np.int32
    assert got["s"][1].shape == () and got["s"][1] == 3.5
    assert np.array_equal(got["w"][1], W)


def test_bfloat16_shards(store):
    import ml_dtypes

    w = (np.arange(64, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16).reshape(8, 8)
    build(store, "ck", {"w": Sharded(w, [((0, 0), (8, 4)), ((0, 4), (8, 4))])})
    got = atomicstore.restore(f"{store.url}/ck")["w"]
    assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.view(np.uint16), w.view(np.uint16))


# -- hostile indexes -------------------------------------------------------------------------
def shards_of(doc: dict, path: list) -> list:
    return next(n for n in doc["nodes"] if n[0] == 1 and n[1] == path)[5]


def w_shards(doc: dict) -> list:
    return shards_of(doc, ["params", "w"])


def _set(i: int, value: Any, k: int = 0) -> Callable[[dict, dict], None]:
    """Set field ``i`` of shard ``k`` of params/w."""
    def mutate(doc: dict, files: dict) -> None:
        w_shards(doc)[k][i] = value
    return mutate


def _truncate(doc: dict, files: dict) -> None:
    f = w_shards(doc)[1][0]
    files[f] = files[f][:-4]


def _unlisted(doc: dict, files: dict) -> None:
    del files[w_shards(doc)[1][0]]


def _extra_block(doc: dict, files: dict) -> None:
    w_shards(doc)[0][4].append(0)


def _twice(doc: dict, files: dict) -> None:
    sh = w_shards(doc)
    sh[1] = list(sh[0])


# check_shards: the shards must tile the array exactly, with files of the right sizes
TILING = [
    ("overlap", [((0, 0), (4, 6)), ((2, 0), (4, 6))], None, "overlap"),
    ("hole", [((0, 0), (4, 6))], None, "cover 24 of 48 elements"),
    ("hole-2d", GRID[:3], None, "cover 36 of 48 elements"),
    ("outside", [((0, 0), (4, 6)), ((6, 0), (4, 6))], None, "outside its array"),
    ("outside-axis1", [((0, 0), (8, 3)), ((0, 4), (8, 3))], None, "outside its array"),
    ("wrong-file-size", ROWS, _truncate, "does not have the size of its shape"),
    ("not-in-manifest", ROWS, _unlisted, "not in the manifest"),
    ("block-count", ROWS, _extra_block, "2 block checksums for 96 bytes"),
    ("listed-twice", ROWS, _twice, "listed twice"),
    ("wrong-rank", ROWS, _set(1, [0]), "wrong rank"),
]

# parse_shards: malformed entries, bad checksums, file names escaping the checkpoint
MALFORMED = [
    ("crc-str", _set(3, "1234"), "bad CRC32C"),
    ("crc-negative", _set(3, -1), "bad CRC32C"),
    ("crc-too-big", _set(3, 2**32), "bad CRC32C"),
    ("crc-nil", _set(3, None), "bad CRC32C"),
    ("block-crc-str", _set(4, ["x"]), "bad block checksums"),
    ("block-crc-too-big", _set(4, [2**40]), "bad block checksums"),
    ("blocks-not-a-list", _set(4, 5), "bad block checksums"),
    ("dotdot", _set(0, "../../outside.bin"), "invalid component"),
    ("dotdot-inside", _set(0, "shards/../../x.bin"), "invalid component"),
    ("absolute", _set(0, "/etc/passwd"), "must be relative"),
    ("backslash", _set(0, "shards\\0\\0_0.bin"), "invalid component"),
    ("file-not-str", _set(0, 7), "not a string"),
    ("negative-start", _set(1, [-4, 0]), "bad dimension or offset"),
    ("float-shape", _set(2, [4.0, 6]), "bad dimension or offset"),
    ("short-entry", lambda doc, files: w_shards(doc)[0].pop(), "malformed shard"),
    ("not-a-list", lambda doc, files: next(n for n in doc["nodes"] if n[1] == ["params", "w"]).__setitem__(5, {}),
     "shards is not a list"),
    ("block-size-0", lambda doc, files: doc.__setitem__("shard_block", 0), "bad shard block size"),
    ("block-size-str", lambda doc, files: doc.__setitem__("shard_block", "8M"), "bad shard block size"),
]


def _hostile(store: atomicstore.Store, boxes: list[Box], mutate: Any) -> atomicstore.CorruptionError:
    build(store, "ck", tree_of(boxes), mutate=mutate)
    with pytest.raises(atomicstore.CorruptionError) as info:
        atomicstore.restore(f"{store.url}/ck")
    return info.value


@pytest.mark.parametrize("boxes, mutate, what", [t[1:] for t in TILING], ids=[t[0] for t in TILING])
def test_shards_that_do_not_tile_the_array_are_refused(store, boxes, mutate, what):
    err = _hostile(store, boxes, mutate)
    assert what in str(err), err
    assert err.path == INDEX_FILE and INDEX_FILE in str(err)
    assert err.leaf == "params/w" and "params/w" in str(err)
    # the same with a target (the per-leaf path) and with a subtree
    with pytest.raises(atomicstore.CorruptionError, match=what):
        atomicstore.restore(f"{store.url}/ck", target={"params": {"w": np.zeros((8, 6), np.float32)}})
    with pytest.raises(atomicstore.CorruptionError, match=what):
        atomicstore.restore(f"{store.url}/ck", subtree="params")


@pytest.mark.parametrize("mutate, what", [t[1:] for t in MALFORMED], ids=[t[0] for t in MALFORMED])
def test_malformed_shard_entries_are_refused_naming_the_index(store, mutate, what):
    err = _hostile(store, ROWS, mutate)
    assert what in str(err), err
    assert err.path == INDEX_FILE and INDEX_FILE in str(err)


@pytest.mark.parametrize("mutate, what", [t[1:] for t in MALFORMED], ids=[t[0] for t in MALFORMED])
def test_malformed_shard_entries_name_the_leaf(store, mutate, what):
    err = _hostile(store, ROWS, mutate)
    assert err.leaf == "params/w" and "params/w" in str(err)


def test_a_doubled_element_and_a_hole_are_found_among_thousands_of_shards(store):
    """Element counts that add up do not make a tiling: 4100 one-element shards where the
    last element is missing and the first is stored twice must be refused (not restored
    with uninitialised memory in the hole), and quickly."""
    n = 4100
    a = np.arange(n, dtype=np.int64) + 1000

    def mutate(doc, files):
        sh = next(x for x in doc["nodes"] if x[0] == 1 and x[2] == "sh")[5]
        del files[sh[-1][0]]
        dup = list(sh[0])
        dup[0] = "shards/0/dup.bin"
        files["shards/0/dup.bin"] = files[sh[0][0]]
        sh[-1] = dup

    build(store, "ck", {"w": Sharded(a, [((i,), (1,)) for i in range(n)])}, mutate=mutate)
    t0 = time.monotonic()
    with pytest.raises(atomicstore.CorruptionError, match="overlap") as info:
        atomicstore.restore(f"{store.url}/ck")
    assert info.value.path == INDEX_FILE and info.value.leaf == "w"
    assert time.monotonic() - t0 < 10


def test_a_column_sharding_of_thousands_of_shards_is_checked_in_linear_time(store):
    n = 4096
    a = np.arange(2 * n, dtype=np.int32).reshape(2, n)
    build(store, "cols", {"w": Sharded(a, [((0, i), (2, 1)) for i in range(n)])})
    t0 = time.monotonic()
    assert np.array_equal(atomicstore.restore(f"{store.url}/cols")["w"], a)
    assert time.monotonic() - t0 < 20  # was 13.8 s for the index check alone (quadratic)


def test_a_path_traversal_never_reads_outside_the_checkpoint(store, tmp_path):
    secret = tmp_path / "store" / "secret.bin"
    secret.write_bytes(W[4:].tobytes())  # what the shard would need, next to the checkpoint
    err = _hostile(store, ROWS, _set(0, "../secret.bin", 1))
    assert err.path == INDEX_FILE and "invalid component" in str(err)


def test_parse_index_refuses_a_sharded_leaf_without_sizes(store):
    build(store, "ck", tree_of())
    ck = store.open("ck")
    raw = ck.read_bytes(INDEX_FILE)
    with pytest.raises(atomicstore.CorruptionError) as info:
        parse_index(raw, ck.files[STATE_FILE].size, "here")
    assert info.value.path == INDEX_FILE and "sharded" in str(info.value)
    idx = parse_index(raw, ck.files[STATE_FILE].size, "here",
                      sizes=lambda f: ck.files[f].size if f in ck.files else None)
    lf = idx.leaves[("params", "w")]
    assert lf.kind == "sh" and lf.shape == (8, 6) and lf.nbytes == 192
    assert [(s.file, s.start, s.shape, s.block) for s in lf.value] == [
        ("shards/0/0_0.bin", (0, 0), (4, 6), SHARD_BLOCK), ("shards/0/4_0.bin", (4, 0), (4, 6), SHARD_BLOCK)]


# -- damaged shard files ----------------------------------------------------------------------
def test_a_flipped_byte_in_a_shard_names_the_file_and_leaf(store):
    build(store, "ck", tree_of(GRID))
    flip(shard_path(store, "ck", "shards/0/4_3.bin"), 5)
    for kw in ({}, {"subtree": "params"}, {"target": {"params": {"w": np.zeros((8, 6), np.float32)}}},
               {"target": {"params": {"w": jax.ShapeDtypeStruct(
                   (8, 6), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}}}):
        with pytest.raises(atomicstore.ChecksumMismatchError) as info:
            atomicstore.restore(f"{store.url}/ck", **kw)
        err = info.value
        assert err.path == "shards/0/4_3.bin" and "shards/0/4_3.bin" in str(err), kw
        assert err.leaf == "params/w" and "params/w" in str(err), kw
    # the leaves of the state file are unaffected
    assert atomicstore.restore(f"{store.url}/ck", subtree="params/b").shape == (3,)
    with pytest.raises(atomicstore.ChecksumMismatchError, match="4_3.bin"):
        store.verify("ck")


def _reader(store: atomicstore.Store, name: str) -> tuple[ShardReader, list]:
    """A ShardReader of params/w, and the (file, start, length) of every ranged read."""
    ck = store.open(name)
    idx = parse_index(ck.read_bytes(INDEX_FILE), ck.files[STATE_FILE].size, ck.where(INDEX_FILE),
                      sizes=lambda f: ck.files[f].size if f in ck.files else None)
    lf = idx.leaves[("params", "w")]
    reads: list = []
    real = ck.read_range_into

    def spy(path: str, start: int, out: Any) -> None:
        reads.append((path, start, memoryview(out).nbytes))
        real(path, start, out)

    ck.read_range_into = spy  # type: ignore[method-assign]
    assert lf.dtype is not None
    return ShardReader(ck, "params/w", lf.dtype, lf.shape, list(lf.value), threads=1), reads


def test_a_ranged_read_fetches_and_verifies_only_the_blocks_it_needs(store):
    # 16-byte blocks: a shard of 4 rows x 6 float32 (96 bytes) has 6 blocks, a row is 24 bytes
    build(store, "ck", tree_of(ROWS), block=16)
    reader, reads = _reader(store, "ck")
    (got,) = reader.read([((5, 6), (0, 6))])  # global row 5: row 1 of the second shard
    assert np.array_equal(got, W[5:6])
    assert reads == [("shards/0/4_0.bin", 16, 32)]  # bytes [24, 48) lie in blocks 1 and 2
    # a flipped byte in a block the region does not need goes unnoticed by that read ...
    flip(shard_path(store, "ck", "shards/0/4_0.bin"), 80)  # block 5: global row 7
    reader, _ = _reader(store, "ck")
    assert np.array_equal(reader.read([((5, 6), (0, 6))])[0], W[5:6])
    assert np.array_equal(reader.read([((0, 4), (2, 4))])[0], W[0:4, 2:4])  # other shard only
    # ... and is caught by any read that does need it, naming the file, block and leaf
    for region in (((7, 8), (0, 6)), ((6, 8), (1, 2)), ((0, 8), (0, 6))):
        with pytest.raises(atomicstore.ChecksumMismatchError) as info:
            reader.read([region])
        err = info.value
        assert err.path == "shards/0/4_0.bin" and err.leaf == "params/w", region
        assert "shards/0/4_0.bin" in str(err) and "block 5" in str(err) and "params/w" in str(err)
    with pytest.raises(atomicstore.ChecksumMismatchError, match="block 5"):
        atomicstore.restore(f"{store.url}/ck")


def test_a_ranged_read_of_a_big_shard_with_the_real_block_size(store):
    rows, cols = 2100, 2048  # 8 KiB rows: a 17.2 MB shard, 3 blocks of 8 MiB (1024 rows each)
    big = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    build(store, "ck", {"params": {"w": Sharded(big, [((0, 0), (rows, cols))])}})
    flip(shard_path(store, "ck", "shards/0/0_0.bin"), 10 * cols * 4 + 3)  # row 10: block 0
    reader, reads = _reader(store, "ck")
    (got,) = reader.read([((1500, 1600), (0, cols))])  # block 1 only
    assert np.array_equal(got, big[1500:1600])
    assert reads == [("shards/0/0_0.bin", SHARD_BLOCK, SHARD_BLOCK)]
    with pytest.raises(atomicstore.ChecksumMismatchError) as info:
        reader.read([((0, 20), (0, 8))])
    assert info.value.path == "shards/0/0_0.bin" and info.value.leaf == "params/w" and "block 0" in str(info.value)
    with pytest.raises(atomicstore.ChecksumMismatchError, match="block 0 of array params/w"):
        atomicstore.restore(f"{store.url}/ck")


RESHARD = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import atomicstore
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    url, spec = sys.argv[1], sys.argv[2]
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = NamedSharding(mesh, P(*json.loads(spec)))
    try:
        got = atomicstore.restore(url, target={"w": jax.ShapeDtypeStruct((8, 6), np.float32, sharding=sharding)})
    except atomicstore.ChecksumMismatchError as exc:
        print(json.dumps({"error": type(exc).__name__, "path": exc.path, "leaf": exc.leaf, "msg": str(exc)}))
    else:
        w = got["w"]
        print(json.dumps({"value": np.asarray(w).tolist(), "devices": len(w.sharding.device_set),
                          "shards": [[list(s.index[0].indices(8)[:2]), list(s.index[1].indices(6)[:2])]
                                     for s in w.addressable_shards]}))
""")


def test_resharding_onto_two_devices_reads_parts_of_shards(store, tmp_path):
    """One process with two CPU devices: saved as rows [0:2] and [2:8], restored as rows
    [0:4] / [4:8] and as columns; each device region is cut from the shards it overlaps."""
    build(store, "ck", {"w": Sharded(W, [((0, 0), (2, 6)), ((2, 0), (6, 6))])}, block=16)
    script = tmp_path / "reshard.py"
    script.write_text(RESHARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}

    def run(spec: list) -> dict:
        out = subprocess.run([sys.executable, str(script), f"{store.url}/ck", json.dumps(spec)],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    for spec, boxes in ((["x", None], [[[0, 4], [0, 6]], [[4, 8], [0, 6]]]),
                        ([None, "x"], [[[0, 8], [0, 3]], [[0, 8], [3, 6]]])):
        got = run(spec)
        assert got["devices"] == 2 and sorted(got["shards"]) == boxes, got
        assert np.array_equal(np.array(got["value"], np.float32), W)
    flip(shard_path(store, "ck", "shards/0/2_0.bin"), 130)  # row 7, needed by the second device
    got = run(["x", None])
    assert got["error"] == "ChecksumMismatchError" and got["path"] == "shards/0/2_0.bin"
    assert got["leaf"] == "w" and "block 8" in got["msg"]


def test_restore_buffers_are_aligned_so_a_cpu_device_aliases_them():
    """jax aliases a host buffer for a CPU device only when it is 64-byte aligned, and
    copies it otherwise (a second copy of every restored array); the reader allocates
    with ``aligned_empty`` for that reason."""
    import jax

    from atomicstore.pytree.format import aligned_empty
    from atomicstore.pytree.tree import device_put_owned

    for shape in [(1000, 300), (3,), (), (0, 5), (1 << 20,)]:
        a = aligned_empty(shape, np.float32)
        assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % 64 == 0 or not a.size
    a = aligned_empty((1 << 20,), np.float32)
    a[:] = 1.0
    x = device_put_owned(a, jax.devices()[0])  # the reader's: may_alias=True where jax has it
    assert x.unsafe_buffer_pointer() == a.ctypes.data  # aliased, not copied
    b = np.empty((1 << 20) + 4, np.float32)[1:]  # a misaligned buffer is copied
    assert b.ctypes.data % 64 and device_put_owned(b, jax.devices()[0]).unsafe_buffer_pointer() != b.ctypes.data
