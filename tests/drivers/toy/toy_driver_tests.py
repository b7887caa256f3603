"""The toy driver's own test file, as a third-party package would write it: atomicstore's
driver contract over ``toy://`` stores, opened by URL. (Copied to ``test_toy_driver.py``
and run in a fresh pytest process by tests/drivers/test_third_party_driver.py, with the
toy package and its entry point on the path; not collected by atomicstore's own suite.)"""

from __future__ import annotations

import secrets
import sys
from importlib.metadata import entry_points

import pytest

import atomicstore
from atomicstore.drivers import ENTRY_POINT_GROUP, driver_class
from atomicstore.testing import DriverContract, StoreLocation

#: nothing imported the driver before atomicstore looked its protocol up
IMPORTED_AT_COLLECTION = "toy_atomicstore_driver" in sys.modules


class TestToyDriver(DriverContract):
    @pytest.fixture
    def location(self) -> StoreLocation:
        return StoreLocation(f"toy://bucket-{secrets.token_hex(4)}/ckpts")


def test_the_driver_comes_from_its_entry_point() -> None:
    assert not IMPORTED_AT_COLLECTION
    (ep,) = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == "toy"]
    assert ep.value == "toy_atomicstore_driver:ToyDriver"
    assert ep.dist is not None and ep.dist.name == "toy-atomicstore-driver"
    cls = driver_class("toy")
    assert cls is ep.load()
    store = atomicstore.open_store(f"toy://bucket-{secrets.token_hex(4)}")
    assert type(store.driver) is cls and store.strategy.kind == "marker"
