"""Process-wide machinery shared by the drivers: the background thread pool, the
per-root process locks, and what a forked child must redo before it uses a driver (fsspec's
async filesystems, thread pools and held locks do not survive a fork)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Protocol, TypeVar

from ..errors import StorageTimeoutError

T = TypeVar("T")


class ForkAware(Protocol):
    """A driver, as the fork hook sees it."""

    def after_fork(self) -> None:
        """Redo what the parent's threads and event loops held (runs in the child)."""


class DaemonPool:
    """:class:`concurrent.futures.ThreadPoolExecutor`'s ``submit`` and ``shutdown``, on
    daemon threads. A thread of these pools waits on one request; a request an abort gave
    up on (``parts.ABORT_WAIT``: a server that holds it) must not keep the process from
    exiting, as the executor's threads do (the interpreter joins them at exit): a
    preempted job would outlive its grace period. What such a request may still store is
    recovery's. A thread is started when no idle one is left, up to ``max_workers``, as
    the executor does."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._max, self._prefix = max_workers, thread_name_prefix
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads done with a task and not yet handed another
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((fut, partial(fn, *args, **kwargs)))
            if self._idle:
                self._idle -= 1
            elif self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._prefix}_{self._threads}", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, job = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(job())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    fut.set_exception(exc)
            del item, fut, job
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = False) -> None:
        """No new work; each thread ends once the work queued before is done. Never
        waits for them (``wait`` is accepted for the executor's signature)."""
        with self._lock:
            self._shut = True
            n = self._threads
        for _ in range(n):
            self._queue.put(None)


_POOL: DaemonPool | None = None
_POOL_GUARD = threading.Lock()


def background_pool() -> DaemonPool:
    """Threads for :meth:`AsyncFsspecDriver.background` (each waits on one request)."""
    global _POOL
    with _POOL_GUARD:
        if _POOL is None:
            _POOL = DaemonPool(32, thread_name_prefix="atomicstore-bg")
        return _POOL


def _forget_pool() -> None:
    """In a forked child the parent's pool threads do not exist: work submitted to it
    would never run. The child makes its own; likewise its own per-root process locks
    (one held by a parent thread at the fork would stay held in the child forever)."""
    global _POOL, _POOL_GUARD, _PROCESS_LOCKS_GUARD
    _POOL, _POOL_GUARD = None, threading.Lock()  # (its guard too: a parent thread may hold it)
    _PROCESS_LOCKS.clear()
    _PROCESS_LOCKS_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)

#: every driver of this process (a forked child resets each: :meth:`Driver.after_fork`)
_LIVE_DRIVERS: weakref.WeakSet[ForkAware] = weakref.WeakSet()
#: in a forked child, the parent's filesystems its drivers held: kept alive and never used
#: (their finalizers would close the parent's connections from the child)
_INHERITED: list[Any] = []


def track_for_fork(driver: ForkAware) -> None:
    """In a forked child, call ``driver.after_fork()`` before anything else runs (for as
    long as the driver lives)."""
    _LIVE_DRIVERS.add(driver)


def keep_inherited(obj: Any) -> None:
    """In a forked child: keep the parent's ``obj`` (an fsspec filesystem) alive, unused
    and unclosed for the rest of this process (:func:`_keep_unclosed`)."""
    _INHERITED.append(obj)
    _keep_unclosed(obj)


def _keep_unclosed(obj: Any) -> None:
    """Keep the finalizers of ``obj`` (s3fs and gcsfs close their sessions in one) from
    running at this process's exit: held in :data:`_INHERITED`, it is never collected,
    and at exit they would wait on the parent's event loop, which does not run here."""
    for fin in list(getattr(weakref.finalize, "_registry", {})):
        info = fin.peek()
        if info is not None and info[0] is obj:
            fin.atexit = False


def _drivers_after_fork() -> None:
    asyn = sys.modules.get("fsspec.asyn")
    if asyn is not None and not hasattr(asyn, "reset_after_fork"):
        # fsspec < 2025.3.1 does not reset its IO loop in a forked child: a filesystem made
        # there would run on the parent's loop, whose thread does not exist here (hangs)
        asyn.reset_lock()
    for driver in list(_LIVE_DRIVERS):
        driver.after_fork()


os.register_at_fork(after_in_child=_drivers_after_fork)


_PROCESS_LOCKS: dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def held(lock: threading.Lock | threading.RLock, timeout: float, what: str) -> Iterator[None]:
    """Hold ``lock``, or raise :class:`StorageTimeoutError` after ``timeout`` seconds."""
    if not lock.acquire(timeout=timeout):
        raise StorageTimeoutError(f"could not take {what} within {timeout}s")
    try:
        yield
    finally:
        lock.release()


def process_lock(root: str, timeout: float) -> contextlib.AbstractContextManager[None]:
    """The lock shared within this process by every driver of ``root`` (held through
    :func:`held`: :class:`StorageTimeoutError` after ``timeout`` seconds)."""
    with _PROCESS_LOCKS_GUARD:
        lk = _PROCESS_LOCKS.setdefault(root, threading.Lock())
    return held(lk, timeout, f"the store lock of {root}")
