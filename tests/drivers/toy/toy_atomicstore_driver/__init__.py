"""toy_atomicstore_driver: a third-party atomicstore driver, as a separate package would
ship one (tests/drivers/test_third_party_driver.py installs it with an entry point in the
``atomicstore.drivers`` group and runs atomicstore's driver contract over it).

``toy://<bucket>/<prefix>`` is an object store kept in this process's memory, written
against atomicstore's public driver API only: every object is written whole and gets a
new generation number; conditional writes and deletes compare it under one lock. It has
no rename and no directories, so atomicstore commits on it with the marker strategy
(conditional create of a commit marker), checks its conformance first, and takes claims,
as on S3 and GCS. It registers nothing itself: atomicstore finds it through the entry
point.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from atomicstore import (
    AlreadyExistsError,
    Capabilities,
    Driver,
    FileInfo,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    Writer,
)
from atomicstore.drivers import Entry

#: every toy object of the process: backend path -> (bytes, generation, modification time)
_OBJECTS: dict[str, tuple[bytes, str, float]] = {}
_LOCK = threading.Lock()
_GENERATIONS = itertools.count(1)


class _ToyWriter(Writer):
    """Buffers the object; ``close`` writes it in one conditional put."""

    def __init__(self, driver: ToyDriver, key: str, exclusive: bool, if_generation: str | None) -> None:
        self.driver, self.key = driver, key
        self.exclusive, self.if_generation = exclusive, if_generation
        self.buf: bytearray | None = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.buf is None:
            raise StorageError(f"write to {self.driver.describe(self.key)} after close or abort")
        self.buf += memoryview(data).cast("B")

    def close(self) -> None:
        if self.buf is None:
            return
        self.generation = self.driver.put(self.key, bytes(self.buf), exclusive=self.exclusive,
                                          if_generation=self.if_generation)
        self.buf = None

    def abort(self) -> None:
        self.buf = None


class ToyDriver(Driver):
    """An in-memory object store (see the module docstring)."""

    protocols = ("toy",)
    capabilities = Capabilities(
        atomic_rename=False, atomic_create=True, durable_fsync=False, directories=False
    )

    @classmethod
    def from_url(cls, protocol: str, path: str, storage_options: dict[str, Any], **kwargs: Any) -> Driver:
        if storage_options:
            raise InvalidArgumentError(f"toy:// takes no storage options (got {sorted(storage_options)})")
        root = path.strip("/")
        if not root:
            raise InvalidArgumentError("toy:// needs a bucket")
        return cls(None, root, url=f"toy://{root}", **kwargs)

    def _base(self, prefix: str) -> str:
        return f"{self.path(prefix)}/"

    def _get(self, op: str, key: str) -> tuple[bytes, str, float]:
        found = _OBJECTS.get(self.path(key))
        if found is None:
            raise NotFoundError(f"{op}: not found: {self.describe(key)}")
        return found

    def open_writer(self, key: str, *, exclusive: bool = False, if_generation: str | None = None) -> Writer:
        return _ToyWriter(self, key, exclusive, if_generation)

    def put(self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None) -> str | None:
        with _LOCK:
            found = _OBJECTS.get(self.path(key))
            if exclusive and found is not None:
                raise AlreadyExistsError(f"put: already exists: {self.describe(key)}")
            if if_generation is not None and (found is None or found[1] != if_generation):
                raise PreconditionFailedError(f"put: {self.describe(key)} changed since it was read")
            gen = str(next(_GENERATIONS))
            _OBJECTS[self.path(key)] = (bytes(data), gen, time.time())
            return gen

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        with _LOCK:
            return self._get("read", key)[0][start:end]

    def info(self, key: str) -> FileInfo:
        with _LOCK:
            data, gen, mtime = self._get("info", key)
        return FileInfo(key, len(data), None, mtime, gen)

    def exists(self, key: str) -> bool:
        with _LOCK:
            return self.path(key) in _OBJECTS

    def listdir(self, prefix: str = "") -> list[Entry]:
        base = self._base(prefix)
        children: dict[str, bool] = {}
        with _LOCK:
            for path in _OBJECTS:
                if path.startswith(base):
                    head, sep, _ = path[len(base):].partition("/")
                    children[head] = children.get(head, False) or bool(sep)
        return [Entry(name, is_dir) for name, is_dir in children.items()]

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        base, root = self._base(prefix), self._base("")
        with _LOCK:
            found = {p[len(root):]: v for p, v in _OBJECTS.items() if p.startswith(base)}
        return {k: FileInfo(k, len(data), None, mtime, gen) for k, (data, gen, mtime) in found.items()}

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        with _LOCK:
            found = _OBJECTS.get(self.path(key))
            if found is None:
                return
            if if_generation is not None and found[1] != if_generation:
                raise PreconditionFailedError(f"delete: {self.describe(key)} changed since it was read")
            del _OBJECTS[self.path(key)]
