"""Crash simulation for the crash-consistency harness.

``Crasher`` counts the mutating storage operations of a write path and simulates a crash
before the k-th one: that operation and every later one (reads included) raise
``SimulatedCrash``, a ``BaseException`` so that no ``except Exception`` clean-up of the
code under test can run, as after a real crash.

``CrashingDriver`` applies a ``Crasher`` in front of any real driver (memory, local, S3,
GCS): a crash is "the writer stops issuing requests". ``PosixModelDriver`` is an in-test
model of a POSIX filesystem (CrashMonkey/ALICE style): file data is durable only once
the file was fsynced, and a directory entry (create, rename, unlink) only once its
directory was fsynced. ``PosixModel.crash()`` returns the worst persisted state: only
what was made durable.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator
from typing import Any

from atomicstore.commit import conformance
from atomicstore.drivers.local import LocalDriver
from atomicstore.drivers.spec import Capabilities, Driver, Entry, FileInfo, Writer
from atomicstore.errors import AlreadyExistsError, NotFoundError


class SimulatedCrash(BaseException):
    """The process died here."""


class Crasher:
    """Counts operations; crashes before operation number ``crash_at``."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.crash_at = crash_at
        self.count = 0
        self.crashed = False
        self.log: list[tuple[str, str]] = []

    def step(self, op: str, key: str) -> None:
        if self.crashed:
            raise SimulatedCrash(f"already crashed (at {op} {key})")
        if self.crash_at is not None and self.count >= self.crash_at:
            self.crashed = True
            raise SimulatedCrash(f"crash before op #{self.count}: {op} {key}")
        self.count += 1
        self.log.append((op, key))

    def read(self) -> None:
        if self.crashed:
            raise SimulatedCrash("already crashed")


# -- any real driver ----------------------------------------------------------------------
class _CrashingWriter(Writer):
    def __init__(self, inner: Writer, crasher: Crasher, key: str) -> None:
        self.inner, self.crasher, self.key = inner, crasher, key

    def write(self, data: Any) -> None:
        self.crasher.step("write", self.key)
        self.inner.write(data)

    def close(self) -> None:
        self.crasher.step("close", self.key)
        self.inner.close()

    def abort(self) -> None:
        self.crasher.step("abort", self.key)
        self.inner.abort()


class CrashingDriver(Driver):
    """A real driver behind a :class:`Crasher`: same facts, same operations."""

    def __init__(self, inner: Driver, crasher: Crasher) -> None:  # noqa: D107
        self.inner = inner
        self.crasher = crasher
        self.capabilities = inner.capabilities  # type: ignore[misc]
        self.url, self.root = inner.url, inner.root
        self.retry, self.operation_timeout, self.block_size = inner.retry, inner.operation_timeout, inner.block_size
        self._secrets = ()
        # the crash points are the protocol's, not the conformance check's (checked on inner)
        conformance.skip(self, warn=False)

    def describe(self, key: str = "") -> str:
        return self.inner.describe(key)

    def _m(self, op: str, key: str) -> Driver:
        self.crasher.step(op, key)
        return self.inner

    def _r(self) -> Driver:
        self.crasher.read()
        return self.inner

    def open_writer(self, key: str, *, exclusive: bool = False, if_generation: str | None = None) -> Writer:
        inner = self._m("open", key).open_writer(key, exclusive=exclusive, if_generation=if_generation)
        return _CrashingWriter(inner, self.crasher, key)

    def put(self, key: str, data: bytes, *, exclusive: bool = False,
            if_generation: str | None = None) -> str | None:
        return self._m("put", key).put(key, data, exclusive=exclusive, if_generation=if_generation)

    def put_volatile(self, key: str, data: bytes, *, if_generation: str | None = None) -> str | None:
        return self._m("put", key).put_volatile(key, data, if_generation=if_generation)

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        self._m("delete", key).delete(key, if_generation=if_generation)

    def lock(self, timeout: float = 60.0) -> Any:
        self.crasher.read()
        return self.inner.lock(timeout)

    def delete_tree(self, prefix: str) -> None:
        # one step per object, as the backends delete them
        for key in sorted(self._r().find(prefix), reverse=True):
            self._m("delete", key).delete(key)
        self._m("delete_tree", prefix).delete_tree(prefix)

    def rename(self, src: str, dst: str) -> None:
        self._m("rename", f"{src} -> {dst}").rename(src, dst)

    def exchange(self, a: str, b: str) -> None:
        self._m("exchange", f"{a} <-> {b}").exchange(a, b)

    def makedirs(self, key: str) -> None:
        self._m("makedirs", key).makedirs(key)

    def fsync_dir(self, key: str) -> None:
        self._m("fsync_dir", key).fsync_dir(key)

    def abort_upload(self, key: str, upload_id: str) -> None:
        self._m("abort_upload", key).abort_upload(key, upload_id)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self._r().read(key, start, end)

    def read_into(self, key: str, offset: int, out: memoryview, *, generation: str | None = None) -> int:
        return self._r().read_into(key, offset, out, generation=generation)

    def iter_read(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        return self._r().iter_read(key, chunk_size)

    def info(self, key: str) -> FileInfo:
        return self._r().info(key)

    def exists(self, key: str) -> bool:
        return self._r().exists(key)

    def listdir(self, prefix: str = "") -> list[Entry]:
        return self._r().listdir(prefix)

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        return self._r().find(prefix)

    def list_incomplete_uploads(self, prefix: str = "") -> list[tuple[str, str, float]]:
        return self._r().list_incomplete_uploads(prefix)


# -- the POSIX power-loss model -----------------------------------------------------------
class _File:
    def __init__(self) -> None:
        self.data = bytearray()
        self.durable = b""
        self.mtime = 0.0


class _Dir:
    def __init__(self) -> None:
        self.entries: dict[str, _File | _Dir] = {}
        self.durable: dict[str, _File | _Dir] = {}


class PosixModel:
    """Inodes with volatile and durable state. ``skip_fsync(site)`` removes one fsync."""

    def __init__(self, root: _Dir | None = None) -> None:
        self.root = root or _Dir()
        self.clock = 1_000_000.0
        self.fsync_sites: list[str] = []

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def crash(self) -> PosixModel:
        """The worst persisted state: only what fsync made durable survives."""
        memo: dict[int, Any] = {}

        def copy(node: _File | _Dir) -> _File | _Dir:
            if id(node) in memo:
                return memo[id(node)]
            if isinstance(node, _File):
                f = _File()
                f.data = bytearray(node.durable)
                f.durable = node.durable
                f.mtime = node.mtime
                memo[id(node)] = f
                return f
            d = _Dir()
            memo[id(node)] = d
            for name, child in node.durable.items():
                d.entries[name] = copy(child)
            d.durable = dict(d.entries)
            return d

        out = PosixModel(copy(self.root))  # type: ignore[arg-type]
        out.clock = self.clock
        return out


def fsync_site(kind: str, key: str) -> str:
    """Which fsync of the protocol this is (for the missing-fsync demonstration)."""
    from atomicstore.commit.strategies import STAGING

    if kind == "file":
        if key.startswith(STAGING + "/"):
            return "file: manifest" if key.endswith("/manifest.json") else "file: staged data"
        return "file: single-file put"
    if key == "":
        return "dir: store root"
    if key == STAGING:
        return "dir: staging parent"
    if key.startswith(STAGING + "/"):
        return "dir: staged subdirectory" if "/" in key[len(STAGING) + 1 :] else "dir: staging directory"
    return "dir: single-file put parent"


def _gen(node: Any) -> str | None:
    """A model file's generation: its identity (a replaced file is a new node)."""
    return None if node is None else f"n{id(node)}"


class _ModelWriter(Writer):
    def __init__(self, drv: PosixModelDriver, key: str, node: _File) -> None:
        self.drv, self.key, self.node = drv, key, node

    def write(self, data: Any) -> None:
        self.drv.crasher.step("write", self.key)
        self.node.data += bytes(memoryview(data).cast("B"))
        self.node.mtime = self.drv.model.tick()

    def close(self) -> None:
        self.drv._fsync_file(self.key, self.node)  # LocalDriver fsyncs on close

    def abort(self) -> None:
        self.drv.delete(self.key)


class PosixModelDriver(Driver):
    """A driver with LocalDriver's facts over :class:`PosixModel`, one step per syscall."""

    protocols = ("posixmodel",)
    capabilities: Capabilities = LocalDriver.capabilities

    def __init__(self, model: PosixModel, crasher: Crasher, skip: Callable[[str], bool] = lambda s: False) -> None:
        super().__init__(None, "/model", url="posixmodel://")
        self.model, self.crasher, self.skip = model, crasher, skip

    # path helpers
    def _parts(self, key: str) -> list[str]:
        return [p for p in key.split("/") if p]

    def _lookup(self, key: str) -> _File | _Dir:
        node: _File | _Dir = self.model.root
        for p in self._parts(key):
            if not isinstance(node, _Dir) or p not in node.entries:
                raise NotFoundError(f"not found: {key}")
            node = node.entries[p]
        return node

    def _parent(self, key: str) -> tuple[_Dir, str]:
        parent = self._lookup(posixpath.dirname(key))
        if not isinstance(parent, _Dir):
            raise NotFoundError(f"not a directory: {posixpath.dirname(key)}")
        return parent, posixpath.basename(key)

    def _fsync_file(self, key: str, node: _File) -> None:
        self.crasher.step("fsync", key)
        site = fsync_site("file", key)
        self.model.fsync_sites.append(site)
        if not self.skip(site):
            node.durable = bytes(node.data)

    # primitives
    def makedirs(self, key: str) -> None:
        node = self.model.root
        for p in self._parts(key):
            if p not in node.entries:
                self.crasher.step("mkdir", key)
                node.entries[p] = _Dir()
            nxt = node.entries[p]
            if not isinstance(nxt, _Dir):
                raise AlreadyExistsError(f"not a directory: {key}")
            node = nxt

    def open_writer(self, key: str, *, exclusive: bool = False, if_generation: str | None = None) -> Writer:
        assert not exclusive and if_generation is None, "the model stages and renames instead"
        self.makedirs(posixpath.dirname(key))
        parent, name = self._parent(key)
        self.crasher.step("creat", key)
        node = _File()
        node.mtime = self.model.tick()
        parent.entries[name] = node
        return _ModelWriter(self, key, node)

    def put_volatile(self, key: str, data: bytes, *, if_generation: str | None = None) -> str | None:
        return self.put(key, data, durable=False, if_generation=if_generation)

    def put(self, key: str, data: bytes, *, exclusive: bool = False, durable: bool = True,
            if_generation: str | None = None) -> str | None:
        self.makedirs(posixpath.dirname(key))
        parent, name = self._parent(key)
        tmp = f".{name}.put-1-00"
        self.crasher.step("creat", tmp)
        node = _File()
        parent.entries[tmp] = node
        self.crasher.step("write", tmp)
        node.data += data
        node.mtime = self.model.tick()
        if durable:
            self._fsync_file(key, node)
        if exclusive:
            if name in parent.entries:
                self.crasher.step("unlink", tmp)
                del parent.entries[tmp]
                raise AlreadyExistsError(f"exists: {key}")
            self.crasher.step("link", key)
            parent.entries[name] = node
            self.crasher.step("unlink", tmp)
            del parent.entries[tmp]
        else:
            if if_generation is not None and _gen(parent.entries.get(name)) != if_generation:
                from atomicstore.errors import PreconditionFailedError

                self.crasher.step("unlink", tmp)
                del parent.entries[tmp]
                raise PreconditionFailedError(f"changed: {key}")
            self.crasher.step("rename", key)
            parent.entries[name] = parent.entries.pop(tmp)
        if durable:
            self.fsync_dir(posixpath.dirname(key))
        return _gen(node)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.crasher.read()
        node = self._lookup(key)
        if not isinstance(node, _File):
            raise NotFoundError(f"is a directory: {key}")
        return bytes(node.data[start:end])

    def info(self, key: str) -> FileInfo:
        self.crasher.read()
        node = self._lookup(key)
        if not isinstance(node, _File):
            raise NotFoundError(f"is a directory: {key}")
        return FileInfo(key, len(node.data), None, node.mtime, _gen(node))

    def exists(self, key: str) -> bool:
        self.crasher.read()
        try:
            self._lookup(key)
        except NotFoundError:
            return False
        return True

    def listdir(self, prefix: str = "") -> list[Entry]:
        self.crasher.read()
        try:
            node = self._lookup(prefix)
        except NotFoundError:
            return []
        if not isinstance(node, _Dir):
            return []
        return [Entry(n, isinstance(c, _Dir)) for n, c in node.entries.items()]

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        self.crasher.read()
        out: dict[str, FileInfo] = {}
        try:
            start = self._lookup(prefix)
        except NotFoundError:
            return out

        def walk(node: _File | _Dir, path: str) -> None:
            if isinstance(node, _File):
                out[path] = FileInfo(path, len(node.data), None, node.mtime)
                return
            for n, c in node.entries.items():
                walk(c, f"{path}/{n}" if path else n)

        walk(start, prefix)
        return out

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        try:
            parent, name = self._parent(key)
        except NotFoundError:
            return
        if name in parent.entries:
            if if_generation is not None and _gen(parent.entries[name]) != if_generation:
                from atomicstore.errors import PreconditionFailedError

                raise PreconditionFailedError(f"changed: {key}")
            if isinstance(parent.entries[name], _Dir):
                return self.delete_tree(key)
            self.crasher.step("unlink", key)
            del parent.entries[name]

    def delete_tree(self, prefix: str) -> None:
        """Like shutil.rmtree: unlink every file, then remove directories bottom-up."""
        try:
            node = self._lookup(prefix)
        except NotFoundError:
            return
        if isinstance(node, _File):
            return self.delete(prefix)
        for n, child in list(node.entries.items()):
            sub = f"{prefix}/{n}" if prefix else n
            if isinstance(child, _Dir):
                self.delete_tree(sub)
            else:
                self.crasher.step("unlink", sub)
                del node.entries[n]
        parent, name = self._parent(prefix)
        self.crasher.step("rmdir", prefix)
        parent.entries.pop(name, None)

    def rename(self, src: str, dst: str) -> None:
        sp, sn = self._parent(src)
        dp, dn = self._parent(dst)
        if sn not in sp.entries:
            raise NotFoundError(f"not found: {src}")
        if dn in dp.entries:
            raise AlreadyExistsError(f"exists: {dst}")
        self.crasher.step("rename", f"{src} -> {dst}")
        dp.entries[dn] = sp.entries.pop(sn)

    def exchange(self, a: str, b: str) -> None:
        ap, an = self._parent(a)
        bp, bn = self._parent(b)
        if an not in ap.entries or bn not in bp.entries:
            raise NotFoundError(f"exchange: missing {a} or {b}")
        self.crasher.step("exchange", f"{a} <-> {b}")
        ap.entries[an], bp.entries[bn] = bp.entries[bn], ap.entries[an]

    def fsync_dir(self, key: str) -> None:
        node = self._lookup(key)
        assert isinstance(node, _Dir)
        self.crasher.step("fsync", key + "/")
        site = fsync_site("dir", key)
        self.model.fsync_sites.append(site)
        if not self.skip(site):
            node.durable = dict(node.entries)
