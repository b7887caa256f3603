"""Checksums of any buffer, without copying it, in the lowest layer (drivers and the
commit protocol above them share them):

* :func:`crc32c` (Castagnoli), the checksum of every file in a manifest, checked on every
  read (:mod:`atomicstore.commit.manifest` exports it);
* :func:`crc32` (IEEE, zlib's), the checksum every S3 part carries
  (``x-amz-checksum-crc32``) for the server to check before it stores the part. It is
  deliberately another polynomial than the manifest's: a part body changed on its way in
  a way that keeps its CRC32 is still caught by the manifest's CRC32C, and the other way
  round (with one CRC32C for both, a change that keeps one keeps the other: CRC is linear).
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import google_crc32c
import numpy as np

try:  # the s3 extra's: ISA-L's CRC32, ~9 GB/s here against zlib's ~2.5
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - the same values, more CPU
    from zlib import crc32 as _crc32

__all__ = ["crc32", "crc32c", "crc32c_slices"]


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32 (IEEE 802.3, as :func:`zlib.crc32`) of ``data``, continuing from ``value``.
    Accepts any C-contiguous buffer."""
    return int(_crc32(data, value))


def _load_extend() -> Any:
    """google-crc32c's own C ``crc32c_extend``, called on buffers without a copy.

    The Python binding accepts only ``bytes``; calling the library it ships through
    ctypes lets numpy arrays and memoryviews be checksummed in place (~10 GB/s).
    """
    libs = glob.glob(os.path.join(os.path.dirname(google_crc32c.__file__), os.pardir,
                                  "google_crc32c.libs", "libcrc32c*.so*"))
    for path in libs:
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        return fn
    return None


_extend = _load_extend()


def crc32c_slices(buf: bytearray | memoryview, spans: list[tuple[int, int]]) -> list[int]:
    """CRC32C of each ``buf[start:start + n]`` for ``(start, n)`` in ``spans``, without
    copying the slices (one C call each). A span outside ``buf`` raises ValueError."""
    mv = memoryview(buf)
    bad = next(((a, n) for a, n in spans if a < 0 or n < 0 or a + n > mv.nbytes), None)
    if bad is not None:
        raise ValueError(f"the span (start, length) {bad} lies outside the buffer of {mv.nbytes} bytes")
    if _extend is None or not spans:
        return [crc32c(mv[a : a + n]) for a, n in spans]
    base = np.frombuffer(buf, dtype=np.uint8)
    addr = base.ctypes.data
    ext = _extend
    return [int(ext(0, addr + a, n)) if n else 0 for a, n in spans]


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data``, continuing from ``value``.

    Accepts any C-contiguous buffer (bytes, bytearray, memoryview, numpy array).
    """
    if type(data) is bytes:
        crc: int = google_crc32c.extend(value, data)
        return crc
    if isinstance(data, np.ndarray):  # its bytes (bfloat16, datetime64...: no buffer format)
        data = data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else data.tobytes()
    mv = memoryview(data)
    if mv.nbytes == 0:
        return value
    if _extend is not None and mv.c_contiguous:
        arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
        return int(_extend(value, arr.ctypes.data, arr.nbytes))
    crc = google_crc32c.extend(value, mv.tobytes())
    return crc
