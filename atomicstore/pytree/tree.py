"""Walking pytrees the way flax's state dicts see them, without importing flax.

dict, list, tuple, namedtuple and None are handled here (so that empty containers and
None survive); any other registered pytree node (dataclasses, flax struct dataclasses,
FrozenDict...) is opened one level at a time with ``jax.tree_util`` key paths.
"""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

Key = str | int | bytes
Path = tuple[Key, ...]

CONTAINER_TYPES = ("dict", "list", "tuple", "none")


def _jax() -> Any:
    try:
        import jax
    except ImportError:  # pragma: no cover - numpy-only installs
        return None
    return jax


_MAY_ALIAS: bool | None = None  # does this jax's device_put take may_alias? (asked once)


def device_put_owned(x: np.ndarray, dest: Any) -> Any:
    """``jax.device_put(x, dest)`` of a buffer nobody else holds: the device may use it as
    is (``may_alias=True``) on a jax that has the option; older jax (0.4.30 has no
    ``may_alias``) decides by itself whether to copy."""
    global _MAY_ALIAS
    import jax

    if _MAY_ALIAS is None:
        try:
            _MAY_ALIAS = "may_alias" in inspect.signature(jax.device_put).parameters
        except (TypeError, ValueError):  # pragma: no cover - a signature jax does not expose
            _MAY_ALIAS = False
    if _MAY_ALIAS:
        return jax.device_put(x, dest, may_alias=True)
    return jax.device_put(x, dest)


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def is_jax_array(x: Any) -> bool:
    jax = _jax() if type(x).__module__.startswith(("jax", "jaxlib")) else None
    return jax is not None and isinstance(x, jax.Array)


def is_leaf_value(x: Any) -> bool:
    return isinstance(x, np.ndarray | np.generic | bool | int | float | complex | str | bytes) or is_jax_array(x)


def _key_of(k: Any) -> Key:
    """A jax key-path entry as a plain key (as flax's state dict names it)."""
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            v = getattr(k, attr)
            return v if isinstance(v, str | int | bytes) else str(v)
    return str(k)


def children(node: Any, sort_keys: bool = True) -> tuple[str, list[tuple[Key, Any]]] | None:
    """(container kind, [(key, child)]) of a container, or None for a leaf.

    ``sort_keys``: plain dicts in key order, as jax flattens them (and so as flax's
    ``msgpack_serialize`` writes them); otherwise in insertion order, as flax's
    ``to_bytes`` and ``save_checkpoint`` write them."""
    if node is None:
        return "none", []
    if type(node) is dict:
        items = list(node.items())
        if sort_keys:
            try:
                items.sort(key=lambda kv: kv[0])
            except TypeError:
                pass
        return "dict", items
    if isinstance(node, OrderedDict):
        return "dict", list(node.items())
    if is_namedtuple(node):
        return "dict", [(f, getattr(node, f)) for f in node._fields]
    if type(node) is list:
        return "list", list(enumerate(node))
    if type(node) is tuple:
        return "tuple", list(enumerate(node))
    if is_leaf_value(node):
        return None
    return _registered_children(node)


def _registered_children(node: Any) -> tuple[str, list[tuple[Key, Any]]] | None:
    """:func:`children` of a node of no built-in container type: a node registered with
    ``jax.tree_util`` (its children keyed as jax names them), or any other mapping."""
    jax = _jax()
    if jax is not None:
        flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if not (len(flat) == 1 and flat[0][1] is node):
            return "dict", [(_key_of(path[-1]) if path else i, child) for i, (path, child) in enumerate(flat)]
    if isinstance(node, Mapping):
        return "dict", list(node.items())
    return None


def rebuild(node: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """A copy of ``node`` with each leaf replaced by ``fn(path, leaf)``, keeping every
    container's type (custom pytree nodes through ``jax.tree_util``)."""
    if node is None:
        return None
    if type(node) is dict or isinstance(node, OrderedDict):
        return type(node)((k, rebuild(v, fn, (*path, k))) for k, v in node.items())
    if is_namedtuple(node):
        return type(node)(*(rebuild(getattr(node, f), fn, (*path, f)) for f in node._fields))
    if type(node) is list:
        return [rebuild(v, fn, (*path, i)) for i, v in enumerate(node)]
    if type(node) is tuple:
        return tuple(rebuild(v, fn, (*path, i)) for i, v in enumerate(node))
    kids = children(node)
    if kids is None:
        return fn(path, node)
    jax = _jax()
    if jax is not None and not isinstance(node, Mapping):
        flat, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        new = [rebuild(child, fn, (*path, _key_of(p[-1]) if p else i)) for i, (p, child) in enumerate(flat)]
        return jax.tree_util.tree_unflatten(treedef, new)
    return type(node)((k, rebuild(v, fn, (*path, k))) for k, v in node.items())


def walk_leaves(node: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, leaf) of every leaf, in the order they are written."""
    kids = children(node)
    if kids is None:
        yield path, node
        return
    for k, child in kids[1]:
        yield from walk_leaves(child, (*path, k))


def path_str(path: Path) -> str:
    """A readable form of a key path (for messages and string selectors)."""
    return "/".join(k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k) for k in path) or "<root>"


def per_leaf_fn(fns: Any, what: str) -> Callable[[Path, Any], Any] | None:
    """A per-leaf function from a callable(path, leaf) or a mapping path-string -> fn."""
    if fns is None:
        return None
    if callable(fns):
        fn: Callable[[Path, Any], Any] = fns
        return fn
    if isinstance(fns, Mapping):
        table = dict(fns)

        def apply(path: Path, leaf: Any) -> Any:
            fn = table.get(path_str(path), table.get(path))
            return fn(leaf) if fn is not None else leaf

        return apply
    raise InvalidArgumentError(f"{what} must be a callable(path, leaf) or a mapping of key path to callable")


def snapshot_tree(tree: Any, copy_numpy: bool) -> Any:
    """A copy of ``tree`` that later mutation of the caller's arrays cannot change: jax
    arrays are copied to host (all transfers started first), numpy arrays copied unless
    the caller promised not to mutate them."""
    def start(path: Any, leaf: Any) -> Any:
        if is_jax_array(leaf) and getattr(leaf, "is_fully_addressable", True):
            leaf.copy_to_host_async()
        return leaf

    rebuild(tree, start)

    def take(path: Any, leaf: Any) -> Any:
        if is_jax_array(leaf) and getattr(leaf, "is_fully_addressable", True):
            return np.asarray(leaf)
        if isinstance(leaf, np.ndarray):
            return leaf.copy() if copy_numpy else leaf
        return copy.deepcopy(leaf) if isinstance(leaf, dict | list) else leaf

    return rebuild(tree, take)
