"""Where a path or URL points: the store that holds it and the checkpoint's name in it.

Every entry point that takes a URL (``atomicstore.save``/``restore``, the flax and
fjformer compat modules, the torch and Orbax integrations, the CLI) turns it into a
:class:`~atomicstore.Store` here, through one process-wide cache: a store opened once is
reused (an object-store client costs a connection to make; a store's ``writer_id`` stays
the same for the process). The cache key is the driver class, the protocol, the root and
every option, so two option sets (two endpoints, two credentials, two clocks) or two
protocols never share a store. A forked child starts with an empty cache: it opens its own
stores on first use.

Names used here:

* a *root* is a store's root: a local directory or ``<protocol>://<bucket>[/<prefix>]``;
* a *location* is ``<root>/<name>``: one checkpoint (or one checkpoint file) in a store.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from ..drivers import driver_class, split_url
from ..drivers.spec import Driver
from ..errors import AtomicStoreError, InvalidArgumentError
from .store import Store, open_store


# -- splitting a location ---------------------------------------------------------------------
def is_local(url_or_path: str) -> bool:
    """Whether ``url_or_path`` is a local path (a plain path or a ``file://`` URL)."""
    return "://" not in url_or_path or url_or_path.startswith("file://")


def split_location(url_or_path: str | os.PathLike[str], *, absolute: bool = False) -> tuple[str, str]:
    """(store root, checkpoint name) of ``<root>/<name>``. With ``absolute``, a plain local
    path is made absolute first (a bare name is then one in the current directory).
    :class:`~atomicstore.InvalidArgumentError` if it names no checkpoint inside a store (a
    bucket, a bare name, an empty string)."""
    s = os.fspath(url_or_path) if isinstance(url_or_path, os.PathLike) else url_or_path
    if not isinstance(s, str) or not s.strip():
        raise InvalidArgumentError("expected a checkpoint path or URL '<store>/<name>'")
    if absolute and "://" not in s:
        s = os.path.abspath(s)
    s = s.rstrip("/")
    root, _, name = s.rpartition("/")
    if not root or not name or root.endswith(":/"):
        raise InvalidArgumentError(f"{s!r} does not name a checkpoint inside a store ('<store>/<name>')")
    return root, name


def names_checkpoint(url_or_path: object, *, absolute: bool = False) -> bool:
    """Whether :func:`split_location` accepts ``url_or_path``."""
    try:
        split_location(url_or_path, absolute=absolute)  # type: ignore[arg-type]
    except InvalidArgumentError:
        return False
    return True


def same_root(driver: Driver, root: str) -> bool:
    """Does ``root`` (a path or URL) name the root of the store ``driver`` serves?"""
    if root.rstrip("/") == driver.url.rstrip("/"):
        return True
    try:
        protocol, path = split_url(root)
        mine, _ = split_url(driver.url)
    except InvalidArgumentError:
        return False
    if protocol != mine and not {protocol, mine} <= set(type(driver).protocols):
        return False
    if mine == "file":  # the local driver's root is an absolute path
        p = os.path.abspath(os.path.expanduser(path))
        return p == driver.root or os.path.realpath(p) == os.path.realpath(driver.root)
    try:  # as the driver normalised its own root (see Driver.from_url)
        return bool(driver.fs._strip_protocol(f"{protocol}://{path}").rstrip("/") == driver.root)
    except Exception:  # noqa: BLE001 - a driver without an fsspec filesystem: not the same spelling
        return False


def checkpoint_name(url_or_path: str | os.PathLike[str], store: Store) -> str:
    """The name in ``store`` of the checkpoint ``url_or_path`` names: a bare name, or
    ``<store root>/<name>`` with the store's root in any spelling (a relative or symlinked
    local path, ``file://``); anything else is :class:`~atomicstore.InvalidArgumentError`,
    never a checkpoint of the store that happens to have the same name."""
    s = os.fspath(url_or_path) if isinstance(url_or_path, os.PathLike) else url_or_path
    if isinstance(s, str) and s.strip() and "/" not in s.rstrip("/"):
        return s.rstrip("/")  # a bare name (checked by the store like any name)
    root, name = split_location(s)
    if not same_root(store.driver, root):
        raise InvalidArgumentError(
            f"{s!r} is not in the store {store.url} passed as store= (it names a checkpoint under {root}): "
            "pass the checkpoint's name, a URL under the store's root, or no store")
    return name


# -- the store cache --------------------------------------------------------------------------
#: (key, the options it was made from: kept alive so an ``id`` in the key is never reused)
_STORES: dict[tuple[Any, ...], tuple[Store, dict[str, Any]]] = {}
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child starts with a fresh lock (another thread of the parent may have held
    it at the fork) and no stores: it opens its own on first use."""
    global _LOCK
    _LOCK = threading.Lock()
    _STORES.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _frozen(value: Any) -> Any:
    """``value`` as a hashable key: mappings and sequences by content, hashable values by
    type and value, anything else (a callable, a client object) by identity."""
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return (type(value), value)


def _key(root: str, options: dict[str, Any]) -> tuple[Any, ...]:
    """Which store ``root`` with ``options`` is: driver class, protocol, root (a local
    one made absolute, so a later change of directory is another store), options."""
    protocol, path = split_url(root)
    cls = driver_class(protocol)
    path = os.path.abspath(os.path.expanduser(path)) if protocol == "file" else path.rstrip("/")
    return (cls, protocol, path, _frozen(options))


def store_at(root: str | os.PathLike[str], **options: Any) -> Store:
    """The store rooted at ``root`` opened with ``options`` (:func:`~atomicstore.open_store`'s
    keywords and fsspec storage options), from the process-wide cache: opened on first use,
    then the same object for the same root and options. Thread-safe."""
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    try:
        key = _key(root, options)
    except AtomicStoreError:
        return open_store(root, **options)  # (it reports the root's fault as open_store does)
    with _LOCK:
        found = _STORES.get(key)
        if found is None:
            found = _STORES[key] = (open_store(root, **options), dict(options))
        return found[0]


def locate(url_or_path: str | os.PathLike[str], *, store: Store | None = None, absolute: bool = False,
           **options: Any) -> tuple[Store, str]:
    """(store, checkpoint name) of the location ``<root>/<name>``: the root's store from
    :func:`store_at` with ``options``; with ``store``, that store and the name
    :func:`checkpoint_name` finds in it (``options`` are then not used: the store is
    open already). ``absolute`` as for :func:`split_location`."""
    if store is not None:
        return store, checkpoint_name(url_or_path, store)
    root, name = split_location(url_or_path, absolute=absolute)
    return store_at(root, **options), name


def forget_stores(root: str | os.PathLike[str] | None = None) -> None:
    """Drop the cached stores rooted at ``root`` (whatever their options), or every cached
    store; the stores stay usable by whoever holds them, a later lookup opens anew."""
    if root is None:
        with _LOCK:
            _STORES.clear()
        return
    where = _key(os.fspath(root), {})[:3]
    with _LOCK:
        for key in [k for k in _STORES if k[:3] == where]:
            del _STORES[key]


__all__ = ["checkpoint_name", "forget_stores", "is_local", "locate", "names_checkpoint", "same_root",
           "split_location", "store_at"]
