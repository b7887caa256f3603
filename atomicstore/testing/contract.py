"""The driver contract: what the commit layer relies on from a driver, as a pytest class.

A driver's test file subclasses :class:`DriverContract` and says where a fresh, empty
store lives (the ``location`` fixture); the base class holds the tests (as zarr-python's
``zarr.testing.store.StoreTests``)::

    import secrets
    import pytest
    from atomicstore.testing import DriverContract, StoreLocation

    class TestMyDriver(DriverContract):
        @pytest.fixture
        def location(self) -> StoreLocation:
            return StoreLocation(f"mine://bucket/{secrets.token_hex(6)}", {"token": "..."})

Every built-in driver runs it (``tests/drivers/test_contract.py``); a third-party driver
registered through the ``atomicstore.drivers`` entry point runs it the same way.

The tests follow the capabilities the driver declares (:class:`~atomicstore.Capabilities`):
where a capability is declared, the behaviour the commit layer then relies on is checked
(an atomic rename of a whole tree, a race of exclusive creates with one winner, listing and
aborting interrupted multipart uploads...); where it is not, the test checks that the
driver does not pretend to have it (``rename`` raises ``NotImplementedError``, no upload is
ever listed), so no test is skipped. Primitive operations come first (put, read, ranged
read, info, listing, delete, conditional writes and deletes, streamed writers), then the
whole protocol end to end through a :class:`~atomicstore.Store` over the driver: a commit
read back and verified, a second commit of the same name refused, recovery of an abandoned
attempt, a one-file commit.

Keys are ``/``-separated paths relative to the store root; the primitive tests write only
below ``t/``, away from the store's reserved ``.atomicstore/`` directory.

Needs pytest (the ``test`` extra); it never imports the project's own ``tests/``.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

import atomicstore
from atomicstore import (
    AlreadyExistsError,
    AtomicStoreError,
    Capabilities,
    ChecksumMismatchError,
    CommitConflictError,
    Driver,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    PreconditionFailedError,
    RetryPolicy,
    StorageError,
    StorageTimeoutError,
    Store,
)
from atomicstore.commit import crc32c
from atomicstore.drivers import Entry, driver_class, get_driver, secrets_of, split_url

MiB = 2**20

__all__ = ["DriverContract", "StoreLocation"]


@dataclass(frozen=True)
class StoreLocation:
    """Where one test's store lives: a URL (or local path) that nothing else uses, and the
    storage options to open it with (passed to fsspec unchanged)."""

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` reproducible pseudo-random bytes."""
    return random.Random(seed).randbytes(n)


def _wait_for(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _parts_landed(driver: Driver) -> None:
    """Wait until no part of a streamed upload is in flight: a driver built on the
    parallel-part writer counts the bytes of its requests in flight (``inflight``); a
    driver without one writes its parts before ``write`` returns."""
    budget = getattr(driver, "inflight", None)
    if budget is not None:
        _wait_for("the parts in flight", lambda: budget.used == 0)


class DriverContract:
    """Tests every driver must pass; subclass it in a ``Test...`` class and override the
    :meth:`location` fixture. (Not collected itself: its name does not start with
    ``Test``.)

    Class attributes a subclass may change:

    * :attr:`retry` - the retry policy of the drivers and stores the tests open;
    * :attr:`block_size` - their part size; :attr:`large` objects span more than two parts;
    * :attr:`clock_skew` - how far the backend's modification times may be from this
      machine's clock; :attr:`upload_times` - whether it reports when an upload started.
    """

    #: retry policy of every driver and store the tests open (short waits)
    retry: ClassVar[RetryPolicy] = RetryPolicy(attempts=8, initial_wait=0.01, max_wait=0.2, deadline=30)
    #: part size of the drivers the tests open (5 MiB: S3's smallest part)
    block_size: ClassVar[int] = 5 * MiB
    #: size of the "large" objects: more than two parts, the last one short
    large: ClassVar[int] = 2 * 5 * MiB + 7
    #: seconds the backend's modification times may differ from this machine's clock
    clock_skew: ClassVar[float] = 300.0
    #: the backend reports when an interrupted upload started (recovery judges its age);
    #: False only for a fake that answers a fixed time
    upload_times: ClassVar[bool] = True

    # -- what a subclass provides ----------------------------------------------------------
    @pytest.fixture
    def location(self) -> StoreLocation:
        """A fresh, empty store location for one test (override it)."""
        raise NotImplementedError(
            f"{type(self).__name__} must override the `location` fixture (a StoreLocation)")

    # -- fixtures built on it --------------------------------------------------------------
    @pytest.fixture
    def open_driver(self, location: StoreLocation) -> Iterator[Callable[[], Driver]]:
        """Opens another driver on the test's location (closed at the end)."""
        opened: list[Driver] = []

        def make() -> Driver:
            d = get_driver(location.url, storage_options=dict(location.storage_options),
                           retry=self.retry, block_size=self.block_size)
            opened.append(d)
            return d

        yield make
        for d in opened:
            d.close()

    @pytest.fixture
    def driver(self, open_driver: Callable[[], Driver]) -> Driver:
        """A driver on the test's location."""
        return open_driver()

    @pytest.fixture
    def open_store(self, location: StoreLocation) -> Iterator[Callable[..., Store]]:
        """Opens another :class:`~atomicstore.Store` on the test's location (keyword
        arguments go to :func:`atomicstore.open_store`; closed at the end)."""
        opened: list[Store] = []

        def make(**kwargs: Any) -> Store:
            kwargs.setdefault("retry", self.retry)
            kwargs.setdefault("block_size", self.block_size)
            s = atomicstore.open_store(location.url, **dict(location.storage_options), **kwargs)
            opened.append(s)
            return s

        yield make
        for s in opened:
            s.close()

    @pytest.fixture
    def store(self, open_store: Callable[..., Store]) -> Store:
        """A store on the test's location."""
        return open_store()

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def caps(driver: Driver) -> Capabilities:
        """What ``driver`` declares."""
        return driver.capabilities

    @staticmethod
    def user_keys(store: Store) -> set[str]:
        """Every object of ``store`` outside its reserved ``.atomicstore/`` directory."""
        return {k for k in store.driver.find("") if not k.startswith(".atomicstore/")}

    # == declaration ======================================================================
    def test_declares_protocols_and_capabilities(self, driver: Driver, location: StoreLocation) -> None:
        assert driver.protocols, "a driver names the URL protocols it serves"
        assert isinstance(driver.capabilities, Capabilities)
        protocol, _ = split_url(location.url)
        assert isinstance(driver, driver_class(protocol)), "the URL's protocol resolves to this driver"
        assert driver.block_size == self.block_size
        assert driver.url and driver.describe()

    def test_store_picks_the_strategy_the_capabilities_call_for(self, store: Store) -> None:
        caps = self.caps(store.driver)
        assert store.strategy.kind == ("rename" if caps.atomic_rename else "marker")

    def test_describe_names_the_key_without_credentials(self, driver: Driver, location: StoreLocation) -> None:
        where = driver.describe("t/some-key")
        assert "some-key" in where
        for secret in secrets_of(dict(location.storage_options)):
            assert secret not in where and secret not in driver.url and secret not in repr(driver)

    # == put / read / info ================================================================
    def test_put_then_read(self, driver: Driver) -> None:
        data = payload(1000, seed=1)
        driver.put("t/a.bin", data)
        assert driver.read("t/a.bin") == data
        driver.put("t/a.bin", b"replaced")
        assert driver.read("t/a.bin") == b"replaced"
        driver.put("t/empty", b"")
        assert driver.read("t/empty") == b""
        assert driver.info("t/empty").size == 0

    def test_put_returns_the_generation_info_reports(self, driver: Driver) -> None:
        gen = driver.put("t/g", b"one")
        info = driver.info("t/g")
        assert info.generation is not None, "info reports a generation (conditional writes take it)"
        assert gen is None or gen == info.generation

    def test_generation_changes_when_the_object_is_written(self, driver: Driver) -> None:
        driver.put("t/g", b"first")
        first = driver.info("t/g").generation
        driver.put("t/g", b"second, longer")
        assert driver.info("t/g").generation != first

    def test_a_conditional_overwrite_moves_the_modification_time_forward(self, driver: Driver) -> None:
        # a lease is live while its object was written within ttl + grace, by the object's
        # own modification time: each renewal (a conditional overwrite) must move it
        # forward, or recovery fences a writer that is alive
        driver.put("t/lease", b"1")
        first = driver.info("t/lease")
        time.sleep(1.1)  # mtimes of one-second resolution (S3's Last-Modified)
        driver.put("t/lease", b"2", if_generation=first.generation)
        second = driver.info("t/lease").mtime
        assert first.mtime is not None and second is not None
        assert second > first.mtime + 0.5, "a rewritten object keeps its old modification time"

    def test_ranged_reads(self, driver: Driver) -> None:
        data = payload(10_000, seed=2)
        driver.put("t/r.bin", data)
        for start, end in [(0, 1), (0, 10_000), (1234, 5678), (9_999, 10_000), (5000, None), (None, 100),
                           (100, 100)]:
            assert driver.read("t/r.bin", start, end) == data[start:end], (start, end)
        # past the end: what there is, as a slice would
        assert driver.read("t/r.bin", 9_990, 20_000) == data[9_990:]

    def test_info_gives_size_mtime_and_generation(self, driver: Driver) -> None:
        before = time.time()
        driver.put("t/i.bin", payload(4321))
        info = driver.info("t/i.bin")
        assert info.key == "t/i.bin"
        assert info.size == 4321
        assert info.mtime is not None, "recovery judges unleased data by its age"
        assert before - self.clock_skew <= info.mtime <= time.time() + self.clock_skew
        assert info.generation

    def test_exists(self, driver: Driver) -> None:
        assert not driver.exists("t/x")
        driver.put("t/x", b"1")
        assert driver.exists("t/x")
        driver.put("t/d/y", b"2")
        if self.caps(driver).directories:
            assert driver.exists("t/d"), "a directory exists (the rename strategy asks)"
        driver.delete("t/x")
        assert not driver.exists("t/x")

    def test_missing_keys_raise_not_found(self, driver: Driver) -> None:
        driver.put("t/there", b"x")
        calls: list[Callable[[], object]] = [
            lambda: driver.read("t/missing"),
            lambda: driver.read("t/missing", 0, 10),
            lambda: driver.info("t/missing"),
            lambda: driver.read_into("t/missing", 0, memoryview(bytearray(4))),
            lambda: b"".join(driver.iter_read("t/missing")),
            lambda: driver.read_if("t/missing", driver.info("t/there").generation or "0"),
        ]
        for call in calls:
            with pytest.raises(NotFoundError) as info:
                call()
            assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, AtomicStoreError)

    def test_a_prefix_is_not_a_file(self, driver: Driver) -> None:
        driver.put("t/dir/file", b"x")
        with pytest.raises(NotFoundError):
            driver.info("t/dir")

    def test_put_leaves_no_temporary_behind(self, driver: Driver) -> None:
        driver.put("t/p", b"1")
        driver.put("t/p", b"2")
        driver.put_volatile("t/v", b"3")
        driver.put("t/e", b"4", exclusive=True)
        assert set(driver.find("t")) == {"t/p", "t/v", "t/e"}
        assert not any(driver.is_temporary(k) for k in driver.find("t"))

    # == conditional writes and deletes ===================================================
    def test_exclusive_put_creates_once(self, driver: Driver) -> None:
        gen = driver.put("t/once", b"first", exclusive=True)
        with pytest.raises(AlreadyExistsError) as info:
            driver.put("t/once", b"second", exclusive=True)
        assert not isinstance(info.value, CommitConflictError)
        assert driver.read("t/once") == b"first"
        assert gen is None or driver.info("t/once").generation == gen

    def test_exclusive_put_race_has_one_winner(self, driver: Driver,
                                               open_driver: Callable[[], Driver]) -> None:
        drivers = [open_driver() for _ in range(4)]
        go = threading.Barrier(8)

        def attempt(i: int) -> bool:
            go.wait(30)
            try:
                drivers[i % 4].put("t/race", str(i).encode(), exclusive=True)
                return True
            except AlreadyExistsError:
                return False

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            won = list(pool.map(attempt, range(8)))
        if self.caps(driver).atomic_create:
            assert won.count(True) == 1, won
            assert driver.read("t/race") == str(won.index(True)).encode()
        else:  # (no atomic create declared: at least one got it, and what is there is whole)
            assert won.count(True) >= 1
            assert driver.read("t/race").decode() in {str(i) for i, w in enumerate(won) if w}

    def test_put_if_generation_swaps_only_that_generation(self, driver: Driver) -> None:
        driver.put("t/cas", b"v1")
        g1 = driver.info("t/cas").generation
        assert g1 is not None
        g2 = driver.put("t/cas", b"v2", if_generation=g1)
        assert driver.read("t/cas") == b"v2"
        now = driver.info("t/cas").generation
        assert now != g1 and (g2 is None or g2 == now)
        with pytest.raises(PreconditionFailedError) as info:
            driver.put("t/cas", b"stale", if_generation=g1)
        assert isinstance(info.value, AlreadyExistsError)
        assert driver.read("t/cas") == b"v2"

    def test_put_if_generation_of_a_missing_key_is_refused(self, driver: Driver) -> None:
        driver.put("t/other", b"x")
        gen = driver.info("t/other").generation
        assert gen is not None
        with pytest.raises(PreconditionFailedError):
            driver.put("t/absent", b"y", if_generation=gen)
        assert not driver.exists("t/absent")

    def test_put_volatile_replaces_and_takes_a_generation(self, driver: Driver) -> None:
        # leases: renewed with put_volatile at the generation the writer last wrote
        g1 = driver.put_volatile("t/lease", b"renewed 1")
        assert driver.read("t/lease") == b"renewed 1"
        g1 = g1 or driver.info("t/lease").generation
        assert g1 is not None
        g2 = driver.put_volatile("t/lease", b"renewed 2", if_generation=g1)
        assert driver.read("t/lease") == b"renewed 2"
        assert (g2 or driver.info("t/lease").generation) != g1
        with pytest.raises(PreconditionFailedError):
            driver.put_volatile("t/lease", b"stale", if_generation=g1)
        assert driver.read("t/lease") == b"renewed 2"

    def test_delete_if_generation(self, driver: Driver) -> None:
        driver.put("t/del", b"v1")
        g1 = driver.info("t/del").generation
        assert g1 is not None
        driver.put("t/del", b"v2")
        with pytest.raises(PreconditionFailedError):
            driver.delete("t/del", if_generation=g1)
        assert driver.read("t/del") == b"v2"
        driver.delete("t/del", if_generation=driver.info("t/del").generation)
        assert not driver.exists("t/del")
        # a conditional delete of what is gone (a retry whose first try landed): no error
        driver.delete("t/del", if_generation=g1)

    def test_delete_removes_one_key_and_a_missing_one_is_no_error(self, driver: Driver) -> None:
        driver.put("t/a", b"1")
        driver.put("t/ab", b"2")
        driver.put("t/a2/x", b"3")
        driver.delete("t/a")
        assert set(driver.find("t")) == {"t/ab", "t/a2/x"}
        driver.delete("t/a")
        driver.delete("t/never")

    def test_delete_tree_removes_the_prefix_and_nothing_beside_it(self, driver: Driver) -> None:
        for k in ["t/a/1", "t/a/sub/2", "t/a/sub/deeper/3", "t/ab/4", "t/a.txt", "t/b/5"]:
            driver.put(k, k.encode())
        driver.delete_tree("t/a")
        assert set(driver.find("t")) == {"t/ab/4", "t/a.txt", "t/b/5"}
        assert driver.listdir("t/a") == []
        driver.delete_tree("t/a")  # missing: no error
        driver.delete_tree("t/nothing")

    # == reads into buffers, streams, conditional reads ===================================
    def test_read_into_fills_the_buffer(self, driver: Driver) -> None:
        data = payload(self.large, seed=3)
        driver.put("t/big", data)
        out = bytearray(3 * MiB)
        n = driver.read_into("t/big", 1000, memoryview(out))
        assert n == len(out) and bytes(out) == data[1000 : 1000 + len(out)]
        tail = bytearray(100)
        n = driver.read_into("t/big", len(data) - 30, memoryview(tail))
        assert n == 30 and bytes(tail[:30]) == data[-30:], "fewer only at the end of the object"
        whole = bytearray(len(data))
        assert driver.read_into("t/big", 0, memoryview(whole), generation=driver.info("t/big").generation) == len(data)
        assert bytes(whole) == data

    def test_read_into_refuses_a_replaced_generation(self, driver: Driver) -> None:
        driver.put("t/v", b"version one")
        old = driver.info("t/v").generation
        driver.put("t/v", b"version two!")
        with pytest.raises(PreconditionFailedError):
            driver.read_into("t/v", 0, memoryview(bytearray(5)), generation=old)

    def test_read_ranges_into_fills_every_range(self, driver: Driver) -> None:
        data = payload(self.large, seed=5)
        driver.put("t/many", data)
        outs = [bytearray(n) for n in (MiB + 5, 3, 2 * MiB, 100)]
        starts = [0, MiB + 5, 7, len(data) - 40]  # overlapping, out of order, past the end
        ranges = [(a, memoryview(o)) for a, o in zip(starts, outs, strict=True)]
        gen = driver.info("t/many").generation
        assert driver.read_ranges_into("t/many", ranges, generation=gen) == [MiB + 5, 3, 2 * MiB, 40]
        for a, o in zip(starts[:3], outs[:3], strict=True):
            assert bytes(o) == data[a : a + len(o)]
        assert bytes(outs[3][:40]) == data[-40:], "fewer only at the end of the object"
        assert driver.read_ranges_into("t/many", [], threads=1) == []
        one = bytearray(10)
        assert driver.read_ranges_into("t/many", [(3, memoryview(one))], threads=1) == [10]
        assert bytes(one) == data[3:13]
        driver.put("t/many", b"replaced")
        with pytest.raises(PreconditionFailedError):
            driver.read_ranges_into("t/many", ranges, generation=gen)
        with pytest.raises(NotFoundError):
            driver.read_ranges_into("t/absent", ranges)

    def test_iter_read_streams_the_object_in_order(self, driver: Driver) -> None:
        data = payload(self.large, seed=4)
        driver.put("t/s", data)
        chunks = list(driver.iter_read("t/s", chunk_size=MiB))
        assert b"".join(chunks) == data
        assert all(0 < len(c) <= MiB for c in chunks)
        assert b"".join(driver.iter_read("t/s")) == data
        driver.put("t/zero", b"")
        assert b"".join(driver.iter_read("t/zero")) == b""

    def test_read_if_reads_only_that_generation(self, driver: Driver) -> None:
        driver.put("t/m", b"marker one")
        g1 = driver.info("t/m").generation
        assert g1 is not None
        assert driver.read_if("t/m", g1) == b"marker one"
        driver.put("t/m", b"marker two")
        with pytest.raises(PreconditionFailedError):
            driver.read_if("t/m", g1)

    # == listings =========================================================================
    def test_listdir_gives_immediate_children(self, driver: Driver) -> None:
        for k in ["t/l/a", "t/l/b", "t/l/sub/c", "t/l/sub/deep/d", "t/lx/e"]:
            driver.put(k, b"x")
        got = sorted(driver.listdir("t/l"), key=lambda e: e.name)
        assert got == [Entry("a", False), Entry("b", False), Entry("sub", True)]
        assert driver.listdir("t/missing") == []
        assert {e.name for e in driver.listdir("t")} == {"l", "lx"}

    def test_find_lists_every_object_below_a_prefix_and_nothing_beside_it(self, driver: Driver) -> None:
        data = {"t/f/a": b"1", "t/f/sub/b": b"22", "t/f/sub/deep/c": b"333", "t/fx/d": b"4", "t/f.e": b"5"}
        for k, v in data.items():
            driver.put(k, v)
        found = driver.find("t/f")
        assert set(found) == {"t/f/a", "t/f/sub/b", "t/f/sub/deep/c"}
        for k, info in found.items():
            assert info.key == k and info.size == len(data[k])
            assert info.mtime is not None, "recovery judges leftovers by the listing's times"
            if info.generation is not None:
                assert info.generation == driver.info(k).generation
        assert set(driver.find("t")) == set(data)
        assert driver.find("t/missing") == {}

    def test_listings_see_every_write_and_delete_at_once(self, driver: Driver) -> None:
        # no listing cache: recovery and the marker strategy decide from one listing
        for i in range(5):
            driver.put(f"t/n/{i}", b"x")
            assert f"t/n/{i}" in driver.find("t/n")
            assert f"t/n/{i}" in driver.scan("t/n")[0]
        driver.delete("t/n/2")
        assert "t/n/2" not in driver.find("t/n")
        assert "t/n/2" not in driver.scan("t/n")[0]
        assert "2" not in {e.name for e in driver.listdir("t/n")}

    def test_scan_rolls_up_below_the_delimiter(self, driver: Driver) -> None:
        for k in ["t/s/a", "t/s/b", "t/s/d1/x", "t/s/d1/y/z", "t/s/d2/w", "t/sx/no"]:
            driver.put(k, b"x")
        objects, prefixes = driver.scan("t/s")
        assert set(objects) == {"t/s/a", "t/s/b"}
        assert prefixes == {"t/s/d1/", "t/s/d2/"}
        for k, info in objects.items():
            assert info.size == 1
            if info.generation is not None:
                assert info.generation == driver.info(k).generation
        assert driver.scan("t/missing") == ({}, set())

    def test_scan_with_the_marker_strategys_delimiter(self, driver: Driver) -> None:
        # the marker strategy lists committed checkpoints with the delimiter "/attempt-":
        # each marker is an object, the files of all attempts of a name one prefix
        keys = ["t/c1/commit_success.txt", "t/c1/attempt-1/manifest.json", "t/c1/attempt-1/a/b.bin",
                "t/c1/attempt-2/manifest.json", "t/c2/commit_success.txt", "t/c2/plain/file", "t/c3/attempt-9/x"]
        for k in keys:
            driver.put(k, b"x")
        objects, prefixes = driver.scan("t", "/attempt-")
        assert set(objects) == {"t/c1/commit_success.txt", "t/c2/commit_success.txt", "t/c2/plain/file"}
        assert prefixes == {"t/c1/attempt-", "t/c3/attempt-"}
        with pytest.raises(InvalidArgumentError):
            driver.scan("t", "")

    # == streamed writers =================================================================
    @pytest.mark.parametrize("size", ["small", "large"])
    def test_writer_streams_pieces(self, driver: Driver, size: str) -> None:
        n = 1000 if size == "small" else self.large
        data = payload(n, seed=5)
        w = driver.open_writer("t/w.bin")
        pos, step = 0, 0
        while pos < n:  # odd sizes, copied and lent
            k = min([17, 300_001, 2 * MiB + 3][step % 3], n - pos)
            piece = memoryview(data)[pos : pos + k]
            if step % 2:
                w.write_borrowed(piece)
            else:
                w.write(bytes(piece))
            pos, step = pos + k, step + 1
        w.close()
        assert driver.read("t/w.bin") == data
        info = driver.info("t/w.bin")
        assert info.size == n
        assert w.generation is None or w.generation == info.generation

    def test_writer_of_nothing_makes_an_empty_object(self, driver: Driver) -> None:
        w = driver.open_writer("t/empty.bin")
        w.close()
        assert driver.read("t/empty.bin") == b""
        assert driver.info("t/empty.bin").size == 0

    def test_writer_close_async(self, driver: Driver) -> None:
        data = payload(self.large, seed=6)
        w = driver.open_writer("t/async.bin")
        w.write(data)
        assert w.close_async().result(timeout=120) is None
        assert driver.read("t/async.bin") == data

    def test_writer_shows_nothing_before_close(self, driver: Driver) -> None:
        data = payload(self.large, seed=7)
        w = driver.open_writer("t/pending.bin")
        w.write(data)
        _parts_landed(driver)
        if not self.caps(driver).atomic_rename:
            # object stores: the object appears whole at close (a one-file commit streams
            # straight to its name); rename backends write into private staging instead
            assert not driver.exists("t/pending.bin")
            assert "t/pending.bin" not in driver.find("t")
        w.close()
        assert driver.read("t/pending.bin") == data

    @pytest.mark.parametrize("size", ["small", "large"])
    def test_writer_abort_leaves_nothing(self, driver: Driver, size: str) -> None:
        n = 100 if size == "small" else self.large
        w = driver.open_writer("t/aborted.bin")
        w.write(payload(n, seed=8))
        _parts_landed(driver)
        w.abort()
        w.abort()  # idempotent
        assert not driver.exists("t/aborted.bin")
        assert driver.find("t") == {}
        assert not [u for u in driver.list_incomplete_uploads("") if u[0] == "t/aborted.bin"]

    @pytest.mark.parametrize("size", ["small", "large"])
    def test_exclusive_writer_is_refused_at_close_if_the_key_exists(self, driver: Driver, size: str) -> None:
        n = 100 if size == "small" else self.large
        w = driver.open_writer("t/x.bin", exclusive=True)
        w.write(payload(n, seed=9))
        w.close()
        assert driver.info("t/x.bin").size == n
        late = driver.open_writer("t/x.bin", exclusive=True)
        late.write(b"late" * (n // 4))
        with pytest.raises(AlreadyExistsError):
            late.close()
        late.abort()
        assert driver.read("t/x.bin") == payload(n, seed=9)

    def test_writer_if_generation(self, driver: Driver) -> None:
        if self.caps(driver).atomic_rename:
            return  # rename backends replace by staging and renaming (commit/onefile.py)
        driver.put("t/o.bin", b"old")
        gen = driver.info("t/o.bin").generation
        assert gen is not None
        w = driver.open_writer("t/o.bin", if_generation=gen)
        w.write(b"new")
        w.close()
        assert driver.read("t/o.bin") == b"new"
        stale = driver.open_writer("t/o.bin", if_generation=gen)
        stale.write(b"stale")
        with pytest.raises(PreconditionFailedError):
            stale.close()
        stale.abort()
        assert driver.read("t/o.bin") == b"new"

    # == multipart uploads ================================================================
    def test_an_interrupted_upload_is_listed_and_aborted(self, driver: Driver) -> None:
        w = driver.open_writer("t/up.bin")
        w.write(payload(self.large, seed=10))
        _parts_landed(driver)
        try:
            ours = [u for u in driver.list_incomplete_uploads("t") if u[0] == "t/up.bin"]
            if not self.caps(driver).multipart_uploads:
                assert driver.list_incomplete_uploads("") == []
                return
            assert len(ours) == 1, driver.list_incomplete_uploads("")
            key, upload_id, started = ours[0]
            assert isinstance(upload_id, str) and upload_id
            if self.upload_times:
                assert abs(started - time.time()) < self.clock_skew + 60, started
            assert [u for u in driver.list_incomplete_uploads("") if u[0] == key]
            assert not [u for u in driver.list_incomplete_uploads("elsewhere") if u[0] == key]
            driver.abort_upload(key, upload_id)
            assert not [u for u in driver.list_incomplete_uploads("") if u[0] == key]
            driver.abort_upload(key, upload_id)  # gone already: no error
        finally:
            w.abort()
        assert not driver.exists("t/up.bin")

    # == rename backends: rename, exchange, directories, lock =============================
    def test_rename_moves_a_tree_and_refuses_to_replace(self, driver: Driver) -> None:
        driver.put("t/src/a", b"1")
        driver.put("t/src/sub/b", b"2")
        driver.put("t/dst/c", b"3")
        if not self.caps(driver).atomic_rename:
            with pytest.raises(NotImplementedError):
                driver.rename("t/src", "t/new")
            return
        driver.rename("t/src", "t/new")
        assert set(driver.find("t")) == {"t/new/a", "t/new/sub/b", "t/dst/c"}
        assert not driver.exists("t/src")
        with pytest.raises(AlreadyExistsError):
            driver.rename("t/new", "t/dst")
        assert driver.read("t/dst/c") == b"3" and driver.read("t/new/a") == b"1"
        with pytest.raises(NotFoundError):
            driver.rename("t/gone", "t/elsewhere")
        driver.rename("t/new/a", "t/file")  # a single file too (one-file commits)
        assert driver.read("t/file") == b"1"
        with pytest.raises(AlreadyExistsError):
            driver.rename("t/new/sub/b", "t/file")

    def test_exchange_swaps_trees(self, driver: Driver) -> None:
        driver.put("t/a/x", b"a's")
        driver.put("t/b/y", b"b's")
        driver.put("t/f1", b"file one")
        driver.put("t/f2", b"file two")
        if not self.caps(driver).atomic_rename:
            with pytest.raises(NotImplementedError):
                driver.exchange("t/a", "t/b")
            return
        driver.exchange("t/f1", "t/f2")  # files: the one-file overwrite
        assert driver.read("t/f2") == b"file one"
        assert not driver.exists("t/f1") or driver.read("t/f1") == b"file two"
        if not driver.capabilities.replaces_directories:
            with pytest.raises(StorageError):
                driver.exchange("t/a", "t/b")
            return
        driver.exchange("t/a", "t/b")
        assert driver.read("t/a/y") == b"b's" and driver.read("t/b/x") == b"a's"
        assert set(driver.find("t/a")) == {"t/a/y"} and set(driver.find("t/b")) == {"t/b/x"}
        with pytest.raises(NotFoundError):
            driver.exchange("t/a", "t/missing")
        assert driver.read("t/a/y") == b"b's", "a failed exchange changes nothing"

    def test_makedirs_and_fsync_dir(self, driver: Driver) -> None:
        # the rename strategy makes the trash directory, then renames a tree into it
        driver.makedirs("t/d/e")
        driver.makedirs("t/d/e")  # exists already: no error
        driver.put("t/f/g", b"x")
        driver.fsync_dir("t/f")
        driver.fsync_dir("")
        if self.caps(driver).atomic_rename:
            driver.rename("t/f", "t/d/e/moved")
            assert driver.read("t/d/e/moved/g") == b"x"
            driver.fsync_dir("t/d/e")
        if not self.caps(driver).directories:
            assert set(driver.find("t")) == {"t/f/g"}, "no directory objects"

    def test_lock_excludes_other_threads(self, driver: Driver, open_driver: Callable[[], Driver]) -> None:
        other = open_driver()
        inside = threading.Event()
        release = threading.Event()
        errors: list[BaseException] = []

        def holder() -> None:
            try:
                with driver.lock():
                    inside.set()
                    release.wait(30)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                inside.set()

        t = threading.Thread(target=holder)
        t.start()
        try:
            assert inside.wait(30) and not errors, errors
            with pytest.raises(StorageTimeoutError):
                with other.lock(timeout=0.3):
                    pass
        finally:
            release.set()
            t.join(30)
        with other.lock(timeout=30):
            pass

    # == end to end: a Store over the driver ==============================================
    def test_store_commits_and_reads_back_verified(self, store: Store, open_store: Callable[..., Store]) -> None:
        big = payload(self.large, seed=11)
        with store.transaction("step_1", metadata={"step": 1}) as txn:
            with txn.open("state/big.bin") as f:
                for i in range(0, len(big), 3 * MiB + 1):
                    f.write(memoryview(big)[i : i + 3 * MiB + 1])
            txn.write_bytes("meta.json", b"{}")
            txn.write_bytes("empty", b"")
        assert txn.committed
        other = open_store()
        assert other.list() == ["step_1"] and other.exists("step_1")
        ckpt = other.open("step_1")
        assert ckpt.metadata == {"step": 1}
        assert set(ckpt.files) == {"state/big.bin", "meta.json", "empty"}
        assert ckpt.files["state/big.bin"].crc32c == crc32c(big)
        assert ckpt.read_bytes("state/big.bin") == big
        assert ckpt.read_range("state/big.bin", 5 * MiB - 3, 5 * MiB + 100) == big[5 * MiB - 3 : 5 * MiB + 100]
        assert ckpt.read_bytes("empty") == b""
        assert other.verify("step_1").files == ckpt.files
        gen = other.committed()["step_1"]
        if gen is not None:
            assert other.open("step_1", generation=gen).files == ckpt.files

    def test_store_refuses_a_second_commit_of_a_name(self, store: Store, open_store: Callable[..., Store]) -> None:
        first = store.transaction("same")
        second = open_store().transaction("same")
        first.write_bytes("who", b"first")
        second.write_bytes("who", b"second")
        first.commit()
        with pytest.raises(CommitConflictError) as info:
            second.commit()
        assert info.value.name == "same"
        with pytest.raises(CommitConflictError):
            store.transaction("same")
        assert store.read_bytes("same", "who") == b"first"
        ckpt = store.open("same")
        expected = {ckpt.key(p) for p in [*ckpt.files, "manifest.json"]}
        if store.strategy.kind == "marker":
            expected.add("same/commit_success.txt")
        assert self.user_keys(store) == expected, "the loser left nothing behind"

    def test_store_an_exception_in_a_transaction_leaves_nothing(self, store: Store) -> None:
        with pytest.raises(RuntimeError, match="boom"):
            with store.transaction("t2") as txn:
                txn.write_bytes("a.bin", b"partial")
                with txn.open("b.bin") as f:
                    f.write(payload(self.large, seed=12))
                raise RuntimeError("boom")
        assert store.list() == [] and not store.exists("t2")
        assert self.user_keys(store) == set()
        assert not store.driver.list_incomplete_uploads("")
        with store.transaction("t2") as txn:
            txn.write_bytes("a.bin", b"second try")
        assert store.read_bytes("t2", "a.bin") == b"second try"

    def test_store_overwrite_replaces_in_one_step(self, store: Store) -> None:
        with store.transaction("o") as txn:
            txn.write_bytes("v", b"one")
        replace = store.transaction("o", overwrite=True)
        replace.write_bytes("v", b"two")
        if self.caps(store.driver).atomic_rename and not store.driver.capabilities.replaces_directories:
            with pytest.raises(StorageError):
                replace.commit()
            assert store.read_bytes("o", "v") == b"one"
            return
        replace.commit()
        assert store.list() == ["o"]
        assert store.read_bytes("o", "v") == b"two"
        ckpt = store.open("o")
        expected = {ckpt.key(p) for p in [*ckpt.files, "manifest.json"]}
        if store.strategy.kind == "marker":
            expected.add("o/commit_success.txt")
        assert self.user_keys(store) == expected, "the replaced data was removed"

    def test_store_delete_removes_everything(self, store: Store) -> None:
        with store.transaction("d") as txn:
            txn.write_bytes("x/y.bin", payload(1000))
        with store.transaction("keep") as txn:
            txn.write_bytes("k", b"k")
        store.delete("d")
        assert store.list() == ["keep"] and not store.exists("d")
        with pytest.raises(NotFoundError):
            store.open("d")
        assert not any(k.startswith("d/") or k == "d" for k in self.user_keys(store))
        with pytest.raises(NotFoundError):
            store.delete("d")

    def test_store_a_flipped_byte_is_caught(self, store: Store) -> None:
        data = payload(100_000, seed=13)
        with store.transaction("c") as txn:
            txn.write_bytes("good.bin", b"fine")
            txn.write_bytes("dir/bad.bin", data)
        ckpt = store.open("c")
        corrupted = bytearray(data)
        corrupted[54_321] ^= 0x10
        store.driver.put(ckpt.key("dir/bad.bin"), bytes(corrupted))
        with pytest.raises(ChecksumMismatchError, match="bad.bin") as info:
            store.verify("c")
        assert info.value.path == "dir/bad.bin"
        with pytest.raises(ChecksumMismatchError, match="bad.bin"):
            store.read_bytes("c", "dir/bad.bin")
        with pytest.raises(ChecksumMismatchError, match="bad.bin"), store.open("c").open("dir/bad.bin") as f:
            while f.read(4096):
                pass
        assert store.read_bytes("c", "good.bin") == b"fine"

    def test_store_recovery_removes_an_abandoned_attempt(self, store: Store, open_store: Callable[..., Store]) -> None:
        with store.transaction("committed") as txn:
            txn.write_bytes("a.bin", b"kept")
        abandoned = open_store(lease_ttl=3600).transaction("abandoned")
        abandoned.write_bytes("a.bin", b"never committed")
        f = abandoned.open("big.bin")  # an upload left open (multipart on object stores)
        f.write(payload(self.large, seed=14))
        _parts_landed(store.driver)
        prefix = abandoned.prefix
        assert any(k.startswith(prefix + "/") for k in store.driver.find(""))
        try:
            assert not open_store().recover(grace=3600).actions, "a live lease protects the attempt"
            report = open_store().recover(now=time.time() + 10**7)  # its writer declared dead
            assert report.actions, report.summary()
            assert not any(k.startswith(prefix + "/") for k in store.driver.find(""))
            assert not [u for u in store.driver.list_incomplete_uploads("") if u[0].startswith(prefix + "/")]
            with pytest.raises((LeaseLostError, NotFoundError, StorageError)):
                f.close()  # (object stores: its upload is gone)
                abandoned.commit()  # a writer declared dead never commits
        finally:
            abandoned.abort()
        assert store.list() == ["committed"]
        store.verify("committed")
        assert not open_store().recover(now=time.time() + 10**7).actions

    def test_store_one_file_commit(self, store: Store, open_store: Callable[..., Store]) -> None:
        data = payload(self.large, seed=15)
        with store.one_file("single") as c:
            for i in range(0, len(data), 4 * MiB):
                c.write(memoryview(data)[i : i + 4 * MiB])
        assert store.read_file("single") == data
        assert store.list() == [], "a one-file checkpoint is not a directory-layout one"
        with pytest.raises(CommitConflictError):
            with open_store().one_file("single") as late:
                late.write(b"late")
        assert store.read_file("single") == data
        with store.one_file("single", overwrite=True) as c:
            c.write(b"replaced")
        assert store.read_file("single") == b"replaced"
        assert self.user_keys(store) == {"single"}, "staging and the replaced file are gone"
        store.delete_one_file("single")
        assert self.user_keys(store) == set()
        assert not store.driver.list_incomplete_uploads("")

    def test_store_write_file_replaces_or_refuses(self, store: Store, open_store: Callable[..., Store]) -> None:
        store.write_file("state.json", b'{"step": 1}')
        store.write_file("state.json", b'{"step": 2}')
        assert store.read_file("state.json") == b'{"step": 2}'
        with pytest.raises(AlreadyExistsError):
            store.write_file("state.json", b'{"step": 3}', overwrite=False)
        assert open_store().read_file("state.json") == b'{"step": 2}'

    def test_store_conformance_holds_for_commits(self, store: Store) -> None:
        report = store.conformance()
        assert not report.failures("commit"), report
