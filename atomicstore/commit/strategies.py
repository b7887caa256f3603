"""The two commit strategies, one small class each behind one protocol, and the choice
between them.

:class:`RenameStrategy` (``commit/rename.py``) for backends whose driver declares
``atomic_rename`` (POSIX, memory); :class:`MarkerStrategy` (``commit/marker.py``) for the
others (object stores). The protocol, the layout and the key kinds are in
``commit/strategy.py``; this module keeps the names importable from one place.
"""

from __future__ import annotations

from ..drivers.spec import Driver
from .marker import MarkerStrategy, Settled
from .names import ATTEMPT_PREFIX
from .rename import RenameStrategy
from .strategy import (
    STAGING,
    TRASH,
    CommitStrategy,
    KeyClass,
    KeyKind,
    new_attempt_id,
    read_capped,
)


def choose_strategy(driver: Driver) -> CommitStrategy:
    """Rename where the driver declares atomic rename, marker otherwise."""
    if driver.capabilities.atomic_rename:
        return RenameStrategy(driver)
    return MarkerStrategy(driver)


__all__ = [
    "ATTEMPT_PREFIX",
    "STAGING",
    "TRASH",
    "CommitStrategy",
    "KeyClass",
    "KeyKind",
    "MarkerStrategy",
    "RenameStrategy",
    "Settled",
    "choose_strategy",
    "new_attempt_id",
    "read_capped",
]
