"""What a commit needs of its store: one small frozen object, built once by the Store.

Transactions, one-file commits, the claims around their commit requests, and recovery
receive a :class:`CommitContext` instead of the :class:`~atomicstore.Store` itself: the
driver, the commit strategy, who writes, and the times a lease and recovery go by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..drivers.spec import Driver
from .claim import NameClaim, claims_needed
from .lease import Lease
from .strategy import CommitStrategy


@dataclass(frozen=True)
class CommitContext:
    """The store's commit facts (see the module docstring)."""

    #: where the bytes go
    driver: Driver
    #: how files staged under an attempt become a committed checkpoint
    strategy: CommitStrategy
    #: who writes: recorded in manifests, markers, leases and claims
    writer_id: str
    #: seconds a lease lives without renewal
    lease_ttl: float
    #: extra seconds recovery waits before it treats unleased data as stale
    grace: float
    #: Unix seconds; leases and recovery read time only through it
    clock: Callable[[], float]

    def lease(self, name: str, attempt: str) -> Lease:
        """The (not yet acquired) lease of ``attempt`` of ``name``."""
        return Lease(self.driver, name, attempt, self.writer_id, self.lease_ttl, self.clock)

    def claim(self, lease: Lease, layout: str) -> NameClaim | None:
        """The claim the commit request of ``lease``'s attempt is made under, where the
        backend needs one (``commit/claim.py``: object stores), else None. ``layout`` is
        recorded in the claim for people reading it."""
        return NameClaim(lease, layout, self.grace) if claims_needed(self.driver) else None
