"""The checksums of buffers (``atomicstore.drivers.crc``): the manifest's CRC32C and the
S3 parts' CRC32 agree with the reference implementations (google-crc32c, zlib) on every
kind of buffer the writers hand them, and a span outside its buffer is refused."""

from __future__ import annotations

import array
import mmap
import zlib

import google_crc32c
import ml_dtypes
import numpy as np
import pytest

from atomicstore.commit import manifest
from atomicstore.drivers import crc

RNG = np.random.default_rng(7)
RAW = RNG.integers(0, 256, 100_003, dtype=np.uint8).tobytes()

BUFFERS = {
    "bytes": RAW,
    "bytearray": bytearray(RAW),
    "empty": b"",
    "memoryview-slice": memoryview(RAW)[13:50_013],
    "memoryview-cast-I": memoryview(RAW[:100_000]).cast("I"),
    "array.array": array.array("d", range(1000)),
    "float32": RNG.standard_normal(4097).astype(np.float32),
    "big-endian": np.arange(999, dtype=">i4"),
    "bfloat16": RNG.standard_normal(3001).astype(ml_dtypes.bfloat16),
    "float8": np.arange(200).astype(ml_dtypes.float8_e4m3fn),
    "datetime64": np.arange(50).astype("datetime64[s]"),
    "0-d": np.array(1.5),
    "0-size": np.zeros((0, 3)),
    "fortran": np.asfortranarray(RNG.standard_normal((64, 33))),
    "strided": RNG.standard_normal(1000)[::3],
}


def reference_bytes(buf: object) -> bytes:
    """The bytes a checksum covers: C order, as ``tobytes`` gives them."""
    if isinstance(buf, np.ndarray):
        return buf.tobytes()
    return memoryview(buf).tobytes()  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(BUFFERS))
def test_crc32c_matches_google_crc32c(name):
    buf = BUFFERS[name]
    want = reference_bytes(buf)
    assert crc.crc32c(buf) == google_crc32c.value(want)  # type: ignore[arg-type]
    assert crc.crc32c(buf, 0xDEADBEEF) == google_crc32c.extend(0xDEADBEEF, want)  # type: ignore[arg-type]
    assert manifest.crc32c is crc.crc32c  # one implementation, exported where it always was


@pytest.mark.parametrize("name", [n for n, b in BUFFERS.items() if not isinstance(b, np.ndarray)
                                  or b.flags.c_contiguous and b.dtype.kind not in "VMm" and b.dtype.isbuiltin])
def test_crc32_matches_zlib(name):
    buf = BUFFERS[name]
    want = reference_bytes(buf)
    assert crc.crc32(buf) == zlib.crc32(want)  # type: ignore[arg-type]
    assert crc.crc32(buf, 12345) == zlib.crc32(want, 12345)  # type: ignore[arg-type]


def test_crc32_continues_across_pieces_as_a_part_is_summed():
    pieces = [memoryview(RAW)[:7], memoryview(RAW)[7:70_000], memoryview(RAW)[70_000:]]
    value = 0
    for p in pieces:
        value = crc.crc32(p, value)
    assert value == zlib.crc32(RAW)


def test_crc32c_of_a_mapped_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(RAW)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert crc.crc32c(memoryview(m)) == google_crc32c.value(RAW)


def test_crc32c_slices_sums_each_span_and_refuses_one_outside_the_buffer():
    buf = bytearray(RAW)
    spans = [(0, 10), (10, 0), (5, 50_000), (len(RAW) - 3, 3)]
    assert crc.crc32c_slices(buf, spans) == [
        google_crc32c.value(bytes(buf[a : a + n])) if n else 0 for a, n in spans]
    for bad in ([(5, len(RAW))], [(-1, 4)], [(len(RAW), 1)]):
        with pytest.raises(ValueError, match="outside the buffer"):
            crc.crc32c_slices(buf, bad)
