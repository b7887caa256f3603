"""Any other fsspec protocol, with conservative facts.

Facts assumed: no atomic rename, no atomic create, no fsync. Strategy: marker, but the
marker's "create if absent" is a check followed by a write, so two writers racing on one
name could both believe they committed. A warning says so, once per protocol.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import AlreadyExistsError
from .spec import Capabilities, Driver, Entry, FileInfo, Writer

_warned: set[str] = set()


class ExclusivityWarning(UserWarning):
    """A backend cannot guarantee that only one writer commits a checkpoint."""


class _GenericWriter(Writer):
    def __init__(self, driver: GenericDriver, key: str) -> None:
        self.driver = driver
        self.f = driver.fs.open(driver.path(key), "wb")

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.f.write(data)

    def close(self) -> None:
        self.f.close()

    def abort(self) -> None:
        try:
            if hasattr(self.f, "discard"):
                self.f.discard()
            else:
                self.f.close()
        except Exception:  # noqa: BLE001 - best effort
            pass


class GenericDriver(Driver):
    """Conservative driver over an arbitrary fsspec filesystem."""

    protocols = ()
    capabilities = Capabilities(
        atomic_rename=False, atomic_create=False, durable_fsync=False, directories=False
    )

    def __init__(self, fs: Any, root: str, **kwargs: Any) -> None:
        super().__init__(fs, root, **kwargs)
        proto = self.url.split("://", 1)[0]
        if proto not in _warned:
            _warned.add(proto)
            warnings.warn(
                f"{proto}:// has no atomicstore driver: exclusivity is not guaranteed "
                "(two writers of one checkpoint could both commit); rename is not atomic",
                ExclusivityWarning,
                stacklevel=4,
            )

    def _run(self, op: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            for attempt in self.retry.retrying(self.is_transient):
                with attempt:
                    return fn(*args, **kwargs)
        except Exception as exc:
            raise self.wrap_error(op, key, exc) from exc

    def open_writer(
        self, key: str, *, exclusive: bool = False, if_generation: str | None = None
    ) -> Writer:
        if exclusive and self.exists(key):  # not atomic: see the module docstring
            raise AlreadyExistsError(f"open: already exists: {self.describe(key)}")
        writer: Writer = self._run("open", key, _GenericWriter, self, key)
        return writer

    def put(
        self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None
    ) -> str | None:
        if exclusive and self.exists(key):  # not atomic: see the module docstring
            raise AlreadyExistsError(f"put: already exists: {self.describe(key)}")
        self._run("put", key, self.fs.pipe_file, self.path(key), data)
        return None

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        data: bytes = self._run("read", key, self.fs.cat_file, self.path(key), start=start, end=end)
        return data

    def info(self, key: str) -> FileInfo:
        raw = self._run("info", key, self.fs.info, self.path(key))
        return FileInfo(key, int(raw.get("size") or 0))

    def listdir(self, prefix: str = "") -> list[Entry]:
        try:
            items = self.fs.ls(self.path(prefix), detail=True)
        except FileNotFoundError:
            return []
        base = self.path(prefix).rstrip("/") + "/"
        return [
            Entry(i["name"].rstrip("/")[len(base):], i.get("type") == "directory")
            for i in items
            if i["name"].startswith(base)
        ]

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        try:
            out = self.fs.find(self.path(prefix), detail=True)
        except FileNotFoundError:
            return {}
        root = self.root + "/"
        return {
            k[len(root):]: FileInfo(k[len(root):], int(v.get("size") or 0))
            for k, v in out.items()
            if k.startswith(root)
        }

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass
