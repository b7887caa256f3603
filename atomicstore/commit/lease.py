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

import json
import logging
import threading
import time

from ..drivers.base import Driver
from ..errors import CorruptionError, LeaseLostError, NotFoundError
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
        doc = json.loads(driver.read(key)[:4096].decode())
        ttl = float(doc["ttl"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptionError(f"{driver.describe(key)}: malformed lease ({exc})", path=key) from None
    if not 0 < ttl < 7 * 86400:
        raise CorruptionError(f"{driver.describe(key)}: lease ttl {ttl} out of range", path=key)
    return ttl


class Lease:
    """The lease of one attempt, renewed by a heartbeat thread until released."""

    def __init__(self, driver: Driver, name: str, attempt: str, writer: str, ttl: float) -> None:
        self.driver = driver
        self.key = lease_key(name, attempt)
        self.name, self.attempt, self.writer, self.ttl = name, attempt, writer, ttl
        self.expires = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _doc(self) -> bytes:
        return json.dumps(
            {"name": self.name, "attempt": self.attempt, "writer": self.writer, "ttl": self.ttl,
             "renewed": time.time()}
        ).encode()

    def acquire(self) -> None:
        start = time.time()
        self.driver.put_volatile(self.key, self._doc())  # a lease needs no fsync
        self.expires = start + self.ttl
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.name}", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            start = time.time()
            try:
                if not self.driver.exists(self.key):
                    raise NotFoundError(f"lease {self.driver.describe(self.key)} was removed")
                self.driver.put_volatile(self.key, self._doc())
                self.expires = start + self.ttl
            except Exception as exc:  # noqa: BLE001 - remembered, raised at commit
                log.warning("lease of %s lost: %s", self.driver.describe(self.name), exc)
                self.error = exc
                return

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless the lease is still ours and unexpired."""
        why = None
        if self.error is not None:
            why = f"renewal failed: {self.error}"
        elif time.time() >= self.expires:
            why = "it expired"
        elif not self.driver.exists(self.key):
            why = "recovery removed it (this writer was declared dead)"
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
        """Stop renewing and remove the lease object."""
        self.stop()
        try:
            self.driver.delete(self.key)
        except Exception as exc:  # noqa: BLE001 - recovery removes stale leases
            log.warning("could not remove lease %s: %s", self.key, exc)
