"""fsspec's in-memory filesystem (for tests and examples).

Facts: every operation of this driver holds one lock, so a rename of a whole tree and a
put-if-absent are atomic with respect to every other operation through a memory driver.
Nothing is durable (it is memory), so fsync is moot. Strategy: rename.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import threading
from typing import Any

from ..errors import AlreadyExistsError, NotFoundError, PreconditionFailedError
from .pools import held
from .spec import Capabilities, Driver, Entry, FileInfo, Writer

_LOCK = threading.RLock()


_GENERATIONS = itertools.count(1)


def _generation(f: Any) -> str:
    """The generation of a stored file: a counter stamped on it when it was written."""
    gen = getattr(f, "atomicstore_generation", None)
    if gen is None:
        gen = f.atomicstore_generation = next(_GENERATIONS)
    return str(gen)


class _MemoryWriter(Writer):
    def __init__(self, driver: MemoryDriver, key: str, exclusive: bool, if_generation: str | None) -> None:
        self.driver, self.key, self.buf, self.exclusive = driver, key, io.BytesIO(), exclusive
        self.if_generation = if_generation

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.buf.write(data)

    def close(self) -> None:
        if self.buf is not None:
            self.driver.put(self.key, self.buf.getvalue(), exclusive=self.exclusive,
                            if_generation=self.if_generation)
            self.buf = None  # type: ignore[assignment]

    def abort(self) -> None:
        self.buf = None  # type: ignore[assignment]


class MemoryDriver(Driver):
    """In-memory storage shared by all memory drivers of the process."""

    protocols = ("memory",)
    capabilities = Capabilities(
        atomic_rename=True, atomic_create=True, durable_fsync=False, directories=True
    )

    @classmethod
    def make_filesystem(cls, protocol: str, storage_options: dict[str, Any]) -> Any:
        from fsspec.implementations.memory import MemoryFileSystem

        return MemoryFileSystem(**storage_options)

    def _store(self) -> dict[str, Any]:
        store: dict[str, Any] = self.fs.store
        return store

    def _children(self, prefix: str) -> list[str]:
        base = self.path(prefix).rstrip("/") + "/"
        return [k for k in self._store() if k.startswith(base)]

    def open_writer(
        self, key: str, *, exclusive: bool = False, if_generation: str | None = None
    ) -> Writer:
        return _MemoryWriter(self, key, exclusive, if_generation)

    def put(
        self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None
    ) -> str | None:
        with _LOCK:
            path = self.path(key)
            if exclusive and (path in self._store() or self._children(key)):
                raise AlreadyExistsError(f"put: already exists: {self.describe(key)}")
            self._check_generation(key, if_generation)
            self.fs.pipe_file(path, bytes(data))
            return _generation(self._store()[path])

    def _check_generation(self, key: str, if_generation: str | None) -> None:
        if if_generation is None:
            return
        f = self._store().get(self.path(key))
        if f is None or _generation(f) != if_generation:
            raise PreconditionFailedError(f"{self.describe(key)} changed since it was read")

    def lock(self, timeout: float = 60.0) -> contextlib.AbstractContextManager[None]:
        return held(_LOCK, timeout, "the memory store lock")

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        with _LOCK:
            f = self._store().get(self.path(key))
            if f is None:
                raise NotFoundError(f"read: not found: {self.describe(key)}")
            return bytes(f.getbuffer()[start:end])

    def info(self, key: str) -> FileInfo:
        with _LOCK:
            f = self._store().get(self.path(key))
            if f is None:
                raise NotFoundError(f"info: not found: {self.describe(key)}")
            return FileInfo(key, f.getbuffer().nbytes, None, f.modified.timestamp(), _generation(f))

    def exists(self, key: str) -> bool:
        with _LOCK:
            return self.path(key) in self._store() or bool(self._children(key))

    def listdir(self, prefix: str = "") -> list[Entry]:
        with _LOCK:
            base = self.path(prefix).rstrip("/") + "/"
            names: dict[str, bool] = {}
            for k in self._store():
                if k.startswith(base):
                    head, sep, _ = k[len(base):].partition("/")
                    names[head] = names.get(head, False) or bool(sep)
            return [Entry(n, d) for n, d in names.items()]

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        with _LOCK:
            out = {}
            root = self.root + "/"
            for k in self._children(prefix):
                rel = k[len(root):]
                f = self._store()[k]
                out[rel] = FileInfo(rel, f.getbuffer().nbytes, None, f.modified.timestamp(), _generation(f))
            return out

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        with _LOCK:
            if if_generation is not None and self.path(key) in self._store():
                self._check_generation(key, if_generation)
            self._store().pop(self.path(key), None)

    def delete_tree(self, prefix: str) -> None:
        with _LOCK:
            for k in self._children(prefix):
                del self._store()[k]
            self._store().pop(self.path(prefix), None)

    def _take(self, key: str) -> dict[str, Any]:
        """Remove and return ``key`` (a file, as {"": f}, or a directory's files by
        relative name)."""
        store = self._store()
        if self.path(key) in store:
            return {"": store.pop(self.path(key))}
        base = self.path(key).rstrip("/") + "/"
        return {k[len(base):]: store.pop(k) for k in self._children(key)}

    def _place(self, key: str, files: dict[str, Any]) -> None:
        for rel, f in files.items():
            self._store()[self.path(key) + (f"/{rel}" if rel else "")] = f

    def rename(self, src: str, dst: str) -> None:
        with _LOCK:
            if self.path(dst) in self._store() or self._children(dst):
                raise AlreadyExistsError(f"rename: already exists: {self.describe(dst)}")
            moving = self._take(src)
            if not moving:
                raise NotFoundError(f"rename: not found: {self.describe(src)}")
            self._place(dst, moving)

    def exchange(self, a: str, b: str) -> None:
        with _LOCK:
            va, vb = self._take(a), self._take(b)
            if not va or not vb:
                self._place(a, va)
                self._place(b, vb)
                raise NotFoundError(f"exchange: not found: {self.describe(a if not va else b)}")
            self._place(b, va)
            self._place(a, vb)
