"""The torch DCP integration holds the contract at every entry point (issue 21 rows 13,
17-20, and the four questions for ``AtomicStorageWriter``/``dcp.save``,
``AtomicStorageReader``/``dcp.load`` and the ``save``/``load`` conveniences).

One process (DCP's ``no_dist``); the two-rank cases are in test_integration_torch.py.
Another job is put exactly between two requests of a load: on the object-store fakes by the
fault layer's hook (a :class:`FaultPlan` stall predicate that runs the other job while it
holds the load's request), on local disk by :class:`HookedLocal`, a local driver registered
for ``torchhook://`` that calls the test's hook before each read (and can hand one read
back with a flipped bit, as a flaky link would).
"""

from __future__ import annotations

import inspect
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Backend, make_backend
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.planner import SavePlanner

import atomicstore
from atomicstore.drivers import register_driver
from atomicstore.drivers.local import LocalDriver
from atomicstore.integrations.torch import (
    ITEMS_FILE,
    METADATA_FILE,
    AtomicStorageReader,
    AtomicStorageWriter,
    _ItemFile,
    atomicstore_error,
    load,
    save,
)
from atomicstore.testing.faults import FaultPlan, is_mutation, object_key, request_kind

sys.path.insert(0, str(Path(__file__).parent))
from torch_worker import check, full, zeroed  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        yield


class HookedLocal(LocalDriver):
    """Local disk calling :attr:`hook` ``(key)`` before each read, and handing the next
    read that covers byte :attr:`flip` ``(key suffix, offset)`` back with that byte's low
    bit flipped (once): a flaky read, the file itself intact."""

    protocols = ("torchhook",)
    hook: ClassVar[Callable[[str], None] | None] = None
    flip: ClassVar[tuple[str, int] | None] = None

    def _flipped(self, key: str, start: int, buf: bytearray | memoryview) -> None:
        if HookedLocal.flip is not None and key.endswith(HookedLocal.flip[0]):
            at = HookedLocal.flip[1] - start
            if 0 <= at < len(buf):
                buf[at] ^= 0x01
                HookedLocal.flip = None

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if HookedLocal.hook is not None:
            HookedLocal.hook(key)
        data = bytearray(super().read(key, start, end))
        self._flipped(key, start or 0, data)
        return bytes(data)

    def read_into(self, key: str, offset: int, out: memoryview, *, generation: str | None = None) -> int:
        if HookedLocal.hook is not None:
            HookedLocal.hook(key)
        n = super().read_into(key, offset, out, generation=generation)
        self._flipped(key, offset, out)
        return n


register_driver(HookedLocal)


@pytest.fixture(autouse=True)
def _no_hook() -> Iterator[None]:
    yield
    HookedLocal.hook = HookedLocal.flip = None


def at_nth_read(b: Backend, match: Callable[[str], bool], nth: int, other: Callable[[], None]) -> threading.Event:
    """Run ``other`` (another job) once, right before the ``nth`` read whose key ``match``
    accepts reaches storage. Returns the event set once it ran."""
    seen, fired, lock = [0], threading.Event(), threading.Lock()

    def step(key: str) -> None:
        with lock:
            if fired.is_set() or not match(key):
                return
            seen[0] += 1
            if seen[0] != nth:
                return
        other()
        fired.set()

    if b.kind == "local":
        HookedLocal.hook = step
    else:
        def pred(environ: dict[str, Any]) -> bool:
            if request_kind(environ) == "get":
                step(object_key(environ) or "")
            return False

        b.faults(FaultPlan(stalls=[(pred, 0.0)]))
    return fired


def hooked(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if kind == "local":
        (tmp_path / "store").mkdir()
        return Backend("local", f"torchhook://{tmp_path}/store")
    return make_backend(kind, request, tmp_path)


def plain_url(b: Backend) -> str:
    return b.url.removeprefix("torchhook://")


# -- row 13: a load whose checkpoint is overwritten or deleted between two of its reads ------
@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
@pytest.mark.parametrize("other_job", ["overwrite", "delete"])
def test_a_load_whose_checkpoint_is_replaced_between_two_reads_says_so(kind, other_job, request, tmp_path):
    b = hooked(kind, request, tmp_path)
    url = f"{b.url}/step_1"
    save(full(1.0), url, **b.options)
    st = atomicstore.open_store(plain_url(b), **b.options)

    def other() -> None:  # another job, with its own store object
        if other_job == "overwrite":
            save(full(2.0), f"{plain_url(b)}/step_1", overwrite=True, **b.options)
        else:
            atomicstore.open_store(plain_url(b), **b.options).delete("step_1")

    # between the first and the second item read of the load (one thread: one at a time)
    fired = at_nth_read(b, lambda key: key.endswith(".distcp"), 2, other)
    got = zeroed(full(0.0))
    with pytest.raises(atomicstore.PreconditionFailedError, match="replaced or deleted .* while it was being read"):
        load(got, url, thread_count=1, **b.options)
    assert fired.is_set()
    if b.server is not None:
        b.faults(None)
    HookedLocal.hook = None
    if other_job == "overwrite":
        again = zeroed(full(0.0))
        load(again, url, **b.options)  # loading again gives the new checkpoint, whole
        assert check(again, 2.0) == []
    else:
        assert st.list() == []
        with pytest.raises(atomicstore.NotFoundError, match="no committed checkpoint"):
            load(zeroed(full(0.0)), url, **b.options)


# -- row 17: the reader verifies exactly what torch.load is given ----------------------------
BIG = torch.arange(2**19, dtype=torch.float32)  # 2 MiB: read by torch.load straight into the tensor


def big_item(url: str) -> tuple[str, int, int, int]:
    """(file, offset, length, CRC32C) of the large item of :data:`BIG`'s checkpoint."""
    root, name = url.rsplit("/", 1)
    ck = atomicstore.open_store(root).open(name)
    items = json.loads(ck.read_bytes(ITEMS_FILE))["items"]
    return next((f, off, n, c) for f, its in items.items() for off, n, c in its if n > 2**20)


@pytest.mark.parametrize("where", ["zip header", "tensor bytes", "zip directory"])
def test_a_byte_flipped_in_a_read_is_caught_and_the_file_loads_again(tmp_path, where):
    # a flaky read (the file intact) hands torch.load one flipped bit: whatever region it is
    # in, the load fails its CRC32C check before the caller's tensor is touched; the next
    # load reads the file clean
    url = f"torchhook://{tmp_path}/store/step_1"
    (tmp_path / "store").mkdir()
    save({"big": BIG, "step": 3}, url)
    file, off, n, _ = big_item(str(tmp_path / "store/step_1"))
    HookedLocal.flip = (file, off + {"zip header": 40, "tensor bytes": n // 2, "zip directory": n - 30}[where])
    got = {"big": torch.zeros_like(BIG), "step": 0}
    with pytest.raises(atomicstore.ChecksumMismatchError) as ei:
        load(got, url)
    assert ei.value.path == file and ei.value.leaf == "big", ei.value
    assert HookedLocal.flip is None and not got["big"].any()
    load(got, url)
    assert torch.equal(got["big"], BIG) and got["step"] == 3


@pytest.mark.parametrize("pattern", ["torch 2.13/2.14", "header again inside a large read",
                                     "backwards in small reads", "tail first, overlapping reads"])
def test_the_item_crc_is_that_of_the_bytes_torch_was_given_whatever_its_reads(tmp_path, pattern):
    # A torch version may read an item's zip in another order or with other sizes. Whatever
    # the reads, the CRC32C the reader checks is that of exactly the bytes it handed out:
    # a flaky read of the zip header at the start (the file itself intact) is caught even
    # when torch reads those bytes again later inside one large read.
    url = f"torchhook://{tmp_path}/store/step_1"
    (tmp_path / "store").mkdir()
    save({"big": BIG}, url)
    file, off, n, crc = big_item(str(tmp_path / "store/step_1"))
    st = atomicstore.open_store(str(tmp_path / "store"))
    raw = st.driver.read(f"step_1/{file}", off, off + n)
    reads = {
        "torch 2.13/2.14": [(0, 4), (0, 8), (n - 4096, 4096), (0, 30), (64, 156), (704, 2**21)],
        "header again inside a large read": [(0, 200), (50, n - 50)],
        "backwards in small reads": [(a, 2**17) for a in range(n - 2**17, -1, -2**17)] + [(0, n % 2**17)],
        "tail first, overlapping reads": [(n - 100, 100), (2**20, n - 2**20), (0, 2**20 + 5), (10, 2**20)],
    }[pattern]
    ck = atomicstore.open_store(f"torchhook://{tmp_path}/store").open("step_1")
    for flaky in (False, True):
        HookedLocal.flip = (file, off + 100) if flaky else None  # inside the first read of the header
        f = _ItemFile(ck, file, off, n)
        for a, k in reads:
            f.seek(a)
            buf = bytearray(k)
            got = f.readinto(buf)
            want = raw[a : a + k]
            assert got == len(want)
            if not flaky:
                assert bytes(buf[:got]) == want, (a, k)
        assert (f.crc32c() == crc) is (not flaky), pattern


# -- row 18: a hostile .metadata is refused, unexecuted -------------------------------------
class RunsCode:
    """Unpickled by full pickle, calls ``fn(*args)``."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def commit_with(st: atomicstore.Store, good: str, name: str, files: dict[str, bytes]) -> None:
    """Commit ``name``: ``good``'s files with ``files`` in their place (committed, so only
    the content is wrong)."""
    ck = st.open(good)
    with st.transaction(name) as txn:
        for p in ck.files:
            txn.write_bytes(p, files.get(p, ck.read_bytes(p)))


def test_a_hostile_metadata_pickle_is_refused_and_runs_nothing(tmp_path):
    root = tmp_path / "store"
    save(full(1.0), str(root / "step_1"))
    st = atomicstore.open_store(str(root))
    marker = tmp_path / "pwned"
    legit = st.open("step_1").read_bytes(METADATA_FILE)
    md = pickle.loads(legit)
    md.planner_data = {"model.w": RunsCode(os.system, f"touch {marker}")}  # inside a real Metadata
    hostile = {
        "os.system": pickle.dumps(RunsCode(os.system, f"touch {marker}")),
        "builtins.exec": pickle.dumps(RunsCode(exec, f"open({str(marker)!r}, 'w').close()")),
        "subprocess.call": pickle.dumps(RunsCode(subprocess.call, ["touch", str(marker)])),
        "nested in Metadata": pickle.dumps(md),
        "protocol 0 INST": f"(S'touch {marker}'\nios\nsystem\n.".encode(),
        "persistent id": b"Pid\n.",
    }
    for i, (how, raw) in enumerate(hostile.items()):
        commit_with(st, "step_1", f"bad_{i}", {METADATA_FILE: raw})
        for reader in ("load", "dcp.load"):
            got = zeroed(full(0.0))
            with pytest.raises((atomicstore.CorruptionError, CheckpointException)) as ei:
                if reader == "load":
                    load(got, str(root / f"bad_{i}"))
                else:
                    dcp.load(got, storage_reader=AtomicStorageReader(str(root / f"bad_{i}")))
            assert not marker.exists(), f"{how}: the pickle ran"
            if reader == "load":
                assert isinstance(ei.value, atomicstore.CorruptionError)
                assert ei.value.path == METADATA_FILE and METADATA_FILE in str(ei.value), (how, ei.value)
                assert "refused unexecuted" in str(ei.value), (how, ei.value)
    got = zeroed(full(0.0))
    load(got, str(root / "step_1"))  # DCP's own metadata still loads
    assert check(got, 1.0) == []


def test_the_writer_refuses_metadata_the_reader_would_refuse(tmp_path):
    # writer and reader agree: a custom planner that puts its own objects into DCP's
    # metadata is refused before the commit, instead of committing an unreadable checkpoint
    class Tagged(DefaultSavePlanner):
        def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
            plans, md = super().create_global_plan(all_plans)
            md.planner_data = {"tag": RunsCode(print, "hello")}
            return plans, md

    root = tmp_path / "store"
    with pytest.raises(atomicstore.InvalidArgumentError, match="restricted unpickler refuses"):
        save(full(1.0), str(root / "step_1"), planner=Tagged())
    st = atomicstore.open_store(str(root))
    assert st.list() == [] and not [k for k in st.driver.find("") if "step_1" in k]


# -- row 19: an existing empty directory is taken over; anything else is named --------------
@pytest.mark.parametrize("renameat2", ["native", "none"])  # none: the rename(2) fallback (NFS, FUSE)
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("how", ["mkdir", "mkdtemp", "TemporaryDirectory"])
def test_saving_into_an_existing_empty_directory_works_as_with_stock_dcp(tmp_path, how, overwrite, renameat2,
                                                                        monkeypatch):
    if renameat2 == "none":
        monkeypatch.setenv("ATOMICSTORE_LOCAL_RENAMEAT2", "none")
    root = tmp_path / "runs"
    root.mkdir()
    if how == "mkdir":
        path = root / "step_1"
        path.mkdir()
        ctx: Any = None
    elif how == "mkdtemp":
        path = Path(tempfile.mkdtemp(dir=root))
        ctx = None
    else:
        ctx = tempfile.TemporaryDirectory(dir=root)
        path = Path(ctx.name)
    with AtomicStorageWriter(path, overwrite=overwrite) as w:
        dcp.save(full(1.0), storage_writer=w)
    got = zeroed(full(0.0))
    dcp.load(got, storage_reader=AtomicStorageReader(path))
    assert check(got, 1.0) == []
    stock = zeroed(full(0.0))
    dcp.load(stock, storage_reader=dcp.FileSystemReader(path))  # still DCP's own files
    assert check(stock, 1.0) == []
    st = atomicstore.open_store(str(root))
    assert st.list() == [path.name]
    assert not [k for k in st.driver.find(".atomicstore") if "staging" in k]  # the empty dir is gone too
    with pytest.raises(atomicstore.CommitConflictError):  # now it is a checkpoint: the usual rule
        save(full(2.0), str(path))
    if ctx is not None:
        ctx.cleanup()


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("what", ["a user's file", "a stock DCP checkpoint"])
def test_a_directory_that_is_not_a_checkpoint_is_refused_up_front_saying_what_is_there(tmp_path, what,
                                                                                       overwrite):
    root = tmp_path / "runs"
    path = root / "step_1"
    if what == "a user's file":
        path.mkdir(parents=True)
        (path / "notes.txt").write_text("mine")
        held = "notes.txt"
    else:
        dcp.save(full(1.0), storage_writer=dcp.FileSystemWriter(path))
        held = ".metadata"
    before = sorted(os.listdir(path))
    planner = CountingPlanner()
    with pytest.raises(atomicstore.AlreadyExistsError) as ei:
        save(full(2.0), str(path), overwrite=overwrite, planner=planner)
    msg = str(ei.value)
    assert "another writer" not in msg and "not a checkpoint" in msg and held in msg and str(path) in msg, msg
    assert planner.resolved == 0  # refused before any item was written
    assert sorted(os.listdir(path)) == before  # nothing of ours written into it


class CountingPlanner(DefaultSavePlanner):
    resolved = 0

    def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
        self.resolved += 1
        return super().resolve_data(write_item)


# -- row 20: the stock writer's and reader's arguments --------------------------------------
class Zlib(StreamTransformExtension):
    """A custom stream transform (zlib compression), as users write them."""

    @staticmethod
    def registry_name() -> str:
        return "test.zlib"

    @staticmethod
    def from_descriptor(version: str) -> Zlib:
        return Zlib()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class W(io.RawIOBase):
            def __init__(self) -> None:
                self.z = zlib.compressobj()

            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                output.write(self.z.compress(bytes(b)))
                return len(memoryview(b))

            def close(self) -> None:
                if not self.closed:
                    output.write(self.z.flush())
                    output.close()
                super().close()

        return W()  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(zlib.decompress(input.read()))


def zlib_registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(Zlib)
    return reg


def test_the_stock_writer_and_reader_arguments_are_taken_by_name_and_position(tmp_path):
    # every argument of this torch's stock FileSystemWriter / FileSystemReader, by name,
    # with its stock default; and by position, in the stock order
    w_params = [p for p in inspect.signature(dcp.FileSystemWriter.__init__).parameters.values() if p.name != "self"]
    r_params = [p for p in inspect.signature(dcp.FileSystemReader.__init__).parameters.values() if p.name != "self"]
    assert w_params[0].name == "path" and r_params[0].name == "path"
    root = tmp_path / "store"
    for i, style in enumerate(("by name", "by position")):
        path = root / f"step_{i}"
        defaults = {p.name: p.default for p in w_params[1:]}
        if style == "by name":
            w = AtomicStorageWriter(path=path, **defaults)
        else:
            w = AtomicStorageWriter(path, *defaults.values())
        assert w.checkpoint_id == str(path) and w.overwrite is True  # the stock default, passed
        dcp.save(full(1.0), storage_writer=w)
        rdefaults = {p.name: p.default for p in r_params[1:]}
        r = (AtomicStorageReader(path=path, **rdefaults) if style == "by name"
             else AtomicStorageReader(path, *rdefaults.values()))
        got = zeroed(full(0.0))
        dcp.load(got, storage_reader=r)
        assert check(got, 1.0) == []
    assert AtomicStorageWriter(root / "x").overwrite is False  # our default: by design (docs)
    with pytest.raises(atomicstore.CommitConflictError, match="already a committed checkpoint.*overwrite=True"):
        save(full(2.0), root / "step_0")  # says what to do


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_single_file_per_rank_false_writes_one_file_per_item(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    url = f"{b.url}/step_1"
    dcp.save(full(1.0), storage_writer=AtomicStorageWriter(url, single_file_per_rank=False, thread_count=2,
                                                           sync_files=False, per_thread_copy_ahead=0, **b.options))
    st = b.open()
    files = sorted(p for p in st.verify("step_1").files if p.endswith(".distcp"))
    assert files == [f"__0_{i}.distcp" for i in range(6)], files  # 6 items: w, b, m, step, lr, tag
    got = zeroed(full(0.0))
    load(got, url, **b.options)
    assert check(got, 1.0) == []
    if kind == "local":
        stock = zeroed(full(0.0))
        dcp.load(stock, storage_reader=dcp.FileSystemReader(url))
        assert check(stock, 1.0) == []


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_stream_extensions_compress_and_their_stored_bytes_are_checksummed(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    url = f"{b.url}/step_1"
    zeros = {"z": torch.zeros(2**19), "step": 5}  # 2 MiB that compress to a few KiB
    dcp.save(zeros, storage_writer=AtomicStorageWriter(url, _extensions=[Zlib()], **b.options))
    st = b.open()
    ck = st.open("step_1")
    md = pickle.loads(ck.read_bytes(METADATA_FILE))
    infos = list(md.storage_data.values())
    assert all(i.transform_descriptors == ["test.zlib/1"] for i in infos), infos
    (file,) = [p for p in ck.files if p.endswith(".distcp")]
    assert ck.files[file].size < 2**16  # compressed
    got = {"z": torch.ones(2**19), "step": 0}
    dcp.load(got, storage_reader=AtomicStorageReader(url, _extension_registry=zlib_registry(), **b.options))
    assert not got["z"].any() and got["step"] == 5
    if kind == "local":  # DCP's own reader reads them too
        stock = {"z": torch.ones(2**19), "step": 0}
        dcp.load(stock, storage_reader=dcp.FileSystemReader(url, _extension_registry=zlib_registry()))
        assert not stock["z"].any() and stock["step"] == 5
    # without the extension registered: named, not taken for damage
    with pytest.raises(atomicstore.InvalidArgumentError, match="test.zlib/1.*_extension_registry"):
        load({"z": torch.ones(2**19), "step": 0}, url, **b.options)
    # a flipped bit of the stored (compressed) bytes fails the item's CRC32C
    items = json.loads(ck.read_bytes(ITEMS_FILE))["items"][file]
    off, n, _ = max(items, key=lambda it: it[1])
    raw = bytearray(st.driver.read(ck.key(file)))
    raw[off + n // 2] ^= 0x01
    commit_with(st, "step_1", "step_2", {file: bytes(raw)})
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"z": torch.ones(2**19), "step": 0},
                 storage_reader=AtomicStorageReader(f"{b.url}/step_2", _extension_registry=zlib_registry(),
                                                    **b.options))
    err = atomicstore_error(ei.value)
    assert isinstance(err, atomicstore.ChecksumMismatchError) and err.path == file and err.leaf == "z", err


def test_cache_staged_state_dict_keeps_the_staged_copy_between_async_saves(tmp_path):
    w = AtomicStorageWriter(tmp_path / "store" / "step_1", cache_staged_state_dict=True)
    dcp.async_save(full(1.0), storage_writer=w).result()
    cached = w.state_dict_cache
    assert cached is not None
    dcp.async_save(full(2.0), storage_writer=w, checkpoint_id=tmp_path / "store" / "step_2").result()
    assert w.state_dict_cache is cached  # reused, as the stock writer does
    for step, val in (("step_1", 1.0), ("step_2", 2.0)):
        got = zeroed(full(0.0))
        load(got, tmp_path / "store" / step)
        assert check(got, val) == []


def test_unsupported_stock_arguments_are_refused_naming_the_argument(tmp_path):
    p = tmp_path / "x"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"serialization_format": SerializationFormat.SAFETENSORS}, "serialization_format"),
        ({"single_file_per_rank": "yes"}, "single_file_per_rank"),
        ({"sync_files": None}, "sync_files"),
        ({"per_thread_copy_ahead": -1}, "per_thread_copy_ahead"),
        ({"cache_staged_state_dict": 1}, "cache_staged_state_dict"),
        ({"_extensions": [zlib]}, "_extensions"),
        ({"_extensions": "zstd"}, "_extensions"),
        ({"thread_count": 0}, "thread_count"),
    ]
    for kw, name in cases:
        with pytest.raises(atomicstore.InvalidArgumentError, match=name):
            AtomicStorageWriter(p, **kw)
    with pytest.raises(atomicstore.InvalidArgumentError, match="not both"):
        AtomicStorageWriter(p, path=p)
    with pytest.raises(atomicstore.InvalidArgumentError, match="required"):
        AtomicStorageWriter()
    with pytest.raises(atomicstore.InvalidArgumentError, match="_extension_registry"):
        AtomicStorageReader(p, _extension_registry={"zstd": 1})
    assert AtomicStorageWriter(p, serialization_format="torch_save").serialization_format is not None


# -- DCP's plan caching: refused, never written into an earlier save's attempt ---------------
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_plan_caching_is_refused_and_the_earlier_checkpoint_stays_intact(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    try:
        save(full(1.0), f"{b.url}/step_1", planner=DefaultSavePlanner(enable_plan_caching=True), **b.options)
        with pytest.raises(atomicstore.InvalidArgumentError, match="plan caching"):
            save(full(2.0), f"{b.url}/step_2", planner=DefaultSavePlanner(enable_plan_caching=True), **b.options)
    finally:  # DCP keeps cached plans on the class
        for cache in [a for a in vars(SavePlanner) if a.startswith("_cached_")]:
            getattr(SavePlanner, cache).clear()
    st = b.open()
    assert st.list() == ["step_1"]
    st.verify("step_1")  # none of the refused save's bytes went into step_1's files
    got = zeroed(full(0.0))
    load(got, f"{b.url}/step_1", **b.options)
    assert check(got, 1.0) == []


# -- the four questions: a save overwritten meanwhile, a read-only store, a forked process ---
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_an_overwrite_whose_checkpoint_was_replaced_meanwhile_loses_whole(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    url = f"{b.url}/step_1"
    save(full(1.0), url, **b.options)

    class OtherJobMidSave(DefaultSavePlanner):  # the caller's code: another job overwrites meanwhile
        done = False

        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            if not OtherJobMidSave.done:
                OtherJobMidSave.done = True
                save(full(2.0), url, overwrite=True, **b.options)
            return super().resolve_data(write_item)

    with pytest.raises(atomicstore.CommitConflictError):  # compare-and-swap on what it read
        save(full(3.0), url, overwrite=True, planner=OtherJobMidSave(), **b.options)
    got = zeroed(full(0.0))
    load(got, url, **b.options)
    assert check(got, 2.0) == []  # the other job's checkpoint, none of ours mixed in
    b.open().recover(now=10**10)
    assert all(k.startswith("step_1/") for k in b.open().driver.find("") if k != ".atomicstore/lock")


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_read_only_store_loads_and_refuses_a_save_before_any_rank_writes(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    url = f"{b.url}/step_1"
    save(full(1.0), url, **b.options)
    b.faults(FaultPlan(deny=is_mutation))  # read-only credentials
    got = zeroed(full(0.0))
    load(got, url, **b.options)
    assert check(got, 1.0) == []
    planner = CountingPlanner()
    with pytest.raises(atomicstore.StorageError):
        save(full(2.0), f"{b.url}/step_2", planner=planner, **b.options)
    assert planner.resolved == 0  # refused at the plan (its lease), before any item was written
    b.faults(None)
    assert b.open().list() == ["step_1"]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_forked_child_saves_and_loads_with_its_parents_writer_and_reader(kind, request, tmp_path):
    # a data-loader-style worker forked after the parent used its writer, reader and store
    b = make_backend(kind, request, tmp_path)
    script = textwrap.dedent("""
        import json, os, sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, sys.argv[3])
        import torch.distributed.checkpoint as dcp
        from torch_worker import check, full, zeroed
        from atomicstore.integrations.torch import AtomicStorageReader, AtomicStorageWriter
        url, opts = sys.argv[1], json.loads(sys.argv[2])
        w = AtomicStorageWriter(url + "/step_1", **opts)
        dcp.save(full(1.0), storage_writer=w)
        r = AtomicStorageReader(url + "/step_1", **opts)
        dcp.load(zeroed(full(0.0)), storage_reader=r)
        pid = os.fork()
        if pid == 0:
            try:
                w.reset(url + "/step_2")
                dcp.save(full(2.0), storage_writer=w, checkpoint_id=url + "/step_2")
                got = zeroed(full(0.0))
                r.reset()
                dcp.load(got, storage_reader=r)
                os._exit(0 if check(got, 1.0) == [] else 3)
            except BaseException as exc:
                print("child:", type(exc).__name__, exc, flush=True)
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        got = zeroed(full(0.0))
        dcp.load(got, storage_reader=AtomicStorageReader(url + "/step_2", **opts))
        print("child", os.waitstatus_to_exitcode(status), "parent", check(got, 2.0), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script, b.url, json.dumps(b.options), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("child 0 parent []"), out.stdout + out.stderr[-3000:]


# -- forged items: CRC-consistent, committed, of another kind than the metadata records ----------
def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def forge_item(st: atomicstore.Store, good: str, name: str, fqn: str, payload: bytes) -> None:
    """Commit ``name``: ``good`` (one file per item) with item ``fqn``'s stored bytes replaced
    by ``payload``, and its records (``.metadata``, the item records) made to match, so every
    checksum agrees: what a writer with access to the store, not damage, can leave."""
    ck = st.open(good)
    md = pickle.loads(ck.read_bytes(METADATA_FILE))
    key = next(k for k in md.storage_data if k.fqn == fqn)
    info = md.storage_data[key]
    assert info.offset == 0  # one item per file
    info.length = len(payload)
    items = json.loads(ck.read_bytes(ITEMS_FILE))
    items["items"][info.relative_path] = [[0, len(payload), atomicstore.commit.manifest.crc32c(payload)]]
    commit_with(st, good, name, {info.relative_path: payload, METADATA_FILE: pickle.dumps(md),
                                 ITEMS_FILE: json.dumps(items).encode()})


def _one_file_per_item(root: Path, val: float) -> None:
    dcp.save(full(val), storage_writer=AtomicStorageWriter(str(root / "good"), single_file_per_rank=False))


@pytest.mark.parametrize("payload", ["an int", "a dict of the tensor", "a list of the tensor", "None", "sparse",
                                     "quantized", "meta", "complex64", "float64"])
def test_a_forged_tensor_item_is_refused_naming_the_file_and_item(tmp_path, payload):
    # Was (attacker, torch 2.13 and 2.15): DCP's CheckpointException wrapping AttributeError
    # or RuntimeError from inside torch, or a complex/float64 item cast silently into the
    # float32 tensor (the imaginary part dropped).
    root = tmp_path / "store"
    _one_file_per_item(root, 1.0)
    w = full(1.0)["model"]["w"]
    forged = {"an int": 5, "a dict of the tensor": {"w": w}, "a list of the tensor": [w], "None": None,
              "sparse": w.to_sparse(), "quantized": torch.quantize_per_tensor(w, 0.1, 0, torch.quint8),
              "meta": torch.empty(w.shape, device="meta"), "complex64": w.to(torch.complex64) * 1j,
              "float64": w.double()}[payload]
    st = atomicstore.open_store(str(root))
    forge_item(st, "good", "forged", "model.w", _saved(forged))
    got = zeroed(full(0.0))
    with pytest.raises(atomicstore.CorruptionError) as ei:
        load(got, str(root / "forged"))
    assert ei.value.leaf == "model.w" and ei.value.path and ei.value.path.endswith(".distcp"), ei.value
    assert "is not the dense tensor its metadata records" in str(ei.value), ei.value
    assert not torch.any(got["model"]["w"]), "the caller's tensor was written"
    got = zeroed(full(0.0))
    load(got, str(root / "good"))
    assert check(got, 1.0) == []


class TrustedConfig:
    """A class of the caller's, in a non-tensor item (full pickle only)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_a_non_tensor_item_runs_nothing_and_trusted_classes_load_when_allowed(tmp_path):
    # Was (attacker): a non-tensor item holding a pickle that calls exec ran it at load:
    # DCP's DefaultLoadPlanner.load_bytes unpickles with weights_only=False.
    root = tmp_path / "store"
    _one_file_per_item(root, 1.0)
    st = atomicstore.open_store(str(root))
    marker = tmp_path / "pwned"
    forge_item(st, "good", "evil", "optim.step", _saved(RunsCode(exec, f"open({str(marker)!r}, 'w').close()")))
    for reader in ("load", "dcp.load"):
        got = zeroed(full(0.0))
        with pytest.raises((atomicstore.CorruptionError, CheckpointException)) as ei:
            if reader == "load":
                load(got, str(root / "evil"))
            else:
                dcp.load(got, storage_reader=AtomicStorageReader(str(root / "evil")))
        assert not marker.exists(), f"{reader}: the pickle ran"
        err = atomicstore_error(ei.value)
        assert isinstance(err, atomicstore.CorruptionError) and err.leaf == "optim.step", ei.value
        assert "refused unexecuted" in str(err) and "weights_only=False" in str(err), err
    # a trusted checkpoint holding a class of the caller's: refused by default, loaded when
    # the caller says so (weights_only=False, or the class allowed by torch)
    state = full(1.0)
    state["optim"]["cfg"] = TrustedConfig(0.25)
    save(state, str(root / "trusted"))
    got = zeroed(full(0.0))
    got["optim"]["cfg"] = None
    with pytest.raises(atomicstore.CorruptionError, match="weights_only"):
        load(got, str(root / "trusted"))
    load(got, str(root / "trusted"), weights_only=False)
    assert isinstance(got["optim"]["cfg"], TrustedConfig) and got["optim"]["cfg"].lr == 0.25
    got = zeroed(full(0.0))
    got["optim"]["cfg"] = None
    with torch.serialization.safe_globals([TrustedConfig]):
        load(got, str(root / "trusted"))
    assert got["optim"]["cfg"].lr == 0.25 and check(got, 1.0) == []
    with pytest.raises(atomicstore.InvalidArgumentError, match="weights_only"):
        AtomicStorageReader(str(root / "trusted"), weights_only="no")


def test_metadata_a_newer_torch_wrote_is_named_so_not_called_corrupt(tmp_path):
    # Was (attacker): a checkpoint saved with torch 2.15 (TensorProperties gained `strides`)
    # loaded with torch 2.13: "CorruptionError: not DCP metadata", while verify said ok.
    root = tmp_path / "store"
    save(full(1.0), str(root / "step_1"))
    st = atomicstore.open_store(str(root))
    items = json.loads(st.open("step_1").read_bytes(ITEMS_FILE))
    assert items["torch"] == torch.__version__  # the writer records its torch
    unreadable = b"\x80\x04K\x05."  # (an int: not DCP metadata, whatever torch reads it)
    for name, writer in (("newer", "99.1.0+cu999"), ("same", torch.__version__), ("older", "2.0.0")):
        commit_with(st, "step_1", name, {METADATA_FILE: unreadable,
                                         ITEMS_FILE: json.dumps(items | {"torch": writer}).encode()})
        with pytest.raises(atomicstore.AtomicStoreError) as ei:
            load(zeroed(full(0.0)), str(root / name))
        if name == "newer":
            assert type(ei.value) is atomicstore.IncompatibleCheckpointError, ei.value
            assert "written by torch 99.1.0+cu999" in str(ei.value) and "torch 99.1.0 or newer" in str(ei.value)
            assert ei.value.path == METADATA_FILE
        else:  # the same or an older torch wrote what this one cannot read: damaged
            assert type(ei.value) is atomicstore.CorruptionError and "refused unexecuted" in str(ei.value)


def test_a_second_save_on_a_writer_in_flight_never_commits_the_first_under_its_name(tmp_path):
    # Was (attacker, documented misuse: one writer per save in flight): async save A blocked
    # in its writes while save B, on the same writer, reset it and planned; A's finish then
    # committed B's attempt, with A's data, under B's name (and in 2 of 6 runs B then wrote
    # into that committed checkpoint: ChecksumMismatchError on load).
    root = tmp_path / "store"
    planned_a, planned_b = threading.Event(), threading.Event()

    class SaveA(DefaultSavePlanner):
        def finish_plan(self, plan: Any) -> Any:
            planned_a.set()
            return super().finish_plan(plan)

        def resolve_data(self, wi: Any) -> Any:
            assert planned_b.wait(30)
            return super().resolve_data(wi)

    class SaveB(DefaultSavePlanner):
        def finish_plan(self, plan: Any) -> Any:
            planned_b.set()
            return super().finish_plan(plan)

    writer = AtomicStorageWriter(str(root / "step_1"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fa = dcp.async_save(full(1.0), storage_writer=writer, planner=SaveA())
        assert planned_a.wait(30)  # A planned (its attempt open), blocked in its writes
        fb = dcp.async_save(full(2.0), checkpoint_id=str(root / "step_2"), storage_writer=writer, planner=SaveB())
        with pytest.raises(BaseException) as ei:
            fa.result(timeout=60)
        fb.result(timeout=60)
    err = atomicstore_error(ei.value)
    assert isinstance(err, atomicstore.TransactionError), ei.value  # B's reset aborted A's attempt
    st = atomicstore.open_store(str(root))
    assert st.list() == ["step_2"]
    got = zeroed(full(0.0))
    load(got, str(root / "step_2"))
    assert check(got, 2.0) == []  # B's own data, whole
    st.verify("step_2")


def test_views_are_saved_as_their_own_bytes_not_their_whole_storage(tmp_path):
    # Was (attacker): 32 parameters that are views into one 8 MiB flat buffer were saved as
    # 256 MiB (torch.save of a view writes its whole storage); the stock writer clones them,
    # and the bytes outside a view (another tensor's) ended up in its item.
    flat = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    views = {f"p{i}": flat[i * (1 << 16):(i + 1) * (1 << 16)] for i in range(16)}  # 256 KiB each
    views["strided"] = flat[::4096]
    root = tmp_path / "store"
    save({"model": views}, str(root / "step_1"))
    ck = atomicstore.open_store(str(root)).open("step_1")
    stored = sum(f.size for p, f in ck.files.items() if p.endswith(".distcp"))
    assert stored < flat.nbytes * 1.1, f"{stored:,} bytes stored for {flat.nbytes:,} bytes of views"
    got = {"model": {k: torch.zeros_like(v) for k, v in views.items()}}
    load(got, str(root / "step_1"))
    assert all(torch.equal(got["model"][k], v) for k, v in views.items())
