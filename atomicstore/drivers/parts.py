"""The parallel-part machinery of object-store drivers: the store's in-flight byte budget
(:class:`InflightBudget`, which the torch integration's reads share too), request bodies
made of the caller's buffers (:class:`PartBody`), faulting in a read's destination ahead
of the data (:func:`populate_pages`) and the multipart writer the S3 and GCS drivers build
on (:class:`BufferedPartWriter`)."""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import contextvars
import errno
import io
import itertools
import logging
import mmap
import sys
import threading
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from ..errors import AlreadyExistsError, NotFoundError, StorageError
from .spec import Writer

log = logging.getLogger("atomicstore.drivers")
T = TypeVar("T")

#: most seconds an abort waits for the parts whose bodies the server already has (their
#: answer is a round trip away unless the server is stalled; then they are cancelled and
#: what they may still store is left to recovery): an interrupted save stays prompt
ABORT_WAIT = 10.0
#: the deadline (``time.monotonic()``) of the abort in progress, shared by every writer a
#: transaction ends together (:func:`abort_deadline`); None: each writer has ABORT_WAIT
_ABORT_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("atomicstore_abort_deadline",
                                                                               default=None)


@contextlib.contextmanager
def abort_deadline(seconds: float = ABORT_WAIT) -> Iterator[None]:
    """Within this block (and in contexts copied from it: ``contextvars.copy_context()``
    for the threads that end several writers at once), a writer's abort waits for its
    requests only until ``seconds`` from now, however many writers wait before it."""
    token = _ABORT_DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _ABORT_DEADLINE.reset(token)


class InflightBudget:
    """Bytes of requests in flight at once on one store, shared by all its writers and
    readers: the parts of every file of a save (and the ranged reads of a restore) draw
    from one budget, so a whole save keeps the link busy without exceeding it.

    :meth:`acquire` blocks until ``n`` more bytes fit (a request larger than the whole
    budget waits until it is alone); :meth:`release` gives them back. ``peak`` is the most
    that was ever in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, give_up: Callable[[], BaseException | None] | None = None) -> int:
        """Take ``n`` bytes (at most the whole budget); return what was taken, to be
        released. ``give_up()`` is asked while waiting: an error it returns is raised."""
        n = min(max(n, 0), self.limit)
        with self._cond:
            while self.used and self.used + n > self.limit:
                err = give_up() if give_up is not None else None
                if err is not None:
                    raise err
                self._cond.wait(1.0)
            self.used += n
            self.peak = max(self.peak, self.used)
        return n

    def fits(self, n: int) -> bool:
        """Would :meth:`acquire` of ``n`` bytes return at once now? (A hint: another
        thread may take the room first.)"""
        with self._cond:
            return not self.used or self.used + min(max(n, 0), self.limit) <= self.limit

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter (one of them may have to give up)."""
        with self._cond:
            self._cond.notify_all()

    def release_when_done(self, fut: concurrent.futures.Future[Any], n: int) -> None:
        """Give ``n`` bytes back once the request ``fut`` is over (however it ends)."""
        fut.add_done_callback(partial(_release, self, n))

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        """Hold ``n`` bytes (at most the whole budget) for the ``with`` block."""
        taken = self.acquire(n)
        try:
            yield
        finally:
            self.release(taken)


def _release(budget: InflightBudget, held: int, _fut: concurrent.futures.Future[Any]) -> None:
    budget.release(held)


class PartBody(io.RawIOBase):
    """A request body made of buffers, read in pieces by the HTTP client without copying
    the buffers as a whole; seekable, so checksums, signatures and retries can re-read it."""

    def __init__(self, segments: Sequence[memoryview]) -> None:
        super().__init__()
        self._segs = list(segments)
        self._ends = list(itertools.accumulate(s.nbytes for s in self._segs))
        self.size = self._ends[-1] if self._ends else 0
        self._pos = 0
        #: set by the sender (:mod:`~atomicstore.drivers.payload`) as it hands the last
        #: bytes to the connection: from then on the server may store the whole body even
        #: if the request is cancelled (a closing connection still flushes what it holds)
        self.handed_over = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        self.handed_over = False  # a new try sends it again
        return self._pos

    def __len__(self) -> int:
        return self.size

    def views(self, n: int) -> Iterator[memoryview]:
        """The next ``n`` bytes (fewer at the end) as views of the buffers, no copy;
        the position moves past each as it is taken."""
        i = bisect.bisect_right(self._ends, self._pos)
        while n > 0 and i < len(self._segs):
            seg = self._segs[i]
            a = self._pos - (self._ends[i] - seg.nbytes)
            k = min(seg.nbytes - a, n)
            self._pos += k
            n -= k
            i += 1
            yield seg[a : a + k]

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        i = bisect.bisect_right(self._ends, self._pos)
        while n < out.nbytes and i < len(self._segs):
            seg = self._segs[i]
            a = self._pos - (self._ends[i] - seg.nbytes)
            k = min(seg.nbytes - a, out.nbytes - n)
            out[n : n + k] = seg[a : a + k]
            n += k
            self._pos += k
            i += 1
        return n


#: reads at least this large have their destination populated ahead of the data
#: (:func:`populate_pages`)
POPULATE_MIN = 2**20
#: the first slice of each span populated (later slices grow fourfold up to the span)
POPULATE_SLICE = 2**18
#: Linux's ``MADV_POPULATE_WRITE`` (5.14+) and ``MADV_NOHUGEPAGE``
_MADV_POPULATE_WRITE = 23
_MADV_NOHUGEPAGE = 15
#: libc's ``madvise`` once looked up; None where there is none
_libc_madvise: Any = ()
#: False once the kernel refused ``MADV_POPULATE_WRITE`` (before 5.14)
_can_populate = True


def _madvise_fn() -> Any:
    global _libc_madvise
    if _libc_madvise == ():
        _libc_madvise = None
        if sys.platform.startswith("linux"):
            import ctypes

            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _libc_madvise = fn
    return _libc_madvise


@contextlib.contextmanager
def _whole_pages(buf: memoryview) -> Iterator[tuple[int, int] | None]:
    """(first, end) addresses of the whole pages of the writable buffer ``buf``, held
    meanwhile; None where it is read-only or not contiguous."""
    import ctypes

    try:
        holder = ctypes.c_char.from_buffer(buf)
    except (TypeError, ValueError, BufferError):
        yield None  # read-only or not contiguous
        return
    try:
        page = mmap.PAGESIZE
        addr = ctypes.addressof(holder)
        yield -(-addr // page) * page, (addr + buf.nbytes) // page * page
    finally:
        del holder


def populate_pages(buf: memoryview, step: int = 8 * 2**20) -> None:
    """Fault in the pages of the writable buffer ``buf`` (Linux ``MADV_POPULATE_WRITE``,
    from its start, ``step`` bytes per call, the GIL released meanwhile) without
    changing a byte of it: safe while another thread writes into ``buf``.

    A restore reads into fresh arrays, and the first write to each of their pages is a
    page fault (measured here: 0.8 s of system time for 256 MiB in a fresh process).
    Without this, every one of them is taken by the event-loop thread that receives
    every response, in series with the receiving. Does nothing where ``buf`` is
    read-only or not contiguous, or the platform has no such call."""
    global _can_populate
    fn = _madvise_fn()
    if fn is None or not _can_populate or not buf.nbytes:
        return
    import ctypes

    with _whole_pages(buf) as pages:
        if pages is None:
            return
        a, end = pages  # whole pages only (the partial ones fault as usual)
        while a < end:
            n = min(step, end - a)
            if fn(a, n, _MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:
                    _can_populate = False  # an unknown advice: a kernel before 5.14
                return
            a += n


def no_huge_pages(buf: memoryview) -> None:
    """Ask that the writable buffer ``buf`` be backed by small pages (Linux
    ``MADV_NOHUGEPAGE``), before any of it is touched. numpy asks for transparent huge
    pages on every large array, and where the kernel defragments on such a request
    (``/sys/kernel/mm/transparent_hugepage/defrag``: ``madvise``, the default) a fault
    can wait for memory to be compacted: populating a fresh 256 MiB destination took
    0.04 to 0.6 s here with huge pages, 0.09 to 0.14 s without. A restore's destination
    is written once, in 8 MiB ranges as they come. Does nothing where ``buf`` is
    read-only, not contiguous, or the platform has no such call."""
    fn = _madvise_fn()
    if fn is None or not buf.nbytes:
        return
    with _whole_pages(buf) as pages:
        if pages is not None and pages[1] > pages[0]:
            fn(pages[0], pages[1] - pages[0], _MADV_NOHUGEPAGE)  # (a refusal changes nothing)


def _done(value: T) -> concurrent.futures.Future[T]:
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class UploadDriver(Protocol):
    """What a :class:`BufferedPartWriter` uses of its driver
    (:class:`atomicstore.drivers.asyncfs.AsyncFsspecDriver` has all of it)."""

    inflight: InflightBudget
    block_size: int
    operation_timeout: float | None

    def describe(self, key: str = "") -> str: ...

    def put(self, key: str, data: bytes, *, exclusive: bool = False,
            if_generation: str | None = None) -> str | None: ...

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...

    def submit(self, op: str, key: str, make: Callable[[], Awaitable[T]],
               conditional: str | None = None) -> concurrent.futures.Future[T]: ...

    def complete_later(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]: ...

    def event_loop(self) -> asyncio.AbstractEventLoop: ...


class BufferedPartWriter(Writer):
    """A streamed object upload: small objects go in one request, large ones in parts
    uploaded in parallel.

    A part is ``block_size`` bytes (the last one shorter) made of the caller's own buffers
    where the caller lends them (:meth:`write_borrowed`: no copy) and of copies of what it
    writes with :meth:`write`. Each part is handed to the backend as soon as it is full;
    it waits only for room in the store's in-flight budget (:class:`InflightBudget`),
    which every upload and ranged read of the store shares: parts of several files fly at
    once, and the copied bytes held by parts stay within the budget. Memory: one part
    being assembled plus the copied parts in flight.

    :meth:`close_async` hands the last part over and completes the object on the driver's
    worker threads; :meth:`close` waits for that. The first part that fails (after the
    retry policy) fails the next ``write``/``close``, and a failed completion aborts the
    upload. Subclasses implement the backend's calls.
    """

    #: borrowed writes shorter than this are copied (not worth a piece of their own)
    min_borrow = 2**16
    #: if set, called right before the request that makes the object visible (the one PUT
    #: of a small object, or the completion once every part is stored), on the thread that
    #: completes it; an exception from it fails ``close`` (the upload is aborted). A
    #: one-file commit takes its claim there (:mod:`atomicstore.commit.onefile`).
    before_complete: Callable[[], None] | None = None
    #: most parts of this one upload in flight at once (``None``: only the store's
    #: in-flight budget bounds them). Backends set it where a server takes the parts of
    #: one upload no faster with more of them at once (S3: :mod:`atomicstore.drivers.s3`)
    max_parts_in_flight: int | None = None

    def __init__(
        self,
        driver: UploadDriver,
        key: str,
        exclusive: bool = False,
        if_generation: str | None = None,
    ) -> None:
        self.driver = driver
        self.key = key
        self.exclusive = exclusive
        self.if_generation = if_generation
        self._pieces: list[memoryview] = []  # sealed pieces of the part being assembled
        self._piece_bytes = 0
        self.buf = bytearray()  # copied bytes not sealed into a piece yet
        self.offset = 0  # bytes handed to the backend so far
        self.parts = 0  # parts handed to the backend so far
        self.started = False
        self.closed = False
        self.aborted = False
        self.error: BaseException | None = None  # the first part that failed
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future[Any]] = []  # every part, in order
        self._closing: concurrent.futures.Future[None] | None = None
        self._live_cond = threading.Condition()
        #: the task of each part request running on the event loop now, with its body
        self._running: dict[asyncio.Future[Any], PartBody] = {}
        self._discarding = False  # no new try of a part starts
        self._flying = 0  # parts handed to the backend and not done yet
        self._flying_cond = threading.Condition()

    # -- streaming ----------------------------------------------------------------------
    def _part_size(self) -> int:
        """The size of the part being assembled (backends may grow it)."""
        return self.driver.block_size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._append(memoryview(data).cast("B"), borrow=False)

    def write_borrowed(self, data: memoryview) -> None:
        self._append(memoryview(data).cast("B"), borrow=True)

    def _append(self, mv: memoryview, *, borrow: bool) -> None:
        self._check()
        if self.closed:
            raise StorageError(f"write to {self.driver.describe(self.key)} after close")
        borrow = borrow and mv.nbytes >= self.min_borrow
        while mv.nbytes:
            take = min(self._part_size() - self._piece_bytes - len(self.buf), mv.nbytes)
            if borrow:
                self._seal()
                self._pieces.append(mv[:take])
                self._piece_bytes += take
            else:
                self.buf += mv[:take]
            mv = mv[take:]
            if self._piece_bytes + len(self.buf) >= self._part_size():
                self._flush_part(final=False)

    def _seal(self) -> None:
        """Make the copied bytes a piece (a fresh buffer takes the next ones)."""
        if self.buf:
            self._pieces.append(memoryview(self.buf))
            self._piece_bytes += len(self.buf)
            self.buf = bytearray()

    def _failure(self) -> BaseException | None:
        if self.error is not None:
            return self.error
        if self.aborted:
            return StorageError(f"upload of {self.driver.describe(self.key)} was aborted")
        return None

    def _check(self) -> None:
        err = self._failure()
        if err is not None:
            raise err

    def _flush_part(self, *, final: bool) -> None:
        self._seal()
        pieces, size = self._pieces, self._piece_bytes
        self._pieces, self._piece_bytes = [], 0
        if final and not size:
            return  # the last part was full: nothing left
        if not self.started:
            self._start()
            self.started = True
        self._take_slot(final)
        budget = self.driver.inflight
        try:
            held = budget.acquire(size, self._failure)
        except BaseException:
            self._give_slot()
            raise
        number = self.parts + 1
        try:
            fut = self._upload_part(pieces, number, self.offset, final)
        except BaseException:
            budget.release(held)
            self._give_slot()
            raise
        del pieces  # the request holds them, and lets go when it is done
        self.parts = number
        self.offset += size
        self._futures.append(fut)
        fut.add_done_callback(partial(self._part_done, held))

    def _take_slot(self, final: bool) -> None:
        """Wait until fewer than :attr:`max_parts_in_flight` parts of this upload are in
        flight (giving up if the upload failed or was aborted meanwhile), and count one more.
        The last part never waits: it is often a short tail (a file a few bytes longer
        than whole parts), and waiting for a slot would delay it, and the completion
        behind it, by a whole part's transfer."""
        cap = None if final else self.max_parts_in_flight
        with self._flying_cond:
            while cap is not None and self._flying >= cap:
                self._check()
                self._flying_cond.wait(1.0)
            self._flying += 1

    def _give_slot(self) -> None:
        with self._flying_cond:
            self._flying -= 1
            self._flying_cond.notify_all()

    def _part_done(self, held: int, fut: concurrent.futures.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            with self._lock:
                if self.error is None:
                    self.error = fut.exception()
        self.driver.inflight.release(held)
        self._give_slot()

    # -- ending -------------------------------------------------------------------------
    def close(self) -> None:
        self._close(inline=True).result()

    def close_async(self) -> concurrent.futures.Future[None]:
        return self._close(inline=False)

    def _close(self, *, inline: bool) -> concurrent.futures.Future[None]:
        if self._closing is not None:
            return self._closing
        self._check()
        if not self.started:
            self._seal()
            data = b"".join(self._pieces)  # smaller than one part
            self._pieces, self._piece_bytes = [], 0
            job: Callable[[], None] = partial(self._put_small, data)
        else:
            self._flush_part(final=True)  # (an error here: the caller aborts)
            job = self._finish
        self.closed = True
        if inline:
            try:
                job()
                self._closing = _done(None)
            except BaseException as exc:
                self._closing = concurrent.futures.Future()
                self._closing.set_exception(exc)
                raise
        else:
            self._closing = self.driver.complete_later(job)
        return self._closing

    def _put_small(self, data: bytes) -> None:
        if self.before_complete is not None:
            self.before_complete()
        try:
            self.generation = self.driver.put(self.key, data, exclusive=self.exclusive,
                                              if_generation=self.if_generation)
        except (AlreadyExistsError, StorageError):
            # A retried put whose first try landed answers 412, and the retry may be
            # invisible (aiohttp re-sends a PUT on a dropped keep-alive connection); or the
            # retries ran out with the outcome unknown: ours if the bytes match.
            if not self._bytes_landed(data):
                raise

    def _submit_part(
        self, op: str, make: Callable[[], Awaitable[T]], body: PartBody
    ) -> concurrent.futures.Future[T]:
        """Submit a part request (with the retry policy), counted while it runs, so an
        abort can wait until none is left in flight before it discards the upload;
        ``body`` is what it sends (an abort cancels it only while not all of it was sent)."""

        async def counted() -> T:
            if self._discarding:  # a retry after the upload was given up: not sent
                raise StorageError(f"upload of {self.driver.describe(self.key)} was aborted")
            task = asyncio.current_task()
            assert task is not None
            with self._live_cond:
                self._running[task] = body
            try:
                return await make()
            finally:
                with self._live_cond:
                    self._running.pop(task, None)
                    self._live_cond.notify_all()

        return self.driver.submit(op, self.key, counted)

    def _settle(self) -> None:
        """Stop every part request and wait until none is running any more: a request
        still running could store a part after the upload is discarded.

        A request whose body has not been sent whole is cancelled: the server gets a short
        body and stores nothing. One whose body was sent whole is let finish (its answer is
        a round trip away): cancelled, its part could still be stored after the discard, as
        a closing connection flushes what it holds (seen on GCS: a component left behind).
        Only if that takes longer than :data:`ABORT_WAIT` (or the operation timeout, if
        shorter) is it cancelled too."""
        self._discarding = True
        loop = self.driver.event_loop()

        async def cancel_unsent() -> None:  # on the loop: no body moves on while it runs
            with self._live_cond:
                running = list(self._running.items())
            for task, body in running:
                if not body.handed_over:
                    task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_unsent(), loop).result(10)
        with self._live_cond:
            settled = self._live_cond.wait_for(lambda: not self._running, timeout=self._abort_wait())
        if settled:
            return
        for f in list(self._futures):
            f.cancel()
        for _ in range(2):  # the cancellations are delivered on the loop, in order
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)
        with self._live_cond:
            self._live_cond.wait_for(lambda: not self._running, timeout=10.0)

    def _abort_wait(self) -> float:
        """How long an abort waits for a request the server may still act on: ABORT_WAIT
        (or the operation timeout, if shorter), or what is left of the deadline shared by
        the writers of one abort (:func:`abort_deadline`)."""
        bound = min(self.driver.operation_timeout or ABORT_WAIT, ABORT_WAIT)
        deadline = _ABORT_DEADLINE.get()
        return bound if deadline is None else min(bound, max(0.0, deadline - time.monotonic()))

    def _finish(self) -> None:
        """Wait for every part, then complete the object; abort the upload on failure."""
        try:
            concurrent.futures.wait(self._futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            self._check()
            for f in self._futures:
                if f.cancelled():
                    raise StorageError(f"upload of {self.driver.describe(self.key)} was aborted")
                f.result()
            if self.before_complete is not None:
                self.before_complete()
            self._complete()
        except BaseException:
            self._abort_quietly()
            raise

    def _bytes_landed(self, data: bytes) -> bool:
        try:
            return self.driver.read(self.key) == data
        except (NotFoundError, StorageError):
            return False

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        self.driver.inflight.wake()  # a writer waiting for room gives up
        with self._flying_cond:
            self._flying_cond.notify_all()  # (or for a slot of this upload)
        closing = self._closing
        if closing is not None:
            # closed: the completion aborts the upload itself if it fails (it does, as it
            # finds this upload aborted); once it is over nothing of it is still in flight.
            # A completion (or small PUT) the server holds is waited for no longer than a
            # part: it may still store the object afterwards, under the attempt's prefix
            # that no marker names, which recovery removes (as any request past its time).
            if self.started:
                self._settle()
            wait = self._abort_wait()
            try:
                closing.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                log.warning("abort of %s: its completion is still unanswered after %.0f s; "
                            "what it may still store is left to recovery",
                            self.driver.describe(self.key), wait)
            except BaseException:  # noqa: BLE001 - the completion's own error was reported
                pass
            return
        if self.started:
            self._abort_quietly()

    def _abort_quietly(self) -> None:
        try:
            self._settle()
            self._abort()
        except Exception as exc:  # noqa: BLE001 - best effort; recovery cleans up
            log.warning("could not abort upload of %s: %s", self.driver.describe(self.key), exc)

    # backend hooks
    @abstractmethod
    def _start(self) -> None:
        """Begin the upload (before the first part)."""

    @abstractmethod
    def _upload_part(
        self, pieces: list[memoryview], number: int, offset: int, final: bool
    ) -> concurrent.futures.Future[Any]:
        """Start uploading part ``number`` (1-based; its bytes are ``pieces``, from byte
        ``offset`` of the object); a future of the request."""

    @abstractmethod
    def _complete(self) -> None:
        """Every part is uploaded: make the object complete at its key (applying the
        writer's conditions)."""

    @abstractmethod
    def _abort(self) -> None:
        """Discard what was uploaded."""
