"""A streamed read of one file of a checkpoint whose size and CRC32C are checked."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from ..errors import InvalidArgumentError
from .manifest import Crc32cHasher, FileEntry


class CheckedReader(io.RawIOBase):
    """A streamed read of one file of a checkpoint that checks size and CRC32C.

    The check happens incrementally while reading; reaching the end of the file with a
    mismatch raises :class:`ChecksumMismatchError` naming the file.
    """

    def __init__(self, chunks: Iterator[bytes], entry: FileEntry, path: str, where: str) -> None:
        self._chunks = chunks
        self._entry = entry
        self._path = path
        self._where = where
        self._hash = Crc32cHasher()
        self._buf = memoryview(b"")
        self._eof = False

    def readable(self) -> bool:
        """Always True (a read-only stream)."""
        return True

    def _next(self) -> bool:
        if self._eof:
            return False
        for chunk in self._chunks:
            if chunk:
                self._hash.update(chunk)
                if self._hash.size > self._entry.size:
                    self._entry.check(self._path, self._hash.size, self._hash.value, where=self._where)
                self._buf = memoryview(chunk)
                return True
        self._eof = True
        self._entry.check(self._path, self._hash.size, self._hash.value, where=self._where)
        return False

    def readinto(self, b: Any) -> int:
        """Read up to ``len(b)`` bytes into ``b``; 0 at the end of the file, where the size
        and CRC32C are checked."""
        out = memoryview(b).cast("B")
        if not len(self._buf) and not self._next():
            return 0
        n = min(len(out), len(self._buf))
        out[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def readall(self) -> bytes:
        """The rest of the file, its size and CRC32C checked."""
        parts = [bytes(self._buf)]
        self._buf = memoryview(b"")
        while self._next():
            parts.append(bytes(self._buf))
            self._buf = memoryview(b"")
        return b"".join(parts)


def destination(where: str, size: int, start: Any, out: Any) -> memoryview:
    """``out`` as a writable byte view, checked to hold a range of the file ``where`` (of
    ``size`` bytes) from ``start``; InvalidArgumentError otherwise."""
    if not isinstance(start, int) or isinstance(start, bool):
        raise InvalidArgumentError(f"a range of {where} starts at an int, not {start!r}")
    try:
        mv = memoryview(out).cast("B")
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"read into {where}: need a writable contiguous buffer, "
                                   f"got {type(out).__name__}") from None
    if mv.readonly:
        raise InvalidArgumentError(f"read into {where}: the buffer is read-only")
    if not (start >= 0 and start + mv.nbytes <= size):
        raise InvalidArgumentError(f"range [{start}, {start + mv.nbytes}) outside {where} of {size} bytes")
    return mv
