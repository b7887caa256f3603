"""Test support shipped with the package: object-store fakes, fault injection, and the
driver contract (:class:`DriverContract`, a pytest class a driver's tests subclass:
:mod:`atomicstore.testing.contract`).

The contract's names are imported on first use, so that the fakes and the fault injector
stay importable without pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .contract import DriverContract, StoreLocation

__all__ = ["DriverContract", "StoreLocation"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import contract

        return getattr(contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
