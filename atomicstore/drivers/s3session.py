"""The botocore session the S3 driver makes (never one the caller passed in): its clients
parse timestamps without dateutil's generic parser, and the sessions configured alike share
one data loader, so S3's service model is parsed once per process, not once per store."""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime
from typing import Any

import aiobotocore.session
import botocore.loaders
import botocore.utils


@functools.cache
def _shared_loader() -> Any:
    """botocore's data loader for the sessions the driver makes with botocore's own data
    path and handlers. It keeps what it parsed, S3's service model above all (~1 MB of
    JSON), which each new session parsed again: a store opened per save, per CLI
    command, per test. Those sessions are configured alike, so sharing it is what one
    session does for all its clients (botocore's handlers edit the loaded model in place,
    the same way in each). A session with a data path of its own (``AWS_DATA_PATH``, which
    may be relative or name a variable) or other session options keeps its own loader."""
    return botocore.loaders.create_loader()


#: session options that leave the data path and handlers alone
_SHAREABLE = frozenset({"profile"})


def new_session(kwargs: dict[str, Any]) -> aiobotocore.session.AioSession:
    """The session s3fs would make, whose clients parse timestamps without dateutil and,
    where configured alike, share one data loader."""
    session = aiobotocore.session.AioSession(**kwargs)
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
    if set(kwargs) <= _SHAREABLE and session.get_config_variable("data_path") is None:
        session.register_component("data_loader", _shared_loader())
    return session


#: the two forms S3 sends: an IMF-fixdate (RFC 9110; headers: ``Last-Modified``) and ISO
#: 8601 with a zone (XML: a listing's ``LastModified``)
_HTTP_DATE = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d\d) (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
                        r"([1-9]\d{3}) (\d\d):(\d\d):(\d\d) GMT", re.ASCII)  # (ASCII: no other script's digits)
_ISO_DATE = re.compile(r"[1-9]\d{3}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?(?:Z|[+-]\d\d:\d\d)", re.ASCII)
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
                                      "Dec"), 1)}


def parse_timestamp(value: Any) -> datetime:
    """botocore's timestamp parser, faster for the two forms S3 sends: an IMF-fixdate
    (``Fri, 27 Nov 2026 12:43:17 GMT``) and ISO 8601 with seconds and a zone
    (``2026-11-27T12:43:17.000Z``, ``...+01:00``), years 1000 to 9999, read exactly,
    without dateutil's generic parser (a fifth of a ranged GET's client CPU here).
    Anything else, however close (another zone name or offset, two-digit years or four
    digits starting with 0, which dateutil reads as two, lower case), goes to botocore's
    own ``parse_timestamp``: the same instant, or the same error, as before. Recovery
    judges ages by these times, so a form read differently could make it remove
    something young."""
    if isinstance(value, str):
        try:
            m = _HTTP_DATE.fullmatch(value)
            if m is not None:
                day, month, year, hour, minute, second = m.groups()
                return datetime(int(year), _MONTHS[month], int(day), int(hour), int(minute), int(second),
                                tzinfo=UTC)
            if _ISO_DATE.fullmatch(value):
                return datetime.fromisoformat(value)
        except ValueError:  # (a day or an hour out of range: botocore says so)
            pass
    return botocore.utils.parse_timestamp(value)  # type: ignore[no-any-return]
