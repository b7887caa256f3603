"""Object-store fakes on loopback, each behind a :class:`FaultInjector`.

``FakeS3`` serves moto's S3 application; ``FakeGCS`` serves :class:`GCSFake`. Both run
in a background thread of the calling process on 127.0.0.1 (pytest-localserver's
``WSGIServer``), so tests, child processes and the demo reach them over real HTTP.
Needs the ``test`` extra (moto, werkzeug, pytest-localserver).
"""

from __future__ import annotations

import json
import logging
import secrets
import urllib.request
from typing import Any

from .faults import FaultInjector, FaultPlan


class _FakeServer:
    protocol = ""

    def __init__(self) -> None:
        self.injector: FaultInjector
        self._server: Any = None

    def _serve(self, app: Any, **kwargs: Any) -> None:
        from pytest_localserver.http import WSGIServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)

        self._server = WSGIServer(host="127.0.0.1", port=0, application=app, threaded=True, **kwargs)
        self._server.daemon = True  # never keeps the process alive
        self._server.start()

    @property
    def endpoint(self) -> str:
        url: str = self._server.url
        return url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def faults(self, plan: FaultPlan | None = None) -> None:
        """Set the fault plan (``None``: no faults)."""
        self.injector.set_plan(plan)

    def new_bucket(self, name: str | None = None) -> str:
        raise NotImplementedError

    def storage_options(self) -> dict[str, Any]:
        raise NotImplementedError

    def url(self, bucket: str, prefix: str = "") -> str:
        return f"{self.protocol}://{bucket}/{prefix}".rstrip("/")

    def __enter__(self) -> _FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeS3(_FakeServer):
    """moto's S3 server application behind the fault injector."""

    protocol = "s3"

    def __init__(self) -> None:
        super().__init__()
        import os

        os.environ.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")
        from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app

        self.injector = FaultInjector(create_backend_app("s3"))
        self._serve(self.injector, request_handler=MotoRequestHandler)

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint,
            "key": "testing-key-id",
            "secret": "testing-secret-key",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{secrets.token_hex(6)}"
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        req.add_header("Authorization", "AWS4-HMAC-SHA256 Credential=testing-key-id/20260101/us-east-1/s3/aws4_request")
        urllib.request.urlopen(req, timeout=30).read()
        return name


class FakeGCS(_FakeServer):
    """:class:`GCSFake` behind the fault injector."""

    protocol = "gs"

    def __init__(self) -> None:
        super().__init__()
        from .gcsfake import GCSFake

        self.app = GCSFake()
        self.injector = FaultInjector(self.app, json_errors=True)
        self._serve(self.injector)

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{secrets.token_hex(6)}"
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=30).read()
        return name
