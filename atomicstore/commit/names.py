"""Validation of checkpoint names and of file paths inside a checkpoint.

Names and paths come from callers (and, when reading, from storage): they are checked
before anything is written or read, so that none can escape the store's root.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import InvalidArgumentError

#: A directory at the store root reserved for staging and trash (rename strategy).
RESERVED_DIR = ".atomicstore"
#: Names that cannot be used for a file at the top of a checkpoint.
MANIFEST_FILE = "manifest.json"
MARKER_FILE = "commit_success.txt"
RESERVED_FILES = frozenset({MANIFEST_FILE, MARKER_FILE})
#: The directory of one save attempt inside a checkpoint (marker strategy): ``attempt-<id>``.
ATTEMPT_PREFIX = "attempt-"
#: an attempt id as :func:`~atomicstore.commit.strategies.new_attempt_id` makes it
ATTEMPT_ID = re.compile(r"\d{8}T\d{6}-[0-9a-f]{12}")

_NAME = re.compile(r"[A-Za-z0-9_+=-][A-Za-z0-9_.+=-]{0,199}")
_COMPONENT_BAD = re.compile(r"[\x00-\x1f\x7f\\]")


def validate_name(name: object) -> str:
    """Check a checkpoint name: 1-200 characters of ``[A-Za-z0-9_.+=-]``, not starting
    with ``.``, without ``..``. Return it unchanged."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"checkpoint name must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidArgumentError("checkpoint name must not be empty")
    if ".." in name or "/" in name or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"invalid checkpoint name {name!r}: use 1-200 characters of letters, digits and "
            "'_.+=-', not starting with '.', without '/' or '..'"
        )
    return name


def validate_path(path: object, *, what: str = "file path", allow_reserved: bool = False) -> str:
    """Check a relative ``/``-separated path inside a checkpoint (or the store root).

    Rejects empty paths and components, absolute paths, ``.``/``..``, backslashes,
    control characters and NUL, so a path can never escape its directory.
    """
    if not isinstance(path, str):
        raise InvalidArgumentError(f"{what} must be a str, not {type(path).__name__}")
    if not path or len(path) > 1024:
        raise InvalidArgumentError(f"{what} must be 1-1024 characters, got {len(path)}")
    if path.startswith("/"):
        raise InvalidArgumentError(f"{what} {path!r} must be relative")
    for part in path.split("/"):
        if part in ("", ".", "..") or _COMPONENT_BAD.search(part) or len(part) > 255:
            raise InvalidArgumentError(
                f"{what} {path!r} has an invalid component {part!r}: it could escape its "
                "directory or is not portable"
            )
    if not allow_reserved and (path in RESERVED_FILES or path.split("/")[0] == RESERVED_DIR):
        raise InvalidArgumentError(f"{what} {path!r} is reserved by atomicstore")
    return path


def reserved_component(path: str) -> str | None:
    """The first component of the ``/``-separated ``path`` that atomicstore's layout
    reserves (its ``.atomicstore`` directory, a commit marker, a manifest, a save's
    ``attempt-*`` directory), or None. Writing such a component would forge or damage a
    checkpoint (e.g. ``x/commit_success.txt`` makes ``x`` look committed)."""
    for part in path.split("/"):
        if part == RESERVED_DIR or part in RESERVED_FILES or part.startswith(ATTEMPT_PREFIX):
            return part
    return None


def validate_writable(path: object, *, what: str = "path") -> str:
    """:func:`validate_path` for a name or path a public store method writes or deletes at
    the store root, also refusing every component :func:`reserved_component` names.
    (Whether its first component is a committed checkpoint is the store's to check.)"""
    validate_path(path, what=what, allow_reserved=True)
    assert isinstance(path, str)
    part = reserved_component(path)
    if part is not None:
        raise InvalidArgumentError(
            f"{what} {path!r} is reserved by atomicstore ({part!r} belongs to its checkpoint layout: "
            "a commit marker, a manifest, a save attempt or its .atomicstore directory)"
        )
    return path


#: a signed decimal or float embedded in a name (flax's ``SIGNED_FLOAT_RE``)
FLOAT_RE = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)")


def natural_key(name: str) -> tuple[tuple[int, float | str], ...]:
    """Sort key that orders embedded numbers by value (``1e1`` after ``9``, ``-0.2``
    before ``0.1``), as flax's ``natural_sort`` does."""
    parts = FLOAT_RE.split(name)
    key: list[tuple[int, float | str]] = []
    for i, p in enumerate(parts):
        if i % 2:
            key.append((0, float(p)))
        elif p:
            key.append((1, p))
    key.append((2, name))  # equal values ("10", "1e1") still sort deterministically
    return tuple(key)


def natural_sort(names: list[str]) -> list[str]:
    """``names`` sorted by :func:`natural_key`."""
    return sorted(names, key=natural_key)


def path_argument(value: Any, what: str = "path") -> str:
    """A path or URL argument as a non-empty ``str`` (``os.PathLike`` accepted); raise
    :class:`~atomicstore.InvalidArgumentError` naming ``what`` otherwise."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"{what} must be a non-empty str or path, got {value!r}")
    return value
