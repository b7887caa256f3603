"""Manifest and commit marker: what a committed checkpoint holds, and who committed it.

Both are small JSON documents. They are read from storage, so parsing treats them as
hostile: sizes are bounded, every field's type is checked, every path re-validated.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# the CRC32C of buffers lives in the lowest layer (drivers use it too); exported here as before
from ..drivers.crc import crc32c as crc32c
from ..drivers.crc import crc32c_slices as crc32c_slices
from ..errors import ChecksumMismatchError, CorruptionError, InvalidArgumentError
from .names import MANIFEST_FILE, validate_name, validate_path

MANIFEST_FORMAT = "atomicstore.manifest/1"
MARKER_FORMAT = "atomicstore.marker/1"
#: Largest manifest (bytes): one limit for writers, which refuse to commit a larger one
#: (:class:`~atomicstore.InvalidArgumentError` before anything is published), and readers,
#: which refuse to parse one (:class:`~atomicstore.CorruptionError`).
MAX_MANIFEST_BYTES = 64 * 2**20
#: Bytes of a manifest kept for its header and file list; its metadata may take the rest.
MANIFEST_RESERVE = 64 * 2**10
#: Largest metadata a checkpoint can carry: bytes of its JSON as the manifest stores it.
MAX_METADATA_BYTES = MAX_MANIFEST_BYTES - MANIFEST_RESERVE
#: Deepest nesting of objects and arrays in metadata (readers parse it without
#: reaching Python's recursion limit).
MAX_METADATA_DEPTH = 100
MAX_MARKER_BYTES = 64 * 2**10
#: Most bytes of its checkpoint's own files a commit marker carries: its manifest, then
#: small files whole, in the order given (:meth:`Marker.new`). A reader that finds them
#: there has the checkpoint's metadata after one request, not two. Base64 and the rest of
#: the marker keep it well under :data:`MAX_MARKER_BYTES`, the most any reader accepts.
MARKER_INLINE_BYTES = 24 * 2**10


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zero_operators() -> list[list[int]]:
    """``ops[k]`` appends 2**k zero bytes to a CRC32C state (zlib's crc32_combine)."""
    odd = [0x82F63B78] + [1 << n for n in range(31)]  # one zero bit
    op = odd
    for _ in range(3):  # 2, 4, 8 zero bits = one zero byte
        op = _gf2_square(op)
    ops = [op]
    for _ in range(63):
        ops.append(_gf2_square(ops[-1]))
    return ops


_ZERO_OPS: list[list[int]] = []


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from CRC32C(A), CRC32C(B) and len(B), without the bytes."""
    if len2 <= 0:
        return crc1
    if not _ZERO_OPS:
        _ZERO_OPS.extend(_zero_operators())
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


class Crc32cHasher:
    """Incremental CRC32C plus byte count."""

    __slots__ = ("value", "size")

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.value = crc32c(data, self.value)
        self.size += memoryview(data).nbytes

    def combine(self, crc: int, size: int) -> None:
        """Account for ``size`` bytes whose CRC32C (``crc``) is already known."""
        self.value = crc32c_combine(self.value, crc, size)
        self.size += size


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size and CRC32C."""

    size: int
    crc32c: int

    def check(self, path: str, size: int, crc: int, *, where: str = "") -> None:
        """Raise :class:`ChecksumMismatchError` unless ``size``/``crc`` match."""
        if size != self.size:
            raise ChecksumMismatchError(
                f"{where or path}: size {size} does not match the manifest's {self.size}",
                path=path,
            )
        if crc != self.crc32c:
            raise ChecksumMismatchError(
                f"{where or path}: CRC32C {crc:08x} does not match the manifest's {self.crc32c:08x}",
                path=path,
            )


@dataclass(frozen=True)
class Manifest:
    """Every file of a committed checkpoint with its size and CRC32C, and who wrote it."""

    name: str
    attempt: str
    writer: str
    created: float
    files: dict[str, FileEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    #: when the manifest was sealed, right before the commit point (None in old manifests)
    committed: float | None = None

    @property
    def total_bytes(self) -> int:
        """The sum of the files' sizes."""
        return sum(f.size for f in self.files.values())

    def to_bytes(self) -> bytes:
        """The manifest as the JSON document stored in ``manifest.json`` (CRC32Cs in hex):
        the header's fields, then ``files`` with one line per file, then ``metadata`` on
        one line (as :func:`encode_metadata` gives it, so its size is known before the
        manifest is written). The size limit is the committer's to check
        (:data:`MAX_MANIFEST_BYTES`)."""
        doc = {
            "format": MANIFEST_FORMAT,
            "name": self.name,
            "attempt": self.attempt,
            "writer": self.writer,
            "created": self.created,
            **({"committed": self.committed} if self.committed is not None else {}),
        }
        head = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)
        quote = json.encoder.encode_basestring_ascii  # (what json.dumps does to a str)
        files = ",\n".join(f'  {quote(p)}: {{"crc32c": "{e.crc32c:08x}", "size": {int(e.size)}}}'
                            for p, e in sorted(self.files.items()))
        meta = json.dumps(self.metadata, sort_keys=True, allow_nan=False)
        body = f"{{\n{files}\n }}" if files else "{}"
        return f'{head[:-2]},\n "files": {body},\n "metadata": {meta}\n}}'.encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        """Parse a ``manifest.json`` document; anything malformed or oversized raises
        :class:`~atomicstore.CorruptionError` naming ``where``."""
        doc = _load_json(data, where=where, limit=MAX_MANIFEST_BYTES, fmt=MANIFEST_FORMAT)
        try:
            files_raw = doc["files"]
            if not isinstance(files_raw, dict):
                raise TypeError("files is not an object")
            files = {}
            for p, e in files_raw.items():
                validate_path(p)
                size, crc = e["size"], e["crc32c"]
                if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
                    raise TypeError(f"bad size for {p!r}")
                if not (isinstance(crc, str) and len(crc) == 8):
                    raise TypeError(f"bad crc32c for {p!r}")
                files[p] = FileEntry(size, int(crc, 16))
            meta = doc.get("metadata", {})
            if not isinstance(meta, dict):
                raise TypeError("metadata is not an object")
            return cls(
                name=validate_name(doc["name"]),
                attempt=_str(doc["attempt"]),
                writer=_str(doc["writer"]),
                created=float(doc["created"]),
                files=files,
                metadata=meta,
                committed=None if doc.get("committed") is None else float(doc["committed"]),
            )
        except (KeyError, TypeError, ValueError, InvalidArgumentError) as exc:
            raise CorruptionError(f"{where}: malformed manifest ({exc})", path=where) from exc


@dataclass(frozen=True)
class Marker:
    """The commit marker of an object-store checkpoint.

    Names the attempt whose data is committed, the writer, and the SHA-256 of the
    attempt's manifest: a reader trusts the checkpoint only if the manifest it finds has
    that digest. It may carry copies of the manifest and of small files of the attempt
    (``inline``, at most :data:`MARKER_INLINE_BYTES`): the manifest copy is used only if
    it has that digest, a file's only if it has the size and CRC32C the manifest gives.
    Readers that predate ``inline`` ignore it and read the files themselves.
    """

    name: str
    attempt: str
    writer: str
    manifest_sha256: str
    committed: float
    #: for an overwrite, the marker this one replaced (so that a commit whose data
    #: vanished can be rolled back to it by its writer or by recovery)
    replaces: Marker | None = None
    #: copies of files of the attempt, by path (the manifest under ``manifest.json``)
    inline: Mapping[str, bytes] = field(default_factory=dict, compare=False, repr=False)

    def _doc(self, *, nested: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": MARKER_FORMAT,
            "name": self.name,
            "attempt": self.attempt,
            "writer": self.writer,
            "manifest_sha256": self.manifest_sha256,
            "committed": self.committed,
        }
        if nested:
            return doc  # (a replaced marker is recorded without its copies)
        if self.replaces is not None:
            doc["replaces"] = self.replaces._doc(nested=True)
        if self.inline:
            doc["inline"] = {p: base64.b64encode(data).decode("ascii") for p, data in self.inline.items()}
        return doc

    def to_bytes(self) -> bytes:
        return json.dumps(self._doc(), sort_keys=True).encode()

    @classmethod
    def new(cls, name: str, attempt: str, writer: str, manifest: bytes,
            replaces: Marker | None = None, files: Mapping[str, bytes] | None = None) -> Marker:
        """A marker committing ``attempt``, whose manifest is ``manifest``. It carries the
        manifest and then as many of ``files`` (small files of the attempt, whole) as fit
        in :data:`MARKER_INLINE_BYTES`, in their order."""
        if replaces is not None:
            replaces = dataclasses.replace(replaces, replaces=None, inline={})  # one level only
        inline: dict[str, bytes] = {}
        room = MARKER_INLINE_BYTES - len(manifest)
        if room >= 0:
            inline[MANIFEST_FILE] = bytes(manifest)
            for path, data in (files or {}).items():
                if path != MANIFEST_FILE and len(data) <= room:
                    inline[path] = bytes(data)
                    room -= len(data)
        return cls(name, attempt, writer, sha256(manifest), time.time(), replaces, inline)

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Marker:
        doc = _load_json(data, where=where, limit=MAX_MARKER_BYTES, fmt=MARKER_FORMAT)
        try:
            prev = doc.get("replaces")
            if prev is not None and not isinstance(prev, dict):
                raise TypeError("replaces is not an object")
            marker = cls._from_doc(doc, None if prev is None else cls._from_doc(prev, None))
        except (KeyError, TypeError, ValueError, InvalidArgumentError) as exc:
            raise CorruptionError(f"{where}: malformed commit marker ({exc})", path=where) from exc
        return dataclasses.replace(marker, inline=_inline(doc.get("inline")))

    @classmethod
    def _from_doc(cls, doc: dict[str, Any], replaces: Marker | None) -> Marker:
        digest = _str(doc["manifest_sha256"])
        if len(digest) != 64:
            raise ValueError("bad manifest_sha256")
        return cls(
            validate_name(doc["name"]),
            validate_attempt(doc["attempt"]),
            _str(doc["writer"]),
            digest,
            float(doc["committed"]),
            replaces,
        )


def _inline(raw: Any) -> dict[str, bytes]:
    """The file copies a marker carries; any entry that is not a path and base64 text is
    left out (a copy is only ever a shortcut: the reader reads the file instead)."""
    out: dict[str, bytes] = {}
    if not isinstance(raw, dict):
        return out
    for path, text in raw.items():
        if isinstance(path, str) and isinstance(text, str):
            try:
                out[path] = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                continue
    return out


def encode_metadata(metadata: Any, *, what: str = "metadata", depth: int = MAX_METADATA_DEPTH,
                    limit: int = MAX_METADATA_BYTES) -> str:
    """The JSON text ``metadata`` takes in a manifest (compact, keys sorted).

    Raises :class:`~atomicstore.InvalidArgumentError` naming ``what`` unless it is a dict
    of JSON values (finite numbers only), nested at most ``depth`` levels deep, whose JSON
    takes at most ``limit`` bytes: what a reader of the manifest accepts."""
    if not isinstance(metadata, dict):
        raise InvalidArgumentError(f"{what} must be a dict of JSON values, not {type(metadata).__name__}")
    try:
        text = json.dumps(metadata, sort_keys=True, allow_nan=False)
    except RecursionError:
        raise InvalidArgumentError(f"{what} is nested deeper than {depth} levels") from None
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} must hold JSON values only (nothing executable is "
                                   f"stored): {exc}") from None
    if len(text) > limit:  # (ASCII: json.dumps escapes everything else)
        raise InvalidArgumentError(
            f"{what} takes {len(text):,} bytes as JSON, over the {limit:,} it may take "
            f"(readers refuse manifests over {MAX_MANIFEST_BYTES:,} bytes)"
        )
    if metadata_depth(metadata) > depth:
        raise InvalidArgumentError(f"{what} is nested deeper than {depth} levels")
    return text


def metadata_depth(value: Any) -> int:
    """How deeply objects and arrays nest in ``value`` (JSON values, or any acyclic
    structure; iterative, so any depth is measured)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        kids = v.values() if isinstance(v, dict) else v
        todo.extend((k, d + 1) for k in kids if isinstance(k, dict | list | tuple))
    return deepest


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def validate_attempt(attempt: object) -> str:
    a = _str(attempt)
    if not a or len(a) > 100 or not all(c.isalnum() or c in "-_" for c in a):
        raise ValueError(f"bad attempt id {a!r}")
    return a


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _load_json(data: bytes, *, where: str, limit: int, fmt: str) -> dict[str, Any]:
    if len(data) > limit:
        raise CorruptionError(f"{where}: {len(data)} bytes, larger than the {limit} allowed", path=where)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptionError(f"{where}: not valid JSON ({exc})", path=where) from exc
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise CorruptionError(f"{where}: not an {fmt} document", path=where)
    return doc
