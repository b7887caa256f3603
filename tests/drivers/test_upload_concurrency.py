"""How the parts of one S3 upload go out (issue 22, the cloud-link benchmark on SeaweedFS).

- At most ``PARTS_IN_FLIGHT`` (16) parts of one upload are in flight at once, whatever
  room the store's in-flight budget has (SeaweedFS answered some of 32 parts sent
  together seconds after their bytes had arrived).
- The last part of an upload never waits for a slot (a short tail waiting for a whole
  part's transfer delayed the completion behind it).
- Part bodies go out right after their headers: no ``Expect: 100-continue`` round trip.

Observed on the server through :class:`test_parallel_io.Tracker` (behind the fault
injector), on moto and on SeaweedFS.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import Backend, make_backend
from test_parallel_io import Tracker, part_of

from atomicstore.drivers import s3 as s3_driver

MiB = 2**20


@pytest.fixture(params=["s3", "seaweed"])
def s3_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    return make_backend(request.param, request, tmp_path)


def track(backend: Backend, watch: Any, hold: float) -> Tracker:
    injector = backend.server.injector
    t = Tracker(injector.app, watch, hold)
    inner = injector.app
    injector.app = t
    t.restore = lambda: setattr(injector, "app", inner)  # type: ignore[attr-defined]
    return t


def write_one_file(backend: Backend, data: bytes, watch: Any, hold: float) -> Tracker:
    store = backend.open(block_size=5 * MiB, max_inflight_bytes=64 * MiB)  # room for 12 parts
    t = track(backend, watch, hold)
    try:
        with store.transaction("step_1") as txn:
            f = txn.open("state.bin")
            f.write(data)
            f.close()
    finally:
        t.restore()  # type: ignore[attr-defined]
    assert store.read_bytes("step_1", "state.bin") == data
    assert store.driver.inflight.used == 0
    return t


def test_the_default_cap_is_16_parts_per_upload():
    assert s3_driver._S3Writer.max_parts_in_flight == s3_driver.PARTS_IN_FLIGHT == 16


def test_parts_of_one_upload_in_flight_are_capped(s3_backend, monkeypatch):
    """Six full parts and a short tail with room for twelve in the budget: at most three
    full parts at once (before: all seven at once), plus the tail, which never waits."""
    monkeypatch.setattr(s3_driver._S3Writer, "max_parts_in_flight", 3, raising=False)
    data = os.urandom(6 * 5 * MiB + 1000)
    t = write_one_file(s3_backend, data, part_of, hold=0.4)
    assert len(t.seen) == 7, t.seen
    assert 3 <= t.max_count <= 4, f"at most 3 full parts and the tail at once, saw {t.max_count}"


def test_the_last_part_does_not_wait_for_a_slot(s3_backend, monkeypatch):
    """Two full parts fill both slots and are held: the tail goes out meanwhile."""
    monkeypatch.setattr(s3_driver._S3Writer, "max_parts_in_flight", 2, raising=False)
    data = os.urandom(2 * 5 * MiB + 1000)
    t = write_one_file(s3_backend, data, part_of, hold=0.8)
    assert len(t.seen) == 3, t.seen
    assert t.max_count == 3, "the tail must have been sent while both full parts were held"


def test_part_bodies_are_sent_without_waiting_for_100_continue(s3_backend):
    expects: list[str | None] = []

    def watch(environ: dict[str, Any]) -> Any:
        what = part_of(environ)
        if what:
            expects.append(environ.get("HTTP_EXPECT"))
        return what

    write_one_file(s3_backend, os.urandom(2 * 5 * MiB + 1000), watch, hold=0.0)
    assert len(expects) == 3
    assert expects == [None] * 3, f"parts asked for 100-continue: {expects}"
