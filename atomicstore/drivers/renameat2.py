"""Linux ``renameat2``: the rename flags the local driver commits with, and the probe that
finds which of them the filesystem under a store honours.

``RENAME_NOREPLACE`` makes a rename refuse an existing target in one step;
``RENAME_EXCHANGE`` swaps two names (whole directories) in one step. NFS and many FUSE
mounts answer EINVAL to both, so the local driver asks its filesystem once
(:func:`probe_in_background`, from the first write) and falls back where they are missing
(:func:`rename_noreplace`); the answer is the ``rename_flags`` fact of its
:class:`~atomicstore.drivers.spec.Capabilities`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import re
import threading
from typing import Any

from ..errors import StorageError
from .spec import RenameFlags

_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


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


def renameat2_call(a: str, b: str, flags: int) -> int:
    """0, or the errno of ``renameat2(a, b, flags)`` (ENOSYS if libc lacks it)."""
    if _renameat2 is None:
        return errno.ENOSYS
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return 0
    return ctypes.get_errno()


#: per filesystem (``st_dev``) and process: the probe's answer, found in the background
#: (a probe that could not run, e.g. on a read-only store or a full disk, is not kept)
_PROBED: dict[int, concurrent.futures.Future[RenameFlags]] = {}
#: where the probe makes its directories (recovery removes those a killed probe left)
PROBE_DIR = ".atomicstore"
PROBE_PREFIX = ".probe-"
_PROBE_NAME = re.compile(r"\.probe-\d+-[0-9a-f]{8}[abc]")
_PROBE_LOCK = threading.Lock()


def is_probe_name(name: str) -> bool:
    """True if ``name`` (a base name) is one of the probe's scratch directories."""
    return bool(_PROBE_NAME.fullmatch(name))


def probe_in_background(root: str) -> concurrent.futures.Future[RenameFlags]:
    """:func:`probe_renameat2` of ``root``'s filesystem, once per filesystem and process,
    run in a thread: its mkdir/rename/rmdir round trips overlap the first save's data
    (nothing is renamed before the answer is in). Where it cannot run (a read-only store,
    no space or inodes left) the future holds a :class:`StorageError` and is forgotten,
    so the next call probes again."""
    try:
        dev = os.stat(root).st_dev
    except OSError:
        dev = None
    with _PROBE_LOCK:
        fut = _PROBED.get(dev) if dev is not None else None
        if fut is not None:
            return fut
        fut = concurrent.futures.Future()
        if dev is not None:
            _PROBED[dev] = fut

    def run() -> None:
        try:
            fut.set_result(probe_renameat2(root))
        except OSError as exc:
            with _PROBE_LOCK:  # not an answer for the filesystem: the next call asks again
                if dev is not None and _PROBED.get(dev) is fut:
                    del _PROBED[dev]
            fut.set_exception(StorageError(f"cannot probe {root} for renameat2 flags (needed to "
                                           f"rename): {exc.strerror or exc}"))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
            fut.set_exception(exc)

    threading.Thread(target=run, name="atomicstore-renameat2-probe", daemon=True).start()
    return fut


def _forget_pending_probes() -> None:
    """In a forked child: a probe still running in the parent never finishes here."""
    for dev, fut in list(_PROBED.items()):
        if not fut.done():
            del _PROBED[dev]


os.register_at_fork(after_in_child=_forget_pending_probes)


def probe_renameat2(directory: str) -> RenameFlags:
    """Which ``renameat2`` flags the filesystem of ``directory`` honours:
    ``(RENAME_NOREPLACE, RENAME_EXCHANGE)``. NFS and many FUSE mounts answer EINVAL.
    Its directories are made in ``<directory>/.atomicstore/`` (the same filesystem as
    the checkpoints, out of the user's listing); a process killed in between leaves
    them, and recovery removes them."""
    home = os.path.join(directory, PROBE_DIR)
    os.makedirs(home, exist_ok=True)
    base = os.path.join(home, f"{PROBE_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
    a, b, c = base + "a", base + "b", base + "c"
    os.mkdir(a)
    try:
        os.mkdir(b)
        try:
            # onto a name that does not exist: the VFS answers EEXIST for an existing target
            # before the filesystem is asked, so only this shows whether it has the flag
            noreplace = renameat2_call(a, c, RENAME_NOREPLACE) == 0
            if noreplace:
                os.rename(c, a)
            exchange = renameat2_call(a, b, RENAME_EXCHANGE) == 0
        finally:
            os.rmdir(b)
    finally:
        os.rmdir(a)
    return RenameFlags(noreplace, exchange)


def _raise_errno(err: int, a: str, b: str) -> None:
    raise OSError(err, os.strerror(err), a, b)


def rename_exchange(a: str, b: str) -> None:
    """Swap ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``)."""
    err = renameat2_call(a, b, RENAME_EXCHANGE)
    if err:
        _raise_errno(err, a, b)


def rename_noreplace(src: str, dst: str, *, native: bool = True) -> None:
    """``rename(src, dst)`` that fails with ``FileExistsError`` if ``dst`` exists, in one
    atomic step: ``renameat2(RENAME_NOREPLACE)`` where the filesystem has it; otherwise
    ``link(2)`` + unlink for a file (link never replaces), and ``rename(2)`` for a
    directory (which fails on a non-empty target; a committed checkpoint is never
    empty)."""
    if native:
        err = renameat2_call(src, dst, RENAME_NOREPLACE)
        if err == 0:
            return
        if err not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: filesystem lacks the flag
            _raise_errno(err, src, dst)
    if os.path.isdir(src):
        os.rename(src, dst)
    else:
        os.link(src, dst)
        os.unlink(src)
