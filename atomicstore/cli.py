"""The ``atomicstore`` command: look after checkpoints, and the demo.

    atomicstore ls URL [--all]          committed checkpoints (and, with --all, the rest)
    atomicstore verify URL[/NAME]       re-check every checksum (exit 0 only if all verify)
    atomicstore recover URL [--dry-run] remove what crashes left behind
    atomicstore inspect URL/NAME        the tree: key paths, dtypes, shapes, sizes, metadata
    atomicstore cp SRC DST              copy a checkpoint between stores, atomically, verified
    atomicstore rm URL/NAME             delete (commit point first)
    atomicstore demo [--store s3]       train, get killed mid-save, recover, resume

Every command takes ``--json`` (machine-readable output on stdout) and
``-o KEY=VALUE`` storage options (VALUE parsed as JSON when it can be). Exit status: 0
success, 1 verification failed or data corrupt, 2 bad arguments or URL, 3 not found,
4 storage error, 5 the destination exists. A user error prints one line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import __version__
from .commit import Store, open_store
from .errors import (
    AlreadyExistsError,
    AtomicStoreError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    StorageError,
)
from .pytree import split_url

EXIT_OK, EXIT_BAD_DATA, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_STORAGE, EXIT_EXISTS = 0, 1, 2, 3, 4, 5


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


def _flax_files(st: Store, committed: set[str]) -> list[str]:
    """Top-level plain files that are flax legacy checkpoints ``<prefix><step>``."""
    out = []
    for e in st.driver.listdir(""):
        name = e.name.rstrip("/")
        if name in committed or name.startswith(".") or name.endswith("_gda"):
            continue
        if _step(name) is not None and st.driver.exists(name) and not st.driver.listdir(name):
            out.append(name)
    return out


# -- commands ----------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace, out: _Out) -> int:
    st = _open(args.url, args.options)
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
        info = st.driver.info(name)
        rows.append({"name": name, "step": _step(name), "kind": "flax file", "bytes": info.size, "files": 1,
                     "committed": info.mtime})
    doc: dict[str, Any] = {"store": st.url, "checkpoints": rows}
    if args.all:
        rep = st.recover(dry_run=True, flax_prefix=args.flax_prefix)
        doc["uncommitted"] = [{"target": a.target, "kind": a.kind, "why": a.reason} for a in rep.actions]
        doc["in_flight"] = list(rep.in_flight)

    def human() -> None:
        if not rows:
            print(f"no committed checkpoints in {st.url}")
        else:
            print(f"{'NAME':32} {'STEP':>10} {'SIZE':>11} {'FILES':>6} {'AGE':>7}  KIND")
            for r in rows:
                if r["kind"] == "damaged":
                    print(f"{r['name']:32} {r['step'] or '-':>10} {'?':>11} {'?':>6} {'?':>7}  "
                          f"damaged: {r['why']}")
                    continue
                print(f"{r['name']:32} {r['step'] or '-':>10} {_size(r['bytes']):>11} {r['files']:>6} "
                      f"{_age(r['committed']):>7}  {r['kind']}")
        if args.all:
            for u in doc["uncommitted"]:
                print(f"uncommitted: {u['target']}  ({u['kind']}: {u['why']})")
            for t in doc["in_flight"]:
                print(f"in flight (a live writer, or too recent to call stale): {t}")
            if not doc["uncommitted"] and not doc["in_flight"]:
                print("nothing uncommitted")

    out.emit(doc, human)
    return EXIT_OK


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


def _verify_one(st: Store, name: str) -> dict[str, Any]:
    try:
        if st.exists(name):
            ck = st.open(name)
            man = ck.manifest
            bar = _Progress(f"verify {name}", man.total_bytes)
            st.verify(name)
            bar.done()
            _check_index(ck)
            return {"name": name, "ok": True, "bytes": man.total_bytes}
        if st.driver.exists(name):  # a flax legacy file: check its structure leaf by leaf
            from .pytree import restore

            restore(f"{st.url}/{name}", store=st)
            return {"name": name, "ok": True, "bytes": st.driver.info(name).size}
        raise NotFoundError(f"no checkpoint {name!r} in {st.url}")
    except CorruptionError as exc:
        leaf = exc.leaf or _bad_leaf(st, name, exc.path)
        return {"name": name, "ok": False, "file": exc.path, "leaf": leaf, "error": str(exc)}


def cmd_verify(args: argparse.Namespace, out: _Out) -> int:
    st, names = _store_or_checkpoint(args.url, args.options)
    results = [_verify_one(st, n) for n in names]

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
    """open_store, refusing a local directory that does not exist (unless ``create``)."""
    if "://" not in url and not create:
        import os

        if not os.path.isdir(url.removeprefix("file://")):
            raise NotFoundError(f"{url}: no such directory")
    return open_store(url, **options)


def _store_or_checkpoint(url: str, options: dict[str, Any]) -> tuple[Store, list[str]]:
    """URL names a checkpoint (``STORE/NAME``) or a store (all its checkpoints)."""
    import os

    if "://" not in url:
        if os.path.isfile(url) or os.path.isfile(os.path.join(url, "manifest.json")):
            root, name = split_url(os.path.abspath(url))
            return open_store(root), [name]
    else:
        try:
            root, name = split_url(url)
            parent = open_store(root, **options)
            if parent.exists(name) or parent.driver.exists(name):
                return parent, [name]
        except InvalidArgumentError:
            pass
    st = _open(url, options)
    names = st.list()
    return st, names + _flax_files(st, set(names))


def cmd_recover(args: argparse.Namespace, out: _Out) -> int:
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
    import math

    from .pytree.format import INDEX_FILE, STATE_FILE, index_of_msgpack, parse_index
    from .pytree.tree import path_str

    root, name = split_url(args.url)
    st = _open(root, args.options)
    meta: dict[str, Any] = {}
    if st.exists(name):
        ck = st.open(name)
        meta = ck.metadata
        if INDEX_FILE not in ck.files:
            files = {p: e.size for p, e in ck.files.items()}
            out.emit({"name": name, "files": files, "metadata": meta},
                     lambda: [print(f"{p}  {_size(n)}") for p, n in files.items()])
            return EXIT_OK
        idx = parse_index(ck.read_bytes(INDEX_FILE), ck.files[STATE_FILE].size, ck.where(INDEX_FILE),
                          sizes=_manifest_sizes(ck))
        kind = "checkpoint"
    elif st.driver.exists(name):
        size = st.driver.info(name).size

        def read(a: int, b: int) -> bytes:
            return st.driver.read(name, a, b)

        idx = index_of_msgpack(read, size, st.driver.describe(name))
        kind = "flax file"
    else:
        raise NotFoundError(f"no checkpoint {name!r} in {st.url}")
    leaves: list[dict[str, Any]] = []
    for lf in idx.leaves.values():
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
        leaves.append(leaf)
    total = sum(lf["bytes"] or 0 for lf in leaves)
    sharded = [lf for lf in leaves if lf["kind"] == "sh"]
    doc = {"name": name, "kind": kind, "leaves": leaves, "total_bytes": total, "metadata": meta}

    def human() -> None:
        print(f"{name} ({kind}): {len(leaves)} leaves, {_size(total)} of arrays"
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

    out.emit(doc, human)
    return EXIT_OK


def cmd_cp(args: argparse.Namespace, out: _Out) -> int:
    sroot, sname = split_url(args.src)
    # -o is for the remote side(s); a local path takes no storage options
    src = _open(sroot, args.options if "://" in sroot else {})
    dst_opts = _options(args.dst_option) if args.dst_option else (args.options if "://" in args.dst else {})
    try:
        droot, dname = split_url(args.dst)
        dst = open_store(droot, **dst_opts)
    except InvalidArgumentError:
        dst, dname = open_store(args.dst, **dst_opts), sname
    t0 = time.monotonic()
    if not args.force and (dst.exists(dname) or dst.driver.exists(dname)):
        raise AlreadyExistsError(f"{dst.driver.describe(dname)} already exists (pass --force to replace it atomically)")
    if src.exists(sname):
        ck = src.open(sname)
        bar = _Progress(f"cp {sname}", ck.manifest.total_bytes)
        done = 0
        with dst.transaction(dname, metadata=ck.metadata, overwrite=args.force) as txn:
            for path in ck.files:
                with ck.open(path) as r, txn.open(path) as f:  # checked while read
                    while chunk := r.read(8 << 20):
                        f.write(chunk)
                        done += len(chunk)
                        bar(done)
        bar.done()
        dst.verify(dname)
        nbytes = ck.manifest.total_bytes
    elif src.driver.exists(sname):  # a flax legacy file
        from .pytree import restore

        restore(f"{src.url}/{sname}", store=src)  # structure check first
        nbytes = 0
        with dst.one_file(dname, overwrite=args.force) as f:
            for chunk in src.driver.iter_read(sname):
                f.write(chunk)
                nbytes += len(chunk)
        if dst.driver.read(dname) != src.driver.read(sname):
            raise CorruptionError(f"{dst.driver.describe(dname)}: copy differs from the source", path=dname)
    else:
        raise NotFoundError(f"no checkpoint {sname!r} in {src.url}")
    doc = {"src": src.driver.describe(sname), "dst": dst.driver.describe(dname), "bytes": nbytes,
           "seconds": round(time.monotonic() - t0, 3), "verified": True}
    out.emit(doc, lambda: print(f"copied {doc['src']} -> {doc['dst']} ({_size(nbytes)}, verified)"))
    return EXIT_OK


def cmd_rm(args: argparse.Namespace, out: _Out) -> int:
    root, name = split_url(args.url)
    st = _open(root, args.options)
    if st.exists(name):
        st.delete(name)
    elif st.driver.exists(name) and not st.driver.listdir(name):
        st.driver.delete(name)  # a flax file: the file is its own commit point
    else:
        raise NotFoundError(f"no checkpoint {name!r} in {st.url}")
    out.emit({"deleted": st.driver.describe(name)}, lambda: print(f"deleted {st.driver.describe(name)}"))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, out: _Out) -> int:
    from .demo import run_demo

    return run_demo(store=args.store, directory=args.dir, as_json=out.as_json)


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
    s = sub.add_parser("demo", parents=[common], help="train, get killed mid-save, recover, resume")
    s.add_argument("--store", choices=["local", "s3"], default="local")
    s.add_argument("--dir", default=None, help="where the local store goes (default: a temporary directory)")
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = _Out(args.json)
    try:
        args.options = _options(args.option)
        return int(args.fn(args, out))
    except InvalidArgumentError as exc:
        code, msg = EXIT_USAGE, str(exc)
    except NotFoundError as exc:
        code, msg = EXIT_NOT_FOUND, str(exc)
    except CorruptionError as exc:
        code, msg = EXIT_BAD_DATA, str(exc)
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
