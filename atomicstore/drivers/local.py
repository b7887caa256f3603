"""Local POSIX filesystem.

Facts: ``rename(2)`` of a directory is atomic, and with ``renameat2(RENAME_NOREPLACE)``
(or, where that is missing, because a committed directory is never empty) it never
replaces an existing checkpoint. ``O_EXCL`` gives put-if-absent. Nothing is durable until
fsynced: files are fsynced on close, directories through :meth:`fsync_dir`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import os
import posixpath
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import IO, Any, TypeVar

from ..errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    StorageTimeoutError,
)
from .pools import background_pool
from .renameat2 import (
    PROBE_DIR,
    is_probe_name,
    probe_in_background,
    rename_exchange,
    rename_noreplace,
)
from .spec import Capabilities, Driver, Entry, FileInfo, RenameFlags, Writer

_T = TypeVar("_T")

#: the store's lock file (kept: recovery never removes it; see :meth:`LocalDriver.lock`)
LOCK_KEY = ".atomicstore/lock"

#: descriptors this process holds the store lock (``flock``) through
_LOCK_FDS: set[int] = set()
_LOCK_FDS_GUARD = threading.Lock()


def _close_inherited_lock_fds() -> None:
    """In a forked child: the child's copies of the descriptors the parent holds store
    locks through are closed (an ``flock`` belongs to the open file, so a copy would keep
    the parent's lock held after the parent released it, for as long as the child
    lives)."""
    global _LOCK_FDS_GUARD
    for fd in _LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    _LOCK_FDS_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_close_inherited_lock_fds)




def _ignore_vanished(func: Any, path: str, exc_info: Any) -> None:
    """rmtree error handler: an entry removed meanwhile (by a concurrent recovery) is fine."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


class _LocalWriter(Writer):
    durable = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._closing: concurrent.futures.Future[None] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        try:
            while len(mv):
                n = os.write(self.fd, mv)
                mv = mv[n:]
        except OSError as exc:  # ENOSPC, EIO, EDQUOT...
            raise StorageError(f"write {self.path} failed: {exc.strerror or exc}") from exc

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            if self.durable:
                os.fsync(self.fd)
        except OSError as exc:  # EIO (or ENOSPC on some filesystems) from writeback
            raise StorageError(f"fsync {self.path} failed: {exc.strerror or exc}") from exc
        finally:
            os.close(self.fd)
            self.fd = -1

    def close_async(self) -> concurrent.futures.Future[None]:
        """The fsync runs in a background thread: the caller writes its next file (and
        the next file's fsync runs) meanwhile; the transaction waits for every one before
        its manifest and rename, so the order of what becomes durable is unchanged."""
        if self.fd < 0 or not self.durable:
            return super().close_async()
        self._closing = background_pool().submit(self.close)
        return self._closing

    def abort(self) -> None:
        if self._closing is not None:  # never close the descriptor under a running fsync
            concurrent.futures.wait([self._closing])
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _generation(st: os.stat_result) -> str:
    """A file's generation: its inode and content modification time (a replaced file is a
    new inode; rename and link keep both)."""
    return f"{st.st_ino}.{st.st_mtime_ns}"


#: the base name :func:`temp_sibling` gives (older versions did not cut the name at 48)
_TEMP_NAME = re.compile(r"\.[^/]+\.put-\d+-[0-9a-f]{12}")


def temp_sibling(path: str) -> str:
    """A hidden temporary name next to ``path`` (short whatever the name's length; the
    pattern recovery recognises as a stale single-file temporary)."""
    return f"{os.path.dirname(path)}/.{os.path.basename(path)[:48]}.put-{os.getpid()}-{os.urandom(6).hex()}"


class _ExclusiveLocalWriter(Writer):
    """Streams into a hidden sibling; ``close`` fsyncs and links it to the name, which
    fails if the name exists."""

    def __init__(self, driver: LocalDriver, key: str) -> None:
        self.driver, self.key = driver, key
        self.tmp = temp_sibling(driver.path(key))
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
    """Local disk. Commit strategy: stage, fsync, rename, fsync parent.

    When the store opens, the driver probes whether the filesystem honours
    ``renameat2(RENAME_NOREPLACE)`` and ``RENAME_EXCHANGE`` (NFS and many FUSE mounts do
    not). Without NOREPLACE it uses ``link(2)`` for files and ``rename(2)`` onto a
    non-empty directory for directories (both refuse an existing target atomically);
    without EXCHANGE a file is replaced by ``rename(2)`` (atomic) and replacing a
    directory is refused with a clear error. ``ATOMICSTORE_LOCAL_RENAMEAT2=none`` forces
    the fallbacks (to test them on a filesystem that has the flags).
    """

    protocols = ("file", "local")
    #: (``rename_flags``: what renameat2 gives; each driver finds its filesystem's own)
    capabilities = Capabilities(
        atomic_rename=True, atomic_create=True, durable_fsync=True, directories=True, pinned_reads=True
    )

    def __init__(self, fs: Any, root: str, **kwargs: Any) -> None:
        super().__init__(fs, root, **kwargs)
        self._lock_depth = threading.local()
        self._flags: RenameFlags | None = None
        #: the background probe, started by the first write (a reader never probes)
        self._probe: concurrent.futures.Future[RenameFlags] | None = None
        if os.environ.get("ATOMICSTORE_LOCAL_RENAMEAT2", "").lower() == "none":
            self._flags = RenameFlags(noreplace=False, exchange=False)
        self._probe_pid = os.getpid()
        # the filesystem's rename flags, found by the probe when a rename first needs them
        self.capabilities = replace(self.capabilities, rename_flags=self._flags or self._renameat2_flags)

    def _start_probe(self) -> None:
        """Start the probe in the background, once: called by the first write, so its
        answer is in by the time that save renames."""
        if self._flags is None and self._probe is None:
            self._probe, self._probe_pid = probe_in_background(self.root), os.getpid()

    def _renameat2_flags(self) -> RenameFlags:
        if self._flags is None:
            self._start_probe()
            assert self._probe is not None
            if not self._probe.done() and os.getpid() != self._probe_pid:
                # forked while the parent's probe ran: its thread does not exist here
                self._probe, self._probe_pid = probe_in_background(self.root), os.getpid()
            try:
                self._flags = self._probe.result()
            except StorageError:  # it could not run in the background: once more, now
                self._probe = probe_in_background(self.root)
                self._flags = self._probe.result()  # (still failing: the StorageError says why)
        return self._flags

    @classmethod
    def from_url(
        cls, protocol: str, path: str, storage_options: dict[str, Any], **kwargs: Any
    ) -> Driver:
        if storage_options:
            raise InvalidArgumentError(
                f"local paths take no storage options (got {sorted(storage_options)})"
            )
        root = os.path.abspath(os.path.expanduser(path))
        if os.path.exists(root) and not os.path.isdir(root):
            raise InvalidArgumentError(f"{root} exists and is not a directory")
        created = not os.path.exists(root)
        try:
            os.makedirs(root, exist_ok=True)
        except (NotADirectoryError, FileExistsError) as exc:
            raise InvalidArgumentError(f"{root}: a parent is not a directory ({exc.strerror})") from None
        except OSError as exc:  # ENAMETOOLONG, EACCES, EROFS...
            if exc.errno == errno.ENAMETOOLONG:
                raise InvalidArgumentError(f"{root[:200]}...: name too long") from None
            raise StorageError(f"cannot create the store directory {root}: {exc.strerror or exc}") from exc
        drv = cls(None, root, url=root, **kwargs)  # fsspec's LocalFileSystem only if asked for
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

    def _os(self, op: str, key: str, fn: Callable[..., _T], *args: Any) -> _T:
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

    def open_writer(
        self, key: str, *, exclusive: bool = False, if_generation: str | None = None
    ) -> Writer:
        if if_generation is not None:
            raise NotImplementedError("local files are replaced by staging and renaming")
        path = self.path(key)
        self._start_probe()
        self.makedirs(os.path.dirname(key))
        if exclusive:
            return _ExclusiveLocalWriter(self, key)
        return self._os("open", key, _LocalWriter, path)

    def put(
        self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None
    ) -> str | None:
        """Atomic small write: temp file, fsync, then ``link`` (exclusive) or ``replace``
        (under the store lock, after checking the generation, with ``if_generation``)."""
        return self._put(key, data, exclusive=exclusive, durable=True, if_generation=if_generation)

    def put_volatile(self, key: str, data: bytes, *, if_generation: str | None = None) -> str | None:
        return self._put(key, data, exclusive=False, durable=False, if_generation=if_generation)

    def _put(self, key: str, data: bytes, *, exclusive: bool, durable: bool,
             if_generation: str | None = None) -> str | None:
        path = self.path(key)
        self.makedirs(os.path.dirname(key))
        tmp = temp_sibling(path)
        w = self._os("put", key, _LocalWriter, tmp)
        w.durable = durable
        try:
            w.write(data)
            w.close()
            gen = _generation(self._os("put", key, os.stat, tmp))  # kept through link/rename
            if exclusive:
                self._os("put", key, os.link, tmp, path)
                os.unlink(tmp)
            elif if_generation is not None:
                with self.lock():
                    self._check_generation(key, if_generation)
                    self._os("put", key, os.replace, tmp, path)
            else:
                self._os("put", key, os.replace, tmp, path)
        except BaseException:
            w.abort()
            raise
        if durable:
            self.fsync_dir(os.path.dirname(key))
        return gen

    def _check_generation(self, key: str, if_generation: str) -> None:
        try:
            gen = self.info(key).generation
        except NotFoundError:
            gen = None
        if gen != if_generation:
            raise PreconditionFailedError(f"{self.describe(key)} changed since it was read")

    @contextlib.contextmanager
    def lock(self, timeout: float = 60.0) -> Iterator[None]:
        """``flock`` on ``.atomicstore/lock`` (NFS emulates it with POSIX locks, per
        process) plus the process's own lock; re-entrant within a thread. The kernel drops
        it when the process dies, so a crashed holder never blocks the store."""
        depth = getattr(self._lock_depth, "n", 0)
        if depth:
            self._lock_depth.n = depth + 1
            try:
                yield
            finally:
                self._lock_depth.n -= 1
            return
        deadline = time.monotonic() + timeout
        with super().lock(timeout):
            self.makedirs(posixpath.dirname(LOCK_KEY))
            with _LOCK_FDS_GUARD:  # (a fork cannot copy it without the child closing it)
                fd = self._os("lock", LOCK_KEY, os.open, self.path(LOCK_KEY),
                              os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                _LOCK_FDS.add(fd)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise StorageTimeoutError(
                                f"could not lock {self.describe(LOCK_KEY)} within "
                                f"{timeout}s (another process holds it)"
                            ) from None
                        time.sleep(0.005)
                self._lock_depth.n = 1
                try:
                    yield
                finally:
                    self._lock_depth.n = 0
            finally:
                with _LOCK_FDS_GUARD:
                    if fd in _LOCK_FDS:  # (not if this is a forked child's copy, closed)
                        _LOCK_FDS.discard(fd)
                        os.close(fd)  # releases the flock

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        def _read() -> bytes:
            with open(self.path(key), "rb") as f:
                if start:
                    f.seek(start)
                if end is None:
                    return f.read()
                return f.read(max(0, end - (start or 0)))

        return self._os("read", key, _read)

    def read_into(self, key: str, offset: int, out: memoryview, *, generation: str | None = None) -> int:
        fd = self._os("read", key, os.open, self.path(key), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if generation is not None and _generation(os.fstat(fd)) != generation:
                # the descriptor pins the file it opened: checked once, read from it
                raise PreconditionFailedError(
                    f"{self.describe(key)} was replaced since it was looked at (generation "
                    f"{generation}): read it again"
                )
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
        f: IO[bytes] = self._os("read", key, open, self.path(key), "rb")
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
        return FileInfo(key, st.st_size, None, st.st_mtime, _generation(st))

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

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        if if_generation is not None:
            with self.lock():
                if os.path.lexists(self.path(key)):
                    self._check_generation(key, if_generation)
                    self.delete(key)
            return
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            self.delete_tree(key)

    def is_temporary(self, key: str) -> bool:
        """A temporary of :meth:`put` or of an exclusive writer (:func:`temp_sibling`)."""
        return bool(_TEMP_NAME.fullmatch(key.rpartition("/")[2]))

    def stray_leftovers(self, older_than: float) -> list[str]:
        """``renameat2`` probe directories (``.probe-<pid>-<hex>{a,b,c}``) of a process
        killed while probing, in ``.atomicstore/`` (and, from older versions, the root)."""
        out, now = [], time.time()
        for where in ("", PROBE_DIR):
            try:
                entries = list(os.scandir(self.path(where)))
            except OSError:
                continue
            for e in entries:
                if is_probe_name(e.name) and e.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        if e.stat(follow_symlinks=False).st_mtime + older_than < now:
                            out.append(f"{where}/{e.name}".lstrip("/"))
        return out

    def delete_tree(self, prefix: str) -> None:
        path = self.path(prefix)
        if os.path.isdir(path) and not os.path.islink(path):
            self._os("delete", prefix, shutil.rmtree, path, False, _ignore_vanished)
        else:
            self.delete(prefix)

    def rename(self, src: str, dst: str) -> None:
        self._os("rename", dst,
                 lambda a, b: rename_noreplace(a, b, native=self.capabilities.renames().noreplace),
                 self.path(src), self.path(dst))

    def exchange(self, a: str, b: str) -> None:
        if self.capabilities.renames().exchange:
            return self._os("exchange", b, rename_exchange, self.path(a), self.path(b))
        if os.path.isdir(self.path(a)):
            raise StorageError(
                f"cannot replace {self.describe(b)} atomically: this filesystem lacks "
                "renameat2(RENAME_EXCHANGE) (NFS, FUSE); delete the checkpoint, then save it"
            )
        # a file is replaced atomically by rename(2); the old one is dropped, not swapped
        if not os.path.lexists(self.path(b)):
            raise NotFoundError(f"exchange: not found: {self.describe(b)}")
        self._os("exchange", b, os.replace, self.path(a), self.path(b))

    def makedirs(self, key: str) -> None:
        self._os("mkdir", key, os.makedirs, self.path(key), 0o755, True)

    def fsync_dir(self, key: str) -> None:
        self._os("fsync", key, self._fsync_path, self.path(key))
