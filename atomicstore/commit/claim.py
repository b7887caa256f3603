"""The claim of a checkpoint name: a short mutual exclusion around a commit request.

A name can be committed in two layouts on an object store: a directory-layout
checkpoint's commit point is its marker ``<name>/commit_success.txt``, a one-file
checkpoint's (flax's layout) is the object ``<name>`` itself. Those are two keys, and no
store makes a write of one conditional on the other; and on S3 stores racing conditional
completions of one upload key are not all exclusive (SeaweedFS lets several win). So on
object stores every commit request of a name is made under its claim:

* right before the commit request the writer creates ``.atomicstore/claims/<name>.json``
  with one conditional PUT (put-if-absent: exclusive on every store measured, and what
  the conformance check tests), then checks under it what the name holds now (the other
  layout's commit point, and for a one-file commit the object's generation), sends the
  commit request, and deletes the claim at the generation it wrote once the request
  answered;
* a writer that finds the claim held waits while the holder's lease is alive; once that
  lease is dead or gone it removes the lease at the generation read (a holder that was
  only paused then fails its lease check before its commit request) and takes the claim
  over with a PUT conditional on the claim's generation (one successor wins);
* recovery removes a claim whose holder's lease is dead and that is older than its ttl
  plus grace.

The commit request itself stays conditional: the claim only keeps two of them, or the two
layouts' checks and commit points, from interleaving. ``docs/commit-protocol.md``
("Claims") walks each step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass

from ..drivers.spec import Driver, FileInfo
from ..errors import (
    AlreadyExistsError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageTimeoutError,
)
from .lease import Lease, lease_key, read_lease_ttl
from .names import ATTEMPT_ID, RESERVED_DIR, validate_name

log = logging.getLogger("atomicstore.commit")

#: where a writer holds the claim of a name while its commit request is in flight
CLAIMS = f"{RESERVED_DIR}/claims"
#: a claim is a small JSON document: anything longer is not one of atomicstore's
MAX_CLAIM_BYTES = 4096
#: first and longest pause between two looks at a claim held by a live writer (seconds)
CLAIM_POLL = (0.02, 0.5)


def claim_key(name: str) -> str:
    """The key of the claim of the checkpoint name ``name``."""
    return f"{CLAIMS}/{name}.json"


def parse_claim_key(key: str) -> str | None:
    """The checkpoint name of a claim key, or None if ``key`` is not one."""
    if not key.startswith(CLAIMS + "/") or not key.endswith(".json"):
        return None
    name = key[len(CLAIMS) + 1 : -len(".json")]
    try:
        return validate_name(name)
    except InvalidArgumentError:
        return None


@dataclass(frozen=True)
class ClaimHolder:
    """What a claim says about the writer holding it (read from storage, validated:
    ``attempt`` is None when the claim is not a readable claim of atomicstore's)."""

    attempt: str | None
    writer: str = ""
    ttl: float | None = None


def read_claim(driver: Driver, key: str, generation: str | None) -> ClaimHolder:
    """The holder named by the claim ``key`` at ``generation`` (hostile input: a malformed
    claim names no attempt). :class:`NotFoundError` if it is gone,
    :class:`PreconditionFailedError` if it changed."""
    raw = driver.read_if(key, generation) if generation else driver.read(key, 0, MAX_CLAIM_BYTES + 1)
    try:
        if len(raw) > MAX_CLAIM_BYTES:
            raise ValueError(f"{len(raw)} bytes")
        doc = json.loads(raw.decode())
        attempt, writer, ttl = doc["attempt"], doc.get("writer", ""), doc.get("ttl")
        if not (isinstance(attempt, str) and ATTEMPT_ID.fullmatch(attempt) and isinstance(writer, str)):
            raise ValueError("no attempt id")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)
                                or not 0 < ttl < 7 * 86400):
            ttl = None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
        log.warning("%s is not a claim of atomicstore's (%s)", driver.describe(key), exc)
        return ClaimHolder(None)
    return ClaimHolder(attempt, writer[:200], None if ttl is None else float(ttl))


class NameClaim:
    """The claim of one commit of the name of ``lease`` by its attempt (the caller holds
    the lease): taken right before its commit request, released right after it answered,
    or kept with the lease when the request's outcome is unknown (it may still land: the
    claim then goes with the lease, after ttl + grace). See the module docstring.
    ``layout`` is recorded in the claim for people reading it; ``grace`` is the store's
    (a holder's lease is alive while renewed within its ttl + grace, as recovery judges
    it). The writer, its ttl and its clock are the lease's."""

    def __init__(self, lease: Lease, layout: str, grace: float) -> None:
        self.name, self.attempt, self.lease, self.grace = lease.name, lease.attempt, lease, grace
        self.driver = lease.driver
        self.key = claim_key(self.name)
        self.doc = json.dumps({"name": self.name, "attempt": self.attempt, "writer": lease.writer,
                               "layout": layout, "ttl": lease.ttl}).encode()
        self.held = False
        self.generation: str | None = None
        #: the first try, sent in the background by :meth:`start`
        self._first: Future[bool] | None = None
        #: lease key -> its ttl (a lease's ttl never changes)
        self._ttls: dict[str, float] = {}
        #: claim generation -> its holder (a generation never comes back with other bytes)
        self._holders: dict[str, ClaimHolder] = {}

    def _holder_lease(self, holder: ClaimHolder) -> tuple[bool, float, FileInfo | None]:
        """(alive, ttl, info) of the holder's lease, read now: alive while it was renewed
        less than its ttl + grace ago (by the storage's clock, as recovery judges it);
        info None if it is gone."""
        d = self.driver
        if holder.attempt is None:
            return False, self.lease.ttl, None
        key = lease_key(self.name, holder.attempt)
        try:
            info = d.info(key)
            if key not in self._ttls:
                try:
                    self._ttls[key] = read_lease_ttl(d, key)
                except CorruptionError:
                    self._ttls[key] = 0.0
        except NotFoundError:
            return False, self.lease.ttl, None
        ttl, now = self._ttls[key], self.lease.clock()
        mtime = info.mtime if info.mtime is not None else now
        return mtime + ttl + self.grace > now, ttl, info

    def _fence(self, lease: FileInfo | None) -> bool:
        """Remove a dead holder's lease at the generation read (as recovery fences one),
        so that a holder that was only paused fails its lease check; False if it was
        renewed meanwhile (then it is alive)."""
        if lease is None:
            return True
        try:
            self.driver.delete(lease.key, if_generation=lease.generation)
        except PreconditionFailedError:
            return False
        return True

    def _put(self, if_generation: str | None) -> bool:
        """Create the claim (or, at ``if_generation``, take it over); False if refused."""
        try:
            gen = self.driver.put(self.key, self.doc, exclusive=if_generation is None,
                                  if_generation=if_generation)
        except AlreadyExistsError:  # (PreconditionFailedError too) ours, if its reply was lost: looked at next
            return False
        self.held, self.generation = True, gen
        return True

    def start(self) -> None:
        """Send the first try in the background (alongside the caller's own requests);
        :meth:`hold` waits for it, :meth:`release` settles it."""
        self._first = self.driver.background(self.try_take)

    def hold(self) -> bool:
        """Hold the claim: the try :meth:`start` sent (or one now), and if it was refused,
        :meth:`take`. True if it had to wait for another writer."""
        first, self._first = self._first, None
        if first.result() if first is not None and not first.cancel() else self.try_take():
            return False
        self.take(tried=True)
        return True

    def try_take(self) -> bool:
        """One try: create the claim; False if it exists (held, or ours if a reply was
        lost: :meth:`take` finds out)."""
        return self._put(None)

    def take(self, *, tried: bool = False) -> None:
        """Hold the claim: create it; if another writer holds it, wait while that writer's
        lease is alive; once the lease is dead or gone, remove the lease (fencing a holder
        that was only paused) and take the claim over.
        :class:`StorageTimeoutError` if a live holder keeps it longer than its lease's
        ttl + grace + the retry deadline of one request. ``tried``: :meth:`try_take` was
        refused just now."""
        d = self.driver
        delay = CLAIM_POLL[0]
        waiting_on: str | None = ""
        since = time.monotonic()
        if not tried and self._put(None):
            return
        while True:
            try:
                info = d.info(self.key)
                gen = info.generation
                holder = self._holders.get(gen) if gen else None
                if holder is None:
                    holder = read_claim(d, self.key, gen)
            except NotFoundError:  # released meanwhile
                if self._put(None):
                    return
                continue
            except PreconditionFailedError:  # replaced meanwhile
                continue
            if gen:
                self._holders[gen] = holder
            if holder.attempt == self.attempt:  # our own PUT, its reply lost
                self.held, self.generation = True, info.generation
                return
            alive, ttl, lease = self._holder_lease(holder)
            if not alive:
                if self._fence(lease) and self._put(info.generation):
                    log.warning("took over the claim of %s from attempt %s (writer %r), whose lease is "
                                "dead or gone", d.describe(self.name), holder.attempt, holder.writer)
                    return
                continue
            if gen != waiting_on:
                waiting_on, since = gen, time.monotonic()
            limit = ttl + self.grace + (d.retry.deadline if d.retry.deadline is not None else math.inf)
            if time.monotonic() - since > limit:
                raise StorageTimeoutError(
                    f"commit of {d.describe(self.name)}: attempt {holder.attempt} (writer "
                    f"{holder.writer!r}) has held its claim {d.describe(self.key)} for more than "
                    f"{limit:.0f}s while its lease stays alive; nothing was committed")
            time.sleep(delay)
            delay = min(2 * delay, CLAIM_POLL[1])

    def _ours_after_lost_reply(self) -> None:
        """After a refused first try that :meth:`hold` never looked at (the commit failed
        before it): if the claim names this attempt, our PUT landed and only its reply
        was lost (a retry was refused): it is ours to release. Best effort."""
        d = self.driver
        with contextlib.suppress(Exception):  # (gone or replaced meanwhile: not ours to touch)
            gen = d.info(self.key).generation
            if read_claim(d, self.key, gen).attempt == self.attempt:
                self.held, self.generation = True, gen

    def confirm(self) -> None:
        """Right before the commit request (no request): :class:`LeaseLostError` if the
        holder's lease expired by its own clock since it was checked (a pause there: others
        may have taken the claim over)."""
        self.lease.check_clock()

    def release(self) -> None:
        """Delete the claim, at the generation this writer wrote (a successor that took it
        over keeps it). Best effort: recovery removes a claim left behind."""
        first, self._first = self._first, None
        if first is not None and not first.cancel():
            refused = False
            with contextlib.suppress(Exception):  # (failed: its outcome is unknown; recovery's)
                refused = first.result() is False
            if refused:  # held by another writer, or ours if its reply was lost: look
                self._ours_after_lost_reply()
        if not self.held:
            return
        self.held = False
        try:
            self.driver.delete(self.key, if_generation=self.generation)
        except PreconditionFailedError:
            log.warning("the claim %s was taken over before it was released", self.driver.describe(self.key))
        except Exception as exc:  # noqa: BLE001 - recovery removes it later
            log.warning("could not release the claim %s: %s", self.driver.describe(self.key), exc)


def claims_needed(driver: Driver) -> bool:
    """Whether commits on ``driver`` are made under claims: on stores that commit by a
    conditional request (no atomic rename) and can create an object exclusively, unless
    the driver declares that the store itself keeps the commit requests of one name
    exclusive (``Capabilities.exclusive_names``)."""
    caps = driver.capabilities
    return not caps.atomic_rename and caps.atomic_create and not caps.exclusive_names


__all__ = ["CLAIMS", "ClaimHolder", "NameClaim", "claim_key", "claims_needed", "parse_claim_key", "read_claim"]
