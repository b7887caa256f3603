"""How the parts of one S3 upload go out (issue 22, the cloud-link benchmark on SeaweedFS).

- At most ``PARTS_IN_FLIGHT`` (16) parts of one upload are in flight at once, whatever
  room the store's in-flight budget has (SeaweedFS answered some of 32 parts sent
  together seconds after their bytes had arrived).
- The last part of an upload never waits for a slot (a short tail waiting for a whole
  part's transfer delayed the completion behind it).
- Part bodies go out right after their headers: no ``Expect: 100-continue`` round trip,
  and unhashed (``UNSIGNED-PAYLOAD``): the part's CRC32 is a signed header the server checks.

Observed on the server through :class:`test_parallel_io.Tracker` (behind the fault
injector), on moto and on SeaweedFS.
"""

from __future__ import annotations

import base64
import io
import os
import zlib
from typing import Any

import numpy as np
import pytest
from conftest import FAST_RETRY, Backend, make_backend
from test_parallel_io import Tracker, part_of

import atomicstore
from atomicstore.commit.manifest import crc32c
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


def part_header(header: str, out: list[str | None]) -> Any:
    """A Tracker ``watch`` that selects part uploads and records ``header`` of each."""

    def watch(environ: dict[str, Any]) -> Any:
        what = part_of(environ)
        if what:
            out.append(environ.get(header))
        return what

    return watch


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
    write_one_file(s3_backend, os.urandom(2 * 5 * MiB + 1000), part_header("HTTP_EXPECT", expects), hold=0.0)
    assert len(expects) == 3
    assert expects == [None] * 3, f"parts asked for 100-continue: {expects}"


def test_parts_sign_their_checksum_not_their_body(s3_backend):
    """A part's body is not hashed for the signature (``UNSIGNED-PAYLOAD``, as botocore
    sends parts on HTTPS): its CRC32 goes in a header that is signed and that the server
    checks. Whole-object PUTs (the manifest, the marker) keep their signed SHA-256."""
    seen: list[tuple[str, str | None, str]] = []

    def watch(environ: dict[str, Any]) -> Any:
        auth = environ.get("HTTP_AUTHORIZATION", "")
        seen.append((environ.get("REQUEST_METHOD", ""), environ.get("HTTP_X_AMZ_CONTENT_SHA256"), auth))
        return part_of(environ)

    write_one_file(s3_backend, os.urandom(2 * 5 * MiB + 1000), watch, hold=0.0)
    parts = [(m, sha, auth) for m, sha, auth in seen if m == "PUT" and sha == "UNSIGNED-PAYLOAD"]
    assert len(parts) == 3, seen
    assert all("x-amz-checksum-crc32;" in auth.split("SignedHeaders=")[1] for _, _, auth in parts), parts
    puts = [sha for m, sha, _ in seen if m == "PUT" and sha != "UNSIGNED-PAYLOAD"]
    assert puts and all(sha and len(sha) == 64 for sha in puts), seen  # manifest, marker, lease


class PartBodies:
    """WSGI middleware in front of the server: records each part of ``state.bin`` (its
    ``x-amz-checksum-*`` headers and body) and passes on ``alter(number, body)``."""

    def __init__(self, app: Any, alter: Any = None) -> None:
        self.app, self.alter = app, alter
        self.sent: list[tuple[dict[str, str], bytes]] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        what = part_of(environ)
        if what and what[0].endswith("state.bin"):  # not the conformance check's part
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            sums = {k: v for k, v in environ.items() if k.startswith("HTTP_X_AMZ_CHECKSUM_")}
            self.sent.append((sums, body))
            if self.alter is not None:
                body = self.alter(what[1], body)
            environ["wsgi.input"] = io.BytesIO(body)
        return self.app(environ, start_response)


def save_through(backend: Backend, data: bytes, alter: Any = None) -> tuple[atomicstore.Store, PartBodies]:
    injector = backend.server.injector
    inner = injector.app
    injector.app = watch = PartBodies(inner, alter)
    try:
        store = backend.open(block_size=5 * MiB)
        with store.transaction("step_1") as txn:
            txn.write_bytes("state.bin", data)
    finally:
        injector.app = inner
    return store, watch


def b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def test_each_part_carries_the_crc32_of_its_own_body(s3_backend):
    """The checksum the server checks a part against is the CRC32 of that part's bytes,
    in ``x-amz-checksum-crc32``, and no other; three parts of different sizes."""
    data = os.urandom(2 * 5 * MiB + 1000)
    store, watch = save_through(s3_backend, data)
    assert sorted(len(body) for _, body in watch.sent) == [1000, 5 * MiB, 5 * MiB]
    assert b"".join(body for _, body in sorted(watch.sent, key=lambda s: data.index(s[1][:64]))) == data
    for sums, body in watch.sent:
        assert sums == {"HTTP_X_AMZ_CHECKSUM_CRC32": b64(zlib.crc32(body))}, (sums, len(body))
    assert store.read_bytes("step_1", "state.bin") == data


def keeping(checksum: Any, n: int) -> bytes:
    """A non-zero ``delta`` of ``n`` bytes with ``checksum(m ^ delta) == checksum(m)`` for
    every ``m`` of ``n`` bytes (CRCs are affine: a bit in the middle, corrected in the last
    four bytes by solving over GF(2))."""
    zero = checksum(bytes(n))

    def lin(d: bytes) -> int:
        return checksum(d) ^ zero

    delta = bytearray(n)
    delta[n // 2] = 0x80
    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (image, which of the 32 tail bits)
    for k in range(32):
        e = bytearray(n)
        e[n - 4 + k // 8] = 1 << (k % 8)
        v, m = lin(bytes(e)), 1 << k
        for bit in range(31, -1, -1):
            if (v >> bit) & 1:
                if bit not in basis:
                    basis[bit] = (v, m)
                    break
                v, m = v ^ basis[bit][0], m ^ basis[bit][1]
    v, m = lin(bytes(delta)), 0
    for bit in range(31, -1, -1):
        if (v >> bit) & 1:
            v, m = v ^ basis[bit][0], m ^ basis[bit][1]
    for k in range(32):
        if (m >> k) & 1:
            delta[n - 4 + k // 8] ^= 1 << (k % 8)
    assert any(delta) and lin(bytes(delta)) == 0
    return bytes(delta)


@pytest.mark.parametrize(("server", "kept"), [("seaweed", "crc32"), ("seaweed", "crc32c"), ("s3", "crc32")])
def test_damage_to_a_part_that_keeps_one_checksum_is_caught_by_the_other(request, tmp_path, server, kept):
    """The part's CRC32 (checked by the server) and the manifest's CRC32C (checked on every
    read) are two polynomials: a part changed on its way so that one of them still matches
    is caught by the other. With CRC32C for both, a change that keeps one keeps the other
    (found by an attack: such a save committed and read back other bytes). moto checks no
    part checksum, so there only the manifest's CRC32C stands."""
    s3_backend = make_backend(server, request, tmp_path)
    fn = zlib.crc32 if kept == "crc32" else crc32c
    delta = keeping(fn, 5 * MiB)

    def alter(number: int, body: bytes) -> bytes:
        if number != 2:
            return body
        changed = (np.frombuffer(body, np.uint8) ^ np.frombuffer(delta, np.uint8)).tobytes()
        assert changed != body and fn(changed) == fn(body)
        return changed

    data = os.urandom(2 * 5 * MiB + 1000)
    if kept == "crc32c":  # the server's CRC32 refuses the part: nothing is committed
        with pytest.raises(atomicstore.StorageError, match="BadDigest|did not match|checksum"):
            save_through(s3_backend, data, alter)
        assert not s3_backend.open().list()
    else:  # the server stores it; every read of the file refuses it
        store, _ = save_through(s3_backend, data, alter)
        with pytest.raises(atomicstore.CorruptionError, match="state.bin"):
            store.read_bytes("step_1", "state.bin")
        with pytest.raises(atomicstore.ChecksumMismatchError):
            store.verify("step_1")


def test_a_client_config_that_asks_for_signed_payloads_keeps_them(s3_backend):
    """``payload_signing_enabled`` set in the user's own ``config_kwargs`` wins."""
    opts = {k: v for k, v in s3_backend.options.items() if k != "config_kwargs"}
    config = {**(s3_backend.options.get("config_kwargs") or {}), "s3": {"payload_signing_enabled": True}}
    store = atomicstore.open_store(s3_backend.url, retry=FAST_RETRY, block_size=5 * MiB, config_kwargs=config,
                                   **opts)
    store.conformance()
    shas: list[str | None] = []
    t = track(s3_backend, part_header("HTTP_X_AMZ_CONTENT_SHA256", shas), 0.0)
    try:
        with store.transaction("step_1") as txn:
            txn.write_bytes("state.bin", os.urandom(2 * s3_driver.MIN_PART + 10))
    finally:
        t.restore()  # type: ignore[attr-defined]
    assert len(shas) == 3 and all(s and len(s) == 64 for s in shas), shas


def test_a_part_whose_body_does_not_match_its_signed_checksum_is_refused(s3_backend):
    """What stands for the body's signature: the server checks the part against its
    CRC32 (SeaweedFS, as AWS documents: 400 BadDigest, and the save fails having
    committed nothing). moto stores what it gets: there the manifest's CRC32C catches it
    when the file is read."""
    def flip(number: int, body: bytes) -> bytes:  # one bit of the first part, on its way
        return bytes([body[0] ^ 1]) + body[1:] if number == 1 else body

    data = os.urandom(2 * 5 * MiB)
    if s3_backend.server_name == "seaweed":
        with pytest.raises(atomicstore.StorageError, match="BadDigest|did not match|checksum"):
            save_through(s3_backend, data, flip)
        assert not s3_backend.open().list()
    else:
        store, _ = save_through(s3_backend, data, flip)
        with pytest.raises(atomicstore.CorruptionError, match="state.bin"):
            store.read_bytes("step_1", "state.bin")
