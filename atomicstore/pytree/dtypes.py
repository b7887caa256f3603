"""The one parser of dtype strings read from storage (hostile input).

Indexes, legacy flax files and multi-process array indexes name each array's dtype as
a string. :func:`parse_dtype` accepts only plain numeric and bool dtypes (numpy's and
ml_dtypes'), datetime/timedelta with a unit (the library writes and restores them), and
an optional byte-order character; anything else (subarray, structured, object, string,
void, Python expressions, non-text) is a :class:`~atomicstore.CorruptionError` naming the
file and the leaf. ``np.dtype`` is never handed a string that has not passed the grammar
below, so none of its parse errors (``SyntaxError`` included) can escape.
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import CorruptionError
from .tree import Path, path_str

#: byte order, a name or type code, a datetime unit: ``float32``, ``<f4``, ``datetime64[s]``
#: (never ``a…``: numpy's deprecated bytes alias, which would only warn before being refused)
_GRAMMAR = re.compile(r"[<>=|]?(?!a)[A-Za-z][A-Za-z0-9_]{0,39}(\[[0-9]{0,9}[A-Za-z]{1,2}\])?")
_KINDS = frozenset("biufcmM")  # bool, ints, floats, complex, timedelta, datetime
_CACHE: dict[str | bytes, np.dtype] = {}


def is_float(dt: np.dtype) -> bool:
    """A floating-point dtype: numpy's, or one of ml_dtypes' (bfloat16, float8_*...),
    which numpy does not count as ``np.floating`` (what ``cast_dtype`` applies to)."""
    return bool(np.issubdtype(dt, np.floating)) or (dt.type.__module__ == "ml_dtypes" and "float" in dt.name)


def is_storable(dt: np.dtype) -> bool:
    """A dtype :func:`parse_dtype` reads back: plain numeric, bool, datetime, timedelta or
    ml_dtypes (not str, bytes, void, object, structured or sub-array dtypes)."""
    plain = dt.kind in _KINDS or dt.type.__module__ == "ml_dtypes"
    return plain and not dt.hasobject and dt.fields is None and dt.subdtype is None


def parse_dtype(text: object, *, path: str, leaf: str | Path, where: str | None = None) -> np.dtype:
    """The dtype named by ``text`` read from storage.

    Args:
        text: the stored dtype name (``str``, or ASCII ``bytes``).
        path: the file it was read from (``CorruptionError.path``).
        leaf: the leaf it describes, a key-path string or tuple (``CorruptionError.leaf``).
        where: how messages name the file (default ``path``).

    Raises :class:`~atomicstore.CorruptionError` for anything but a plain numeric, bool,
    datetime or timedelta dtype that numpy (with ml_dtypes) knows.
    """
    if isinstance(text, str | bytes):
        hit = _CACHE.get(text)
        if hit is not None:
            return hit
    dt = _parse(text, path, leaf, where)
    if len(_CACHE) < 1024:
        _CACHE[text] = dt  # type: ignore[index]
    return dt


def _parse(text: object, path: str, leaf: str | Path, where: str | None) -> np.dtype:
    leaf = leaf if isinstance(leaf, str) else path_str(leaf)

    def bad(why: str) -> CorruptionError:
        return CorruptionError(f"{where or path} leaf {leaf}: {why}", path=path, leaf=leaf)

    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            raise bad(f"dtype {text[:40]!r} is not ASCII text") from None
    if not isinstance(text, str):
        raise bad(f"dtype is not a name ({type(text).__name__})")
    if not _GRAMMAR.fullmatch(text):
        raise bad(f"dtype {text[:80]!r} is not a plain array dtype")
    try:
        import ml_dtypes  # noqa: F401 - registers bfloat16, float8_*, int4... (imported lazily)
    except ImportError:  # pragma: no cover - numpy-only installs
        pass
    try:
        dt = np.dtype(text)
    except (TypeError, ValueError, SyntaxError, Warning):  # Warning: under -W error
        raise bad(f"unknown dtype {text!r}") from None
    if not is_storable(dt):
        raise bad(f"dtype {text!r} is not a plain array dtype")
    return dt
