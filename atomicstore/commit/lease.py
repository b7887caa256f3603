"""Leases: how a writer tells recovery that its attempt is still in flight.

A transaction writes ``.atomicstore/leases/<name>.<attempt>.json`` before any data and
rewrites it every ``ttl / 3`` seconds from a heartbeat thread. Recovery leaves an
attempt alone while its lease object was written less than ``ttl + grace`` seconds ago
(by the storage's own clock: the object's modification time). A writer that cannot renew
its lease, or finds it gone or expired when it is about to commit, has been declared dead
(a zombie): it refuses to commit (:class:`LeaseLostError`), so it cannot publish over the
run that replaced it.
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import logging
import threading
import time
from collections.abc import Callable

from ..drivers.spec import Driver
from ..errors import CorruptionError, LeaseLostError, NotFoundError, PreconditionFailedError
from . import conformance
from .names import RESERVED_DIR

log = logging.getLogger("atomicstore.commit")

LEASES = f"{RESERVED_DIR}/leases"
#: Default lease time-to-live (seconds); renewed every third of it.
DEFAULT_LEASE_TTL = 60.0


def lease_key(name: str, attempt: str) -> str:
    return f"{LEASES}/{name}.{attempt}.json"


def parse_lease_key(key: str) -> tuple[str, str] | None:
    """(name, attempt) of a lease key, or None."""
    if not key.startswith(LEASES + "/") or not key.endswith(".json"):
        return None
    stem = key[len(LEASES) + 1 : -len(".json")]
    name, dot, attempt = stem.rpartition(".")
    return (name, attempt) if dot and name else None


def read_lease_ttl(driver: Driver, key: str) -> float:
    """The TTL recorded in a lease object (hostile input: validated)."""
    try:
        doc = json.loads(driver.read(key, 0, 4096).decode())
        ttl = float(doc["ttl"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptionError(f"{driver.describe(key)}: malformed lease ({exc})", path=key) from None
    if not 0 < ttl < 7 * 86400:
        raise CorruptionError(f"{driver.describe(key)}: lease ttl {ttl} out of range", path=key)
    return ttl


class LeaseState(enum.Enum):
    """What a lease says about its attempt, read now."""

    LIVE = "live"  #: renewed within ``ttl + grace``: the writer may still commit
    EXPIRED = "expired"  #: not renewed within ``ttl + grace``: the writer is presumed dead
    GONE = "gone"  #: no lease object (never written, released, or fenced)

    @property
    def word(self) -> str:
        """How reasons in reports name the state ("lease alive", "lease none")."""
        return {"live": "alive", "expired": "expired", "gone": "none"}[self.value]


def lease_state(driver: Driver, name: str, attempt: str, now: float, grace: float
                ) -> tuple[LeaseState, str | None]:
    """The one rule for every caller (recovery, retention, the Orbax adapter): the state
    of ``attempt``'s lease and the generation it was read at (a fence deletes that
    generation only, so a renewal after this read wins). The age is the object's own
    modification time (the storage's clock), so a writer's clock never decides it; a
    lease whose body is unreadable counts with a ttl of 0 (expired once ``grace`` passed).
    """
    key = lease_key(name, attempt)
    try:
        info = driver.info(key)
    except NotFoundError:
        return LeaseState.GONE, None
    try:
        ttl = read_lease_ttl(driver, key)
    except NotFoundError:
        return LeaseState.GONE, None
    except CorruptionError:
        ttl = 0.0
    mtime = info.mtime if info.mtime is not None else now
    live = mtime + ttl + grace > now
    return (LeaseState.LIVE if live else LeaseState.EXPIRED), info.generation


class Lease:
    """The lease of one attempt, renewed by a heartbeat thread until released.

    Every renewal is a conditional write on the generation this lease last wrote, so a
    lease that recovery removed (or anything else replaced) is never written back; and a
    lease that expired by the writer's own clock is never renewed at all: a writer that
    was paused past its ttl (a frozen VM, SIGSTOP) stays dead.
    """

    def __init__(self, driver: Driver, name: str, attempt: str, writer: str, ttl: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.driver = driver
        self.key = lease_key(name, attempt)
        self.name, self.attempt, self.writer, self.ttl = name, attempt, writer, ttl
        self.clock = clock
        self.expires = 0.0
        self.generation: str | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a renewal and a check never interleave
        self._thread: threading.Thread | None = None
        self._stored: concurrent.futures.Future[str | None] | None = None

    def _doc(self, now: float) -> bytes:
        return json.dumps(
            {"name": self.name, "attempt": self.attempt, "writer": self.writer, "ttl": self.ttl,
             "renewed": now}
        ).encode()

    def acquire(self, *, wait: bool = True) -> None:
        """Write the lease and start renewing it. With ``wait=False`` the write may still
        be in flight when this returns (:meth:`Driver.background`): then nothing of the
        attempt may be stored before :meth:`wait` returned.

        Every writer takes a lease before its first write, so this is where the first
        commit on an endpoint waits for the conformance check
        (:func:`~atomicstore.commit.conformance.ensure`: once per endpoint and bucket per
        process): :class:`~atomicstore.ConformanceError` if the store does not hold a
        guarantee a commit relies on, before anything is written."""
        conformance.ensure(self.driver, conformance.COMMIT)
        start = self.clock()
        doc = self._doc(start)
        self.expires = start + self.ttl
        self._stored = self.driver.background(lambda: self.driver.put_volatile(self.key, doc))  # no fsync needed
        if wait or self._stored.done():
            self.wait()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.name}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Return once the lease is stored; raise why it could not be."""
        stored = self._stored
        if stored is None:
            return
        gen = stored.result()
        with self._lock:
            if self._stored is stored:  # the first to see it records its generation
                self.generation, self._stored = gen, None

    def renew(self) -> None:
        """Extend the lease by ``ttl`` from now, unless it is lost or already expired
        (then :attr:`error` says why and it is never renewed again)."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - remembered, raised at commit
            with self._lock:
                self.error = self.error or exc
            return
        with self._lock:
            if self.error is not None:
                return
            start = self.clock()
            try:
                if start >= self.expires:
                    raise LeaseLostError(f"lease {self.driver.describe(self.key)} expired before "
                                         "it could be renewed (the writer was paused)", name=self.name)
                doc = self._doc(start)
                try:
                    gen = self.driver.put_volatile(self.key, doc, if_generation=self.generation)
                except PreconditionFailedError:
                    gen = self._landed(doc)  # our own renewal, its reply lost and re-sent?
            except Exception as exc:  # noqa: BLE001 - remembered, raised at commit
                log.warning("lease of %s lost: %s", self.driver.describe(self.name), exc)
                self.error = exc
                return
            self.generation = gen
            self.expires = start + self.ttl

    def _landed(self, doc: bytes) -> str | None:
        """The generation of the lease if it holds exactly ``doc`` (a renewal whose reply
        was lost, then refused on retry), else re-raise the conflict."""
        info = self.driver.info(self.key)
        if self.driver.read(self.key) != doc:
            raise PreconditionFailedError(f"lease {self.driver.describe(self.key)} was replaced")
        return info.generation

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self.renew()
            if self.error is not None:
                return

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless the lease is still ours and unexpired:
        not expired by this writer's clock, and still stored at the generation it wrote
        (read afresh)."""
        self.wait()
        with self._lock:
            why = None
            if self.error is not None:
                why = f"renewal failed: {self.error}"
            elif self.clock() >= self.expires:
                why = "it expired"
            else:
                try:
                    gen = self.driver.info(self.key).generation
                except NotFoundError:
                    why = "recovery removed it (this writer was declared dead)"
                else:
                    if self.generation is not None and gen != self.generation:
                        why = "it was replaced by another process"
        if why:
            raise LeaseLostError(
                f"refusing to commit {self.driver.describe(self.name)}: the lease of attempt "
                f"{self.attempt} is lost ({why})",
                name=self.name,
            )

    def check_clock(self) -> None:
        """:meth:`check` without a request, right before a commit request: raise
        :class:`LeaseLostError` if a renewal failed or the lease expired by this writer's
        clock (it was paused past its ttl since its last renewal: a SIGSTOP between the
        lease check and the commit request; others may have declared it dead)."""
        with self._lock:
            why = (f"renewal failed: {self.error}" if self.error is not None
                   else "it expired (the writer was paused)" if self.clock() >= self.expires else None)
        if why:
            raise LeaseLostError(
                f"refusing to commit {self.driver.describe(self.name)}: the lease of attempt "
                f"{self.attempt} is lost ({why})",
                name=self.name,
            )

    def stop(self) -> None:
        """Stop renewing (the lease object stays until it expires)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def release(self) -> None:
        """Stop renewing and remove the lease object (its key is this attempt's alone)."""
        self.stop()
        try:
            self.wait()  # (a write still in flight would land after the delete)
        except Exception:  # noqa: BLE001 - it may have landed all the same: delete it
            pass
        try:
            self.driver.delete(self.key)
        except Exception as exc:  # noqa: BLE001 - recovery removes stale leases
            log.warning("could not remove lease %s: %s", self.key, exc)
