"""A fault-injecting WSGI layer to put in front of the object-store fakes.

Deterministic by seed. Faults it can inject into a request:

* ``latency``: sleep before handling;
* ``error``: answer 500, 503 SlowDown or 429 without touching the backend;
* ``reset``: drop the connection without an answer, before the backend sees the request;
* ``lost_reply``: let the backend apply the request, then drop the connection, so the
  client cannot know it succeeded (the case a conditional commit must reconcile);
* ``stall``: hold requests that match a rule for a number of seconds (timeout tests);
* ``deny``: refuse requests that match a rule with 403, as read-only credentials get;
* ``409 ConditionalRequestConflict`` (S3 only): the answer real S3 may give a conditional
  write (``PutObject`` or ``CompleteMultipartUpload`` with ``If-None-Match`` or
  ``If-Match``) when a conflicting operation on the same key is in progress, e.g. another
  conditional write, or a delete that succeeds before the conditional write completes. The
  request is not applied. AWS tells clients to retry a ``PutObject`` (after fetching the
  ETag again for ``If-Match``) and, for ``CompleteMultipartUpload``, to start a new
  multipart upload and upload every part again. Either for overlapping operations
  (``FaultPlan.conflict_on_overlap``) or for the next N conditional writes matching a rule
  (``FaultPlan.conflicts``). moto never answers 409.

It also serialises conditional writes and deletes (``If-None-Match``/``If-Match`` on S3,
``ifGenerationMatch``/``ifMetagenerationMatch`` on GCS), because moto checks the conditions
outside a lock: with this layer, two racing conditional PUTs are decided one after the
other, as a real object store decides them. And it enforces what moto 5.2.5 ignores:
``If-Match`` on S3 ``CompleteMultipartUpload`` (412 ``PreconditionFailed`` when the
object's ETag differs, 404 ``NoSuchKey`` when there is no object), checked under the same
lock, so compare-and-swap completions can be tested. In front of a real server
(``real_server=True``, e.g. SeaweedFS) it does neither: the server decides every
precondition, racing requests race there, and what it gets wrong stays visible.

And it can log requests (:meth:`FaultInjector.recording`): method, kind (list, head, get,
put, delete), object key, status, and when each arrived and was answered, so tests count
the requests an operation makes and how many of them waited on each other
(:meth:`RequestLog.depth`).
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import random
import re
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

#: a test on a request's WSGI ``environ``: which requests a rule of a :class:`FaultPlan` applies to
Predicate = Callable[[dict[str, Any]], bool]

#: GCS query parameters that make a request conditional
GCS_PRECONDITIONS = ("ifGenerationMatch", "ifGenerationNotMatch", "ifMetagenerationMatch",
                     "ifMetagenerationNotMatch")
_GCS_BASES = ("/upload/storage/v1/b/", "/download/storage/v1/b/", "/storage/v1/b/")


def query(environ: dict[str, Any]) -> dict[str, str]:
    """The request's query parameters (last value wins, blanks kept)."""
    pairs = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    return {k: v[-1] for k, v in pairs.items()}


def is_gcs(environ: dict[str, Any]) -> bool:
    """True for a request of the GCS JSON API (the paths :class:`GCSFake` serves)."""
    path: str = environ.get("PATH_INFO", "")
    return path.startswith(_GCS_BASES)


def is_mutation(environ: dict[str, Any]) -> bool:
    """True for a request that may change the store: ``PUT``, ``POST`` or ``DELETE``."""
    return environ.get("REQUEST_METHOD", "GET") in ("PUT", "POST", "DELETE")


def _gcs_final_chunk(environ: dict[str, Any]) -> bool:
    """A chunk of a GCS resumable upload that finishes it (``Content-Range: .../<total>``)."""
    crange = environ.get("HTTP_CONTENT_RANGE", "")
    return bool(crange) and not crange.endswith("/*")


def is_conditional(environ: dict[str, Any]) -> bool:
    """True for a conditional write or delete: S3 ``If-None-Match``/``If-Match``; GCS
    ``ifGenerationMatch``/``ifMetagenerationMatch`` (and their ``Not`` forms). For a GCS
    resumable upload (whose chunks repeat the session's preconditions in the query, as
    GCS's session URL does), only the final chunk, the one that creates the object."""
    if not is_mutation(environ):
        return False
    if is_gcs(environ):
        q = query(environ)
        if not any(p in q for p in GCS_PRECONDITIONS):
            return False
        if "upload_id" in q:
            return environ.get("REQUEST_METHOD") != "DELETE" and _gcs_final_chunk(environ)
        return True
    return "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ


def is_conditional_write(environ: dict[str, Any]) -> bool:
    """An S3 write that may be answered ``409 ConditionalRequestConflict``: ``PutObject``
    (or ``CopyObject``) or ``CompleteMultipartUpload`` with ``If-None-Match`` or
    ``If-Match``. Never a GCS request."""
    if is_gcs(environ) or not ("HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ):
        return False
    method = environ.get("REQUEST_METHOD")
    q = query(environ)
    if method == "PUT":
        return "uploadId" not in q and "partNumber" not in q
    return method == "POST" and "uploadId" in q


def is_multipart_completion(environ: dict[str, Any]) -> bool:
    """S3 ``CompleteMultipartUpload`` (``POST <key>?uploadId=...``)."""
    return (not is_gcs(environ) and environ.get("REQUEST_METHOD") == "POST"
            and "uploadId" in query(environ))


def _peek_body(environ: dict[str, Any]) -> bytes:
    """The request body, read once and put back so the application still sees it."""
    cached: bytes | None = environ.get("atomicstore.body")
    if cached is not None:
        return cached
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    body = environ["wsgi.input"].read(length) if length else b""
    environ["wsgi.input"] = io.BytesIO(body)
    environ["atomicstore.body"] = body
    return body


def object_key(environ: dict[str, Any]) -> str | None:
    """``bucket/key`` of the object a request addresses, or None (bucket requests,
    listings). S3: path-style URL. GCS: the ``name`` query parameter (uploads, and the
    session URL of a resumable upload), the ``/o/<name>`` path, or the metadata part of a
    multipart upload (the body is buffered for that)."""
    path = environ.get("PATH_INFO", "")
    if is_gcs(environ):
        rest = next(path[len(b):] for b in _GCS_BASES if path.startswith(b))
        bucket, _, tail = rest.partition("/")
        q = query(environ)
        if "name" in q:
            return f"{bucket}/{q['name']}"
        if tail.startswith("o/"):
            return f"{bucket}/{unquote(tail[2:])}"
        if q.get("uploadType") == "multipart":
            body = _peek_body(environ)
            m = re.search(rb"\r?\n\r?\n(\{.*?\})\r?\n--", body, re.S)
            if m:
                try:
                    return f"{bucket}/{json.loads(m.group(1))['name']}"
                except (ValueError, KeyError):
                    return None
        return None
    bucket, _, key = unquote(path).lstrip("/").partition("/")
    return f"{bucket}/{key}" if bucket and key else None


def writes_to(suffix: str) -> Predicate:
    """A predicate: a write or delete of an object whose key ends with ``suffix`` (e.g.
    ``"commit_success.txt"``)."""

    def pred(environ: dict[str, Any]) -> bool:
        if not is_mutation(environ):
            return False
        key = object_key(environ)
        return key is not None and key.endswith(suffix)

    return pred


def request_kind(environ: dict[str, Any]) -> str:
    """What a request is, across both fakes: ``"list"`` (a listing of a bucket),
    ``"head"`` (an object's metadata: S3 HEAD, GCS metadata GET), ``"get"`` (an object's
    bytes), ``"put"`` (an object written: S3 PUT or multipart call, GCS upload),
    ``"delete"``, or ``"other"`` (bucket calls, multipart-upload listings)."""
    method = environ.get("REQUEST_METHOD", "GET")
    q = query(environ)
    key = object_key(environ)
    if is_gcs(environ):
        path = environ.get("PATH_INFO", "")
        if path.startswith("/upload/"):
            return "delete" if method == "DELETE" else "put"
        if method == "DELETE":
            return "delete"
        if method == "GET" and path.rstrip("/").endswith("/o") and key is None:
            return "list"
        if method == "GET" and key is not None:
            return "get" if (path.startswith("/download/") or q.get("alt") == "media") else "head"
        return "other"
    if key is None:
        if method == "GET" and "uploads" not in q and "location" not in q:
            return "list"
        return "other"
    if method == "HEAD":
        return "head"
    if method == "GET":
        return "get" if "uploadId" not in q else "other"
    if method in ("PUT", "POST"):
        return "put"
    if method == "DELETE":
        return "delete"
    return "other"


@dataclass(frozen=True)
class LoggedRequest:
    """One request as the fake saw it (times from ``time.monotonic()``)."""

    method: str
    kind: str  # see request_kind
    key: str | None  # "bucket/key" of the object, None for bucket requests
    query: str
    start: float  # arrival, before any injected stall or latency
    end: float  # answered (or dropped)
    status: str = ""


class RequestLog:
    """The requests answered while :meth:`FaultInjector.recording` was active."""

    def __init__(self) -> None:
        self.requests: list[LoggedRequest] = []
        self._lock = threading.Lock()

    def add(self, r: LoggedRequest) -> None:
        with self._lock:
            self.requests.append(r)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[LoggedRequest]:
        return iter(list(self.requests))

    def count(self, kind: str | None = None, where: Callable[[LoggedRequest], bool] | None = None) -> int:
        """How many requests (of ``kind``; matching ``where(request)``) were logged."""
        return sum(1 for r in self if (kind is None or r.kind == kind) and (where is None or where(r)))

    def kinds(self) -> Counter[str]:
        return Counter(r.kind for r in self)

    def depth(self, where: Callable[[LoggedRequest], bool] | None = None) -> int:
        """The longest chain of (``where``-selected) requests of which each arrived after
        the previous one was answered: the number of round trips that waited on each
        other. Requests a client issues concurrently overlap in time (inject ``latency``
        to make sure they do), so they count once."""
        reqs = sorted((r for r in self if where is None or where(r)), key=lambda r: r.start)
        best: list[int] = []
        for i, r in enumerate(reqs):
            best.append(1 + max((best[j] for j in range(i) if reqs[j].end <= r.start), default=0))
        return max(best, default=0)

    def describe(self) -> str:
        """One line per request, in order of arrival (for assertion messages)."""
        t0 = min((r.start for r in self), default=0.0)
        return "\n".join(f"{r.start - t0:8.3f} {r.end - t0:8.3f} {r.kind:6} {r.method:6} {r.status[:3]} "
                         f"{r.key or ''}?{r.query[:80]}" for r in sorted(self, key=lambda r: r.start))


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
    #: S3: a conditional write of a key that arrives while another conditional write of the
    #: same key is in progress (from its arrival, stalls included, to its answer), or during
    #: which a delete of the key succeeds, gets 409 ConditionalRequestConflict and is not
    #: applied, instead of being decided in its turn
    conflict_on_overlap: bool = False
    #: S3: (predicate, n): answer 409 ConditionalRequestConflict, without applying them, to
    #: the next n conditional writes (see :func:`is_conditional_write`) matching predicate
    conflicts: list[tuple[Predicate, int]] = field(default_factory=list)
    #: S3: once a CompleteMultipartUpload got 409, every later completion of that upload id
    #: gets 409 too (AWS: "re-initiate the multipart upload with CreateMultipartUpload and
    #: re-upload each part"); the upload stays listed until it is aborted
    conflict_ends_upload: bool = True
    #: requests matching it are refused without being applied: 403 ``AccessDenied`` (S3) or
    #: 403 ``forbidden`` (GCS), what read-only credentials get (``deny=is_mutation``)
    deny: Predicate | None = None


_S3_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
             "<Message>{message}</Message>{extra}<RequestId>{rid}</RequestId>"
             "<HostId>{host}</HostId></Error>")


class FaultInjector:
    """WSGI middleware injecting the faults of its current :class:`FaultPlan`.

    ``json_errors`` marks the GCS fake (errors as JSON); otherwise the backend is S3, and
    the S3-only behaviour (409 conflicts, ``If-Match`` on multipart completion) applies.
    ``real_server`` marks a real object store behind the injector: conditional requests
    are passed through as they come (not serialised, no precondition emulated); every
    injected fault works the same.
    """

    _ERRORS = (
        ("500 Internal Server Error", b"<Error><Code>InternalError</Code><Message>injected</Message></Error>",
         '{"error": {"code": 500, "message": "injected backendError"}}'),
        ("503 Slow Down", b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
         '{"error": {"code": 503, "message": "injected backendError"}}'),
        ("429 Too Many Requests", b"<Error><Code>TooManyRequests</Code><Message>injected</Message></Error>",
         '{"error": {"code": 429, "message": "injected rateLimitExceeded"}}'),
    )

    def __init__(self, app: Callable[..., Iterable[bytes]], *, json_errors: bool = False,
                 real_server: bool = False) -> None:
        self.app = app
        self.json_errors = json_errors
        self.real_server = real_server
        self.plan = FaultPlan()
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self._conditional = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.injected = 0
        self._conflicts_left: list[int] = []
        self._in_progress: Counter[str] = Counter()
        #: S3 key -> how many DeleteObject requests of it succeeded (ever)
        self._deletes: Counter[str] = Counter()
        self._ended_uploads: set[str] = set()
        #: upload id -> ETag of the object its completion created (S3)
        self._completed: dict[str, str] = {}
        self._logs: list[RequestLog] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[RequestLog]:
        """Log every request answered inside the ``with`` block (nested recordings each
        get every request)."""
        log = RequestLog()
        with self._lock:
            self._logs.append(log)
        try:
            yield log
        finally:
            with self._lock:
                self._logs.remove(log)

    @property
    def s3(self) -> bool:
        return not self.json_errors

    def set_plan(self, plan: FaultPlan | None = None) -> None:
        """Replace the plan (and reseed); ``None`` turns faults off."""
        with self._lock:
            self.plan = plan or FaultPlan()
            self._rng = random.Random(self.plan.seed)
            self.counts.clear()
            self.injected = 0
            self._conflicts_left = [n for _, n in self.plan.conflicts]

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

    # -- S3 answers ----------------------------------------------------------------------
    @staticmethod
    def _s3_error(status: str, code: str, message: str, **extra: str) -> tuple[str, list[tuple[str, str]], bytes]:
        tags = "".join(f"<{k}>{html.escape(v)}</{k}>" for k, v in extra.items())
        body = _S3_ERROR.format(
            code=code, message=html.escape(message), extra=tags,
            rid=secrets.token_hex(8).upper(), host=secrets.token_urlsafe(24),
        ).encode()
        headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
        return status, headers, body

    def _denied(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        """The answer to a request the credentials do not allow (see ``FaultPlan.deny``)."""
        if self.s3:
            return self._s3_error("403 Forbidden", "AccessDenied", "Access Denied")
        body = json.dumps({"error": {"code": 403, "message": "injected: the caller does not have "
                                     "storage.objects.create/delete access (read-only credentials)",
                                     "errors": [{"reason": "forbidden", "message": "forbidden"}]}}).encode()
        return "403 Forbidden", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body

    def _conflict_answer(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        key = (object_key(environ) or "").partition("/")[2]
        return self._s3_error(
            "409 Conflict", "ConditionalRequestConflict",
            "A conflicting conditional operation is currently in progress against this resource. "
            "Try again.", Key=key)

    def _should_conflict(self, environ: dict[str, Any], overlapped: bool) -> bool:
        """Decide (and count) whether this S3 conditional write gets 409."""
        q = query(environ)
        upload = q.get("uploadId") if is_multipart_completion(environ) else None
        with self._lock:
            hit = overlapped or (upload is not None and upload in self._ended_uploads)
            if not hit:
                for i, (pred, _n) in enumerate(self.plan.conflicts):
                    if self._conflicts_left[i] > 0 and pred(environ):
                        self._conflicts_left[i] -= 1
                        hit = True
                        break
            if hit:
                self.counts["conflict"] += 1
                if upload is not None and self.plan.conflict_ends_upload:
                    self._ended_uploads.add(upload)
        return hit

    def _complete_precondition(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes] | None:
        """``If-Match`` on an S3 CompleteMultipartUpload, which moto ignores: the answer
        S3 gives when it does not hold, or None. Called under the conditional lock."""
        want = environ.get("HTTP_IF_MATCH")
        if not (self.s3 and want and is_multipart_completion(environ)):
            return None
        head = dict(environ)
        for k in ("HTTP_IF_MATCH", "HTTP_IF_NONE_MATCH", "CONTENT_TYPE", "HTTP_CONTENT_MD5",
                  "werkzeug.request", "atomicstore.body"):
            head.pop(k, None)
        head.update({"REQUEST_METHOD": "HEAD", "QUERY_STRING": "", "CONTENT_LENGTH": "0",
                     "wsgi.input": io.BytesIO(b"")})
        status, headers, _ = _run(self.app, head)
        key = (object_key(environ) or "").partition("/")[2]
        if status.startswith("404"):
            return self._s3_error("404 Not Found", "NoSuchKey", "The specified key does not exist.",
                                  Key=key)
        etag = next((v for k, v in headers if k.lower() == "etag"), "").strip('"')
        upload = query(environ)["uploadId"]
        with self._lock:
            if self._completed.get(upload) == etag:
                return None  # a retry of a completion that was applied: moto answers it as done
        if want.strip() != "*" and want.strip().strip('"') != etag:
            return self._s3_error("412 Precondition Failed", "PreconditionFailed",
                                  "At least one of the pre-conditions you specified did not hold",
                                  Condition="If-Match")
        return None

    def _note_completion(self, environ: dict[str, Any], status: str, body: bytes) -> None:
        if self.s3 and status.startswith("200") and is_multipart_completion(environ):
            m = re.search(rb"<ETag>(.*?)</ETag>", body)
            if m:
                etag = html.unescape(m.group(1).decode()).strip('"')
                with self._lock:
                    self._completed[query(environ)["uploadId"]] = etag

    # -- WSGI ----------------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not self._logs:
            return self._serve(environ, start_response)
        start = time.monotonic()
        kind, key, qs = request_kind(environ), object_key(environ), environ.get("QUERY_STRING", "")
        status = ["dropped"]

        def start_logged(st: str, headers: list[tuple[str, str]], *args: Any) -> Any:
            status[0] = st
            return start_response(st, headers, *args)

        try:
            return self._serve(environ, start_logged)
        finally:
            entry = LoggedRequest(environ.get("REQUEST_METHOD", "GET"), kind, key, qs, start,
                                  time.monotonic(), status[0])
            with self._lock:
                logs = list(self._logs)
            for log in logs:
                log.add(entry)

    def _serve(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        plan = self.plan
        key = object_key(environ) if self.s3 and is_conditional_write(environ) else None
        overlapped = False
        deletes = 0
        if key is not None:
            with self._lock:
                overlapped = plan.conflict_on_overlap and self._in_progress[key] > 0
                self._in_progress[key] += 1
                deletes = self._deletes[key]
        try:
            return self._handle(plan, environ, start_response, key, overlapped, deletes)
        finally:
            if key is not None:
                with self._lock:
                    self._in_progress[key] -= 1
                    if not self._in_progress[key]:
                        del self._in_progress[key]

    def _handle(self, plan: FaultPlan, environ: dict[str, Any], start_response: Callable[..., Any],
                key: str | None, overlapped: bool, deletes: int) -> Iterable[bytes]:
        if plan.deny is not None and plan.deny(environ):
            _consume(environ)
            with self._lock:
                self.counts["denied"] += 1
            status, headers, body = self._denied(environ)
            start_response(status, headers)
            return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]
        for pred, seconds in plan.stalls:
            if pred(environ):
                with self._lock:
                    self.counts["stall"] += 1
                time.sleep(seconds)
        if plan.latency:
            time.sleep(plan.latency)
        if key is not None and plan.conflict_on_overlap:
            with self._lock:  # a delete of the key succeeded while this write was in progress
                overlapped = overlapped or self._deletes[key] != deletes
        if key is not None and self._should_conflict(environ, overlapped):
            _consume(environ)
            status, headers, body = self._conflict_answer(environ)
            start_response(status, headers)
            return [body]
        fault = self._draw(environ)
        if fault == "error":
            return self._error_answer(environ, start_response)
        if fault == "reset":
            _consume(environ)  # read (and ignore) the body so the socket holds no stray bytes
            self._drop(environ)
        result = self._forward(environ)
        if self.s3 and environ.get("REQUEST_METHOD") == "DELETE" and result[0].startswith("204"):
            deleted = object_key(environ)
            if deleted is not None and "uploadId" not in query(environ):
                with self._lock:
                    self._deletes[deleted] += 1
        if fault == "lost_reply":
            self._drop(environ)
        status, headers, body = result
        start_response(status, headers)
        return [body]

    def _error_answer(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """An injected error answer (one of :attr:`_ERRORS`), the request not forwarded."""
        status, xml, js = self._ERRORS[self._rng.randrange(len(self._ERRORS))]
        body = js.encode() if self.json_errors else xml
        if environ.get("REQUEST_METHOD") == "HEAD":
            body = b""
        _consume(environ)
        ctype = "application/json" if self.json_errors else "application/xml"
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    def _forward(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        """The app's answer to the request; a conditional one is decided here first when
        the app does not enforce preconditions itself."""
        if is_conditional(environ) and not self.real_server:
            with self._conditional:
                refused = self._complete_precondition(environ)
                if refused is not None:
                    _consume(environ)
                    return refused
                result = _run(self.app, environ)
                self._note_completion(environ, result[0], result[2])
                return result
        return _run(self.app, environ)


def _consume(environ: dict[str, Any]) -> None:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length:
        environ["wsgi.input"].read(length)


def _run(app: Callable[..., Iterable[bytes]], environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    """Run ``app`` to completion and capture its answer."""
    captured: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
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
