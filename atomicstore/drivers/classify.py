"""What a backend error means: the HTTP status or service error code it carries (from
botocore, gcsfs or aiohttp, anywhere in its chain of causes), and whether it is worth
retrying. Drivers translate errors with it (:meth:`.spec.Driver.wrap_error`), and the
commit layer's conformance checks read a status with it."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping


def _walk_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


# Fallback when an error carries no HTTP status: names of throttling and server faults.
_TRANSIENT_TEXT = re.compile(
    r"SlowDown|Throttl|TooManyRequests|RequestTimeout|InternalError|ServiceUnavailable|"
    r"Connection reset|Server disconnected|ConnectionReset|reduce your request rate",
    re.IGNORECASE,
)


def error_code_of(exc: BaseException) -> str | None:
    """The service's error code (``"SlowDown"``, ``"ConditionalRequestConflict"``...)
    carried by a botocore error in ``exc``'s chain, if any."""
    for e in _walk_chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, Mapping):
            code = resp.get("Error", {}).get("Code")
            if code:
                return str(code)
    return None


def http_status_of(exc: BaseException) -> int | None:
    """The HTTP status carried by a botocore/gcsfs/aiohttp error, if any."""
    for e in _walk_chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, Mapping):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return int(status)
        for attr in ("code", "status"):
            val = getattr(e, attr, None)
            if isinstance(val, int) and 100 <= val < 600:
                return val
    return None


def is_transient_error(exc: BaseException, transient_types: tuple[type[BaseException], ...]) -> bool:
    """True if ``exc`` is worth retrying: HTTP 429 or 5xx, else an error of one of
    ``transient_types`` in its chain, else a throttling or server fault named in its text.
    Timeouts are final by design, and 404/412/403 are answers, not faults."""
    if isinstance(exc, TimeoutError | FileNotFoundError | FileExistsError | PermissionError):
        return False
    status = http_status_of(exc)
    if status is not None:
        return status == 429 or status >= 500
    for e in _walk_chain(exc):
        if isinstance(e, transient_types):
            return True
    return bool(_TRANSIENT_TEXT.search(str(exc)))
