"""Driver layer: find the driver for a URL and build it.

Built-in drivers are named here by import path (so s3fs and gcsfs are imported only when
used). Third-party drivers register through the entry-point group
``atomicstore.drivers`` (each entry point names a :class:`Driver` subclass whose
``protocols`` it serves; consulted for protocols that have no built-in driver) or at run
time with :func:`register_driver` (which may also replace a built-in driver).
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from importlib.metadata import entry_points
from typing import Any

from ..errors import InvalidArgumentError, UnknownProtocolError
from ..retry import RetryPolicy
from .spec import (
    DEFAULT_OPERATION_TIMEOUT,
    Capabilities,
    Driver,
    Entry,
    FileInfo,
    Writer,
    refusals_are_final,
    refusals_final,
)

ENTRY_POINT_GROUP = "atomicstore.drivers"

_BUILTIN: dict[str, str] = {
    "file": "atomicstore.drivers.local:LocalDriver",
    "local": "atomicstore.drivers.local:LocalDriver",
    "memory": "atomicstore.drivers.memory:MemoryDriver",
    "s3": "atomicstore.drivers.s3:S3Driver",
    "s3a": "atomicstore.drivers.s3:S3Driver",
    "gs": "atomicstore.drivers.gcs:GCSDriver",
    "gcs": "atomicstore.drivers.gcs:GCSDriver",
}
_REGISTERED: dict[str, type[Driver]] = {}
_lock = threading.Lock()
_entry_points_loaded = False

#: storage option names whose values are secrets, never to be shown
_SECRET_KEY = re.compile(r"key|secret|token|password|passwd|credential|session|auth", re.I)


def register_driver(cls: type[Driver], protocols: tuple[str, ...] | None = None) -> type[Driver]:
    """Register ``cls`` for ``protocols`` (default ``cls.protocols``); usable as a
    decorator. A driver registered this way takes precedence over a built-in one."""
    if not (isinstance(cls, type) and issubclass(cls, Driver)):
        raise InvalidArgumentError(f"{cls!r} is not a Driver subclass")
    protos = protocols or cls.protocols
    if not protos:
        raise InvalidArgumentError(f"{cls.__name__} declares no protocols")
    with _lock:
        for p in protos:
            _REGISTERED[p] = cls
    return cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        register_driver(cls, cls.protocols or (ep.name,))


def driver_class(protocol: str) -> type[Driver]:
    """The driver class serving ``protocol``.

    Entry points are scanned (once per process) only for protocols that are neither
    registered nor built in: scanning every installed distribution costs tens of
    milliseconds. To replace a built-in driver, call :func:`register_driver`.
    """
    if protocol not in _REGISTERED and protocol not in _BUILTIN:
        _load_entry_points()
    with _lock:
        if protocol in _REGISTERED:
            return _REGISTERED[protocol]
    if protocol in _BUILTIN:
        mod, _, name = _BUILTIN[protocol].partition(":")
        try:
            cls: type[Driver] = getattr(importlib.import_module(mod), name)
            return cls
        except ImportError as exc:
            extra = "s3" if protocol.startswith("s3") else "gcs"
            raise InvalidArgumentError(
                f"the {protocol}:// driver needs an optional dependency: "
                f"pip install 'atomicstore[{extra}]' ({exc})"
            ) from None
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise UnknownProtocolError(
            f"unknown protocol {protocol!r}: no atomicstore driver and no fsspec filesystem "
            f"serves it (atomicstore drivers: {', '.join(sorted(set(_BUILTIN) | set(_REGISTERED)))})"
        ) from None
    except ImportError as exc:
        raise InvalidArgumentError(f"the fsspec filesystem for {protocol!r} is not installed: {exc}") from None
    from .generic import GenericDriver

    return GenericDriver


def split_url(url_or_path: str | os.PathLike[str]) -> tuple[str, str]:
    """(protocol, path without protocol); plain paths are ``file``."""
    if isinstance(url_or_path, os.PathLike):
        url_or_path = os.fspath(url_or_path)
    if not isinstance(url_or_path, str):
        raise InvalidArgumentError(f"expected a path or URL, got {type(url_or_path).__name__}")
    url = url_or_path.strip()
    if not url:
        raise InvalidArgumentError("the store path or URL must not be empty")
    if "\x00" in url:
        raise InvalidArgumentError("the store path or URL contains a NUL byte")
    if "::" in url:
        raise InvalidArgumentError("chained fsspec URLs ('a::b') are not supported")
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", url)
    if not m:
        return "file", url
    return m.group(1).lower(), m.group(2)


def secrets_of(storage_options: dict[str, Any]) -> tuple[str, ...]:
    """Values of options that look like credentials (for redaction)."""
    out: list[str] = []

    def walk(d: Any, sensitive: bool) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                walk(v, sensitive or bool(_SECRET_KEY.search(str(k))))
        elif isinstance(d, str) and sensitive and len(d) >= 4:
            out.append(d)

    walk(storage_options, False)
    return tuple(out)


def get_driver(
    url_or_path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    operation_timeout: float | None = None,
    block_size: int | None = None,
    max_inflight_bytes: int | None = None,
) -> Driver:
    """Build the driver for ``url_or_path``; ``storage_options`` go to fsspec unchanged."""
    protocol, path = split_url(url_or_path)
    cls = driver_class(protocol)
    opts = dict(storage_options or {})
    return cls.from_url(
        protocol,
        path,
        opts,
        retry=retry,
        operation_timeout=DEFAULT_OPERATION_TIMEOUT if operation_timeout is None else operation_timeout,
        block_size=block_size or cls.default_block_size,
        secrets=secrets_of(opts),
        max_inflight_bytes=max_inflight_bytes,
    )


__all__ = [
    "Capabilities",
    "Driver",
    "ENTRY_POINT_GROUP",
    "Entry",
    "FileInfo",
    "Writer",
    "driver_class",
    "get_driver",
    "refusals_are_final",
    "refusals_final",
    "register_driver",
    "split_url",
]
