"""The store: committed checkpoints under one root, read and written through a driver."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..drivers import get_driver
from ..drivers.spec import Driver
from ..errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    ConformanceError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
)
from ..retry import RetryPolicy
from . import conformance
from .checked import CheckedReader, destination
from .conformance import ConformanceReport
from .context import CommitContext
from .lease import DEFAULT_LEASE_TTL
from .manifest import (
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    Marker,
    crc32c,
    crc32c_combine,
)
from .names import (
    MANIFEST_FILE,
    MARKER_FILE,
    natural_sort,
    validate_name,
    validate_path,
    validate_writable,
)
from .onefile import OneFileCommit
from .recovery import DEFAULT_GRACE, RecoveryReport, recover
from .strategies import choose_strategy
from .strategy import MAX_READ_AHEAD, CommitStrategy, new_attempt_id
from .transaction import Transaction

log = logging.getLogger("atomicstore")


#: files above twice this size are read by ``Checkpoint.read_into`` in parallel ranges
PARALLEL_READ_CHUNK = 32 * 2**20


def default_writer_id() -> str:
    """``host:pid:random``: who wrote a checkpoint, recorded in manifests and markers."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Checkpoint:
    """A committed checkpoint opened for reading: its manifest and its files."""

    def __init__(self, store: Store, name: str, prefix: str, manifest: Manifest,
                 ahead: dict[str, bytes] | None = None, raw: bytes | None = None) -> None:
        self.store = store
        self.name = name
        self.prefix = prefix
        self.manifest = manifest
        self._ahead = dict(ahead or {})  # files read beside the manifest, not yet checked
        self._raw = raw  # the manifest's bytes as opened (verify compares the stored ones)

    @property
    def files(self) -> dict[str, FileEntry]:
        """The checkpoint's files (paths relative to it), each with its size and CRC32C."""
        return self.manifest.files

    @property
    def metadata(self) -> dict[str, Any]:
        """The metadata given to the transaction that committed the checkpoint."""
        return self.manifest.metadata

    def _entry(self, path: str) -> FileEntry:
        validate_path(path)
        try:
            return self.manifest.files[path]
        except KeyError:
            raise NotFoundError(f"{self.where(path)}: no such file in checkpoint") from None

    def where(self, path: str) -> str:
        """``path`` of this checkpoint as a URL, for messages (never with credentials)."""
        return self.store.driver.describe(f"{self.name}/{path}")

    def key(self, path: str) -> str:
        """The driver key of ``path`` (for drivers' range reads)."""
        return f"{self.prefix}/{path}"

    def open(self, path: str) -> CheckedReader:
        """Stream ``path``; its checksum is verified as it is read."""
        entry = self._entry(path)
        chunks = self.store.driver.iter_read(self.key(path))
        return CheckedReader(chunks, entry, path, self.where(path))

    def read_bytes(self, path: str) -> bytes:
        """The whole of ``path``, verified against the manifest."""
        entry = self._entry(path)
        data = self._ahead.pop(path, None)  # (Store.open's read_ahead: used once)
        if data is not None and len(data) == entry.size and crc32c(data) == entry.crc32c:
            return data  # (else read again: a damaged file raises from there)
        with self.open(path) as f:
            return f.readall()

    def read_into(self, path: str, out: Any) -> Any:
        """Read the whole of ``path`` into ``out`` (a writable buffer of exactly the file's
        size, e.g. a preallocated numpy array) and verify its CRC32C. No extra copy."""
        entry = self._entry(path)
        mv = destination(self.where(path), entry.size, 0, out)
        if mv.nbytes != entry.size:
            raise InvalidArgumentError(
                f"read_into {self.where(path)}: need a writable buffer of {entry.size} bytes, got {mv.nbytes}")
        if mv.nbytes <= PARALLEL_READ_CHUNK * 2:
            self.read_range_into(path, 0, mv)
            crc = crc32c(mv)
        else:  # large files: ranges read and checksummed in parallel, CRCs combined
            spans = [(a, min(PARALLEL_READ_CHUNK, mv.nbytes - a)) for a in range(0, mv.nbytes, PARALLEL_READ_CHUNK)]

            def part(span: tuple[int, int]) -> int:
                a, n = span
                self.read_range_into(path, a, mv[a : a + n])
                return crc32c(mv[a : a + n])

            with concurrent.futures.ThreadPoolExecutor(min(8, len(spans))) as pool:
                crcs = list(pool.map(part, spans))
            crc = crcs[0]
            for c, (_, n) in zip(crcs[1:], spans[1:], strict=True):
                crc = crc32c_combine(crc, c, n)
        entry.check(path, mv.nbytes, crc, where=self.where(path))
        return out

    def read_range_into(self, path: str, start: int, out: Any) -> None:
        """Fill the writable buffer ``out`` with bytes ``[start, start + len(out))`` of
        ``path`` (not checksummed: the caller checks its own CRC32C)."""
        self.read_ranges_into(path, [(start, out)])

    def read_ranges_into(self, path: str, ranges: Sequence[tuple[int, Any]], *, threads: int | None = None) -> None:
        """:meth:`read_range_into` of each ``(start, out)`` of ``ranges``, all at once (on
        object stores every range's requests go out from this thread before any is
        awaited; elsewhere on up to ``threads`` threads). Not checksummed."""
        entry = self._entry(path)
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise InvalidArgumentError("threads must be a positive int")
        pairs: list[tuple[int, memoryview]] = []
        for item in ranges:
            if not isinstance(item, tuple) or len(item) != 2:
                raise InvalidArgumentError(f"a range of {self.where(path)} is (start, buffer), not {item!r:.80}")
            mv = destination(self.where(path), entry.size, *item)
            if mv.nbytes:
                pairs.append((item[0], mv))
        counts = self.store.driver.read_ranges_into(self.key(path), pairs, threads=threads)
        for (start, mv), n in zip(pairs, counts, strict=True):
            if n != mv.nbytes:
                raise ChecksumMismatchError(
                    f"{self.where(path)}: short read ({n} of {mv.nbytes} bytes at {start})", path=path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (not checksummed: a part of a file cannot be;
        the pytree layer checks each leaf's own CRC32C)."""
        entry = self._entry(path)
        if not (0 <= start <= end <= entry.size):
            raise InvalidArgumentError(f"range [{start}, {end}) outside {self.where(path)} of {entry.size} bytes")
        data = self.store.driver.read(self.key(path), start, end)
        if len(data) != end - start:
            raise ChecksumMismatchError(
                f"{self.where(path)}: short read ({len(data)} of {end - start} bytes)", path=path)
        return data

    def verify(self) -> Manifest:
        """Re-read every file and check size and CRC32C; raise on the first mismatch
        (:class:`ChecksumMismatchError` naming the file). The stored manifest too, byte for
        byte, which ``open`` may have read from the commit marker's copy (:class:`CorruptionError`)."""
        driver = self.store.driver
        found = driver.find(self.prefix)
        if self._raw is not None:  # byte for byte: one only its readers refuse is damage too
            try:
                stored: bytes | None = driver.read(self.key(MANIFEST_FILE))
            except NotFoundError:
                stored = None
            if stored != self._raw:
                raise CorruptionError(f"{self.where(MANIFEST_FILE)}: missing, or not the manifest the "
                                      "checkpoint was opened with", path=MANIFEST_FILE)
        for path, entry in sorted(self.manifest.files.items()):
            key = self.key(path)
            if key not in found:
                raise ChecksumMismatchError(f"{self.where(path)}: file is missing", path=path)
            h = 0
            n = 0
            for chunk in driver.iter_read(key):
                h = crc32c(chunk, h)
                n += len(chunk)
            entry.check(path, n, h, where=self.where(path))
        return self.manifest


class Store:
    """Committed checkpoints under one root (a directory or a bucket prefix).

    Create one with :func:`open_store`. The commit strategy is chosen from the driver's
    declared capabilities: ``rename`` on POSIX and memory, ``marker`` on object stores.
    Before the first commit on an object store's endpoint, a conformance check verifies
    what the strategy relies on (``check_conformance``: see :func:`open_store`).
    """

    def __init__(
        self,
        driver: Driver,
        *,
        writer_id: str | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        grace: float = DEFAULT_GRACE,
        clock: Callable[[], float] | None = None,
        check_conformance: bool = True,
    ) -> None:
        if not isinstance(check_conformance, bool):
            raise InvalidArgumentError("check_conformance must be a bool")
        if clock is not None and not callable(clock):
            raise InvalidArgumentError("clock must be a callable returning Unix seconds")
        if not (isinstance(lease_ttl, int | float) and not isinstance(lease_ttl, bool)
                and 0 < lease_ttl < 7 * 86400):  # (finite: recovery must be able to expire it)
            raise InvalidArgumentError("lease_ttl must be a positive number of seconds below 7 days")
        if not (isinstance(grace, int | float) and grace >= 0):
            raise InvalidArgumentError("grace must be a non-negative number of seconds")
        if writer_id is not None and (not isinstance(writer_id, str) or not writer_id or len(writer_id) > 200):
            raise InvalidArgumentError("writer_id must be a non-empty string of at most 200 characters")
        if clock is not None:
            try:
                now = clock()
                ok = isinstance(now, int | float) and not isinstance(now, bool) and math.isfinite(now)
            except Exception as exc:  # noqa: BLE001 - reported as the argument's fault
                raise InvalidArgumentError(f"clock() failed: {exc!r}") from None
            if not ok:
                raise InvalidArgumentError(f"clock must return Unix seconds as a number, not {now!r}")
        #: what transactions, one-file commits and recovery are given (built once here)
        self.context = CommitContext(
            driver=driver,
            strategy=choose_strategy(driver),
            writer_id=writer_id or default_writer_id(),
            lease_ttl=float(lease_ttl),
            grace=float(grace),
            clock=clock or time.time,
        )
        if not check_conformance and conformance.needs_check(driver):
            conformance.skip(driver)  # (a warning, once per endpoint and bucket)

    @property
    def driver(self) -> Driver:
        """The driver the store reads and writes through."""
        return self.context.driver

    @property
    def strategy(self) -> CommitStrategy:
        """The commit strategy, chosen from the driver's declared capabilities."""
        return self.context.strategy

    @property
    def writer_id(self) -> str:
        """Who writes: recorded in manifests, commit markers, leases and claims."""
        return self.context.writer_id

    @property
    def lease_ttl(self) -> float:
        """Seconds a save's lease lives without renewal."""
        return self.context.lease_ttl

    @property
    def grace(self) -> float:
        """Extra seconds recovery waits before it treats unleased data as stale."""
        return self.context.grace

    @property
    def clock(self) -> Callable[[], float]:
        """Unix seconds; leases and recovery read time only through it (tests inject one)."""
        return self.context.clock

    def conformance(self) -> ConformanceReport:
        """The conformance report of this store's endpoint and bucket: the result of this
        process's check if one ran (the first commit runs it), else the check is run now
        (and cached). Rename backends and drivers without atomic create need no request.
        See ``docs/conformance.md``."""
        found = conformance.cached(self.driver)
        if found is not None:
            return found
        if not conformance.needs_check(self.driver):
            return conformance.check(self.driver)
        try:
            report = conformance.ensure(self.driver)
        except ConformanceError as exc:
            assert isinstance(exc.report, ConformanceReport)
            return exc.report
        return report if report is not None else conformance.check(self.driver)

    @property
    def url(self) -> str:
        """The store's root as a URL (never with credentials)."""
        return self.driver.url

    # -- writing ------------------------------------------------------------------------
    def transaction(
        self, name: str, *, metadata: dict[str, Any] | None = None, overwrite: bool = False
    ) -> Transaction:
        """Begin writing checkpoint ``name``. See :class:`Transaction`.

        Raises :class:`~atomicstore.CommitConflictError` at once if ``name`` is already
        committed (unless ``overwrite``: then the commit replaces it in one atomic step:
        readers see the old checkpoint or the new one, never neither), and
        :class:`~atomicstore.InvalidArgumentError` for a bad name or metadata that is not
        a JSON object.
        """
        if not isinstance(overwrite, bool):
            raise InvalidArgumentError("overwrite must be a bool")
        validate_name(name)
        validate_writable(name, what="checkpoint name")
        if metadata is not None and not isinstance(metadata, dict):
            raise InvalidArgumentError("metadata must be a dict of JSON values")
        if metadata:
            try:
                json.dumps(metadata, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as exc:
                raise InvalidArgumentError(f"metadata is not JSON-serialisable: {exc}") from None
        return Transaction(self.context, name, metadata=metadata, attempt=new_attempt_id(), overwrite=overwrite)

    def one_file(self, name: str, *, overwrite: bool = False) -> OneFileCommit:
        """Stream a checkpoint that is a single file ``name`` (flax's legacy layout) and
        commit it atomically: see :class:`~atomicstore.commit.onefile.OneFileCommit`."""
        validate_name(name)
        validate_writable(name, what="checkpoint name")
        # its commit point completes an upload: refused where the store ignores the
        # precondition of a completion (the conformance check, once per endpoint)
        conformance.ensure(self.driver, conformance.ONE_FILE)
        # A directory-layout checkpoint of that name is refused (the layouts cannot be
        # swapped atomically): checked alongside the commit's own first requests.
        native = self.driver.background(lambda: self.strategy.has_checkpoint(name))

        def is_native() -> bool:
            return self.strategy.has_checkpoint(name) if native.cancel() else native.result()

        try:
            commit = OneFileCommit(self.context, name, overwrite=overwrite)
        except AlreadyExistsError:
            if is_native():
                raise self.strategy.one_file_over_native(name) from None
            raise
        except BaseException:
            native.cancel()
            raise
        try:
            found = is_native()
        except BaseException:
            commit.abort()
            raise
        if found:
            commit.abort()
            raise self.strategy.one_file_over_native(name)
        return commit

    def write_file(self, path: str, data: bytes, *, overwrite: bool = True) -> None:
        """Write one small file at the store root atomically: readers see the old content
        or the new, never a part. With ``overwrite=False`` an existing file is not
        replaced (:class:`~atomicstore.AlreadyExistsError`); a retry whose first try
        landed (lost reply) is recognised by reading the file back.

        :class:`~atomicstore.InvalidArgumentError` for a path inside a committed
        checkpoint, or with a component the checkpoint layout reserves (``.atomicstore``,
        ``manifest.json``, ``commit_success.txt``, ``attempt-*``): such a write would
        damage a checkpoint or forge one."""
        validate_writable(path)
        self._refuse_inside_checkpoint(path)
        if not isinstance(overwrite, bool):
            raise InvalidArgumentError("overwrite must be a bool")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidArgumentError("data must be bytes")
        data = bytes(data)
        try:
            self.driver.put(path, data, exclusive=not overwrite)
        except AlreadyExistsError:
            # Our own first try may have landed, its reply lost, and the retry refused (a
            # retry below us, e.g. aiohttp re-sending a PUT, is invisible): read it back.
            # Identical bytes written by another writer are indistinguishable from ours.
            if self.driver.read(path) != data:
                raise
            log.info("write of %s: reply lost, the file is ours", self.driver.describe(path))

    def _refuse_inside_checkpoint(self, path: str) -> None:
        """InvalidArgumentError if the first component of ``path`` is a committed
        checkpoint, or ``path`` is one (one request: its commit point)."""
        first, sep, _ = path.partition("/")
        if not sep:
            # On an object store (and in memory) the object <name> and the checkpoint
            # <name>/ are two keys: a file written there would sit beside a committed
            # checkpoint. (A file written while a save of that name is in flight: the save
            # checks for it right before its commit point, under the name's claim.)
            if self.strategy.has_checkpoint(path):
                raise InvalidArgumentError(
                    f"{self.driver.describe(path)} is a committed checkpoint: a file cannot be written "
                    "under its name")
            return
        point = f"{first}/{MANIFEST_FILE if self.strategy.kind == 'rename' else MARKER_FILE}"
        if self.driver.exists(point):
            raise InvalidArgumentError(
                f"{self.driver.describe(path)} is inside committed checkpoint "
                f"{self.driver.describe(first)}: a committed checkpoint is never written to"
            )

    def read_file(self, path: str) -> bytes:
        """Read a file written by :meth:`write_file`."""
        validate_path(path)
        return self.driver.read(path)

    # -- reading ------------------------------------------------------------------------
    def list(self) -> list[str]:
        """Names of committed checkpoints, in natural order (one listing: on object
        stores about one request per 500 checkpoints, whatever their number of files)."""
        return natural_sort(self.strategy.list())

    def committed(self) -> dict[str, str | None]:
        """Committed names in natural order, each with the generation of its commit point
        as the same listing saw it (the marker's ETag or GCS generation; None on rename
        backends). ``open(name, generation=...)`` reads exactly that checkpoint."""
        found = self.strategy.committed()
        return {n: found[n] for n in natural_sort(list(found))}

    def exists(self, name: str) -> bool:
        """True if ``name`` is committed."""
        validate_name(name)
        try:
            self.strategy.resolve(name)
        except NotFoundError:
            return False
        return True

    def open(self, name: str, *, generation: str | None = None, read_ahead: Sequence[str] = ()) -> Checkpoint:
        """Open committed checkpoint ``name`` for reading (reads and checks its manifest).
        With ``generation`` (from :meth:`committed`), only if its commit point is still at
        that generation, read in the same request
        (:class:`~atomicstore.PreconditionFailedError` otherwise). The small files
        ``read_ahead`` (paths in the checkpoint, e.g. an index) are read beside the
        manifest on object stores, or taken from the commit marker's copies with it (no
        request): :meth:`Checkpoint.read_bytes` of each checks them against the manifest
        without a request (once)."""
        validate_name(name)
        paths = tuple(itertools.islice(read_ahead, MAX_READ_AHEAD + 1)) if isinstance(read_ahead, list | tuple) else None
        if paths is None or len(paths) > MAX_READ_AHEAD:
            raise InvalidArgumentError(f"read_ahead: a list of at most {MAX_READ_AHEAD} paths, not {read_ahead!r:.80}")
        ahead = tuple(dict.fromkeys(str.__str__(validate_path(p, what="read_ahead path")) for p in paths))
        prefix, raw, read = self.strategy.resolve_ahead(name, generation, ahead)
        manifest = Manifest.from_bytes(raw, where=self.driver.describe(f"{name}/manifest.json"))
        return Checkpoint(self, name, prefix, manifest, read, raw)

    def manifest(self, name: str) -> Manifest:
        """The manifest of committed checkpoint ``name``: its files with their sizes and
        CRC32C, and its metadata."""
        return self.open(name).manifest

    def read_bytes(self, name: str, path: str) -> bytes:
        """One whole file of a committed checkpoint, checksum verified."""
        return self.open(name).read_bytes(path)

    def verify(self, name: str) -> Manifest:
        """Re-check every file of ``name`` against its manifest (see
        :meth:`Checkpoint.verify`). A failure is reported as damage
        (:class:`~atomicstore.CorruptionError`, :class:`~atomicstore.ChecksumMismatchError`)
        only if ``name`` still holds the attempt that was verified (its commit point is read
        again); if another writer replaced or deleted it meanwhile,
        :class:`~atomicstore.PreconditionFailedError` (verify it again), as restore does."""
        try:
            ckpt = self.open(name)
        except CorruptionError:
            # the marker read may name an attempt that a replacement removed right after:
            # damage only if opening again, with the commit point unchanged, fails the same way
            before = self.strategy.current(name)
            try:
                ckpt = self.open(name)
            except (CorruptionError, NotFoundError) as exc:
                now = self.strategy.current(name)
                if now == before:
                    raise
                raise self._replaced_while_verified(name, before, now) from exc
        try:
            return ckpt.verify()
        except (CorruptionError, NotFoundError) as exc:
            now = self.strategy.current(name)
            if now == ckpt.manifest.attempt:
                raise  # still the checkpoint read: the damage is real
            raise self._replaced_while_verified(name, ckpt.manifest.attempt, now) from exc

    def _replaced_while_verified(self, name: str, read: str | None, now: str | None) -> PreconditionFailedError:
        return PreconditionFailedError(
            f"{self.driver.describe(name)} was replaced or deleted while it was being verified "
            f"(attempt {read} was read, it holds {'attempt ' + now if now else 'nothing'} now): verify it again"
        )

    # -- deleting -----------------------------------------------------------------------
    def delete(self, name: str, *, if_attempt: str | None = None) -> None:
        """Delete ``name``: its commit point first, then its data. A crash in between
        leaves garbage for recovery, never a committed-looking partial checkpoint.

        Only the checkpoint read when the delete starts is removed (a conditional delete
        on its generation), so a late delete never removes a newer checkpoint of the same
        name. With ``if_attempt`` (a :attr:`Manifest.attempt` the caller read earlier),
        nothing is deleted unless ``name`` still holds that attempt
        (:class:`~atomicstore.PreconditionFailedError`)."""
        validate_name(name)
        if if_attempt is not None and not isinstance(if_attempt, str):
            raise InvalidArgumentError("if_attempt must be a str")
        validate_writable(name, what="checkpoint name")
        self.strategy.unpublish(name, if_generation=if_attempt)

    def delete_one_file(self, name: str, *, if_generation: str | None = None) -> None:
        """Delete the one-file checkpoint ``name`` (flax's legacy layout, committed by
        :meth:`one_file`). The file is its own commit point, so one conditional delete
        un-publishes and removes it: only the version read when the delete starts is
        removed, or with ``if_generation`` (``driver.info(name).generation``, e.g. of the
        version the caller checked) only that version;
        :class:`~atomicstore.PreconditionFailedError` if ``name`` was replaced meanwhile
        (nothing is deleted). :class:`~atomicstore.NotFoundError` if there is no file
        ``name``; :class:`~atomicstore.InvalidArgumentError` if ``name`` is a committed
        checkpoint of the native layout (delete that with :meth:`delete`). On a backend
        without generations the delete is unconditional."""
        validate_name(name)
        if if_generation is not None and not isinstance(if_generation, str):
            raise InvalidArgumentError("if_generation must be a str")
        validate_writable(name, what="checkpoint name")
        if self.exists(name):
            raise InvalidArgumentError(
                f"{self.driver.describe(name)} is a committed checkpoint, not a one-file checkpoint: "
                "delete it with Store.delete")
        found = self.driver.info(name).generation  # NotFoundError: no file (or a directory)
        if if_generation is not None and found != if_generation:
            raise PreconditionFailedError(
                f"{self.driver.describe(name)} changed since it was read (expected generation "
                f"{if_generation}, found {found}): nothing deleted")
        self.driver.delete(name, if_generation=found)

    # -- recovery -----------------------------------------------------------------------
    def recover(
        self,
        *,
        dry_run: bool = False,
        grace: float | None = None,
        now: float | None = None,
        flax_prefix: str | None = None,
    ) -> RecoveryReport:
        """Remove what crashed saves and interrupted deletes left behind.

        Never touches a committed checkpoint or a save in flight (an attempt whose lease
        was renewed within ``lease ttl + grace`` seconds, or that has no lease and was
        written to within ``grace`` seconds). One listing decides; committed data is not
        read. Safe to run from several processes at once. With ``dry_run`` nothing is
        changed and the report says what would be removed. ``now`` (Unix seconds)
        overrides the clock, e.g. to treat everything in flight as dead.

        With ``flax_prefix`` (e.g. ``"checkpoint_"``) it also removes what
        ``flax.training.checkpoints`` leaves after a crash in that layout: ``<prefix>tmp``
        and ``<prefix>tmp_gda`` staging, and ``<prefix><step>_gda`` directories whose
        ``<prefix><step>`` does not exist (older than ``grace``).
        """
        if grace is not None and not (isinstance(grace, int | float) and grace >= 0):
            raise InvalidArgumentError("grace must be a non-negative number of seconds")
        if flax_prefix is not None and (not isinstance(flax_prefix, str) or "/" in flax_prefix):
            raise InvalidArgumentError("flax_prefix must be a string without '/'")
        return recover(self.context, dry_run=dry_run, grace=self.grace if grace is None else grace,
                       now=now, flax_prefix=flax_prefix)

    def close(self) -> None:
        """Release the driver's resources; leaving a ``with`` block does it too."""
        self.driver.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Store {self.url} strategy={self.strategy.kind}>"


def open_store(
    url_or_path: str | os.PathLike[str],
    *,
    writer_id: str | None = None,
    retry: RetryPolicy | None = None,
    operation_timeout: float | None = None,
    block_size: int | None = None,
    max_inflight_bytes: int | None = None,
    lease_ttl: float = DEFAULT_LEASE_TTL,
    grace: float = DEFAULT_GRACE,
    clock: Callable[[], float] | None = None,
    check_conformance: bool = True,
    **storage_options: Any,
) -> Store:
    """Open the store at a local path or URL (``s3://bucket/prefix``, ``gs://…``,
    ``memory://…``, any fsspec URL).

    Args:
        url_or_path: where the checkpoints live.
        writer_id: identity recorded in manifests and commit markers (default
            ``host:pid:random``).
        retry: retry policy for transient errors (default :class:`RetryPolicy()`).
        operation_timeout: seconds one storage request may take (object stores).
        block_size: streaming chunk / multipart part size in bytes (default 16 MiB on
            local disk, 8 MiB on object stores).
        max_inflight_bytes: object stores: bytes of part uploads and ranged reads in
            flight at once, for the whole store (every file of a save together; default
            256 MiB, i.e. 16 parts of 16 MiB or 32 reads of 8 MiB). Parts lent from the
            caller's buffers (``atomicstore.save`` lends the arrays' own) cost no memory;
            copied parts cost at most this much.
        lease_ttl: seconds a save's lease lives without renewal (renewed every third).
        grace: extra seconds recovery waits before it treats unleased data as stale.
        clock: where leases and recovery read the time (Unix seconds; default
            ``time.time``), e.g. a simulated clock in tests.
        check_conformance: before the first commit on an object store's endpoint and
            bucket (once per process), verify with ten small requests below
            ``.atomicstore/conformance/`` that the store enforces what the commit relies
            on: conditional create (one winner of a race), conditional overwrite, delete
            and upload completion, read-after-write. A store that fails gets
            :class:`~atomicstore.ConformanceError` naming the guarantee and the endpoint
            at its first commit (one-file commits only, where only the completion
            fails), never a silent double commit. Opening and reading never run it.
            ``False`` skips it with a logged warning, for a store you know conforms
            (``docs/conformance.md``).
        **storage_options: passed to the fsspec filesystem unchanged (endpoint,
            credentials, anon...). Credentials never appear in logs or errors.
    """
    _refuse_reserved_root(url_or_path)
    driver = get_driver(
        url_or_path,
        storage_options=storage_options,
        retry=retry,
        operation_timeout=operation_timeout,
        block_size=block_size,
        max_inflight_bytes=max_inflight_bytes,
    )
    try:
        _refuse_root_inside_checkpoint(driver)
    except BaseException:
        driver.close()
        raise
    return Store(driver, writer_id=writer_id, lease_ttl=lease_ttl, grace=grace, clock=clock,
                 check_conformance=check_conformance)


def _refuse_reserved_root(url_or_path: Any) -> None:
    """InvalidArgumentError for a store root inside another store's reserved layout (its
    ``.atomicstore`` directory, a save's ``attempt-*`` files): checked on the URL alone,
    no request. What another store's recovery removes there is not ours to commit."""
    if isinstance(url_or_path, os.PathLike):
        url_or_path = os.fspath(url_or_path)
    if not isinstance(url_or_path, str):
        return  # get_driver reports the argument
    path = url_or_path.split("://", 1)[-1]
    for part in path.replace(os.sep, "/").split("/"):
        if part == ".atomicstore" or part.startswith("attempt-"):
            raise InvalidArgumentError(
                f"{url_or_path}: a store root inside atomicstore's reserved layout ({part!r}: "
                "another store's reserved directory or a save attempt's files) is refused")


def _refuse_root_inside_checkpoint(driver: Driver) -> None:
    """InvalidArgumentError if the store root (local disk) is a committed checkpoint or
    lies inside one: a directory on its path holds an atomicstore manifest or commit
    marker. A few ``stat`` calls; object stores are not asked (no request)."""
    root = getattr(driver, "root", None)
    if "file" not in getattr(driver, "protocols", ()) or not isinstance(root, str):
        return
    cur = os.path.abspath(root)
    while True:
        for point, parse in ((MANIFEST_FILE, Manifest.from_bytes), (MARKER_FILE, Marker.from_bytes)):
            f = os.path.join(cur, point)
            try:
                if not os.path.isfile(f) or os.path.getsize(f) > MAX_MANIFEST_BYTES:
                    continue
                with open(f, "rb") as fh:
                    parse(fh.read(), where=f)
            except (OSError, CorruptionError):
                continue  # not atomicstore's (a user's own manifest.json) or unreadable
            raise InvalidArgumentError(
                f"{root}: a store root inside committed checkpoint {cur} is refused (deleting or "
                "replacing that checkpoint would remove this store's checkpoints with it)"
            )
        parent = os.path.dirname(cur)
        if parent == cur:
            return
        cur = parent
