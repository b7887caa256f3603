"""Local POSIX filesystem.

Facts: ``rename(2)`` of a directory is atomic, and with ``renameat2(RENAME_NOREPLACE)``
(or, where that is missing, because a committed directory is never empty) it never
replaces an existing checkpoint. ``O_EXCL`` gives put-if-absent. Nothing is durable until
fsynced: files are fsynced on close, directories through :meth:`fsync_dir`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from collections.abc import Iterator
from typing import Any

from ..errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, StorageError
from .base import Capabilities, Driver, Entry, FileInfo, Writer

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _load_renameat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


_RENAME_EXCHANGE = 2


def rename_exchange(a: str, b: str) -> None:
    """Swap ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``).

    Where the kernel or filesystem lacks it, falls back to three renames through a
    temporary name, which is not atomic (a crash in between leaves ``b`` missing and
    its old content under ``<a>.xchg``; recovery treats both as uncommitted).
    """
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), a, b)
    tmp = a + ".xchg"
    os.rename(b, tmp)
    os.rename(a, b)
    os.rename(tmp, a)


def rename_noreplace(src: str, dst: str) -> None:
    """``rename(src, dst)`` that fails with ``FileExistsError`` if ``dst`` exists."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: filesystem lacks the flag
            raise OSError(err, os.strerror(err), src, dst)
    # Fallback: a rename onto a non-empty directory fails (ENOTEMPTY/EEXIST), and the
    # commit layer never renames onto a name that could be an empty directory.
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "exists", dst)
    os.rename(src, dst)


def _ignore_vanished(func: Any, path: str, exc_info: Any) -> None:
    """rmtree error handler: an entry removed meanwhile (by a concurrent recovery) is fine."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


class _LocalWriter(Writer):
    durable = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            n = os.write(self.fd, mv)
            mv = mv[n:]

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            if self.durable:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _ExclusiveLocalWriter(Writer):
    """Streams into a hidden sibling; ``close`` fsyncs and links it to the name, which
    fails if the name exists."""

    def __init__(self, driver: LocalDriver, key: str) -> None:
        self.driver, self.key = driver, key
        path = driver.path(key)
        self.tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.put-{os.getpid()}-{os.urandom(6).hex()}"
        self.w = driver._os("open", key, _LocalWriter, self.tmp)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.w.write(data)

    def close(self) -> None:
        if self.w.fd < 0:
            return
        try:
            self.w.close()
            self.driver._os("put", self.key, os.link, self.tmp, self.driver.path(self.key))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
        self.driver.fsync_dir(os.path.dirname(self.key))

    def abort(self) -> None:
        self.w.abort()


class LocalDriver(Driver):
    """Local disk. Commit strategy: stage, fsync, rename, fsync parent."""

    protocols = ("file", "local")
    capabilities = Capabilities(
        atomic_rename=True, atomic_create=True, durable_fsync=True, directories=True
    )

    @classmethod
    def from_url(
        cls, protocol: str, path: str, storage_options: dict[str, Any], **kwargs: Any
    ) -> Driver:
        from fsspec.implementations.local import LocalFileSystem

        if storage_options:
            raise InvalidArgumentError(
                f"local paths take no storage options (got {sorted(storage_options)})"
            )
        root = os.path.abspath(os.path.expanduser(path))
        if os.path.exists(root) and not os.path.isdir(root):
            raise InvalidArgumentError(f"{root} exists and is not a directory")
        created = not os.path.exists(root)
        os.makedirs(root, exist_ok=True)
        drv = cls(LocalFileSystem(), root, url=root, **kwargs)
        if created:
            drv._fsync_path(os.path.dirname(root))
        return drv

    def describe(self, key: str = "") -> str:
        return os.path.join(self.root, key) if key else self.root

    def _fsync_path(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _os(self, op: str, key: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{op}: not found: {self.describe(key)}") from exc
        except NotADirectoryError as exc:
            if op == "rename":
                raise AlreadyExistsError(f"{op}: already exists: {self.describe(key)}") from exc
            raise NotFoundError(f"{op}: not found (a parent is a file): {self.describe(key)}") from exc
        except FileExistsError as exc:
            raise AlreadyExistsError(f"{op}: already exists: {self.describe(key)}") from exc
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR) and op == "rename":
                raise AlreadyExistsError(f"{op}: already exists: {self.describe(key)}") from exc
            raise StorageError(f"{op} {self.describe(key)} failed: {exc.strerror or exc}") from exc

    def open_writer(self, key: str, *, exclusive: bool = False) -> Writer:
        path = self.path(key)
        self.makedirs(os.path.dirname(key))
        if exclusive:
            return _ExclusiveLocalWriter(self, key)
        return self._os("open", key, _LocalWriter, path)

    def put(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Atomic small write: temp file, fsync, then ``link`` (exclusive) or ``replace``."""
        self._put(key, data, exclusive=exclusive, durable=True)

    def put_volatile(self, key: str, data: bytes) -> None:
        self._put(key, data, exclusive=False, durable=False)

    def _put(self, key: str, data: bytes, *, exclusive: bool, durable: bool) -> None:
        path = self.path(key)
        parent = os.path.dirname(path)
        self.makedirs(os.path.dirname(key))
        tmp = f"{parent}/.{os.path.basename(path)}.put-{os.getpid()}-{os.urandom(6).hex()}"
        w = self._os("put", key, _LocalWriter, tmp)
        w.durable = durable
        try:
            w.write(data)
            w.close()
            if exclusive:
                self._os("put", key, os.link, tmp, path)
                os.unlink(tmp)
            else:
                self._os("put", key, os.replace, tmp, path)
        except BaseException:
            w.abort()
            raise
        if durable:
            self.fsync_dir(os.path.dirname(key))

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        def _read() -> bytes:
            with open(self.path(key), "rb") as f:
                if start:
                    f.seek(start)
                if end is None:
                    return f.read()
                return f.read(max(0, end - (start or 0)))

        return self._os("read", key, _read)

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        fd = self._os("read", key, os.open, self.path(key), os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < out.nbytes:
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    break
                done += n
            return done
        finally:
            os.close(fd)

    def iter_read(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        chunk = chunk_size or self.block_size
        f = self._os("read", key, open, self.path(key), "rb")
        with f:
            while True:
                data = f.read(chunk)
                if not data:
                    return
                yield data

    def info(self, key: str) -> FileInfo:
        st = self._os("info", key, os.stat, self.path(key))
        if not os.path.isfile(self.path(key)):
            raise NotFoundError(f"info: not a file: {self.describe(key)}")
        return FileInfo(key, st.st_size, None, st.st_mtime)

    def exists(self, key: str) -> bool:
        return os.path.lexists(self.path(key))

    def listdir(self, prefix: str = "") -> list[Entry]:
        try:
            with os.scandir(self.path(prefix)) as it:
                return [Entry(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        base = self.path(prefix)
        out: dict[str, FileInfo] = {}
        if os.path.isfile(base):
            st = os.stat(base)
            return {prefix: FileInfo(prefix, st.st_size, None, st.st_mtime)}
        for dirpath, _dirs, files in os.walk(base):
            for fn in files:
                full = os.path.join(dirpath, fn)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                out[key] = FileInfo(key, st.st_size, None, st.st_mtime)
        return out

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            self.delete_tree(key)

    def delete_tree(self, prefix: str) -> None:
        path = self.path(prefix)
        if os.path.isdir(path) and not os.path.islink(path):
            self._os("delete", prefix, shutil.rmtree, path, False, _ignore_vanished)
        else:
            self.delete(prefix)

    def rename(self, src: str, dst: str) -> None:
        self._os("rename", dst, rename_noreplace, self.path(src), self.path(dst))

    def exchange(self, a: str, b: str) -> None:
        self._os("exchange", b, rename_exchange, self.path(a), self.path(b))

    def makedirs(self, key: str) -> None:
        self._os("mkdir", key, os.makedirs, self.path(key), 0o755, True)

    def fsync_dir(self, key: str) -> None:
        self._os("fsync", key, self._fsync_path, self.path(key))
