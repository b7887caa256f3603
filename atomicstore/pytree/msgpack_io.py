"""Streaming msgpack: emit headers around leaf payloads, and scan a file's structure.

The writer produces exactly the bytes ``msgpack.packb`` would (smallest headers), so a
state written here is byte-identical to ``flax.serialization.msgpack_serialize`` of the
same state dict, without ever holding the whole encoding in memory.

The scanner walks the structure of a msgpack file (hostile input) through ranged reads,
checking every declared length against the file size before anything is allocated, with
bounded depth and counts, and records where each leaf's bytes are.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import CorruptionError

# -- headers -----------------------------------------------------------------------------


def _container_header(n: int, fix: int, tag16: bytes, tag32: bytes) -> bytes:
    if n < 16:
        return bytes([fix | n])
    if n < 2**16:
        return tag16 + struct.pack(">H", n)
    return tag32 + struct.pack(">I", n)


def map_header(n: int) -> bytes:
    return _container_header(n, 0x80, b"\xde", b"\xdf")


def array_header(n: int) -> bytes:
    return _container_header(n, 0x90, b"\xdc", b"\xdd")


def bin_header(n: int) -> bytes:
    if n < 2**8:
        return b"\xc4" + bytes([n])
    if n < 2**16:
        return b"\xc5" + struct.pack(">H", n)
    if n < 2**32:
        return b"\xc6" + struct.pack(">I", n)
    raise ValueError(f"a msgpack bin holds at most 4 GiB, got {n} bytes")


def ext_header(code: int, n: int) -> bytes:
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if n in fixed:
        return bytes([fixed[n], code])
    if n < 2**8:
        return b"\xc7" + bytes([n, code])
    if n < 2**16:
        return b"\xc8" + struct.pack(">H", n) + bytes([code])
    if n < 2**32:
        return b"\xc9" + struct.pack(">I", n) + bytes([code])
    raise ValueError(f"a msgpack ext holds at most 4 GiB, got {n} bytes")


def pack(obj: Any) -> bytes:
    """A small value as msgpack packs it (flax's settings)."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=True)
    return packed


# -- scanning ----------------------------------------------------------------------------

#: deepest nesting accepted when scanning (two Python frames per level)
MAX_DEPTH = 200
#: most map entries / array items accepted in one container
MAX_ITEMS = 50_000_000


@dataclass
class Span:
    """Where a value's encoding lies in the file: [start, end)."""

    start: int
    end: int


@dataclass
class ExtLeaf:
    """An ext value: its type code and the span of its payload."""

    code: int
    payload: Span


class Source:
    """Ranged reads of a file of known size, with a read-ahead window."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, window: int = 1 << 20) -> None:
        self._read, self.size, self._window = read, size, window
        self._buf = b""
        self._at = 0

    def take(self, pos: int, n: int, what: str) -> bytes:
        if n < 0 or pos + n > self.size:
            raise CorruptionError(
                f"{what} at byte {pos} declares {n} bytes, past the end of the file ({self.size} bytes)"
            )
        if not (self._at <= pos and pos + n <= self._at + len(self._buf)):
            self._at = pos
            self._buf = self._read(pos, min(self.size, pos + max(n, self._window)))
            if len(self._buf) < n:
                raise CorruptionError(f"short read at byte {pos}")
        off = pos - self._at
        return self._buf[off : off + n]


_FIXED = {0xC0: None, 0xC2: False, 0xC3: True}
_NUM = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
        0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
#: width of the length field of str 8/16/32, bin 8/16/32 and ext 8/16/32
_STR_LEN = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_BIN_LEN = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_EXT_LEN = {0xC7: 1, 0xC8: 2, 0xC9: 4}


def scan(src: Source, *, on_ext: Callable[[int, Span], Any] | None = None) -> tuple[Any, int]:
    """Parse the msgpack value at the start of ``src`` into Python containers, with ext
    values replaced by ``on_ext(code, payload_span)`` (default :class:`ExtLeaf`) and bin
    values by their :class:`Span` when larger than 64 KiB. Returns (value, end offset).

    Raises :class:`CorruptionError` for anything malformed, truncated or oversized.
    """
    return _Scanner(src, on_ext or (lambda code, span: ExtLeaf(code, span))).value(0, 0)


class _Scanner:
    """One :func:`scan`: values are parsed at byte offsets, every length checked against
    the file's size before it is read, with a budget of :data:`MAX_ITEMS` items in all.
    Nesting takes two frames per level (:meth:`value` and :meth:`container`)."""

    def __init__(self, src: Source, on_ext: Callable[[int, Span], Any]) -> None:
        self.src, self.on_ext = src, on_ext
        self.budget = MAX_ITEMS

    def value(self, pos: int, depth: int) -> tuple[Any, int]:
        if depth > MAX_DEPTH:
            raise CorruptionError(f"nesting deeper than {MAX_DEPTH} at byte {pos}")
        b = self.src.take(pos, 1, "type byte")[0]
        pos += 1
        if 0x80 <= b <= 0x8F:
            return self.container(pos, b & 0x0F, True, depth)
        if 0x90 <= b <= 0x9F:
            return self.container(pos, b & 0x0F, False, depth)
        if b in (0xDC, 0xDD):
            n, pos = self.length(pos, 2 if b == 0xDC else 4)
            return self.container(pos, n, False, depth)
        if b in (0xDE, 0xDF):
            n, pos = self.length(pos, 2 if b == 0xDE else 4)
            return self.container(pos, n, True, depth)
        return self.scalar(b, pos)

    def scalar(self, b: int, pos: int) -> tuple[Any, int]:
        """The value of type byte ``b`` (any but a map or an array), whose encoding goes
        on at ``pos``."""
        if b <= 0x7F:
            return b, pos
        if b >= 0xE0:
            return b - 0x100, pos
        if 0xA0 <= b <= 0xBF:
            return self.string(pos, b & 0x1F)
        if b in _FIXED:
            return _FIXED[b], pos
        if b in _NUM:
            fmt = _NUM[b]
            n = struct.calcsize(fmt)
            return struct.unpack(fmt, self.src.take(pos, n, "number"))[0], pos + n
        if b in _STR_LEN:
            n, pos = self.length(pos, _STR_LEN[b])
            return self.string(pos, n)
        if b in _BIN_LEN:
            return self.bin(pos, _BIN_LEN[b])
        if 0xD4 <= b <= 0xD8:
            return self.fixext(pos, 1 << (b - 0xD4))
        if b in _EXT_LEN:
            return self.ext(pos, _EXT_LEN[b])
        raise CorruptionError(f"invalid msgpack type byte 0x{b:02x} at byte {pos - 1}")

    def length(self, pos: int, width: int) -> tuple[int, int]:
        raw = self.src.take(pos, width, "length")
        return int.from_bytes(raw, "big"), pos + width

    def string(self, pos: int, n: int) -> tuple[str, int]:
        raw = self.src.take(pos, n, "string")
        try:
            return raw.decode("utf-8"), pos + n
        except UnicodeDecodeError:
            raise CorruptionError(f"invalid UTF-8 string at byte {pos}") from None

    def bin(self, pos: int, width: int) -> tuple[bytes | Span, int]:
        src = self.src
        n, pos = self.length(pos, width)
        src.take(pos, 0, "bin")
        if pos + n > src.size:
            raise CorruptionError(f"bin at byte {pos} declares {n} bytes, past the end of the file")
        if n > 65536:
            return Span(pos, pos + n), pos + n
        return src.take(pos, n, "bin"), pos + n

    def fixext(self, pos: int, n: int) -> tuple[Any, int]:
        src = self.src
        code = src.take(pos, 1, "ext type")[0]
        pos += 1
        src.take(pos, 0, "ext")
        if pos + n > src.size:
            raise CorruptionError(f"ext at byte {pos} runs past the end of the file")
        return self.on_ext(code, Span(pos, pos + n)), pos + n

    def ext(self, pos: int, width: int) -> tuple[Any, int]:
        n, pos = self.length(pos, width)
        code = self.src.take(pos, 1, "ext type")[0]
        pos += 1
        if pos + n > self.src.size:
            raise CorruptionError(f"ext at byte {pos} declares {n} bytes, past the end of the file")
        return self.on_ext(code, Span(pos, pos + n)), pos + n

    def container(self, pos: int, n: int, is_map: bool, depth: int) -> tuple[Any, int]:
        # every item takes at least one byte: a count beyond what is left is a lie
        if n > (self.src.size - pos) // (2 if is_map else 1):
            raise CorruptionError(f"container at byte {pos} declares {n} items, more than the file holds")
        self.budget -= n
        if self.budget < 0:
            raise CorruptionError(f"more than {MAX_ITEMS} items in the file")
        if is_map:
            out: dict[Any, Any] = {}
            for _ in range(n):
                k, pos = self.value(pos, depth + 1)
                if isinstance(k, dict | list | Span | ExtLeaf):
                    raise CorruptionError(f"unhashable map key before byte {pos}")
                v, pos = self.value(pos, depth + 1)
                out[k] = v
            return out, pos
        items = []
        for _ in range(n):
            v, pos = self.value(pos, depth + 1)
            items.append(v)
        return items, pos
