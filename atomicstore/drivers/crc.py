"""CRC32C (Castagnoli) of any buffer, without copying it: the checksum of every file in a
manifest, and of every S3 part (``x-amz-checksum-crc32c``). The lowest layer, so that
drivers and the commit protocol above them share one implementation
(:mod:`atomicstore.commit.manifest` exports both functions)."""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import google_crc32c
import numpy as np

__all__ = ["crc32c", "crc32c_slices"]


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
    copying the slices (one C call each)."""
    if _extend is None or not spans:
        mv = memoryview(buf)
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
    mv = memoryview(data)
    if mv.nbytes == 0:
        return value
    if _extend is not None and mv.c_contiguous:
        arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
        return int(_extend(value, arr.ctypes.data, arr.nbytes))
    crc = google_crc32c.extend(value, mv.tobytes())
    return crc
