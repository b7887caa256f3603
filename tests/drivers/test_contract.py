"""Every built-in driver through the shipped driver contract (atomicstore.testing.contract):
local disk, memory, S3 on moto, S3 on SeaweedFS and GCS on our fake."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
from conftest import note_server

from atomicstore.testing import DriverContract, StoreLocation


def server_location(request: pytest.FixtureRequest, server: Any, name: str) -> StoreLocation:
    """A fresh bucket on ``server`` (no faults, also after the test)."""
    server.faults(None)
    request.addfinalizer(lambda: server.faults(None))
    note_server(request, name)
    return StoreLocation(server.url(server.new_bucket(), "ckpts"), server.storage_options())


class TestLocalDriver(DriverContract):
    @pytest.fixture
    def location(self, tmp_path: Path) -> StoreLocation:
        return StoreLocation(str(tmp_path / "store"))


class TestMemoryDriver(DriverContract):
    @pytest.fixture
    def location(self) -> StoreLocation:
        return StoreLocation(f"memory://contract-{secrets.token_hex(6)}")


class TestS3DriverOnMoto(DriverContract):
    upload_times = False  # moto answers Initiated 2010-11-10 for every multipart upload

    @pytest.fixture
    def location(self, request: pytest.FixtureRequest, s3_server: Any) -> StoreLocation:
        return server_location(request, s3_server, "moto")


class TestS3DriverOnSeaweedFS(DriverContract):
    @pytest.fixture
    def location(self, request: pytest.FixtureRequest, seaweed_server: Any) -> StoreLocation:
        return server_location(request, seaweed_server, "seaweed")


class TestGCSDriverOnFake(DriverContract):
    @pytest.fixture
    def location(self, request: pytest.FixtureRequest, gcs_server: Any) -> StoreLocation:
        return server_location(request, gcs_server, "gcsfake")
