"""Issue 11, row 5: local filesystems whose ``renameat2`` lacks RENAME_NOREPLACE and
RENAME_EXCHANGE (NFS, many FUSE mounts).

The store probes the flags when it opens and falls back to mechanisms that are still
atomic: ``link(2)`` for a one-file save without overwrite, ``rename(2)`` onto a non-empty
directory for a directory save, ``rename(2)`` under the store lock for a one-file
overwrite, and a clear refusal to replace a directory. The tests run on a real
filesystem without the flags: a ``bindfs`` (FUSE) mount of a temporary directory, whose
``renameat2`` answers EINVAL to both flags. They also run with
``ATOMICSTORE_LOCAL_RENAMEAT2=none`` (configuration read when a store opens), which forces
the same fallbacks on an ordinary directory.

Without ``bindfs`` (Debian package ``bindfs``, which brings ``fuse``/``fusermount``) or
``/dev/fuse`` the FUSE cases are skipped, except under CI (``CI`` set), where they fail:
CI must not silently test less than it claims.

Each test asserts something the old fallback (check with ``lexists``, then ``rename``;
swap by three renames) gets wrong: two racing saves that both report success, a reader
that finds no checkpoint in the middle of an overwrite, a crash that leaves neither the
old nor the new checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
from crashsim import Crasher, CrashingDriver, SimulatedCrash

import atomicstore
from atomicstore.commit.lease import LEASES
from atomicstore.commit.strategies import STAGING, TRASH
from atomicstore.drivers import local as local_driver
from atomicstore.drivers import renameat2
from atomicstore.drivers.local import LOCK_KEY
from atomicstore.errors import CommitConflictError, LeaseLostError, StorageError

ENV = "ATOMICSTORE_LOCAL_RENAMEAT2"
FUTURE = time.time() + 10**7
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


# -- the filesystem without renameat2 flags -----------------------------------------------
def _kernel_flags(directory: Path) -> tuple[bool, bool]:
    """What the kernel and filesystem of ``directory`` really do with each flag, asked
    so that the VFS cannot answer for the filesystem: RENAME_NOREPLACE onto a name that
    does not exist (onto an existing one the VFS says EEXIST before the filesystem is
    asked), RENAME_EXCHANGE of two directories."""
    call = renameat2.renameat2_call
    a, b = directory / f".kf-{secrets.token_hex(4)}a", directory / f".kf-{secrets.token_hex(4)}b"
    a.mkdir()
    try:
        err = call(str(a), str(b), _RENAME_NOREPLACE)
        if err == 0:
            b.rename(a)
        noreplace = err == 0
        b.mkdir()
        try:
            exchange = call(str(a), str(b), _RENAME_EXCHANGE) == 0
        finally:
            b.rmdir()
    finally:
        a.rmdir()
    return noreplace, exchange


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must install the Debian package bindfs (apt-get install -y bindfs)")
    pytest.skip(reason)


def _close_fds_under(root: Path) -> None:
    """Close this process's descriptors of files below ``root``, as the kernel does for a
    process that died (a simulated crash leaves its writers' descriptors open)."""
    prefix = str(root) + os.sep
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            with contextlib.suppress(OSError):
                os.close(int(fd))


def _unmount(mnt: Path, proc: subprocess.Popen[bytes]) -> None:
    for attempt in range(50):
        if subprocess.run(["fusermount", "-u", str(mnt)], capture_output=True).returncode == 0:
            break
        _close_fds_under(mnt)  # a leaked descriptor keeps the mount busy
        time.sleep(0.05)
        if attempt == 49:
            subprocess.run(["fusermount", "-u", "-z", str(mnt)], capture_output=True)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def fuse_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A bindfs (FUSE passthrough) mount of a temporary directory, for this module."""
    if not os.path.exists("/dev/fuse"):
        _unavailable("no /dev/fuse")
    if not shutil.which("bindfs") or not shutil.which("fusermount"):
        _unavailable("bindfs / fusermount not installed")
    base = tmp_path_factory.mktemp("fuse")
    src, mnt = base / "src", base / "mnt"
    src.mkdir()
    mnt.mkdir()
    proc = subprocess.Popen(["bindfs", "-f", str(src), str(mnt)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not os.path.ismount(mnt):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate()
            _unavailable(f"bindfs could not mount: {err.decode(errors='replace').strip()}")
        time.sleep(0.01)
    try:
        yield mnt
    finally:
        _unmount(mnt, proc)


@dataclass
class Root:
    """A directory on which the store must use the fallbacks."""

    kind: str  # "fuse" (real filesystem without the flags) or "env" (forced by ENV)
    path: Path

    def url(self, sub: str = "store") -> str:
        return str(self.path / sub)

    def open(self, sub: str = "store") -> atomicstore.Store:
        return atomicstore.open_store(self.url(sub), lease_ttl=3600)


@pytest.fixture(params=["fuse", "env"])
def fallback(request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Root]:
    if request.param == "fuse":
        monkeypatch.delenv(ENV, raising=False)
        mnt: Path = request.getfixturevalue("fuse_mount")
        path = mnt / f"t-{secrets.token_hex(6)}"
        path.mkdir()
    else:
        monkeypatch.setenv(ENV, "none")  # read when a store opens
        path = tmp_path
    yield Root(request.param, path)
    _close_fds_under(path)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter can, so racing threads interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _race(n: int, fn: Callable[[int, threading.Barrier], Any]) -> list[tuple[bool, Any]]:
    """Run ``fn(i, barrier)`` in ``n`` threads; (True, result) or (False, exception) each."""
    barrier = threading.Barrier(n, timeout=30)
    out: list[tuple[bool, Any]] = [(False, None)] * n

    def run(i: int) -> None:
        try:
            out[i] = (True, fn(i, barrier))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            barrier.abort()
            out[i] = (False, exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a racing writer hangs"
    return out


def _one_winner(results: list[tuple[bool, Any]], where: str) -> int:
    """Index of the only writer told it committed; every other one got a conflict."""
    winners = [i for i, (ok, _) in enumerate(results) if ok]
    assert len(winners) == 1, f"{where}: {len(winners)} writers were told they committed: {results}"
    for i, (ok, exc) in enumerate(results):
        if not ok:
            assert isinstance(exc, CommitConflictError) and not isinstance(exc, LeaseLostError), (
                f"{where}: writer {i}: {exc!r}")
    return winners[0]


def _leftovers(st: atomicstore.Store) -> dict[str, list[str]]:
    d = st.driver
    return {k: sorted(e.name for e in d.listdir(k)) for k in (STAGING, TRASH, LEASES)
            if d.listdir(k)}


# -- (a) the probe ------------------------------------------------------------------------
def test_fuse_mount_lacks_the_flags_and_the_driver_says_so(fuse_mount: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    path = fuse_mount / f"a-{secrets.token_hex(4)}"
    path.mkdir()
    # the mount is what the tests claim: a filesystem that answers EINVAL to both flags
    assert _kernel_flags(path) == (False, False)
    st = atomicstore.open_store(str(path / "store"))
    d = st.driver
    assert isinstance(d, local_driver.LocalDriver)
    flags = d.capabilities.renames()
    assert flags == (False, False), (
        f"probe says NOREPLACE={flags.noreplace} EXCHANGE={flags.exchange} on a FUSE mount "
        "where renameat2 answers EINVAL to both")


def test_env_forces_the_fallbacks_and_native_dir_has_the_flags(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    native = atomicstore.open_store(str(tmp_path / "native")).driver
    assert isinstance(native, local_driver.LocalDriver)
    truth = _kernel_flags(tmp_path)
    assert native.capabilities.renames() == truth
    if truth != (True, True):
        pytest.skip(f"{tmp_path} lacks renameat2 flags ({truth}): nothing native to compare")
    monkeypatch.setenv(ENV, "none")
    forced = atomicstore.open_store(str(tmp_path / "forced")).driver
    assert isinstance(forced, local_driver.LocalDriver)
    assert forced.capabilities.renames() == (False, False)


# -- (b) two one-file saves of one name ---------------------------------------------------
def test_racing_one_file_saves_have_one_winner(fallback: Root, fast_switching: None) -> None:
    stores = [fallback.open(), fallback.open()]  # two writers (as two processes would)
    payloads = [bytes([65 + i]) * 50_000 for i in range(2)]
    for r in range(30):
        name = f"checkpoint_{r}"

        def save(i: int, barrier: threading.Barrier, name: str = name) -> None:
            with stores[i].one_file(name) as f:  # both pass the early existence check
                f.write(payloads[i])
                barrier.wait()  # then both reach the commit point together

        results = _race(2, save)
        win = _one_winner(results, f"{fallback.kind} round {r}")
        assert stores[0].driver.read(name) == payloads[win], f"round {r}: not the winner's bytes"
        assert _leftovers(stores[0]) == {}, f"round {r}"
    assert sorted(e.name for e in stores[0].driver.listdir("") if not e.is_dir) == sorted(
        f"checkpoint_{r}" for r in range(30))


# -- (c) two directory transactions of one name -------------------------------------------
def test_racing_directory_saves_have_one_winner(fallback: Root, fast_switching: None) -> None:
    stores = [fallback.open(), fallback.open()]
    payloads = [bytes([97 + i]) * 20_000 for i in range(2)]
    for r in range(20):
        name = f"step_{r}"
        attempts: list[str] = ["", ""]

        def save(i: int, barrier: threading.Barrier, name: str = name,
                 attempts: list[str] = attempts) -> None:
            with stores[i].transaction(name, metadata={"writer": i}) as txn:
                attempts[i] = txn.attempt
                txn.write_bytes("data.bin", payloads[i])
                barrier.wait()

        win = _one_winner(_race(2, save), f"{fallback.kind} round {r}")
        st = stores[1 - win]  # the loser's view
        manifest = st.verify(name)
        assert manifest.attempt == attempts[win] and manifest.metadata == {"writer": win}
        assert st.read_bytes(name, "data.bin") == payloads[win]
        assert _leftovers(st) == {}, f"round {r}"
    assert stores[0].list() == [f"step_{r}" for r in range(20)]


# -- (d) overwriting a one-file checkpoint ------------------------------------------------
_READER = r"""
import json, os, sys
path, stop, out = sys.argv[1:4]
size = 64 * 1024
seen, missing, bad = [], 0, []
while not os.path.exists(stop):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        missing += 1
        continue
    v = data[0] - 48 if data else -1
    if v < 0 or len(data) != size + v or data.count(data[0]) != len(data):
        bad.append(len(data))
    elif not seen or seen[-1] != v:
        seen.append(v)
json.dump({"seen": seen, "missing": missing, "bad": bad[:5]}, open(out, "w"))
"""


def test_one_file_overwrite_readers_see_old_or_new(fallback: Root) -> None:
    """Overwrites while another process reads in a tight loop: every read is one whole
    version, versions only move forward, and the name is never missing (the old fallback
    swapped by three renames, leaving the name absent in between).

    On the FUSE mount absence is not asserted: there a concurrent ``open`` of a name that
    ``rename(2)`` is replacing sometimes fails with ENOENT whatever the caller does
    (libfuse's path-based API looks the old inode up by a name it no longer has; plain
    ``os.replace`` and ``open`` in two threads show it without atomicstore)."""
    writer, reader = fallback.open(), fallback.open()
    name = "checkpoint_1"
    versions = [bytes([48 + v]) * (64 * 1024 + v) for v in range(40)]
    with writer.one_file(name) as f:
        f.write(versions[0])
    stop, out = fallback.path / "stop-reader", fallback.path / "reader.json"
    proc = subprocess.Popen([sys.executable, "-c", _READER, writer.driver.path(name),
                             str(stop), str(out)])
    try:
        time.sleep(0.05)  # the reader is reading
        for v in range(1, len(versions)):
            with writer.one_file(name, overwrite=True) as f:
                f.write(versions[v])
            assert reader.driver.read(name) == versions[v]
            assert _leftovers(writer) == {}, f"overwrite {v}"
    finally:
        stop.touch()
        proc.wait(30)
    got = json.loads(out.read_text())
    assert not got["bad"], f"a reader saw partial or foreign data: {got}"
    assert len(got["seen"]) > 1 and got["seen"] == sorted(got["seen"]), got
    if fallback.kind != "fuse":
        assert got["missing"] == 0, f"a reader found no checkpoint {got['missing']} times"
    assert writer.recover(now=FUTURE).actions == []


def test_racing_one_file_overwrites_have_one_winner(fallback: Root, fast_switching: None) -> None:
    stores = [fallback.open(), fallback.open()]
    payloads = [b"X" * 30_000, b"Y" * 30_000]
    for r in range(15):
        name = f"checkpoint_{r}"
        with stores[0].one_file(name) as f:
            f.write(b"old")

        def overwrite(i: int, barrier: threading.Barrier, name: str = name) -> None:
            with stores[i].one_file(name, overwrite=True) as f:  # both read the same generation
                f.write(payloads[i])
                barrier.wait()

        win = _one_winner(_race(2, overwrite), f"{fallback.kind} round {r}")
        assert stores[0].driver.read(name) == payloads[win]
        assert _leftovers(stores[0]) == {}, f"round {r}"


# -- (e) overwriting a directory checkpoint -----------------------------------------------
def test_directory_overwrite_is_refused_and_the_old_checkpoint_kept(fallback: Root) -> None:
    st = fallback.open()
    with st.transaction("step_1", metadata={"v": 1}) as txn:
        txn.write_bytes("data.bin", b"old" * 1000)
    before = st.manifest("step_1")
    with pytest.raises(StorageError, match="RENAME_EXCHANGE") as info:
        with st.transaction("step_1", overwrite=True, metadata={"v": 2}) as txn:
            txn.write_bytes("data.bin", b"new" * 1000)
    assert not isinstance(info.value, CommitConflictError)
    assert "step_1" in str(info.value)
    for s in (st, fallback.open()):  # this process's view and a fresh one
        assert s.list() == ["step_1"]
        assert s.verify("step_1") == before
        assert s.read_bytes("step_1", "data.bin") == b"old" * 1000
    st.recover(now=FUTURE)
    assert _leftovers(st) == {}
    assert st.recover(now=FUTURE).actions == []
    assert st.verify("step_1") == before


def test_directory_overwrite_works_where_exchange_exists(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal above comes from the missing flag, not from the overwrite itself."""
    monkeypatch.delenv(ENV, raising=False)
    if _kernel_flags(tmp_path) != (True, True):
        pytest.skip(f"{tmp_path} lacks renameat2 flags")
    st = atomicstore.open_store(str(tmp_path / "store"))
    with st.transaction("step_1") as txn:
        txn.write_bytes("data.bin", b"old")
    with st.transaction("step_1", overwrite=True) as txn:
        txn.write_bytes("data.bin", b"new")
    assert st.read_bytes("step_1", "data.bin") == b"new"
    assert _leftovers(st) == {}


# -- (f) crash consistency in fallback mode -----------------------------------------------
V1, V2 = b"one" * 700, b"two" * 900


def _save_one(st: atomicstore.Store, name: str, data: bytes, overwrite: bool = False) -> None:
    with st.one_file(name, overwrite=overwrite) as f:
        for i in range(0, len(data), 1000):
            f.write(data[i:i + 1000])


def _save_dir(st: atomicstore.Store, name: str, data: bytes, overwrite: bool = False) -> None:
    with st.transaction(name, overwrite=overwrite) as txn:
        txn.write_bytes("a/data.bin", data)
        txn.write_bytes("meta.json", b"{}")


SCENARIOS: dict[str, tuple[Callable[..., None], str, bool]] = {
    # what is saved, under which name, overwrite
    "one-file-save": (_save_one, "checkpoint_2", False),
    "one-file-overwrite": (_save_one, "checkpoint_1", True),
    "directory-save": (_save_dir, "step_2", False),
}


def _state(st: atomicstore.Store) -> dict[str, bytes]:
    d = st.driver
    return {k: d.read(k) for k in d.find("") if k != LOCK_KEY and not k.endswith("manifest.json")}


def _expected(scenario: str) -> tuple[dict[str, bytes], dict[str, bytes]]:
    save, name, overwrite = SCENARIOS[scenario]
    if save is _save_one:
        before = {"checkpoint_1": V1}
        return before, {"checkpoint_1": V2} if overwrite else {**before, name: V2}
    before = {"step_1/a/data.bin": V1, "step_1/meta.json": b"{}"}
    return before, {**before, "step_2/a/data.bin": V2, "step_2/meta.json": b"{}"}


def _crash_every_point(root: Root, scenario: str,
                       crashing: Callable[[atomicstore.Store, Crasher], Any]) -> int:
    """Commit the old state, crash the save of the new one before each operation the
    crasher counts, recover, and check that exactly the old or the new state is there
    (the new one if nothing crashed), with no garbage and every checkpoint verifying."""
    save, name, overwrite = SCENARIOS[scenario]
    first = "checkpoint_1" if save is _save_one else "step_1"
    before, after = _expected(scenario)

    def run(sub: str, crash_at: int | None) -> Crasher:
        st = root.open(sub)
        save(st, first, V1)
        c = Crasher(crash_at=crash_at)
        with crashing(st, c) as crash_store:
            try:
                save(crash_store, name, V2, overwrite)
            except SimulatedCrash:
                pass
        _close_fds_under(root.path / sub)  # the writer died: the kernel closes its files
        return c

    probe = run("probe", None)
    assert probe.count > 2
    for k in range(probe.count + 1):
        sub = f"k{k}"
        c = run(sub, k if k < probe.count else None)
        st = root.open(sub)  # a new process
        st.recover(now=FUTURE, flax_prefix="checkpoint_")
        where = f"{root.kind} {scenario}: crash before op {k}/{probe.count} " + (
            f"(after {c.log[-1]})" if c.log else "(start)")
        state = _state(st)
        assert state in ([after] if k == probe.count else [before, after]), (
            f"{where}: {sorted(state)}")
        if save is _save_dir:
            assert st.list() == sorted({k.split("/")[0] for k in state}), where
            for n in st.list():
                st.verify(n)
        assert _leftovers(st) == {}, where
        assert st.recover(now=FUTURE, flax_prefix="checkpoint_").actions == [], where
    return probe.count


@contextlib.contextmanager
def _driver_crashes(st: atomicstore.Store, c: Crasher) -> Iterator[atomicstore.Store]:
    yield atomicstore.Store(CrashingDriver(st.driver, c), lease_ttl=3600)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_crash_point_in_fallback_mode(fallback: Root, scenario: str) -> None:
    """The crash harness (tests/crashsim.py) before each driver operation."""
    _crash_every_point(fallback, scenario, _driver_crashes)


def test_crash_between_link_and_unlink_keeps_the_checkpoint(fallback: Root) -> None:
    """The one state of the link fallback between two system calls, built by hand: the
    staged file is also linked at the name. Recovery removes the staging link only."""
    st = fallback.open()
    _save_one(st, "checkpoint_1", V1)
    staged = f"{STAGING}/checkpoint_1.20000101T000000-0123456789ab"
    st.driver.makedirs(STAGING)
    os.link(st.driver.path("checkpoint_1"), st.driver.path(staged))
    report = st.recover(now=FUTURE, flax_prefix="checkpoint_")
    assert [a.target for a in report.actions] == [staged]
    assert st.driver.read("checkpoint_1") == V1
    assert _leftovers(st) == {}
