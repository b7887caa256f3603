"""The conformance check: before the first commit on an endpoint, verify what the commit
strategy relies on.

A driver *declares* what its backend guarantees (:class:`~atomicstore.Capabilities`); an
S3-compatible store that silently ignores a precondition, or honours it without
atomicity, would turn "two writers can never both commit" into a lie without a single
error. So before the first commit on an endpoint, :func:`ensure` runs :func:`check`: a
handful of small requests under the store's own reserved prefix
(``.atomicstore/conformance/<random>/``), through the same driver methods the commit
strategies use, so it is the same for S3, GCS and any third-party driver:

1. two conditional creates (``put(exclusive=True)``) of one key, sent at once: exactly
   one must win (conditional create, and exclusivity under a race);
2. meanwhile an upload of the same key is started (``open_writer(exclusive=True)``, one
   part of ``block_size`` bytes: the multipart/composite path a one-file commit uses);
3. a conditional overwrite at a made-up generation (``put(if_generation=...)``): refused;
4. the upload is completed: refused, the key exists (conditional completion);
5. the key is read: the winner's bytes (read-after-write; the refused requests left no
   trace);
6. a delete at a made-up generation: refused; a delete at the winner's generation: done.

Ten requests on S3 and GCS. The result is cached per (driver class, endpoint, bucket) for
the process (thread-safe; a forked child keeps the results its parent had and runs its own
check otherwise). ``docs/conformance.md`` says what each guarantee protects.

A failed guarantee gets a safe strategy where one exists (a failed conditional completion:
one-file commits are refused, directory-layout checkpoints, whose commit point is a
single conditional PUT, still commit) or a refusal: :class:`~atomicstore.ConformanceError`
naming the guarantee and the endpoint. A 403 during the check is a permission error
(:class:`~atomicstore.StorageError`), never taken for non-conformance, and not cached.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import re
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..drivers.classify import http_status_of
from ..drivers.spec import Driver, Writer, refusals_are_final
from ..errors import AlreadyExistsError, ConformanceError, NotFoundError, StorageError
from .names import RESERVED_DIR

log = logging.getLogger("atomicstore.commit")

#: where the check writes, below the store root (inside the reserved directory)
CONFORMANCE_PREFIX = f"{RESERVED_DIR}/conformance"
#: uses of a store that rely on guarantees: any commit (commit markers, leases, deletes)
COMMIT = "commit"
#: ... and a one-file commit (flax's layout), whose commit point completes an upload
ONE_FILE = "one-file"

#: the upload of the check is lent to the writer in pieces of this many zero bytes
_ZEROS = 2**18
#: the statuses of a :class:`Guarantee`
HOLDS, FAILS, NOT_DECLARED, NOT_CHECKED, NOT_RELIED = (
    "holds", "FAILS", "not declared", "not checked", "not relied upon")

_CREATE = "conditional create"
_RACE = "exclusive under a race"
_OVERWRITE = "conditional overwrite"
_COMPLETION = "conditional completion"
_RACING_COMPLETIONS = "exclusive completions"
_READ = "read-after-write"
_DELETE = "conditional delete"
_ORDER = "listing order"

_REFUSE = "every commit is refused (ConformanceError)"
#: what each guarantee is (the request), what relies on it, what atomicstore does if it fails
_WHY = {
    _CREATE: ("put-if-absent (S3 If-None-Match: *, GCS ifGenerationMatch=0)",
              "commit marker, Orbax's step claim, one-file claim", _REFUSE),
    _RACE: ("of two racing put-if-absent requests exactly one wins",
            "one winner: two writers of one name never both commit", _REFUSE),
    _OVERWRITE: ("a write at a stale generation is refused (S3 If-Match, GCS ifGenerationMatch)",
                 "overwrite=True (marker compare-and-swap), lease renewals, recovery", _REFUSE),
    _COMPLETION: ("an upload completes only if its precondition holds (S3 CompleteMultipartUpload, "
                  "GCS compose, with If-None-Match/ifGenerationMatch)",
                  "the commit point of a one-file (flax layout) checkpoint",
                  "one-file commits are refused (ConformanceError); directory-layout checkpoints, "
                  "whose commit point is one conditional PUT, still commit"),
    _READ: ("a write is visible to the next read",
            "a commit whose reply was lost is confirmed by reading its marker back", _REFUSE),
    _DELETE: ("a delete at a stale generation is refused (S3 If-Match, GCS ifGenerationMatch)",
              "delete un-publishes only the version it read; recovery removes only the lease it judged "
              "expired", _REFUSE),
}


@dataclass(frozen=True)
class Guarantee:
    """One row of a :class:`ConformanceReport`.

    Attributes:
        name: the guarantee (``"conditional create"``, ``"exclusive under a race"``...).
        meaning: what it is, in terms of requests (``"put-if-absent (S3 If-None-Match: *,
            GCS ifGenerationMatch=0)"``).
        status: ``"holds"``, ``"FAILS"``, ``"not declared"`` (the driver does not
            declare it), ``"not checked"`` or ``"not relied upon"``.
        detail: what the check saw.
        action: what relies on it, or (when it fails) what atomicstore does.
        relied_by: the uses that rely on it (``"commit"``: every commit, ``"one-file"``:
            one-file commits); empty if atomicstore never relies on it here.
    """

    name: str
    meaning: str
    status: str
    detail: str
    action: str
    relied_by: tuple[str, ...] = ()

    @property
    def passed(self) -> bool | None:
        """True if it holds, False if it fails or is not declared, None if not checked."""
        return {HOLDS: True, FAILS: False, NOT_DECLARED: False}.get(self.status)


@dataclass(frozen=True)
class ConformanceReport:
    """What :func:`check` found for one endpoint: a frozen table of :class:`Guarantee`.

    Attributes:
        store: the store's URL (never with credentials).
        endpoint: the service endpoint (``""``: the driver's default).
        driver: the driver class.
        guarantees: the rows.
        seconds: wall time of the check.
    """

    store: str
    endpoint: str
    driver: str
    guarantees: tuple[Guarantee, ...]
    seconds: float = 0.0

    @property
    def where(self) -> str:
        """The store and its endpoint, for messages."""
        return f"{self.store} at {self.endpoint}" if self.endpoint else self.store

    @property
    def ok(self) -> bool:
        """True if every guarantee atomicstore relies on here holds (none fails and none is
        missing from the driver's declaration)."""
        return not [g for g in self.guarantees if g.relied_by and g.passed is False]

    def failures(self, use: str | None = None) -> list[Guarantee]:
        """Guarantees that failed the check and that ``use`` (``"commit"``, ``"one-file"``;
        None: any use) relies on."""
        return [g for g in self.guarantees
                if g.status == FAILS and g.relied_by and (use is None or use in g.relied_by)]

    def raise_for(self, use: str) -> None:
        """Raise :class:`~atomicstore.ConformanceError` naming the first failed guarantee
        that ``use`` relies on (nothing if there is none)."""
        failed = self.failures(use)
        if not failed:
            return
        g = failed[0]
        what = "a one-file commit" if use == ONE_FILE else "a commit"
        raise ConformanceError(
            f"{self.where} does not enforce {g.name}, {g.meaning}, which {what} relies on: {g.detail}. "
            f"Nothing was written; on this store {g.action}, never a silent double commit. See "
            "docs/conformance.md; open_store(..., check_conformance=False) skips the check for a store "
            "you know conforms",
            guarantee=g.name, endpoint=self.where, report=self)

    def table(self) -> str:
        """The report as a text table (what ``atomicstore doctor`` prints): one line per
        guarantee (name, status, the uses relying on it), then what was seen and what
        atomicstore does."""
        rows = [("guarantee", "status", "relied on by")]
        rows += [(g.name, g.status, ", ".join(g.relied_by) or "-") for g in self.guarantees]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        verdict = ("every guarantee atomicstore relies on holds" if self.ok
                   else "NOT CONFORMING: " + ", ".join(g.name for g in self.guarantees
                                                        if g.relied_by and g.passed is False))
        lines = [f"{self.where} ({self.driver}, checked in {self.seconds:.2f}s): {verdict}", ""]
        for i, r in enumerate(rows):
            lines.append("  ".join(r[j].ljust(widths[j]) for j in range(3)).rstrip())
            if i:
                g = self.guarantees[i - 1]
                lines.append(f"    {g.meaning}: {g.detail}")
                lines.append(f"    -> {g.action}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data."""
        return {"store": self.store, "endpoint": self.endpoint, "driver": self.driver, "ok": self.ok,
                "seconds": round(self.seconds, 4),
                "guarantees": [{"name": g.name, "meaning": g.meaning, "status": g.status, "passed": g.passed, "detail": g.detail,
                                "action": g.action, "relied_by": list(g.relied_by)} for g in self.guarantees]}


# -- the check ----------------------------------------------------------------------------
def endpoint_of(driver: Driver) -> str:
    """The service endpoint a driver talks to (``""``: its default), never with credentials
    (read from the driver's filesystem; a forked child's driver makes its own first, from
    the storage options it was opened with, so the child finds its parent's results)."""
    fs = getattr(driver, "_fs", None)
    if fs is None and getattr(driver, "_remake", None) is not None:
        try:
            fs = driver.fs
        except Exception:  # noqa: BLE001 - no filesystem: the default endpoint
            fs = None
    url = None
    if fs is not None:
        url = (getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
               or getattr(fs, "_endpoint", None))
    if not isinstance(url, str):
        return ""
    url = re.sub(r"//[^/@]*@", "//", url)  # user:password@host
    return driver.redact(url).rstrip("/")


def cache_key(driver: Driver) -> tuple[str, str, str]:
    """What a result is cached by: (driver class, endpoint, bucket or first component of
    the root)."""
    cls = type(driver)
    bucket = driver.url.split("://", 1)[-1].lstrip("/").split("/", 1)[0]
    return f"{cls.__module__}.{cls.__qualname__}", endpoint_of(driver), bucket


def _rows(driver: Driver) -> list[Guarantee]:
    """The rows no request decides: listing order, racing completions."""
    meaning = "of two racing conditional upload completions of one key at most one succeeds"
    if driver.capabilities.exclusive_completion:
        racing = Guarantee(_RACING_COMPLETIONS, meaning, NOT_CHECKED,
                           "declared by the driver; a race of a few requests cannot prove it",
                           "trusted (the backend documents it); a commit request is made under the "
                           "name's claim all the same (it also keeps the two layouts apart)", (ONE_FILE,))
    else:
        racing = Guarantee(_RACING_COMPLETIONS, meaning, NOT_RELIED,
                           "not declared by the driver (SeaweedFS 4.48 lets racing completions both win)",
                           "every commit request of a name is made under its claim (a conditional create)")
    order = Guarantee(_ORDER, "a listing's pages come in key order", NOT_RELIED, "not checked",
                      "atomicstore sorts every listing itself; no decision depends on a page's order")
    return [racing, order]


def _made_up(generation: str | None) -> str:
    """A generation the object never had (and never will have): older than a numeric one
    (GCS), another MD5 for an ETag (S3), something else otherwise."""
    g = generation or ""
    if g.isdigit() and int(g) > 1:
        return str(int(g) - 1)
    if re.fullmatch(r"[0-9a-fA-F]{32}(-\d+)?", g):
        return hashlib.md5(secrets.token_bytes(8)).hexdigest()
    return f"{g or '1'}0"


def _permission(exc: BaseException) -> bool:
    """A 403 anywhere in ``exc``'s chain: botocore's status, s3fs's PermissionError, or
    gcsfs's ``OSError("Forbidden: ...")``."""
    cur: BaseException | None = exc
    seen = 0
    while cur is not None and seen < 20:
        if isinstance(cur, PermissionError) or (type(cur) is OSError and str(cur).startswith("Forbidden")):
            return True
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return http_status_of(exc) == 403


class _Check:
    """One run of the check on one driver (see the module docstring for the steps)."""

    def __init__(self, driver: Driver) -> None:
        self.d = driver
        self.prefix = f"{CONFORMANCE_PREFIX}/{secrets.token_hex(8)}"
        self.key = f"{self.prefix}/k"
        token = secrets.token_hex(8)
        self.payload = {w: f"atomicstore conformance check {token}: writer {w}\n".encode() for w in "AB"}
        self.rows: dict[str, Guarantee] = {}
        #: what the key holds now (as far as the answers say) and at which generation
        self.holds: bytes | None = None
        self.generation: str | None = None
        self.writer: Writer | None = None
        self.deleted = False

    def row(self, name: str, ok: bool, detail: str) -> None:
        uses = (ONE_FILE,) if name == _COMPLETION else (COMMIT, ONE_FILE)
        meaning, relied, on_fail = _WHY[name]
        if ok:
            self.rows[name] = Guarantee(name, meaning, HOLDS, detail, "relied upon: " + relied, uses)
        elif name not in self.rows or self.rows[name].status != FAILS:
            self.rows[name] = Guarantee(name, meaning, FAILS, detail, on_fail, uses)

    def run(self) -> list[Guarantee]:
        d = self.d
        try:
            # (its keys are new, below a random prefix: a driver need not spend requests
            # telling its refusals from leftovers of deleted keys)
            with refusals_are_final():
                self.race_and_upload()
                self.overwrite()
                self.completion()
                self.read_back()
                self.delete()
        except BaseException as exc:
            self.cleanup()
            if isinstance(exc, Exception) and _permission(exc):
                raise StorageError(
                    f"{d.describe()}: permission denied: the credentials cannot write there, so atomicstore "
                    f"cannot save to it (its conformance check writes below {CONFORMANCE_PREFIX}/ before the "
                    f"first commit; reading and listing need no write): {exc}") from exc
            raise
        order = [_CREATE, _RACE, _OVERWRITE, _COMPLETION, _READ, _DELETE]
        return [self.rows[n] for n in order if n in self.rows] + _rows(d)

    def race_and_upload(self) -> None:
        d = self.d

        def racer(w: str) -> tuple[str, Any]:
            try:
                with refusals_are_final():  # (on another thread)
                    return "won", d.put(self.key, self.payload[w], exclusive=True)
            except AlreadyExistsError as exc:
                return "refused", exc

        # both sent at once where the driver runs requests in the background (object
        # stores: two threads); a driver that runs them in the caller's thread (a test
        # scheduler) sees them in order, deterministically
        racing = [d.background(partial(racer, w)) for w in "AB"]
        try:
            # meanwhile: an upload of the same key, one whole part (the multipart path)
            # (lent in pieces of one small zero buffer: no block-sized allocation)
            self.writer = d.open_writer(self.key, exclusive=True)
            zeros = memoryview(bytes(_ZEROS))
            left = d.block_size
            while left:
                n = min(left, _ZEROS)
                self.writer.write_borrowed(zeros[:n])
                left -= n
        finally:
            concurrent.futures.wait(racing)
        outcome = dict(zip("AB", (f.result() for f in racing), strict=True))
        won = [w for w in "AB" if outcome[w][0] == "won"]
        if len(won) == 2:
            both = ("two conditional creates of one key, sent at once, both succeeded (the precondition is "
                    "ignored, or not enforced atomically)")
            self.row(_CREATE, False, both)
            self.row(_RACE, False, both)
            self.holds, self.generation = None, None  # one of the two: the read says which
            return
        if not won:
            # both refused: a retry of our own create whose reply was lost is refused too
            # (retried=True); the read decides which one landed, if any
            self.holds = self.generation = None
            return
        w = won[0]
        self.holds, self.generation = self.payload[w], outcome[w][1]
        self.row(_CREATE, True, "a conditional create of an absent key succeeded, a second one was refused")
        self.row(_RACE, True, "of two racing conditional creates exactly one won")

    def current_generation(self) -> str | None:
        if self.generation is None:
            try:
                self.generation = self.d.info(self.key).generation
            except NotFoundError:
                self.generation = None
        return self.generation

    def overwrite(self) -> None:
        stale = _made_up(self.current_generation())
        try:
            gen = self.d.put(self.key, b"atomicstore conformance check: stale overwrite\n", if_generation=stale)
        except AlreadyExistsError:
            self.row(_OVERWRITE, True, "a write at a stale generation was refused")
            return
        self.row(_OVERWRITE, False, f"a write at a made-up generation ({stale}) succeeded")
        self.holds, self.generation = b"atomicstore conformance check: stale overwrite\n", gen

    def completion(self) -> None:
        w = self.writer
        assert w is not None
        try:
            w.close()
        except AlreadyExistsError:
            self.writer = None
            w.abort()  # (the writer's contract: a failed close is aborted by its caller)
            self.row(_COMPLETION, True, "completing an upload with put-if-absent over an existing key was refused")
            return
        self.writer = None
        self.row(_COMPLETION, False,
                 "completing an upload with put-if-absent over an existing key succeeded (the precondition "
                 "was ignored)")
        self.holds, self.generation = bytes(min(self.d.block_size, 256)), w.generation

    def read_back(self) -> None:
        n = 256
        try:
            got: bytes | None = self.d.read(self.key, 0, n)
        except NotFoundError:
            got = None
        if self.holds is None and _CREATE not in self.rows:
            # both creates were refused: one of ours landed if the key holds its bytes
            landed = [w for w in "AB" if got == self.payload[w][:n]]
            if landed:
                self.holds = self.payload[landed[0]]
                self.row(_CREATE, True, "a conditional create succeeded (its reply was lost; the key holds its "
                                        "bytes), a second one was refused")
                self.row(_RACE, True, "of two racing conditional creates exactly one won")
                self.generation = None
            else:
                self.row(_CREATE, False, "both conditional creates of an absent key were refused")
                self.row(_RACE, False, "no racing conditional create won")
        elif self.holds is None:  # both won: the key holds one of them
            self.holds = next((self.payload[w] for w in "AB" if got == self.payload[w][:n]), None)
        if got is not None and self.holds is not None and got == self.holds[:n]:
            self.row(_READ, True, "a read right after the writes returned the bytes of the write that won")
        else:
            self.row(_READ, False, f"a read right after the writes returned {_show(got)}, not the bytes of the "
                                   "write that won")

    def delete(self) -> None:
        d = self.d
        current = self.current_generation()
        stale = _made_up(current)
        try:
            d.delete(self.key, if_generation=stale)
        except AlreadyExistsError:
            refused = True
        else:
            refused = False
        try:
            d.delete(self.key, if_generation=current)
            done = True
        except AlreadyExistsError:
            # a refusal may answer our own delete sent again after its reply was lost (by
            # our retry policy, or unseen: aiohttp re-sends a DELETE on a dropped keep-alive
            # connection), and SeaweedFS refuses a conditional delete of a key that is gone;
            # under refusals_are_final the driver does not look: the key being gone says so
            done = not d.exists(self.key)
            if not done:
                d.delete(self.key)  # (cleanup)
        self.deleted = True
        if not refused:
            self.row(_DELETE, False, f"a delete at a made-up generation ({stale}) was not refused")
        elif not done:
            self.row(_DELETE, False, f"a delete at the current generation ({current}) was refused")
        else:
            self.row(_DELETE, True, "a delete at a stale generation was refused, at the current one done")

    def cleanup(self) -> None:
        """After an error: abort the upload, remove the key (best effort: recovery and the
        next check do not depend on it)."""
        if self.writer is not None:
            try:
                self.writer.abort()
            except Exception as exc:  # noqa: BLE001 - best effort
                log.debug("conformance check: abort failed: %s", exc)
        if not self.deleted:
            try:
                self.d.delete(self.key)
            except Exception as exc:  # noqa: BLE001 - best effort
                log.debug("conformance check: cleanup of %s failed: %s", self.d.describe(self.key), exc)


def _show(data: bytes | None) -> str:
    if data is None:
        return "nothing (the key was absent)"
    if not data.strip(b"\0"):
        return "the refused upload's bytes"
    return repr(data[:60])


def check(driver: Driver) -> ConformanceReport:
    """Check the guarantees the commit strategy of ``driver`` relies on (no cache): on an
    object store (a driver declaring ``atomic_create`` but not ``atomic_rename``), ten
    requests below ``.atomicstore/conformance/<random>/``, cleaned up afterwards. Rename
    backends (local disk, memory) need no request: their commit point is an atomic
    rename. A driver that declares no atomic create gets a report saying so (its
    :class:`~atomicstore.ExclusivityWarning` stands).

    Raises :class:`~atomicstore.StorageError` naming permissions when the credentials
    cannot write, and whatever a request raised otherwise (after the retry policy)."""
    t0 = time.perf_counter()
    caps = driver.capabilities
    cls = type(driver).__name__
    if caps.atomic_rename:
        rows = [Guarantee("atomic rename", "a rename that refuses to replace its target", NOT_CHECKED,
                          "no network check: the commit point is a rename by this machine's filesystem",
                          "relied upon: the commit point", (COMMIT, ONE_FILE))]
    elif not caps.atomic_create:
        rows = [Guarantee(_CREATE, _WHY[_CREATE][0], NOT_DECLARED,
                          "the driver declares no atomic create (it checks, then writes)",
                          "commits with an ExclusivityWarning: two writers of one name could both commit",
                          (COMMIT, ONE_FILE))]
    else:
        rows = _Check(driver).run()
    return ConformanceReport(driver.describe(), endpoint_of(driver), cls, tuple(rows), time.perf_counter() - t0)


# -- once per endpoint per process ------------------------------------------------------
_GUARD = threading.Lock()
_LOCKS: dict[tuple[str, str, str], threading.Lock] = {}
_CACHE: dict[tuple[str, str, str], ConformanceReport] = {}
_SKIPPED: weakref.WeakSet[Driver] = weakref.WeakSet()
_WARNED: set[tuple[str, str, str]] = set()


def needs_check(driver: Driver) -> bool:
    """True if commits on ``driver`` wait for a conformance check (object stores: drivers
    that declare ``atomic_create`` without ``atomic_rename``)."""
    caps = driver.capabilities
    return caps.atomic_create and not caps.atomic_rename


def skip(driver: Driver, *, warn: bool = True) -> None:
    """Commit on ``driver`` without the check (``open_store(check_conformance=False)``),
    with a warning logged once per endpoint and bucket per process (``warn=False``: none,
    for a test harness wrapping a driver whose store was checked, e.g. to count or crash
    its operations)."""
    _SKIPPED.add(driver)
    if not warn:
        return
    key = cache_key(driver)
    with _GUARD:
        if key in _WARNED:
            return
        _WARNED.add(key)
    log.warning(
        "%s: conformance check skipped (check_conformance=False): that the store enforces the "
        "preconditions atomicstore relies on (conditional create, overwrite, delete and upload completion, "
        "one winner of a race) is not verified; if it does not, two writers of one checkpoint can both be "
        "told they committed", driver.describe())


def cached(driver: Driver) -> ConformanceReport | None:
    """The result of this process's check of ``driver``'s endpoint and bucket, if any."""
    return _CACHE.get(cache_key(driver))


def ensure(driver: Driver, use: str = COMMIT) -> ConformanceReport | None:
    """Run the check once per (driver class, endpoint, bucket) per process, before the
    first commit (every writer calls it: :meth:`Lease.acquire`, ``Store.one_file``), and
    raise :class:`~atomicstore.ConformanceError` if a guarantee ``use`` relies on failed.
    Threads wait for the one check in flight; a failed check (an error, not a verdict) is
    not cached. None where no check applies or it was skipped."""
    if driver in _SKIPPED or not needs_check(driver):
        return None
    key = cache_key(driver)
    report = _CACHE.get(key)
    if report is None:
        with _GUARD:
            lock = _LOCKS.setdefault(key, threading.Lock())
        with lock:
            report = _CACHE.get(key)
            if report is None:
                report = check(driver)
                _CACHE[key] = report
                log.log(logging.INFO if report.ok else logging.ERROR, "conformance check of %s: %s in %.2fs%s",
                        report.where, "conforms" if report.ok else "NOT CONFORMING", report.seconds,
                        "".join(f"; {g.name} {g.status}: {g.detail}" for g in report.failures()))
    report.raise_for(use)
    return report


def _after_fork_in_child() -> None:
    """A lock held by a parent's thread (a check in flight at the fork) would stay held in
    the child forever: new locks. Finished results stay (facts about the endpoint)."""
    global _GUARD, _LOCKS
    _GUARD = threading.Lock()
    _LOCKS = {}


os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["ConformanceReport", "Guarantee", "check", "ensure"]
