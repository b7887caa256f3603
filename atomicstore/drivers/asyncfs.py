"""Drivers over fsspec's async filesystems (s3fs, gcsfs, ...): every request a coroutine
on the filesystem's own event loop, under the operation timeout and the retry policy;
large reads split into ranged requests within the store's in-flight budget
(:mod:`.parts`); listings, deletes and ``info`` through fsspec's async API."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from functools import partial
from typing import Any, ClassVar, TypeVar

from ..errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, StorageError
from .classify import http_status_of, is_transient_error
from .parts import POPULATE_MIN, POPULATE_SLICE, InflightBudget, populate_pages
from .pools import DaemonPool, background_pool
from .spec import Driver, Entry, FileInfo, refusals_are_final, refusals_final

log = logging.getLogger("atomicstore.drivers")
T = TypeVar("T")

#: Object-store reads are split into ranged requests of this size, run in parallel
READ_CHUNK = 8 * 2**20
#: Default part size of object-store uploads (as boto3's and the AWS CRT's): with the
#: default budget, 32 parts in flight
OBJECT_BLOCK_SIZE = 8 * 2**20


def _swallow(task: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of an abandoned request so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


def _mtime(raw: Mapping[str, Any]) -> float | None:
    """Modification time (Unix seconds) from an fsspec info dict, if it has one."""
    for k in ("LastModified", "mtime", "updated", "last_modified"):
        v = raw.get(k)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, int | float):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None



class AsyncFsspecDriver(Driver):
    """Helpers for drivers over fsspec's async filesystems (s3fs, gcsfs, ...).

    Every request runs as a coroutine on the filesystem's own event loop under the
    operation timeout and the retry policy, so a stalled request is abandoned (cancelled
    in the background) and fails with :class:`StorageTimeoutError` instead of hanging the
    caller.
    A timeout is not retried: the caller learns within the timeout plus a small margin.
    """

    #: exception types (besides HTTP 429/5xx) that are transient for this backend
    transient_types: ClassVar[tuple[type[BaseException], ...]] = (ConnectionError,)
    default_block_size = OBJECT_BLOCK_SIZE
    #: size of the ranged requests a large read is split into
    read_chunk: ClassVar[int] = READ_CHUNK

    def is_transient(self, exc: BaseException) -> bool:
        return is_transient_error(exc, self.transient_types)

    def __init__(self, fs: Any, root: str, **kwargs: Any) -> None:
        super().__init__(fs, root, **kwargs)
        #: the store's in-flight budget: every part upload and ranged read draws from it
        self.inflight = InflightBudget(self.max_inflight_bytes)
        # a reader runs as many ranged reads at once as the budget holds, all sent from
        # one thread (read_ranges_into)
        self.capabilities = replace(
            self.capabilities, io_threads=max(8, self.max_inflight_bytes // self.read_chunk), batched_reads=True)
        self._completer: DaemonPool | None = None
        self._completer_lock = threading.Lock()

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The filesystem's event loop, where every request of this driver runs."""
        loop: asyncio.AbstractEventLoop = self.fs.loop
        return loop

    def after_fork(self) -> None:
        """Also the in-flight budget (the parent's requests, which never end here, hold
        some of it) and the completion threads (the parent's do not exist here)."""
        super().after_fork()
        self.inflight = InflightBudget(self.max_inflight_bytes)
        self._completer = None
        self._completer_lock = threading.Lock()

    def complete_later(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the driver's completion threads: the completions of uploads
        closed with ``close_async``, each waiting for its parts, then completing the
        object (long waits, kept off the short-request pool of :meth:`background`)."""
        with self._completer_lock:
            if self._completer is None:
                self._completer = DaemonPool(32, thread_name_prefix="atomicstore-complete")
            return self._completer.submit(fn)

    def close(self) -> None:
        with self._completer_lock:
            if self._completer is not None:
                self._completer.shutdown(wait=False)
                self._completer = None

    def connect(self, make: Callable[[], Coroutine[Any, Any, Any]],
                loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Create the backend client now (loading service models, credentials), so that
        this one-off cost is never charged to the timeout of the first request. ``make``
        runs on ``loop`` (default: the filesystem's)."""
        try:
            asyncio.run_coroutine_threadsafe(make(), loop or self.event_loop()).result()
        except TypeError as exc:  # an option the client does not take (`-o nonsense=1`)
            raise InvalidArgumentError(f"{self.describe()}: bad storage options: {exc}") from None
        except Exception as exc:
            raise self.wrap_error("connect", "", exc) from exc

    def submit(
        self, op: str, key: str, make: Callable[[], Awaitable[T]], conditional: str | None = None
    ) -> concurrent.futures.Future[T]:
        """Run ``make()`` on the filesystem loop with timeout and retries; a future."""

        async def once() -> T:
            # Not asyncio.wait_for: it waits for the cancelled request to wind down, which
            # an HTTP client may delay until the server answers. Give up on time instead.
            task = asyncio.ensure_future(make())
            try:
                done, _ = await asyncio.wait({task}, timeout=self.operation_timeout)
            except asyncio.CancelledError:  # the caller gave up (an aborted upload)
                task.cancel()
                task.add_done_callback(_swallow)
                raise
            if not done:
                task.cancel()
                task.add_done_callback(_swallow)
                raise TimeoutError(f"{op} timed out")
            return task.result()

        async def run() -> T:
            tries = 0
            try:
                async for attempt in self.retry.async_retrying(self.is_transient):
                    with attempt:
                        tries += 1
                        # a try sent again may be refused for what the one before did
                        with refusals_are_final(tries == 1 and refusals_final()):
                            return await once()
            except BaseException as exc:  # noqa: BLE001 - translated below
                if isinstance(exc, asyncio.CancelledError):
                    raise
                err = self.wrap_error(op, key, exc, conditional)
                if isinstance(err, AlreadyExistsError) and tries > 1:
                    err.retried = True  # an earlier try may have been applied: reconcile
                raise err from exc
            raise AssertionError("unreachable")  # pragma: no cover

        return asyncio.run_coroutine_threadsafe(run(), self.event_loop())

    def call(
        self, op: str, key: str, make: Callable[[], Awaitable[T]], conditional: str | None = None
    ) -> T:
        """Like :meth:`submit`, waiting for the result."""
        return self.submit(op, key, make, conditional).result()

    # Generic primitives through fsspec's async API --------------------------------------
    def _read_range(self, key: str, start: int | None, end: int | None) -> Awaitable[bytes]:
        """A coroutine reading bytes ``[start, end)`` of ``key``."""
        return self.fs._cat_file(self.path(key), start=start, end=end)  # type: ignore[no-any-return]

    async def _get_into(self, key: str, start: int, out: memoryview, *, generation: str | None = None) -> int:
        """Read ``out.nbytes`` bytes of ``key`` from ``start`` into ``out``; how many
        there were (fewer only at the end of the object). Backends stream the answer into
        ``out`` without an intermediate copy of the range; those with
        ``native_generation_reads`` (:class:`Capabilities`) make it conditional on
        ``generation``."""
        data = await self._read_range(key, start, start + out.nbytes)
        out[: len(data)] = data
        return len(data)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.call("read", key, lambda: self._read_range(key, start, end))

    def read_into(self, key: str, offset: int, out: memoryview, *, generation: str | None = None) -> int:
        """Ranged reads of :attr:`read_chunk` bytes straight into ``out``, as many at
        once as the store's in-flight budget allows; with ``generation``, each of them
        conditional on it (:meth:`Driver.read_into`)."""
        return self.read_ranges_into(key, [(offset, out)], generation=generation)[0]

    def read_ranges_into(self, key: str, ranges: Sequence[tuple[int, memoryview]], *,
                         generation: str | None = None, threads: int | None = None) -> list[int]:
        """Every range's ranged reads of :attr:`read_chunk` bytes, sent from this thread
        in order, as many at once as the store's in-flight budget allows, before waiting
        for any (:meth:`Driver.read_ranges_into`; ``threads`` is not needed: the event
        loop does the waiting)."""
        views = [memoryview(out).cast("B") for _, out in ranges]
        step = self.read_chunk
        # (range, offset in it, length): every range's spans, in the order given
        spans = [(i, a, min(step, mv.nbytes - a)) for i, mv in enumerate(views) for a in range(0, mv.nbytes, step)]
        futures: list[concurrent.futures.Future[int]] = []

        def failed() -> BaseException | None:
            return next((f.exception() for f in futures if f.done() and not f.cancelled()
                         and f.exception() is not None), None)

        # This thread takes the destinations' page faults (populate_pages, the GIL
        # released) while the requests are on their way, so that the event loop does not:
        # it would take them while it copies a response in, holding the GIL, and a slow
        # fault (a huge page to zero or compact) stalls every thread of the process (seen
        # here: 16 leaves' requests sent 1.5 s late). The spans sent so far are populated
        # whenever this thread would wait for room in the budget, and once all are sent:
        # breadth first (each span's next slice in turn), the order their bytes come in.
        # Sending every range's requests from one thread before waiting for any puts
        # them all on the wire at once: one thread per range (a reader's leaves) sent them
        # over 0.6 s, each thread waiting for the GIL the event loop holds.
        populated = 0  # spans[:populated] are

        def populate_sent() -> None:
            nonlocal populated
            todo: dict[int, list[tuple[int, int]]] = {}
            for i, a, k in spans[populated : len(futures)]:
                if views[i].nbytes >= POPULATE_MIN:
                    todo.setdefault(i, []).append((a, k))
            for i, part in todo.items():
                _populate_breadth_first(views[i], part, step)
            populated = len(futures)

        # At most as many requests at once as the budget holds of full-size reads: many
        # small ranges would otherwise all be sent at once (the budget counts bytes) and
        # wait for a pooled connection inside their own operation timeout.
        most = self.capabilities.io_threads
        flying: list[concurrent.futures.Future[int]] = []
        try:
            for i, a, k in spans:
                if futures and not self.inflight.fits(k):
                    populate_sent()
                if len(flying) >= most:
                    populate_sent()
                    flying = _after_one_done(flying)
                held = self.inflight.acquire(k, failed)
                try:
                    fut = self.submit("read", key, partial(
                        self._get_into_or_end, key, ranges[i][0] + a, views[i][a : a + k], generation),
                        "generation" if generation is not None else None)
                except BaseException:
                    self.inflight.release(held)
                    raise
                self.inflight.release_when_done(fut, held)
                futures.append(fut)
                flying.append(fut)
            populate_sent()
            counts = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        if not self.capabilities.native_generation_reads:
            self._still_at(key, generation)
        return _bytes_read(len(views), spans, counts)

    async def _get_into_or_end(self, key: str, start: int, out: memoryview,
                               generation: str | None = None) -> int:
        try:
            if generation is not None and self.capabilities.native_generation_reads:
                return await self._get_into(key, start, out, generation=generation)
            return await self._get_into(key, start, out)
        except Exception as exc:
            if http_status_of(exc) == 416:  # the range starts past the end of the object
                return 0
            raise

    async def _read_sized(self, key: str, start: int, end: int, sized: Callable[[int], None]) -> bytes:
        """Like :meth:`_read_range` (bytes ``[start, end)``, fewer at the end of the
        object), and call ``sized(size of the whole object)`` as soon as the answer's
        headers tell it (S3: ``Content-Range``), before its body has arrived. Backends
        whose ranged reads say the size implement it; without it :meth:`iter_read` asks
        :meth:`info` first (one more round trip)."""
        raise NotImplementedError

    def _submit_read(self, key: str, k: int, make: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Submit a read of ``k`` bytes within the in-flight budget (released when it ends)."""
        held = self.inflight.acquire(k)
        try:
            fut = self.submit("read", key, make)
        except BaseException:
            self.inflight.release(held)
            raise
        self.inflight.release_when_done(fut, held)
        return fut

    def iter_read(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        """Stream ``key`` in order, reading a few chunks ahead in parallel (within the
        in-flight budget). Where the first ranged read tells the object's size
        (:meth:`_read_sized`), the others are sent as soon as its headers arrive, and no
        request asks for the size first."""
        chunk = chunk_size or self.read_chunk
        window = max(1, min(8, self.max_inflight_bytes // chunk))
        ahead: collections.deque[tuple[int, concurrent.futures.Future[bytes]]] = collections.deque()
        pos = size = 0

        def more() -> None:
            nonlocal pos
            while pos < size and len(ahead) < window:
                k = min(chunk, size - pos)
                ahead.append((k, self._submit_read(key, k, partial(self._read_range, key, pos, pos + k))))
                pos += k

        try:
            if type(self)._read_sized is AsyncFsspecDriver._read_sized:
                size = self.info(key).size
            else:
                told: concurrent.futures.Future[int] = concurrent.futures.Future()

                def sized(n: int) -> None:  # on the event loop; a retry may tell it again
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        told.set_result(n)

                first = self._submit_read(key, chunk, partial(self._read_sized, key, 0, chunk, sized))
                ahead.append((chunk, first))
                either: list[concurrent.futures.Future[Any]] = [told, first]
                concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
                if not told.done():
                    first.result()  # its error
                    raise StorageError(f"read {self.describe(key)}: the answer did not say the object's size")
                size = told.result()
                ahead[0] = (min(chunk, size), first)
                pos = min(chunk, size)
                if not size:
                    first.result()
                    return
            more()
            while ahead:
                k, fut = ahead.popleft()
                data = fut.result()
                if len(data) != k:
                    raise StorageError(f"read {self.describe(key)}: unexpected end of the object")
                more()
                yield data
        finally:
            for _, f in ahead:
                f.cancel()

    def info(self, key: str) -> FileInfo:
        raw = self.call("info", key, lambda: self.fs._info(self.path(key)))
        if raw.get("type") == "directory":
            raise NotFoundError(f"info: not a file: {self.describe(key)}")
        return self._file_info(key, raw)

    def _file_info(self, key: str, raw: Mapping[str, Any]) -> FileInfo:
        return FileInfo(
            key, int(raw.get("size") or 0), self._native_crc32c(raw), _mtime(raw), self._generation(raw)
        )

    def _native_crc32c(self, raw: Mapping[str, Any]) -> int | None:
        return None

    def _generation(self, raw: Mapping[str, Any]) -> str | None:
        return None

    def _rel(self, path: str) -> str:
        path = path.rstrip("/")
        root = self.root + "/"
        return path[len(root):] if path.startswith(root) else path

    def listdir(self, prefix: str = "") -> list[Entry]:
        async def ls() -> list[dict[str, Any]]:
            try:
                listing: list[dict[str, Any]] = await self.fs._ls(self.path(prefix), detail=True, refresh=True)
                return listing
            except FileNotFoundError:
                return []

        out = self.call("list", prefix, ls)
        base = self.path(prefix).rstrip("/") + "/"
        entries = []
        for item in out:
            name = item["name"].rstrip("/")
            if not name.startswith(base):
                continue
            entries.append(Entry(name[len(base):], item.get("type") == "directory"))
        return entries

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        async def find() -> dict[str, dict[str, Any]]:
            self.fs.invalidate_cache()
            try:
                found: dict[str, dict[str, Any]] = await self.fs._find(self.path(prefix), detail=True)
                return found
            except FileNotFoundError:
                return {}

        out = self.call("find", prefix, find)
        return {
            self._rel(name): self._file_info(self._rel(name), v)
            for name, v in out.items()
            if v.get("type") != "directory"
        }

    #: entries per page of a delimited listing (the most S3 and GCS return)
    page_size = 1000

    async def _list_page(
        self, prefix_path: str, delimiter: str, token: str | None
    ) -> tuple[list[tuple[str, Mapping[str, Any]]], list[str], str | None]:
        """One page of a delimited listing of backend path ``prefix_path`` (bucket/key
        prefix, ending with ``/`` unless it is the bucket): ``(objects as (path, raw
        info), rolled-up prefix paths, next page token or None)``. Drivers of backends
        with delimited listings implement it; without it :meth:`scan` uses :meth:`find`."""
        raise NotImplementedError

    #: delimiters this backend was found not to honour (then :meth:`scan` uses find)
    _bad_delimiters: frozenset[str] = frozenset()

    def scan(self, prefix: str = "", delimiter: str = "/") -> tuple[dict[str, FileInfo], set[str]]:
        if type(self)._list_page is AsyncFsspecDriver._list_page or delimiter in self._bad_delimiters:
            return super().scan(prefix, delimiter)
        if not delimiter:
            raise InvalidArgumentError("scan needs a delimiter")
        where = self.path(prefix).rstrip("/") + "/"
        objects: dict[str, FileInfo] = {}
        prefixes: set[str] = set()
        token: str | None = None
        while True:  # pages depend on each other (the token): one request after another
            try:
                page, rolled, token = self.call(
                    "list", prefix, partial(self._list_page, where, delimiter, token)
                )
            except StorageError as exc:
                if http_status_of(exc) not in (400, 501):
                    raise
                # refused (e.g. S3 directory buckets take only "/")
                return self._unsupported(prefix, delimiter, f"{exc}")
            if any(not p.endswith(delimiter) for p in rolled):
                # a store that cut at the delimiter's first character only, say: its
                # answer would hide objects, so it is not used
                return self._unsupported(prefix, delimiter, f"rolled up at {rolled[0]!r}")
            for path, raw in page:
                rel = self._rel(path)
                objects[rel] = self._file_info(rel, raw)
            prefixes.update(self._rel(p) + ("/" if p.endswith("/") else "") for p in rolled)
            if not token:
                return objects, prefixes

    def _unsupported(self, prefix: str, delimiter: str, why: str) -> tuple[dict[str, FileInfo], set[str]]:
        log.warning("%s does not list with the delimiter %r (%s): listing every object instead",
                    self.describe(), delimiter, self.redact(why))
        self._bad_delimiters = self._bad_delimiters | {delimiter}
        return super().scan(prefix, delimiter)

    def background(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        return background_pool().submit(fn)

    def split(self, key: str) -> tuple[str, str]:
        """(bucket, object name) of ``key``."""
        bucket, _, obj = self.path(key).partition("/")
        return bucket, obj

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        if if_generation is None:
            return self.call("delete", key, self._rm_one(key))

        async def rm() -> None:
            try:
                await self._delete_if(key, if_generation)
            except FileNotFoundError:
                pass  # gone already (a retry of our own delete, or another deleter)

        self.call("delete", key, rm, "generation")

    async def _delete_if(self, key: str, generation: str) -> None:
        """Delete ``key`` only at ``generation`` (the backend's precondition)."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional delete")

    def delete_tree(self, prefix: str) -> None:
        keys = sorted(self.find(prefix), reverse=True)
        futures = [self.submit("delete", k, self._rm_one(k)) for k in keys]
        for f in futures:
            f.result()

    def _rm_one(self, key: str) -> Callable[[], Awaitable[None]]:
        async def rm() -> None:
            try:
                await self.fs._rm_file(self.path(key))
            except FileNotFoundError:
                pass

        return rm


def _populate_breadth_first(mv: memoryview, todo: list[tuple[int, int]], step: int) -> None:
    """Populate the pages of the spans ``todo`` of ``mv`` (offset, length; each at most
    ``step``): breadth first, each span's next slice in turn, the order their bytes come in."""
    pos, piece = 0, POPULATE_SLICE
    while pos < step:
        for a, k in todo:
            if pos < k:
                populate_pages(mv[a + pos : a + min(k, pos + piece)], piece)
        pos += piece
        piece = min(4 * piece, step)  # (the first bytes come first: small slices)


def _after_one_done(flying: list[concurrent.futures.Future[int]]) -> list[concurrent.futures.Future[int]]:
    """Wait until one of the requests ``flying`` is done; those still flying (the error of
    one that failed is raised)."""
    concurrent.futures.wait(flying, return_when=concurrent.futures.FIRST_COMPLETED)
    for f in flying:
        if f.done() and not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return [f for f in flying if not f.done()]


def _bytes_read(n: int, spans: list[tuple[int, int, int]], counts: list[int]) -> list[int]:
    """How many bytes each of ``n`` ranges got in a row, from the ranged reads of
    ``spans`` ((range, offset, length) each) and ``counts`` (each one's)."""
    totals = [0] * n
    ended = [False] * n  # a range's bytes count up to its first short read
    for (i, _, k), got in zip(spans, counts, strict=True):
        if not ended[i]:
            totals[i] += got
            ended[i] = got < k  # the object ends here
    return totals
