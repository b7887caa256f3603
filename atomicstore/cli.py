"""The ``atomicstore`` command: look after checkpoints, and the demo.

    atomicstore ls URL [--all]          committed checkpoints (and, with --all, the rest)
    atomicstore ls URL --local-dir DIR  each step's tiers: URL persistent, DIR the local tier
    atomicstore verify URL[/NAME]       re-check every checksum (exit 0 only if all verify)
    atomicstore recover URL [--dry-run] remove what crashes left behind
    atomicstore inspect URL/NAME        the tree: key paths, dtypes, shapes, sizes, metadata
    atomicstore cp SRC DST              copy a checkpoint between stores, atomically, verified
    atomicstore rm URL/NAME             delete (commit point first)
    atomicstore doctor URL              the conformance check: what the store enforces
    atomicstore demo [--store s3]       train, get killed mid-save, recover, resume
    atomicstore demo --tiers            the same with a local tier: killed mid-upload, the
                                        machine lost, resumed from the persistent copy

Every command takes ``--json`` (machine-readable output on stdout) and
``-o KEY=VALUE`` storage options (VALUE parsed as JSON when it can be). Exit status: 0
success, 1 verification failed or data corrupt, 2 bad arguments or URL, 3 not found,
4 storage error, 5 the destination exists, 6 another writer replaced or deleted the
checkpoint while the command was working on it (nothing was changed: run it again), 7 the
store does not enforce a guarantee atomicstore relies on to commit (``doctor``, or a
command that writes to such a store). A user error prints one line, never a traceback.

``ls URL --local-dir DIR`` (with ``--all``, what crashes left in either tier) lists the steps of a tiered ``CheckpointManager(URL,
local_dir=DIR)`` (one process's local tier: ``DIR/process-<i>`` in a multi-host job), each
with its ``tiers``: ``local`` (committed in DIR only), ``persisted`` (committed in URL
only), ``local+persisted`` (both), or ``persisting``: committed in DIR only, due to be
persisted (``tier.due`` in its manifest) and newer than the newest step in URL, so an
upload of it is queued or running in the job, or, if the job died, the next manager opened
on DIR resumes it. It is what the two stores hold, not what a running job's uploader is
doing: an upload can have just committed, or failed, since.

``cp``, ``rm``, ``verify`` and ``inspect`` act only on checkpoints: a committed one of the
native layout or a flax one-file checkpoint. A path inside a checkpoint, inside a save's
attempt or atomicstore's reserved directory is refused (exit 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import __version__
from .commit import Store, conformance, crc32c, validate_name
from .commit.locator import is_local, split_location, store_at
from .commit.names import RESERVED_DIR
from .commit.strategies import ATTEMPT_PREFIX
from .errors import (
    AlreadyExistsError,
    AtomicStoreError,
    ConformanceError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)

log = logging.getLogger("atomicstore.cli")

EXIT_OK, EXIT_BAD_DATA, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_STORAGE, EXIT_EXISTS, EXIT_CHANGED = 0, 1, 2, 3, 4, 5, 6
#: the store does not enforce a guarantee atomicstore relies on (``doctor``, ConformanceError)
EXIT_NONCONFORMING = 7

#: how many times ``cp``, ``verify`` and ``inspect`` start again on a checkpoint that another
#: writer replaced while they read it, before they give up (exit 6)
TRIES = 3
#: bytes read (and written) at a time when copying a flax one-file checkpoint
COPY_CHUNK = 32 * 2**20
#: kinds of what a URL names: a committed checkpoint of the native layout, a flax one-file checkpoint
NATIVE, ONE_FILE = "checkpoint", "flax file"


class _Out:
    """Human lines on stdout, or one JSON document with ``--json``."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def emit(self, doc: Any, human: Callable[[], Any]) -> None:
        if self.as_json:
            print(json.dumps(doc, indent=1, default=str))
        else:
            human()


class _Progress:
    """A progress line on stderr, only when it is a terminal."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.tty = label, max(total, 1), sys.stderr.isatty()
        self.t0 = time.monotonic()

    def __call__(self, done: int) -> None:
        if self.tty:
            pct = 100 * done / self.total
            rate = done / max(time.monotonic() - self.t0, 1e-9) / 2**20
            print(f"\r{self.label}: {pct:5.1f}% ({rate:,.0f} MiB/s)", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs:
        key, eq, val = p.partition("=")
        if not eq or not key:
            raise InvalidArgumentError(f"storage option {p!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(val)
        except ValueError:
            out[key] = val
    return out


def _age(t: float | None) -> str:
    if t is None:
        return "?"
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _step(name: str) -> str | None:
    from .commit.names import FLOAT_RE

    m = FLOAT_RE.findall(name)
    return m[-1] if m and name.endswith(m[-1]) else None


def _starts_like_flax(head: bytes) -> bool:
    """Whether a file's first byte is that of a flax state: a msgpack map (a damaged flax
    checkpoint still starts with one; a text file, an empty file or anything else does not)."""
    return bool(head) and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))


def _flax_files(st: Store, committed: set[str]) -> list[str]:
    """Top-level plain files that are flax legacy checkpoints ``<prefix><step>``: a regular
    file (not a directory, FIFO or dangling link) that starts like a flax state. Anything
    else named like one (``logs2026/``, a text file ``data1``) is not a checkpoint: skipped."""
    out = []
    for e in st.driver.listdir(""):
        name = e.name.rstrip("/")
        if e.is_dir or name in committed or name.startswith(".") or name.endswith("_gda"):
            continue
        if _step(name) is None or _one_file_info(st, name) is None:
            continue
        try:
            head = st.driver.read(name, 0, 1)
        except (NotFoundError, StorageError, OSError):
            continue  # deleted since the listing, or not readable as a file
        if _starts_like_flax(head):
            out.append(name)
    return out


def _holds_anything(st: Store) -> bool:
    """Whether the store's root holds atomicstore's reserved directory (a store that was
    used), so an empty listing means "a store with no checkpoints", not "nothing there"."""
    return any(e.name.rstrip("/") == RESERVED_DIR for e in st.driver.listdir(""))


# -- what a URL names -----------------------------------------------------------------------------
class _Replaced(Exception):
    """The checkpoint being read was replaced or deleted by another writer meanwhile: the
    command starts again (at most :data:`TRIES` times)."""


def _inside(root: str, options: dict[str, Any]) -> str | None:
    """Where ``root`` (a store root about to be used) lies inside something that is not a
    store: a committed checkpoint, a save's attempt, atomicstore's reserved directory or
    the arrays directory of a flax checkpoint (``<name>_gda``). Returns a description of it,
    or None. Each ancestor is asked through the commit layer (``Store.exists``)."""
    cur = root.removeprefix("file://").rstrip("/")
    if is_local(root):
        cur = os.path.abspath(cur)
    for _ in range(64):
        parent, _sep, base = cur.rpartition("/")
        if not parent or parent.endswith(":/") or parent.endswith("://"):
            return None  # a bucket, or a top-level directory
        if base == RESERVED_DIR:
            return f"{cur} (atomicstore's reserved directory)"
        if base.startswith(ATTEMPT_PREFIX):
            return f"{cur} (the files of one save attempt)"
        if is_local(root) and not os.path.isdir(cur):
            cur = parent  # not there (a destination to be made): nothing to ask
            continue
        try:
            validate_name(base)
        except InvalidArgumentError:
            cur = parent  # no checkpoint can have this name
            continue
        outer = _open(parent, {} if is_local(root) else options)
        try:
            if outer.exists(base):
                return f"checkpoint {outer.driver.describe(base)}"
        except CorruptionError:  # committed, its commit point unreadable: still a checkpoint
            return f"checkpoint {outer.driver.describe(base)}"
        if base.endswith("_gda") and _one_file_info(outer, base[: -len("_gda")]) is not None:
            return f"{outer.driver.describe(base)} (the arrays of flax checkpoint {base[: -len('_gda')]})"
        cur = parent
    return None


def _one_file_info(st: Store, name: str) -> Any:
    """The driver's ``FileInfo`` of a plain file/object ``name`` at the root of ``st``, None
    if there is none (a directory, FIFO, dangling link or prefix is not one)."""
    try:
        return st.driver.info(name)
    except (NotFoundError, InvalidArgumentError):
        return None


def _kind(st: Store, name: str) -> str | None:
    """:data:`NATIVE` if ``name`` is a committed checkpoint (even one whose commit point or
    manifest is damaged), :data:`ONE_FILE` if it is a file at the store's root, else None."""
    try:
        if st.exists(name):
            return NATIVE
    except CorruptionError:
        return NATIVE
    return ONE_FILE if _one_file_info(st, name) is not None else None


def _resolve(root: str, name: str, options: dict[str, Any], *, create: bool = False) -> tuple[Store, str, str | None]:
    """(store, name, kind) of ``<root>/<name>``, refusing (exit 2) a name no checkpoint can
    have and a path inside a checkpoint, an attempt or the reserved directory."""
    validate_name(name)
    where = _inside(root, options)
    if where is not None:
        raise InvalidArgumentError(
            f"{root}/{name} is inside {where}: a path inside a checkpoint is not a checkpoint "
            "(name the checkpoint itself)")
    st = _open(root, options, create=create)
    return st, name, _kind(st, name)


def _locate(url: str, options: dict[str, Any]) -> tuple[Store, str, str]:
    """:func:`_resolve` of ``STORE/NAME``; NotFoundError (exit 3) if nothing is there."""
    root, name = split_location(url)
    st, name, kind = _resolve(root, name, options)
    if kind is None:
        raise NotFoundError(f"no checkpoint {name!r} in {st.url}")
    return st, name, kind


class _OneFile:
    """Ranged reads of one version of a flax one-file checkpoint: every read is
    conditional on the generation first read (S3 ``If-Match``, GCS ``ifGenerationMatch``,
    the opened inode on POSIX), as ``restore`` reads it. A read that finds the file
    replaced or deleted raises :class:`_Replaced`."""

    def __init__(self, st: Store, name: str) -> None:
        self.st, self.name = st, name
        self.where = st.driver.describe(name)
        info = st.driver.info(name)
        self.size, self.generation = info.size, info.generation

    def read_into(self, off: int, mv: memoryview) -> None:
        try:
            n = self.st.driver.read_into(self.name, off, mv, generation=self.generation)
        except (PreconditionFailedError, NotFoundError) as exc:
            raise _Replaced(str(exc)) from exc
        if n != mv.nbytes:
            raise CorruptionError(f"{self.where}: short read at byte {off} ({n} of {mv.nbytes} bytes)",
                                  path=self.name)

    def read(self, a: int, b: int) -> bytes:
        buf = bytearray(b - a)
        self.read_into(a, memoryview(buf))
        return bytes(buf)

    def index(self) -> Any:
        """The structure check: the msgpack tree scanned with ranged reads (only headers are
        read; every length is checked before anything is allocated)."""
        from .pytree.format import index_of_msgpack

        return index_of_msgpack(self.read, self.size, self.where)

    def chunks(self, buf: bytearray) -> Any:
        """Every byte in order, in views of ``buf`` (reused: consume each before the next)."""
        for off in range(0, self.size, len(buf)):
            mv = memoryview(buf)[: min(len(buf), self.size - off)]
            self.read_into(off, mv)
            yield mv

    def crc32c(self, buf: bytearray) -> int:
        crc = 0
        for mv in self.chunks(buf):
            crc = crc32c(mv, crc)
        return crc


def _attempt(st: Store, name: str) -> str | None:
    """The attempt that committed ``name`` now, read afresh from its commit point alone
    (None if it is not committed), as :meth:`Store.verify` tells damage from replacement."""
    try:
        return st.strategy.current(name)
    except (NotFoundError, CorruptionError):
        return None


def _tries(what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` again while it finds its checkpoint replaced; :class:`PreconditionFailedError`
    (exit 6) after :data:`TRIES` times."""
    for _ in range(TRIES):
        try:
            return fn()
        except _Replaced as exc:
            last = str(exc)
    raise PreconditionFailedError(
        f"{what} was replaced by another writer {TRIES} times while it was read ({_first_line(last)}); "
        "nothing was changed: run the command again")


# -- commands ----------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace, out: _Out) -> int:
    local = _local_tier(args.local_dir, args.url) if args.local_dir is not None else None
    st = _open(args.url, args.options)
    if local is not None and local.url == st.url:
        raise InvalidArgumentError(f"--local-dir {args.local_dir} is the persistent tier itself ({st.url}): "
                                   "give the local tier's directory")
    rows = _ls_rows(st)
    doc: dict[str, Any] = {"store": st.url, "checkpoints": rows}
    if local is not None:
        doc["local_dir"] = local.url
        doc["checkpoints"] = _tier_rows(rows, local)
    if args.all:
        rep = st.recover(dry_run=True, flax_prefix=args.flax_prefix)
        doc["uncommitted"] = [{"target": a.target, "kind": a.kind, "why": a.reason} for a in rep.actions]
        doc["in_flight"] = list(rep.in_flight)
        if local is not None:  # what crashes left in the local tier too
            rep = local.recover(dry_run=True, flax_prefix=args.flax_prefix)
            doc["local_uncommitted"] = [{"target": a.target, "kind": a.kind, "why": a.reason} for a in rep.actions]
            doc["local_in_flight"] = list(rep.in_flight)
    out.emit(doc, lambda: _print_ls(st.url, doc, show_all=args.all))
    return EXIT_OK


def _ls_rows(st: Store) -> list[dict[str, Any]]:
    """``ls``'s rows: the committed checkpoints (damaged ones too), then the flax files."""
    rows: list[dict[str, Any]] = []
    names = st.list()
    for name in names:
        try:
            man = st.manifest(name)
        except NotFoundError:
            continue  # deleted since the listing
        except CorruptionError as exc:  # committed, but its manifest cannot be read
            rows.append({"name": name, "step": _step(name), "kind": "damaged", "bytes": None,
                         "files": None, "committed": None, "why": _first_line(str(exc))})
            continue
        rows.append({"name": name, "step": _step(name), "kind": "checkpoint", "bytes": man.total_bytes,
                     "files": len(man.files), "committed": man.committed or man.created})
    for name in _flax_files(st, set(names)):
        info = _one_file_info(st, name)
        if info is None:
            continue  # deleted since the listing
        rows.append({"name": name, "step": _step(name), "kind": "flax file", "bytes": info.size, "files": 1,
                     "committed": info.mtime})
    return rows


def _local_tier(path: str, url: str) -> Store:
    """The local tier ``path`` of ``ls --local-dir``, opened for reading: an existing
    local directory (exit 3 if missing, 2 if it is a URL, a file, inside a checkpoint or
    holds the local tiers of several processes)."""
    if "://" in path:
        raise InvalidArgumentError(f"--local-dir {path!r} is a URL: the local tier is a directory on this machine "
                                   f"(the persistent tier is the URL, {url})")
    if not os.path.exists(path):
        raise NotFoundError(f"--local-dir {path}: no such directory")
    if not os.path.isdir(path):
        raise InvalidArgumentError(f"--local-dir {path} is not a directory")
    where = _inside(path, {})
    if where is not None:
        raise InvalidArgumentError(f"--local-dir {path} is inside {where}, not a local tier")
    local = _open(path, {})
    if not local.list():
        procs = sorted(e.name.rstrip("/") for e in local.driver.listdir("")
                       if e.is_dir and e.name.rstrip("/").startswith("process-"))
        if procs:
            raise InvalidArgumentError(f"--local-dir {path} holds the local tiers of several processes "
                                       f"({', '.join(procs[:4])}): name one, e.g. {os.path.join(path, procs[0])}")
    return local


def _tier_rows(rows: list[dict[str, Any]], local: Store) -> list[dict[str, Any]]:
    """``ls --local-dir``: ``rows`` (the persistent tier's, from :func:`_ls_rows`) with
    each one's ``tiers``, and a row for each step committed only in the local tier
    ``local`` (``local`` or ``persisting``; see the module docstring). A local step
    deleted between the listing and the reading of its manifest is left out (its
    persistent row, if any, stays ``persisted``); a local copy whose manifest cannot be
    read is reported (``local_damaged``), never guessed."""
    from .commit.names import natural_key
    from .tiers import TIER_KEY, TierState

    persisted = {r["name"]: r for r in rows if r["kind"] != ONE_FILE}
    newest: dict[str, float] = {}  # name prefix -> newest persisted step
    for name, r in persisted.items():
        if r["step"] is not None:
            pre = name[: -len(r["step"])]
            newest[pre] = max(newest.get(pre, -float("inf")), float(r["step"]))
    out = [{**r, "tiers": TierState.PERSISTED.value} for r in rows]
    by_name = {r["name"]: r for r in out if r["kind"] != ONE_FILE}
    for name in local.list():
        try:
            man = local.manifest(name)
        except NotFoundError:
            continue  # deleted since the listing (local retention, or the job's overwrite)
        except CorruptionError as exc:
            why = _first_line(str(exc))
            if name in by_name:
                by_name[name].update(tiers=f"{TierState.LOCAL.value}+{TierState.PERSISTED.value}", local_damaged=why)
            else:
                out.append({"name": name, "step": _step(name), "kind": "damaged", "bytes": None, "files": None,
                            "committed": None, "why": why, "tiers": TierState.LOCAL.value})
            continue
        if name in by_name:
            by_name[name]["tiers"] = f"{TierState.LOCAL.value}+{TierState.PERSISTED.value}"
            continue
        tier = man.metadata.get(TIER_KEY)
        step = _step(name)
        state = TierState.LOCAL
        if (isinstance(tier, dict) and tier.get("due") is True and step is not None
                and float(step) > newest.get(name[: -len(step)], -float("inf"))):
            state = TierState.PERSISTING  # the job uploads it, or a restarted one resumes it
        out.append({"name": name, "step": step, "kind": "checkpoint", "bytes": man.total_bytes,
                    "files": len(man.files), "committed": man.committed or man.created, "tiers": state.value})
    flax = [r for r in out if r["kind"] == ONE_FILE]
    steps = sorted((r for r in out if r["kind"] != ONE_FILE), key=lambda r: natural_key(r["name"]))
    return steps + flax


def _print_ls(url: str, doc: dict[str, Any], *, show_all: bool) -> None:
    """``ls`` for people: ``doc`` as :func:`cmd_ls` emits it."""
    rows = doc["checkpoints"]
    tiered = "local_dir" in doc
    if not rows:
        print(f"no committed checkpoints in {url}" + (f" or {doc['local_dir']}" if tiered else ""))
    else:
        def tcol(r: dict[str, Any]) -> str:
            return f" {r['tiers']:15}" if tiered else ""

        print(f"{'NAME':32} {'STEP':>10} {'SIZE':>11} {'FILES':>6} {'AGE':>7} " + (f" {'TIERS':15}" if tiered else "")
              + " KIND")
        for r in rows:
            if r["kind"] == "damaged":
                print(f"{r['name']:32} {r['step'] or '-':>10} {'?':>11} {'?':>6} {'?':>7} {tcol(r)} "
                      f"damaged: {r['why']}")
                continue
            print(f"{r['name']:32} {r['step'] or '-':>10} {_size(r['bytes']):>11} {r['files']:>6} "
                  f"{_age(r['committed']):>7} {tcol(r)} {r['kind']}"
                  + (f" (local copy damaged: {r['local_damaged']})" if r.get("local_damaged") else ""))
        if tiered:
            print(f"tiers: persistent {url}, local {doc['local_dir']}")
    if show_all:
        for u in doc["uncommitted"]:
            print(f"uncommitted: {u['target']}  ({u['kind']}: {u['why']})")
        for t in doc["in_flight"]:
            print(f"in flight (a live writer, or too recent to call stale): {t}")
        for u in doc.get("local_uncommitted", []):
            print(f"uncommitted in the local tier: {u['target']}  ({u['kind']}: {u['why']})")
        for t in doc.get("local_in_flight", []):
            print(f"in flight in the local tier (a live writer, or too recent to call stale): {t}")
        if not any(doc.get(k) for k in ("uncommitted", "in_flight", "local_uncommitted", "local_in_flight")):
            print("nothing uncommitted")


def _first_line(msg: str) -> str:
    return msg.strip().splitlines()[0] if msg.strip() else "unreadable"


def _manifest_sizes(ck: Any) -> Callable[[str], int | None]:
    """``sizes`` for ``parse_index``: a file's size in the manifest, None if not in it."""
    files = ck.files
    return lambda f: files[f].size if f in files else None


def _bad_leaf(st: Store, name: str, path: str | None = None) -> str | None:
    """The leaf of a pytree checkpoint that the damaged file ``path`` holds: the sharded
    array that ``path`` is a shard file of, else the first leaf of the state file whose
    bytes fail their CRC32C."""
    from .commit.manifest import crc32c
    from .pytree.format import INDEX_FILE, STATE_FILE, parse_index
    from .pytree.tree import path_str

    try:
        ck = st.open(name)
        idx = parse_index(ck.read_bytes(INDEX_FILE), ck.files[STATE_FILE].size, ck.where(INDEX_FILE),
                          sizes=_manifest_sizes(ck))
        if path is not None:
            for lf in idx.leaves.values():
                if lf.kind == "sh" and any(s.file == path for s in lf.value):
                    return path_str(lf.path)
        for lf in idx.leaves.values():
            for off, n, crc in lf.ranges:
                if crc is not None and crc32c(ck.read_range(STATE_FILE, off, off + n)) != crc:
                    return path_str(lf.path)
    except (AtomicStoreError, KeyError, AttributeError):
        return None
    return None


def _check_index(ck: Any) -> None:
    """A pytree checkpoint's index must hold up too (restore refuses it otherwise): every
    range inside the state file, the shards of each sharded array tiling it exactly with
    files of the sizes the manifest records (:func:`~atomicstore.pytree.format.parse_index`)."""
    from .pytree.format import INDEX_FILE, STATE_FILE, parse_index

    if INDEX_FILE in ck.files and STATE_FILE in ck.files:
        parse_index(ck.read_bytes(INDEX_FILE), ck.files[STATE_FILE].size, ck.where(INDEX_FILE),
                    sizes=_manifest_sizes(ck))


def _verify_one(st: Store, name: str, kind: str) -> dict[str, Any]:
    try:
        if kind == NATIVE:
            doc: dict[str, Any] = _tries(st.driver.describe(name), lambda: _verify_native(st, name))
        elif kind == ONE_FILE:
            doc = _tries(st.driver.describe(name), lambda: _verify_one_file(st, name))
        else:
            raise NotFoundError(f"no checkpoint {name!r} in {st.url}")
        return doc
    except CorruptionError as exc:
        leaf = exc.leaf or _bad_leaf(st, name, exc.path)
        return {"name": name, "ok": False, "file": exc.path, "leaf": leaf, "error": str(exc)}


def _verify_native(st: Store, name: str) -> dict[str, Any]:
    ck = st.open(name)
    man = ck.manifest
    bar = _Progress(f"verify {name}", man.total_bytes)
    try:
        ck.verify()
        _check_index(ck)
    except (CorruptionError, NotFoundError) as exc:
        if _attempt(st, name) != man.attempt:  # replaced or deleted while read: not damage
            raise _Replaced(str(exc)) from exc
        raise
    finally:
        bar.done()
    return {"name": name, "ok": True, "bytes": man.total_bytes}


def _verify_one_file(st: Store, name: str) -> dict[str, Any]:
    """A flax file carries no checksums: its structure is checked leaf by leaf (every
    declared length against the file) and every byte is read, all from one version,
    streamed (memory bounded by one chunk and the index)."""
    f = _OneFile(st, name)
    f.index()
    for _ in f.chunks(bytearray(min(COPY_CHUNK, max(f.size, 1)))):
        pass
    return {"name": name, "ok": True, "bytes": f.size}


def cmd_verify(args: argparse.Namespace, out: _Out) -> int:
    st, names, single = _store_or_checkpoint(args.url, args.options)
    results = []
    for name, kind in names:
        try:
            results.append(_verify_one(st, name, kind))
        except NotFoundError:
            if single:
                raise
            continue  # deleted since the listing

    def human() -> None:
        for r in results:
            if r["ok"]:
                print(f"ok       {r['name']} ({_size(r['bytes'])})")
            else:
                where = (r["file"] or r["name"]) + (f", leaf {r['leaf']}" if r.get("leaf") else "")
                print(f"CORRUPT  {r['name']}: {where}: {r['error']}")
        if not results:
            print(f"no committed checkpoints in {st.url}")

    out.emit({"store": st.url, "results": results, "ok": all(r["ok"] for r in results)}, human)
    return EXIT_OK if all(r["ok"] for r in results) else EXIT_BAD_DATA


def _open(url: str, options: dict[str, Any], *, create: bool = False) -> Store:
    """The store at ``url`` (:func:`store_at`: opened once per process for its root and
    options, so a root a command asks twice costs one client), refusing a local directory
    that does not exist (unless ``create``). What a root must not be (inside a checkpoint,
    an attempt, the reserved directory) is checked by :func:`_inside` on every command."""
    if "://" not in url and not create and not os.path.isdir(url.removeprefix("file://")):
        raise NotFoundError(f"{url}: no such directory")
    return store_at(url, **options)


def _store_or_checkpoint(url: str, options: dict[str, Any]) -> tuple[Store, list[tuple[str, str]], bool]:
    """URL names a checkpoint (``STORE/NAME``) or a store (all its checkpoints): (store,
    [(name, kind)], whether the URL named one checkpoint)."""
    try:
        root, name = split_location(url.removeprefix("file://") if is_local(url) else url)
        validate_name(name)
    except InvalidArgumentError:
        pass  # no checkpoint can have this name: a store
    else:
        if is_local(url):
            root = os.path.abspath(root)
        if not is_local(url) or os.path.isdir(root):
            parent, name, kind = _resolve(root, name, options)
            if kind is not None:
                return parent, [(name, kind)], True
            # not a checkpoint: a store only if it holds checkpoints or was used as one
            st = _open(url, options)
            names = st.list()
            found = [(n, NATIVE) for n in names] + [(n, ONE_FILE) for n in _flax_files(st, set(names))]
            if not found and not _holds_anything(st):
                raise NotFoundError(f"no checkpoint {name!r} in {parent.url} (and {st.url} is not a store "
                                    "holding checkpoints)")
            return st, found, False
    st = _open(url, options)
    names = st.list()
    return st, [(n, NATIVE) for n in names] + [(n, ONE_FILE) for n in _flax_files(st, set(names))], False


def cmd_recover(args: argparse.Namespace, out: _Out) -> int:
    where = _inside(args.url, args.options)
    if where is not None:  # its "leftovers" are a checkpoint's (or a live save's) files
        raise InvalidArgumentError(f"{args.url} is inside {where}, not a store: recover the store that holds it")
    st = _open(args.url, args.options)
    rep = st.recover(dry_run=args.dry_run, grace=args.grace, flax_prefix=args.flax_prefix)
    doc = {"store": st.url, "dry_run": rep.dry_run, "committed": rep.committed, "in_flight": rep.in_flight,
           "actions": [{"kind": a.kind, "target": a.target, "why": a.reason, "objects": a.keys}
                       for a in rep.actions]}
    out.emit(doc, lambda: print(rep.summary()))
    return EXIT_OK


#: shard files listed per sharded array in human ``inspect`` output (``--json`` lists all)
SHOW_SHARDS = 16


def _span(start: Sequence[int], shape: Sequence[int]) -> str:
    """A shard's index range in the global array, ``[0:4, 0:6]``."""
    return "[" + ", ".join(f"{a}:{a + n}" for a, n in zip(start, shape, strict=True)) + "]"


def cmd_inspect(args: argparse.Namespace, out: _Out) -> int:
    st, name, kind = _locate(args.url, args.options)
    return int(_tries(st.driver.describe(name), lambda: _inspect(st, name, kind, out)))


def _inspect(st: Store, name: str, kind: str, out: _Out) -> int:
    from .pytree.format import INDEX_FILE, STATE_FILE, parse_index

    meta: dict[str, Any] = {}
    if kind == NATIVE:
        ck = st.open(name)
        meta = ck.metadata
        if INDEX_FILE not in ck.files:
            files = {p: e.size for p, e in ck.files.items()}
            out.emit({"name": name, "files": files, "metadata": meta},
                     lambda: [print(f"{p}  {_size(n)}") for p, n in files.items()])
            return EXIT_OK
        try:
            idx = parse_index(ck.read_bytes(INDEX_FILE), ck.files[STATE_FILE].size, ck.where(INDEX_FILE),
                              sizes=_manifest_sizes(ck))
        except (CorruptionError, NotFoundError) as exc:
            if _attempt(st, name) != ck.manifest.attempt:  # replaced or deleted while read
                raise _Replaced(str(exc)) from exc
            raise
    else:  # every range from the version first read
        idx = _OneFile(st, name).index()
    leaves = [_leaf_row(lf) for lf in idx.leaves.values()]
    total = sum(lf["bytes"] or 0 for lf in leaves)
    doc = {"name": name, "kind": kind, "leaves": leaves, "total_bytes": total, "metadata": meta}
    out.emit(doc, lambda: _print_inspect(doc))
    return EXIT_OK


def _leaf_row(lf: Any) -> dict[str, Any]:
    """``inspect``'s row of one leaf of a pytree checkpoint's index."""
    import math

    from .pytree.tree import path_str

    nbytes = sum(n for _, n, _ in lf.ranges) if lf.kind in ("nd", "ndc", "sc") else None
    leaf: dict[str, Any] = {"path": path_str(lf.path), "dtype": None if lf.dtype is None else lf.dtype.name,
                            "shape": list(lf.shape) if lf.dtype is not None else None, "bytes": nbytes,
                            "kind": lf.kind}
    if lf.kind == "sh":  # sharded across processes: its bytes are in its shard files
        assert lf.dtype is not None
        item = lf.dtype.itemsize
        leaf["bytes"] = lf.nbytes
        leaf["shards"] = [{"file": s.file, "start": list(s.start), "shape": list(s.shape),
                           "bytes": math.prod(s.shape) * item} for s in lf.value]
    return leaf


def _print_inspect(doc: dict[str, Any]) -> None:
    """``inspect`` for people: ``doc`` as :func:`_inspect` emits it."""
    name, kind, leaves, meta = doc["name"], doc["kind"], doc["leaves"], doc["metadata"]
    sharded = [lf for lf in leaves if lf["kind"] == "sh"]
    print(f"{name} ({kind}): {len(leaves)} leaves, {_size(doc['total_bytes'])} of arrays"
          + (f", {len(sharded)} sharded across processes" if sharded else ""))
    w = max([len(lf["path"]) for lf in leaves] + [4])
    for lf in leaves:
        shape = "" if lf["shape"] is None else "(" + ", ".join(map(str, lf["shape"])) + ")"
        line = (f"  {lf['path']:{w}}  {lf['dtype'] or lf['kind']:>10} {shape:>18} "
                f"{_size(lf['bytes']) if lf['bytes'] is not None else '':>10}")
        if lf["kind"] != "sh":
            print(line)
            continue
        n = len(lf["shards"])
        print(f"{line}  sharded, {n} shard{'s' if n != 1 else ''}:")
        shown = lf["shards"][:SHOW_SHARDS]
        fw = max(len(s["file"]) for s in shown) if shown else 0
        sw = max(len(_span(s["start"], s["shape"])) for s in shown) if shown else 0
        for s in shown:
            print(f"      {s['file']:{fw}}  {_span(s['start'], s['shape']):{sw}}  {_size(s['bytes'])}")
        if n > SHOW_SHARDS:
            print(f"      ... and {n - SHOW_SHARDS} more (--json lists them all)")
    if meta:
        print("metadata: " + json.dumps(meta, default=str))


def cmd_cp(args: argparse.Namespace, out: _Out) -> int:
    sroot, sname = split_location(args.src)
    # -o is for the remote side(s); a local path takes no storage options
    src, sname, skind = _resolve(sroot, sname, args.options if "://" in sroot else {})
    if skind is None:
        raise NotFoundError(f"no checkpoint {sname!r} in {src.url}")
    dst_opts = _options(args.dst_option) if args.dst_option else (args.options if "://" in args.dst else {})
    try:
        droot, dname = split_location(args.dst)
    except InvalidArgumentError:
        droot, dname = args.dst, sname  # a bucket: the same name there
    dst, dname, dkind = _resolve(droot, dname, dst_opts, create=True)
    if (dst.url, dname) == (src.url, sname):
        raise InvalidArgumentError(f"{src.driver.describe(sname)}: the source and the destination are the same")
    if dkind is not None and not args.force:
        raise AlreadyExistsError(f"{dst.driver.describe(dname)} already exists (pass --force to replace it atomically)")
    if dkind is not None and dkind != skind:
        raise InvalidArgumentError(
            f"cannot replace the {'native checkpoint' if dkind == NATIVE else 'flax one-file checkpoint'} "
            f"{dst.driver.describe(dname)} with a {'native checkpoint' if skind == NATIVE else 'flax file'}: "
            "the two layouts cannot be swapped in one atomic step (readers would see neither for a "
            f"moment); delete it first (atomicstore rm {dst.driver.describe(dname)}), then copy")
    t0 = time.monotonic()
    copy = _copy_native if skind == NATIVE else _copy_one_file
    nbytes = _tries(src.driver.describe(sname), lambda: copy(src, sname, dst, dname, args.force))
    doc = {"src": src.driver.describe(sname), "dst": dst.driver.describe(dname), "bytes": nbytes,
           "seconds": round(time.monotonic() - t0, 3), "verified": True}
    out.emit(doc, lambda: print(f"copied {doc['src']} -> {doc['dst']} ({_size(nbytes)}, verified)"))
    return EXIT_OK


def _copy_native(src: Store, sname: str, dst: Store, dname: str, force: bool) -> int:
    """Every file checked against the source's manifest while it is read, before the
    destination's commit point; a source replaced meanwhile (its files then fail their
    check or are gone) raises :class:`_Replaced` and nothing is committed."""
    ck = src.open(sname)
    man = ck.manifest
    bar = _Progress(f"cp {sname}", man.total_bytes)
    done = 0

    def failed(path: str, exc: AtomicStoreError) -> Exception:
        if _attempt(src, sname) != man.attempt:  # replaced or deleted, not damaged
            return _Replaced(str(exc))
        if isinstance(exc, NotFoundError):  # the same attempt lacks a file its manifest lists
            return CorruptionError(f"{ck.where(path)}: listed in the manifest but missing ({_first_line(str(exc))})",
                                   path=path)
        return exc

    with dst.transaction(dname, metadata=ck.metadata, overwrite=force) as txn:
        for path in ck.files:
            try:
                r = ck.open(path)
            except (CorruptionError, NotFoundError, PreconditionFailedError) as exc:
                raise failed(path, exc) from exc
            with r, txn.open(path) as f:  # checked while read
                while True:
                    try:
                        chunk = r.read(8 << 20)
                    except (CorruptionError, NotFoundError, PreconditionFailedError) as exc:
                        raise failed(path, exc) from exc
                    if not chunk:
                        break
                    f.write(chunk)
                    done += len(chunk)
                    bar(done)
    bar.done()
    try:
        dst.verify(dname)
    except PreconditionFailedError:
        # another writer replaced (or deleted) the destination after our commit point:
        # the copy itself committed whole; what is there now is that writer's
        log.warning("%s/%s was replaced by another writer right after the copy committed",
                    dst.url, dname)
    return man.total_bytes


def _copy_one_file(src: Store, sname: str, dst: Store, dname: str, force: bool) -> int:
    """Structure checked first, then streamed: every read conditional on the generation
    first read (a source replaced meanwhile raises :class:`_Replaced` before the
    destination's commit point), one chunk in memory; read back after the commit."""
    f = _OneFile(src, sname)
    f.index()  # refuses anything that is not a well-formed flax state, before writing
    buf = bytearray(min(COPY_CHUNK, max(f.size, 1)))
    bar = _Progress(f"cp {sname}", f.size)
    crc = done = 0
    with dst.one_file(dname, overwrite=force) as w:
        for mv in f.chunks(buf):
            crc = crc32c(mv, crc)
            w.write(mv)
            done += mv.nbytes
            bar(done)
        # a backend without generations: nothing pinned the reads, check before the commit point
        if f.generation is None and _OneFile(src, sname).crc32c(buf) != crc:
            raise _Replaced(f"{f.where} changed while it was copied")
    bar.done()
    try:
        back = _OneFile(dst, dname)
        got = (back.size, back.crc32c(buf))
    except _Replaced:
        return f.size  # replaced by another writer since our commit: theirs to check
    if got != (f.size, crc):
        raise CorruptionError(f"{dst.driver.describe(dname)}: the copy reads back differently from the source "
                              f"({got[0]} bytes, CRC32C {got[1]:08x}; expected {f.size}, {crc:08x})", path=dname)
    return f.size


def cmd_rm(args: argparse.Namespace, out: _Out) -> int:
    st, name, kind = _locate(args.url, args.options)
    what = st.driver.describe(name)
    if kind == NATIVE:
        st.delete(name)  # the commit point first, conditional on the generation read
    else:
        f = _OneFile(st, name)
        try:
            head = f.read(0, 1) if f.size else b""
        except _Replaced as exc:
            raise PreconditionFailedError(f"{what} changed since it was read ({exc}): nothing deleted") from None
        # a flax state is a msgpack map: refuse any other file (a damaged checkpoint still starts with one)
        if not _starts_like_flax(head):
            raise InvalidArgumentError(f"{what} is not a checkpoint (neither a committed checkpoint nor a flax "
                                       "one-file checkpoint): nothing deleted")
        st.delete_one_file(name, if_generation=f.generation)  # only the version checked
    out.emit({"deleted": what}, lambda: print(f"deleted {what}"))
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace, out: _Out) -> int:
    where = _inside(args.url, args.options)
    if where is not None:  # the check writes below <root>/.atomicstore/: never inside a checkpoint
        raise InvalidArgumentError(f"{args.url} is inside {where}, not a store: check the store that holds it")
    st = _open(args.url, args.options)
    report = conformance.check(st.driver)  # always afresh (never this process's cached result)
    out.emit(report.to_dict(), lambda: print(report.table()))
    return EXIT_OK if report.ok else EXIT_NONCONFORMING


def cmd_demo(args: argparse.Namespace, out: _Out) -> int:
    from .demo import run_demo, run_tiers_demo

    run = run_tiers_demo if args.tiers else run_demo
    return run(store=args.store, directory=args.dir, as_json=out.as_json)


# -- entry point ---------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="storage option for fsspec (repeatable; VALUE parsed as JSON if it can be)")
    p = argparse.ArgumentParser(prog="atomicstore", description="Atomic checkpoints on local disk, S3 and GCS.")
    p.add_argument("--version", action="version", version=f"atomicstore {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("ls", parents=[common], help="list committed checkpoints")
    s.add_argument("url")
    s.add_argument("--all", action="store_true", help="also uncommitted and stale data, and why")
    s.add_argument("--flax-prefix", default="checkpoint_")
    s.add_argument("--local-dir", default=None, metavar="DIR",
                   help="the local tier of a tiered CheckpointManager(URL, local_dir=DIR): show each step's tiers "
                        "(local, persisting, persisted, local+persisted)")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("verify", parents=[common], help="re-check every checksum")
    s.add_argument("url", help="STORE_URL (every checkpoint) or STORE_URL/NAME")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("recover", parents=[common], help="remove what crashes left behind")
    s.add_argument("url")
    s.add_argument("--dry-run", action="store_true")
    s.add_argument("--grace", type=float, default=None, help="seconds an untouched attempt is still in flight")
    s.add_argument("--flax-prefix", default="checkpoint_")
    s.set_defaults(fn=cmd_recover)
    s = sub.add_parser("inspect", parents=[common], help="show a checkpoint's tree")
    s.add_argument("url", help="STORE_URL/NAME")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("cp", parents=[common], help="copy a checkpoint between stores")
    s.add_argument("src", help="STORE_URL/NAME")
    s.add_argument("dst", help="STORE_URL/NAME or STORE_URL")
    s.add_argument("--dst-option", action="append", default=[], metavar="KEY=VALUE",
                   help="storage options for the destination (default: the -o options)")
    s.add_argument("--force", action="store_true", help="replace an existing destination atomically")
    s.set_defaults(fn=cmd_cp)
    s = sub.add_parser("rm", parents=[common], help="delete a checkpoint")
    s.add_argument("url", help="STORE_URL/NAME")
    s.set_defaults(fn=cmd_rm)
    s = sub.add_parser("doctor", parents=[common],
                       help="check that the store enforces what atomicstore relies on to commit")
    s.add_argument("url", help="STORE_URL")
    s.set_defaults(fn=cmd_doctor)
    s = sub.add_parser("demo", parents=[common], help="train, get killed mid-save, recover, resume")
    s.add_argument("--store", choices=["local", "s3"], default="local")
    s.add_argument("--dir", default=None, help="where the local store goes (default: a temporary directory)")
    s.add_argument("--tiers", action="store_true",
                   help="with a local tier: killed mid-upload, restarted on the same machine (restores from the "
                        "local tier), the machine lost, resumed from the persistent tier")
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = _Out(args.json)
    try:
        args.options = _options(args.option)
        return int(args.fn(args, out))
    except _Replaced as exc:  # (every command reading in several requests handles it first)
        code, msg = EXIT_CHANGED, f"replaced by another writer while it was read: {exc}"
    except InvalidArgumentError as exc:
        code, msg = EXIT_USAGE, str(exc)
    except NotFoundError as exc:
        code, msg = EXIT_NOT_FOUND, str(exc)
    except CorruptionError as exc:
        code, msg = EXIT_BAD_DATA, str(exc)
    except ConformanceError as exc:  # (a StorageError: caught first)
        code, msg = EXIT_NONCONFORMING, str(exc)
    except PreconditionFailedError as exc:  # (an AlreadyExistsError: caught first)
        code, msg = EXIT_CHANGED, str(exc)
    except AlreadyExistsError as exc:
        code, msg = EXIT_EXISTS, str(exc)
    except (StorageError, AtomicStoreError, OSError) as exc:
        code, msg = EXIT_STORAGE, str(exc)
    except KeyboardInterrupt:
        code, msg = 130, "interrupted"
    first = msg.strip().splitlines()[0] if msg.strip() else "failed"
    if args.json:
        print(json.dumps({"error": first, "exit": code}))
    print(f"atomicstore {args.command}: error: {first}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
