"""A fault-injecting WSGI layer to put in front of the object-store fakes.

Deterministic by seed. Faults it can inject into a request:

* ``latency``: sleep before handling;
* ``error``: answer 500, 503 SlowDown or 429 without touching the backend;
* ``reset``: drop the connection without an answer, before the backend sees the request;
* ``lost_reply``: let the backend apply the request, then drop the connection, so the
  client cannot know it succeeded (the case a conditional commit must reconcile);
* ``stall``: hold requests that match a rule for a number of seconds (timeout tests).

It also serialises conditional writes (``If-None-Match`` on S3, ``ifGenerationMatch`` on
GCS), because moto checks the condition outside a lock: with this layer, two racing
conditional PUTs are decided one after the other, as a real object store decides them.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Predicate = Callable[[dict[str, Any]], bool]


def is_conditional(environ: dict[str, Any]) -> bool:
    """True for a conditional create on S3 or GCS."""
    return "HTTP_IF_NONE_MATCH" in environ or "ifGenerationMatch" in environ.get("QUERY_STRING", "")


def is_mutation(environ: dict[str, Any]) -> bool:
    return environ.get("REQUEST_METHOD", "GET") in ("PUT", "POST", "DELETE")


@dataclass
class FaultPlan:
    """What to inject. Rates are probabilities per request (drawn from ``seed``)."""

    seed: int = 0
    error_rate: float = 0.0
    reset_rate: float = 0.0
    lost_reply_rate: float = 0.0
    latency: float = 0.0
    #: only requests matching this are subject to the random faults
    applies_to: Predicate = field(default=lambda env: True)
    #: (predicate, seconds): matching requests sleep that long first
    stalls: list[tuple[Predicate, float]] = field(default_factory=list)
    #: stop injecting random faults after this many (None: no limit)
    budget: int | None = None


class FaultInjector:
    """WSGI middleware injecting the faults of its current :class:`FaultPlan`."""

    _ERRORS = (
        ("500 Internal Server Error", b"<Error><Code>InternalError</Code><Message>injected</Message></Error>",
         '{"error": {"code": 500, "message": "injected backendError"}}'),
        ("503 Slow Down", b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
         '{"error": {"code": 503, "message": "injected backendError"}}'),
        ("429 Too Many Requests", b"<Error><Code>TooManyRequests</Code><Message>injected</Message></Error>",
         '{"error": {"code": 429, "message": "injected rateLimitExceeded"}}'),
    )

    def __init__(self, app: Callable[..., Iterable[bytes]], *, json_errors: bool = False) -> None:
        self.app = app
        self.json_errors = json_errors
        self.plan = FaultPlan()
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self._conditional = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.injected = 0

    def set_plan(self, plan: FaultPlan | None = None) -> None:
        """Replace the plan (and reseed); ``None`` turns faults off."""
        with self._lock:
            self.plan = plan or FaultPlan()
            self._rng = random.Random(self.plan.seed)
            self.counts.clear()
            self.injected = 0

    def _draw(self, environ: dict[str, Any]) -> str | None:
        p = self.plan
        with self._lock:
            self.counts["requests"] += 1
            if not p.applies_to(environ):
                return None
            if p.budget is not None and self.injected >= p.budget:
                return None
            r = self._rng.random()
            for kind, rate in (("error", p.error_rate), ("reset", p.reset_rate), ("lost_reply", p.lost_reply_rate)):
                if r < rate:
                    self.injected += 1
                    self.counts[kind] += 1
                    return kind
                r -= rate
            return None

    @staticmethod
    def _drop(environ: dict[str, Any]) -> None:
        sock = environ.get("werkzeug.socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        raise ConnectionResetError("fault injector dropped the connection")

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        plan = self.plan
        for pred, seconds in plan.stalls:
            if pred(environ):
                self.counts["stall"] += 1
                time.sleep(seconds)
        if plan.latency:
            time.sleep(plan.latency)
        fault = self._draw(environ)
        if fault == "error":
            status, xml, js = self._ERRORS[self._rng.randrange(len(self._ERRORS))]
            body = js.encode() if self.json_errors else xml
            if environ.get("REQUEST_METHOD") == "HEAD":
                body = b""
            _consume(environ)
            ctype = "application/json" if self.json_errors else "application/xml"
            start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
            return [body]
        if fault == "reset":
            _consume(environ)  # read (and ignore) the body so the socket holds no stray bytes
            self._drop(environ)
        if is_conditional(environ):
            with self._conditional:
                result = _run(self.app, environ)
        else:
            result = _run(self.app, environ)
        if fault == "lost_reply":
            self._drop(environ)
        status, headers, body = result
        start_response(status, headers)
        return [body]


def _consume(environ: dict[str, Any]) -> None:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length:
        environ["wsgi.input"].read(length)


def _run(app: Callable[..., Iterable[bytes]], environ: dict[str, Any]) -> tuple[str, list, bytes]:
    """Run ``app`` to completion and capture its answer."""
    captured: dict[str, Any] = {}

    def start_response(status: str, headers: list, exc_info: Any = None) -> Callable[[bytes], None]:
        captured["status"], captured["headers"] = status, headers
        return lambda data: None

    it = app(environ, start_response)
    try:
        body = b"".join(it)
    finally:
        close = getattr(it, "close", None)
        if close:
            close()
    return captured["status"], captured["headers"], body
