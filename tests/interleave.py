"""Deterministic interleaving exploration for the concurrency contract (issue 11).

In the spirit of FoundationDB's deterministic simulation and of stateless model checking
(CHESS, Flanagan-Godefroid DPOR): each *actor* (a writer, a second writer, a zombie whose
process was paused, recovery, a deleter, retention, a reader, a one-file writer) is a
Python callable run in its own thread against its own :class:`atomicstore.Store`, whose
driver is a :class:`SchedDriver`. Every storage primitive the library issues is a
*scheduling point*: the calling thread blocks until the :class:`Scheduler` grants it,
then performs the operation. Only one actor runs at a time, so a run is a deterministic
function of the sequence of choices (which actor goes next) and of the faults injected.

Explorers
    :func:`explore_exhaustive` enumerates every interleaving of a small scenario at
    operation granularity by depth-first search over choice sequences, replaying each
    schedule from scratch (stateless model checking). Two reductions keep that
    affordable without losing a behaviour:

    * *invisible* operations (``open_writer``, a writer's ``write`` and ``abort``,
      ``makedirs``, ``fsync_dir`` on the models: they touch no shared state) run at once,
      without a choice point;
    * with ``reduce=True`` (the default) the search is Flanagan-Godefroid dynamic
      partial-order reduction with sleep sets. Two operations are *dependent* when one
      writes what the other reads or writes, at the granularity of :func:`resource_of`:
      the objects of one attempt (its staging directory or ``attempt-`` prefix and its
      lease), a checkpoint's commit point (writing it is dependent with everything of
      that name, since it decides which attempt is live), a listing (dependent with every
      write below its prefix); the lock, pauses, clock jumps and stale listings are
      dependent with everything. Of interleavings that differ only in the order of
      independent operations, one is run. ``reduce=False`` runs the plain search; the
      suite checks that both reach the same outcomes (``signature``) where the plain
      search is affordable.

    :func:`explore_random` runs seeded random schedules (``random.Random(seed)``).

Faults (data, per schedule: :class:`Fault`)
    ``crash`` (the actor dies before its n-th operation: that and every later operation
    raise :class:`crashsim.SimulatedCrash`, a ``BaseException``), ``lost_reply`` (the
    operation is applied, then the client acts as a driver does after a lost reply: a
    put, a writer's close or a delete is re-issued as a separate scheduling point, and a
    refused retry raises what the backend answers, with ``retried=True``; any other
    operation raises ``StorageError``), ``lost_reply_error`` (applied, then
    ``StorageError``: the retries ran out), ``stale_listing`` (``find``/``listdir``
    answer what this actor's previous identical listing answered, or the store as it was
    when the actor started, as an fsspec listing cache would) and ``clock_jump`` (when
    the actor reaches its n-th operation, time moves on, at a scheduling point of its own:
    for everyone, for everyone but this actor (its clock stopped: a frozen VM), or for
    this actor only). Every library call an actor makes starts with a ``call`` point (the
    library reads the clock there), so a jump can land before it.

Models
    :class:`ModelBackend` is a dict of objects with data, an mtime from the virtual
    clock and a generation counter, plus the unfinished multipart uploads.
    :class:`ObjectModelDriver` declares S3's facts (no rename, put-if-absent and
    compare-and-swap on the generation, multipart uploads: every writer is an upload,
    listed until it completes); :class:`RenameModelDriver` declares the memory/POSIX
    facts (a rename or exchange of a whole prefix is one atomic step). The real S3 and
    GCS fakes can be driven too (``inner_factory``); their clock is real time plus jumps.

Time
    A :class:`VirtualClock`: storage stamps modification times with the global virtual
    time; each actor's ``Store`` gets ``clock=`` reading the global time plus that
    actor's offset. Leases use a real ttl of an hour so heartbeat threads never fire
    during a run: staleness comes only from the virtual clock.

Invariants (:func:`check_run`, after every schedule; every message carries the trace)
    1. every listed checkpoint opens, verifies and reads back the bytes its writer wrote
       (also after the final recovery, which must not change what is committed);
    2. nothing a writer was told is committed is lost, unless a later delete or
       overwrite of that name replaced it (one told it succeeded, or not told anything
       definite: a crash or an ambiguous error);
    3. per name and generation at most one writer is told it succeeded: a successful
       save's commit point replaced exactly the generation it read when it began (an
       overwrite: compare-and-swap) or nothing (a plain save); a successful delete
       removed the generation it read; and a call told a definite refusal
       (``CommitConflictError``, ``LeaseLostError``, ``AlreadyExistsError``,
       ``PreconditionFailedError``, ``NotFoundError``) changed no commit point;
    4. recovery never removes an object of a checkpoint committed at that moment
       (checked right before each of its removals), nor anything (data, lease, upload)
       of an attempt whose writer was told it committed, before that commit, nor of a
       save in flight (its writer alive and in that save, its lease renewed less than
       ``ttl + grace`` ago by recovery's clock, or holding no lease at all);
    5. once every actor is done and ``ttl + grace`` has passed, one recovery leaves no
       garbage (nothing but committed checkpoints, one-file checkpoints and root files;
       no lease, no unfinished upload) and a second recovery finds nothing to do.

    A reader actor checks that what it reads of a checkpoint that did not change while it
    read is complete and is its writer's bytes.

Documented bounds
    The protocol cannot protect a writer that passes its lease check and then pauses
    (or whose clock lags) for longer than ``grace`` before its commit point: recovery
    may by then have removed its data (``docs/commit-protocol.md``, "Concurrency",
    remaining windows). A schedule where a writer committed although some live actor's
    clock had passed its lease's ``mtime + ttl + grace`` while the writer's own clock
    still said the lease was valid is *beyond the bounds*: its invariants are still
    checked and violations reported, but counted apart instead of failing the test.

Determinism
    Attempt ids come from ``new_attempt_id()`` (real time plus a random token), which
    the harness cannot inject. Traces are normalised (attempt ids become
    ``<writer>#<n>``, random trash suffixes ``<hex>``), and every replay checks that each
    recorded choice point offers the same enabled actors. The one place where the
    library orders attempts by id is recovery sorting two attempts of the same name: with
    two such attempts created within one second, the order of recovery's deletes (not
    its decisions) may differ between replays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import itertools
import json
import random
import re
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from crashsim import SimulatedCrash

import atomicstore
import atomicstore.errors as _errors
from atomicstore.commit import conformance
from atomicstore.drivers.spec import Capabilities, Driver, Entry, FileInfo, Writer
from atomicstore.errors import AlreadyExistsError, NotFoundError, StorageError

# -- pre-issue-11 compatibility: lets the harness run against the last commit too --------
#: PreconditionFailedError where the library has it (issue 11), else a stand-in
PreconditionFailedError: type[AlreadyExistsError] = getattr(
    _errors, "PreconditionFailedError", type("PreconditionFailedError", (AlreadyExistsError,), {})
)
_FILEINFO_HAS_GENERATION = "generation" in {f.name for f in dataclasses.fields(FileInfo)}
#: True if ``Store`` takes ``clock=`` (issue 11); before, the harness passes ``now=``
STORE_HAS_CLOCK = "clock" in inspect.signature(atomicstore.Store.__init__).parameters

RESERVED = ".atomicstore"
MARKER_FILE = "commit_success.txt"
MANIFEST_FILE = "manifest.json"
LEASES = f"{RESERVED}/leases"
#: a lease ttl long enough that no heartbeat ever fires during a run (seconds)
TTL = 3600.0
#: recovery's grace period in the scenarios (seconds of virtual time)
GRACE = 100.0
#: real seconds a granted operation (and the actor's code up to its next operation) may
#: take before the run is declared hung
WATCHDOG = 30.0

_ATTEMPT_ID = re.compile(r"\d{8}T\d{6}-[0-9a-f]{12}")
_TRASH_SUFFIX = re.compile(r"(?<=\.)[0-9a-f]{8}(?=$|/|\s|'|\))")


def _file_info(key: str, size: int, mtime: float | None, generation: str | None) -> FileInfo:
    if _FILEINFO_HAS_GENERATION:
        return FileInfo(key, size, None, mtime, generation)
    return FileInfo(key, size, None, mtime)


def _cond_kwargs(exclusive: bool, if_generation: str | None) -> dict[str, Any]:
    """Keyword arguments of a conditional write, omitting defaults (older drivers lack
    ``if_generation``)."""
    kw: dict[str, Any] = {}
    if exclusive:
        kw["exclusive"] = True
    if if_generation is not None:
        kw["if_generation"] = if_generation
    return kw


# -- time ------------------------------------------------------------------------------
class VirtualClock:
    """Global virtual time plus a per-actor offset.

    On the models, time stands still except for explicit jumps; over the real fakes it is
    real time plus an offset (the fakes stamp objects with real time).
    """

    def __init__(self, start: float | None = None, *, real: bool = False) -> None:
        self.real = real
        self.base = float(int(time.time())) if start is None else start
        self.offset = 0.0
        self.actor_offsets: dict[str, float] = {}

    def now(self) -> float:
        """The global time: what storage stamps on objects."""
        return (time.time() if self.real else self.base) + self.offset

    def of(self, actor: str) -> float:
        """What ``actor``'s clock reads now."""
        return self.now() + self.actor_offsets.get(actor, 0.0)

    def for_actor(self, actor: str) -> Callable[[], float]:
        """The zero-argument clock handed to ``actor``'s Store."""
        return lambda: self.of(actor)

    def jump(self, delta: float, actor: str | None = None, scope: str = "all") -> None:
        """Move time on by ``delta`` seconds: ``all`` clocks, all but ``actor``'s
        (``others``: its clock stopped), or ``actor``'s only (``self``)."""
        if scope == "all":
            self.offset += delta
        elif scope == "others":
            assert actor is not None
            self.offset += delta
            self.actor_offsets[actor] = self.actor_offsets.get(actor, 0.0) - delta
        elif scope == "self":
            assert actor is not None
            self.actor_offsets[actor] = self.actor_offsets.get(actor, 0.0) + delta
        else:  # pragma: no cover - scenario bug
            raise ValueError(f"unknown clock scope {scope!r}")


# -- the storage models ----------------------------------------------------------------
@dataclass(frozen=True)
class StoredObject:
    """One object of the model: immutable, replaced on every write."""

    data: bytes
    mtime: float
    generation: str


class ModelBackend:
    """Objects by key, stamped with the virtual clock and a generation counter (the
    crashsim style: a plain dict that tests can inspect and snapshot)."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.objects: dict[str, StoredObject] = {}
        self.lock = threading.RLock()  # model operations are atomic
        self._generations = itertools.count(1)
        #: unfinished multipart uploads: upload id -> (key, start time)
        self.uploads: dict[str, tuple[str, float]] = {}

    def stamp(self, data: bytes) -> StoredObject:
        return StoredObject(bytes(data), self.clock.now(), str(next(self._generations)))

    def snapshot(self) -> dict[str, StoredObject]:
        with self.lock:
            return dict(self.objects)

    def copy(self, clock: VirtualClock) -> ModelBackend:
        """An independent copy (objects, unfinished uploads) stamping with ``clock``: for
        checks that must act on the final store without changing it. Its generations
        continue this one's, so none is reused."""
        with self.lock:
            other = ModelBackend(clock)
            other.objects = dict(self.objects)
            other.uploads = dict(self.uploads)
            other._generations = itertools.count(next(self._generations))
            return other

    def start_upload(self, key: str) -> str:
        with self.lock:
            upload_id = f"u{next(self._generations)}"
            self.uploads[upload_id] = (key, self.clock.now())
            return upload_id


class _ModelWriter(Writer):
    """Buffers, then one conditional put at close. On a driver with multipart uploads
    (the object model) every writer is one: the upload is started when the writer opens
    (listed by ``list_incomplete_uploads`` until it completes or is aborted), and the
    completion is the conditional put; an aborted upload cannot complete."""

    def __init__(
        self, driver: ObjectModelDriver, key: str, exclusive: bool, if_generation: str | None
    ) -> None:
        self.driver, self.key = driver, key
        self.exclusive, self.if_generation = exclusive, if_generation
        self.buf: bytearray | None = bytearray()
        self.upload_id = ""
        if driver.capabilities.multipart_uploads:
            self.upload_id = driver.backend.start_upload(key)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert self.buf is not None, "write after close"
        self.buf += memoryview(data).cast("B")

    def close(self) -> None:
        if self.buf is None:
            return
        backend = self.driver.backend
        with backend.lock:
            if self.upload_id and self.upload_id not in backend.uploads:
                raise StorageError(f"complete {self.driver.describe(self.key)}: NoSuchUpload")
            self.driver.put(
                self.key,
                bytes(self.buf),
                exclusive=self.exclusive,
                if_generation=self.if_generation,
            )
            backend.uploads.pop(self.upload_id, None)
        self.buf = None

    def abort(self) -> None:
        self.buf = None
        with self.driver.backend.lock:
            self.driver.backend.uploads.pop(self.upload_id, None)


class ObjectModelDriver(Driver):
    """An object store over :class:`ModelBackend` with S3's facts: no rename,
    put-if-absent and compare-and-swap on the generation enforced atomically, multipart
    uploads that linger until completed or aborted. Strategy: marker."""

    protocols = ("objmodel",)
    capabilities = Capabilities(
        atomic_rename=False,
        atomic_create=True,
        durable_fsync=False,
        directories=False,
        multipart_uploads=True,
        # a completion is one conditional put under the backend's lock (AWS S3 as
        # documented), and no scenario commits two layouts of one name, so commits take
        # no claim here: a claim's wait for a live holder is a polling loop, an unbounded
        # branch for the exhaustive search (tried in issue 22: one scenario went from 303
        # schedules to more than two minutes without an end). The claims are tested on the
        # real servers, each actor put between two requests by a held request
        # (tests/commit/test_onefile_claim.py, tests/commit/test_layout_collision.py)
        exclusive_completion=True,
        exclusive_names=True,
    )

    def __init__(self, backend: ModelBackend, url: str = "objmodel://sched") -> None:
        super().__init__(None, "/model", url=url)
        self.backend = backend
        # the model is a conforming store by construction; a cached check would make the
        # replays of one schedule differ
        conformance.skip(self, warn=False)

    @property
    def _objects(self) -> dict[str, StoredObject]:
        return self.backend.objects

    def _present(self, key: str) -> bool:
        return key in self._objects

    def _check(self, key: str, exclusive: bool, if_generation: str | None) -> None:
        if exclusive and self._present(key):
            raise AlreadyExistsError(f"put: already exists: {self.describe(key)}")
        if if_generation is not None:
            obj = self._objects.get(key)
            if obj is None or obj.generation != if_generation:
                raise PreconditionFailedError(
                    f"put: {self.describe(key)} changed since it was read"
                )

    def open_writer(
        self, key: str, *, exclusive: bool = False, if_generation: str | None = None
    ) -> Writer:
        return _ModelWriter(self, key, exclusive, if_generation)

    def put(
        self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None
    ) -> str | None:
        with self.backend.lock:
            self._check(key, exclusive, if_generation)
            obj = self.backend.stamp(data)
            self._objects[key] = obj
            return obj.generation

    def put_volatile(
        self, key: str, data: bytes, *, if_generation: str | None = None
    ) -> str | None:
        return self.put(key, data, if_generation=if_generation)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        with self.backend.lock:
            obj = self._objects.get(key)
            if obj is None:
                raise NotFoundError(f"read: not found: {self.describe(key)}")
            return obj.data[start:end]

    def info(self, key: str) -> FileInfo:
        with self.backend.lock:
            obj = self._objects.get(key)
            if obj is None:
                raise NotFoundError(f"info: not found: {self.describe(key)}")
            return _file_info(key, len(obj.data), obj.mtime, obj.generation)

    def exists(self, key: str) -> bool:
        with self.backend.lock:
            return self._present(key)

    def listdir(
        self, prefix: str = "", objects: dict[str, StoredObject] | None = None
    ) -> list[Entry]:
        with self.backend.lock:
            objs = self._objects if objects is None else objects
            base = f"{prefix.rstrip('/')}/" if prefix else ""
            names: dict[str, bool] = {}
            for k in objs:
                if k.startswith(base):
                    head, sep, _ = k[len(base) :].partition("/")
                    names[head] = names.get(head, False) or bool(sep)
            return [Entry(n, d) for n, d in sorted(names.items())]

    def find(
        self, prefix: str = "", objects: dict[str, StoredObject] | None = None
    ) -> dict[str, FileInfo]:
        with self.backend.lock:
            objs = self._objects if objects is None else objects
            base = f"{prefix.rstrip('/')}/" if prefix else ""
            return {
                k: _file_info(k, len(o.data), o.mtime, o.generation)
                for k, o in sorted(objs.items())
                if k.startswith(base) or (prefix and k == prefix)
            }

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        with self.backend.lock:
            obj = self._objects.get(key)
            if obj is None:
                return  # missing is not an error (also for a conditional delete)
            if if_generation is not None and obj.generation != if_generation:
                raise PreconditionFailedError(
                    f"delete: {self.describe(key)} changed since it was read"
                )
            del self._objects[key]

    def delete_tree(self, prefix: str) -> None:
        with self.backend.lock:
            for k in list(self.find(prefix)):
                del self._objects[k]

    def list_incomplete_uploads(self, prefix: str = "") -> list[tuple[str, str, float]]:
        with self.backend.lock:
            return sorted(
                (key, uid, started)
                for uid, (key, started) in self.backend.uploads.items()
                if not prefix or key == prefix or key.startswith(prefix.rstrip("/") + "/")
            )

    def abort_upload(self, key: str, upload_id: str) -> None:
        with self.backend.lock:
            self.backend.uploads.pop(upload_id, None)


class RenameModelDriver(ObjectModelDriver):
    """Like :class:`atomicstore.drivers.memory.MemoryDriver`: directories are key
    prefixes, and a rename or exchange of a whole prefix is one atomic step (an
    object keeps its generation and mtime when renamed, as an inode does). Strategy:
    rename."""

    protocols = ("renamemodel",)
    capabilities = Capabilities(
        atomic_rename=True,
        atomic_create=True,
        durable_fsync=False,
        directories=True,
        multipart_uploads=False,
    )

    def _children(self, key: str) -> list[str]:
        base = f"{key.rstrip('/')}/"
        return [k for k in self._objects if k.startswith(base)]

    def _present(self, key: str) -> bool:
        return key in self._objects or bool(self._children(key))

    def _take(self, key: str) -> dict[str, StoredObject]:
        if key in self._objects:
            return {"": self._objects.pop(key)}
        base = f"{key.rstrip('/')}/"
        return {k[len(base) :]: self._objects.pop(k) for k in self._children(key)}

    def _place(self, key: str, moving: dict[str, StoredObject]) -> None:
        for rel, obj in moving.items():
            self._objects[f"{key}/{rel}" if rel else key] = obj

    def rename(self, src: str, dst: str) -> None:
        with self.backend.lock:
            if self._present(dst):
                raise AlreadyExistsError(f"rename: already exists: {self.describe(dst)}")
            moving = self._take(src)
            if not moving:
                raise NotFoundError(f"rename: not found: {self.describe(src)}")
            self._place(dst, moving)

    def exchange(self, a: str, b: str) -> None:
        with self.backend.lock:
            va, vb = self._take(a), self._take(b)
            if not va or not vb:
                self._place(a, va)
                self._place(b, vb)
                raise NotFoundError(f"exchange: not found: {self.describe(a if not va else b)}")
            self._place(b, va)
            self._place(a, vb)


# -- operations and their footprints ---------------------------------------------------
#: operations that touch no shared state on the models (run without a choice point)
INVISIBLE = frozenset({"open_writer", "write", "abort", "makedirs", "fsync_dir"})
#: operations that read stored state
READS = frozenset({"read", "read_into", "iter_read", "info", "exists"})
#: points of the harness itself (a call starting, a pause, the store lock): no storage reply
HARNESS_POINTS = frozenset({"call", "pause", "clock_jump", "lock"})
LISTINGS = frozenset({"find", "listdir", "list_uploads"})
WRITES = frozenset(
    {"put", "put_volatile", "close", "delete", "delete_tree", "rename", "exchange"}
    | {"open_upload", "abort_upload"}  # multipart uploads: recovery lists and aborts them
)
_LOCK_RESOURCE = "#lock"


Resource = tuple[str, str]


def resource_of(key: str, *, prefix: bool = False) -> Resource | None:
    """What a key belongs to, for the reduction: ``(name, attempt)`` for the objects of
    one attempt (its staging directory or ``attempt-`` prefix, its lease), ``(name,
    "commit")`` for a checkpoint's commit point and committed files (the marker, a
    committed directory, a one-file checkpoint), ``(name, "trash:...")`` for trash, and
    ``(name, "*")`` for a listing or removal of a whole name. None: it may cover several
    names (the root, a reserved directory). Scenario names contain no dot, so
    ``<name>.<attempt>`` splits safely."""
    parts = key.split("/")
    if parts[0] == RESERVED:
        if len(parts) >= 3 and parts[1] in ("staging", "trash", "leases") and parts[2]:
            stem = parts[2].removesuffix(".json") if parts[1] == "leases" else parts[2]
            name, _, rest = stem.partition(".")
            if parts[1] == "trash":
                return (name, "trash:" + rest)
            return (name, rest or "*")
        return None
    if not parts[0]:
        return None
    if len(parts) >= 2 and parts[1].startswith("attempt-"):
        return (parts[0], parts[1][len("attempt-") :])
    if len(parts) == 1 and prefix:
        return (parts[0], "*")
    return (parts[0], "commit")


def _overlap(w: Resource, x: Resource) -> bool:
    """Does writing ``w`` interfere with an access to ``x``? Writing a commit point
    interferes with everything of that name (it decides which attempt is live)."""
    return w[0] == x[0] and (w[1] == x[1] or "*" in (w[1], x[1]) or w[1] == "commit")


@dataclass(frozen=True)
class Footprint:
    """What a transition reads and writes (for the reduction)."""

    reads: frozenset[Resource] = frozenset()
    writes: frozenset[Resource] = frozenset()
    read_all: bool = False
    write_all: bool = False

    @property
    def empty(self) -> bool:
        return not (self.reads or self.writes or self.read_all or self.write_all)

    def conflicts(self, other: Footprint) -> bool:
        """True if the two transitions do not commute."""
        if self.empty or other.empty:
            return False
        if self.write_all or other.write_all:
            return True
        if (self.read_all and other.writes) or (other.read_all and self.writes):
            return True
        return any(_overlap(w, x) for w in self.writes for x in other.reads | other.writes) or any(
            _overlap(w, x) for w in other.writes for x in self.reads
        )

    def __or__(self, other: Footprint) -> Footprint:
        return Footprint(
            self.reads | other.reads,
            self.writes | other.writes,
            self.read_all or other.read_all,
            self.write_all or other.write_all,
        )


EVERYTHING = Footprint(write_all=True)
LOCK_FOOTPRINT = Footprint(writes=frozenset({(_LOCK_RESOURCE, "*")}))
#: the start of a library call: it reads the clock, so it is ordered only against jumps
CLOCK_READ = Footprint(reads=frozenset({("#clock", "*")}))


@dataclass(frozen=True)
class Op:
    """One primitive call as the scheduler sees it."""

    kind: str
    key: str = ""
    key2: str = ""  # rename / exchange target
    cond: str = ""  # "excl", "gen=<g>" or ""

    @property
    def invisible(self) -> bool:
        return self.kind in INVISIBLE

    @property
    def base_kind(self) -> str:
        return self.kind.removeprefix("retry:")

    def label(self) -> str:
        tgt = f" -> {self.key2}" if self.key2 else ""
        cond = f" [{self.cond}]" if self.cond else ""
        return f"{self.kind}({self.key}{tgt}){cond}"

    def footprint(self) -> Footprint:
        kind = self.base_kind
        if kind in INVISIBLE:
            return Footprint()
        if kind == "lock":
            return LOCK_FOOTPRINT
        if kind in ("pause", "clock_jump"):
            return EVERYTHING  # every actor reads the clock
        if kind == "call":
            return CLOCK_READ
        listing = kind in LISTINGS or kind == "delete_tree"
        names = [resource_of(self.key, prefix=listing)]
        if self.key2:
            names.append(resource_of(self.key2))
        if kind in ("rename", "exchange"):
            names = [resource_of(self.key, prefix=True), resource_of(self.key2, prefix=True)]
        known = frozenset(n for n in names if n)
        if kind in READS or kind in LISTINGS:
            return Footprint(reads=known) if len(known) == len(names) else Footprint(read_all=True)
        return Footprint(writes=known) if len(known) == len(names) else EVERYTHING


# -- faults ----------------------------------------------------------------------------
FAULT_KINDS = ("crash", "lost_reply", "lost_reply_error", "stale_listing", "clock_jump")


@dataclass(frozen=True)
class Fault:
    """A fault at an actor's ``at``-th operation (0-based, counting every scheduling point
    of that actor, invisible ones and lost-reply retries included)."""

    kind: str
    actor: str
    at: int
    delta: float = 0.0  # clock_jump: seconds
    scope: str = "all"  # clock_jump: all | others | self

    def __post_init__(self) -> None:
        assert self.kind in FAULT_KINDS, self.kind

    def __str__(self) -> str:
        extra = f" {self.delta:+.0f}s {self.scope}" if self.kind == "clock_jump" else ""
        return f"{self.kind}@{self.actor}#{self.at}{extra}"


# -- what actors were told -------------------------------------------------------------
#: outcomes that say definitely "nothing happened" (the contract's refusals)
DEFINITE_REFUSALS = frozenset(
    {
        "CommitConflictError",
        "LeaseLostError",
        "NotFoundError",
        "PreconditionFailedError",
        "AlreadyExistsError",
    }
)


@dataclass
class Event:
    """One library call of an actor and what it was told."""

    eid: int
    kind: str  # save | delete | recover | read | onefile | write_file | list
    actor: str
    name: str = ""
    overwrite: bool = False
    files: dict[str, bytes] = field(
        default_factory=dict
    )  # save: what it wrote; onefile: {"": data}
    attempt: str | None = None
    first_step: int | None = None
    last_step: int | None = None
    begin_epoch: int | None = None  # the generation this call read before its first write
    begin_read: bool = False
    wrote: bool = False
    outcome: str = "running"  # ok | crash | <exception class name>
    error: str = ""
    reads: list[ReadResult] = field(default_factory=list)  # reader

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def definite_failure(self) -> bool:
        return self.outcome in DEFINITE_REFUSALS

    def describe(self) -> str:
        what = f"{self.kind}({self.name}{', overwrite' if self.overwrite else ''})"
        err = f" [{self.error[:160]}]" if self.error and not self.ok else ""
        return f"{self.actor}:{what} -> {self.outcome}{err}"


@dataclass
class ReadResult:
    """One checkpoint a reader read: its manifest attempt and bytes, or the error."""

    name: str
    start_step: int
    end_step: int = 0
    attempt: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    error: str = ""
    complete: bool = False  # read to the end (not cut short by a crash)
    storage_fault: bool = False  # failed on a storage error, not on what it read


_LOCAL = threading.local()


def current() -> ActorCtx:
    """The context of the actor running in this thread."""
    ctx = getattr(_LOCAL, "ctx", None)
    assert ctx is not None, "not called from an actor thread"
    return ctx


@contextlib.contextmanager
def _event(kind: str, name: str = "", **detail: Any) -> Iterator[Event]:
    """Record one library call of the current actor and its outcome. A simulated crash
    ends the actor; other exceptions are recorded and swallowed (the actor goes on)."""
    ctx = current()
    ev = Event(ctx.sched.world.next_eid(), kind, ctx.name, name, **detail)
    ctx.sched.world.events.append(ev)
    try:
        # the call starts (and the library reads the actor's clock) at a point of its own
        ctx.sched.point(ctx, Op("call", cond=f"{kind} {name}".strip()), lambda: None)
        ctx.event = ev
        yield ev
    except SimulatedCrash as exc:
        ev.outcome, ev.error = "crash", str(exc)
        raise
    except _Aborted:
        ev.outcome = "aborted"
        raise
    except Exception as exc:  # noqa: BLE001 - recorded: what the caller was told
        ev.outcome, ev.error = type(exc).__name__, str(exc)
    else:
        ev.outcome = "ok"
    finally:
        ctx.event = None


def payload(actor: str, name: str, n: int = 1) -> dict[str, bytes]:
    """Small files unique to one writer of one name (so a reader can tell whose they are)."""
    return {f"f{i}.bin": f"{name}:{actor}:{i}".encode() * 3 for i in range(n)}


# -- actor programs' building blocks ---------------------------------------------------
def save(
    st: atomicstore.Store, name: str, files: dict[str, bytes], *, overwrite: bool = False
) -> None:
    """A transaction writing ``files`` under ``name``, committed on exit."""
    with _event("save", name, overwrite=overwrite, files=dict(files)) as ev:
        with st.transaction(name, overwrite=overwrite) as txn:
            ev.attempt = txn.attempt
            for path, data in files.items():
                txn.write_bytes(path, data)


def zombie_save(
    st: atomicstore.Store,
    name: str,
    files: dict[str, bytes],
    *,
    pause: float,
    scope: str = "all",
    overwrite: bool = False,
) -> None:
    """A save whose process is stopped after writing its files, before it commits, while
    time moves on by ``pause`` seconds (``scope="others"``: its own clock stopped too, as
    in a frozen VM; ``"all"``: as after SIGSTOP/SIGCONT)."""
    with _event("save", name, overwrite=overwrite, files=dict(files)) as ev:
        with st.transaction(name, overwrite=overwrite) as txn:
            ev.attempt = txn.attempt
            for path, data in files.items():
                txn.write_bytes(path, data)
            pause_here(pause, scope)


def pause_here(delta: float, scope: str = "all") -> None:
    """The current actor is paused here while ``delta`` seconds pass (see
    :meth:`VirtualClock.jump`). The moment time moves on is a scheduling point, so every
    order of it and the other actors' operations is explored."""
    ctx = current()
    ctx.sched.point(
        ctx,
        Op("pause", cond=f"{delta:+.0f}s {scope}"),
        lambda: ctx.sched.jump(ctx, delta, scope, why="pause"),
    )


def delete(st: atomicstore.Store, name: str) -> None:
    with _event("delete", name):
        st.delete(name)


def recover(st: atomicstore.Store) -> None:
    """One recovery pass, reading the actor's clock (``now=`` for a library without
    ``Store(clock=)``)."""
    ctx = current()
    with _event("recover"):
        ctx.role = "recovery"
        try:
            if STORE_HAS_CLOCK:
                st.recover()
            else:
                st.recover(now=ctx.sched.world.clock.of(ctx.name))
        finally:
            ctx.role = ""


def read_all(st: atomicstore.Store) -> None:
    """A reader: list, then open, verify and read every checkpoint."""
    ctx = current()
    world = ctx.sched.world
    with _event("read") as ev:
        names = st.list()
        for name in names:
            res = ReadResult(name, world.step)
            ev.reads.append(res)
            try:
                ck = st.open(name)
                res.attempt = ck.manifest.attempt
                ck.verify()
                res.files = {p: ck.read_bytes(p) for p in sorted(ck.files)}
                res.complete = True
            except StorageError as exc:  # a storage fault (injected): not about the data
                res.error, res.storage_fault = f"{type(exc).__name__}: {exc}", True
            except Exception as exc:  # noqa: BLE001 - judged against the history later
                res.error = f"{type(exc).__name__}: {exc}"
            res.end_step = world.step


def retention(st: atomicstore.Store, new: str, files: dict[str, bytes], *, keep: int = 2) -> None:
    """A manager step: save ``new``, then delete all but the newest ``keep``."""
    save(st, new, files)
    with _event("list") as ev:
        names = st.list()
    if not ev.ok:
        return
    for name in names[: max(0, len(names) - keep)]:
        delete(st, name)


def one_file(st: atomicstore.Store, name: str, data: bytes, *, overwrite: bool = False) -> None:
    """A one-file (flax layout) save."""
    with _event("onefile", name, overwrite=overwrite, files={"": data}) as ev:
        with st.one_file(name, overwrite=overwrite) as f:
            ev.attempt = f.attempt
            f.write(data)


def write_file(st: atomicstore.Store, path: str, data: bytes, *, overwrite: bool = False) -> None:
    with _event("write_file", path, overwrite=overwrite, files={"": data}):
        st.write_file(path, data, overwrite=overwrite)


class _Aborted(BaseException):
    """The run was abandoned (watchdog or another actor's failure): unwind quietly."""


# -- the instrumented driver -----------------------------------------------------------
class _SchedWriter(Writer):
    """A writer whose ``write``/``close``/``abort`` are scheduling points; keeps the bytes
    so that a close whose reply was lost can be re-issued as the same request. As the
    real drivers' writers do (``BufferedPartWriter`` reads a small object back, the S3
    writer compares the multipart ETag), a refused retry whose object is this writer's
    own bytes counts as success: reconciling a lost completion is the driver's job."""

    def __init__(
        self, drv: SchedDriver, key: str, inner: Writer, exclusive: bool, if_generation: str | None
    ) -> None:
        self.drv, self.key, self.inner = drv, key, inner
        self.kw = _cond_kwargs(exclusive, if_generation)
        self.cond = _cond_label(exclusive, if_generation)
        self.data = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.drv._call(Op("write", self.key), lambda: self.inner.write(data))
        self.data += memoryview(data).cast("B")

    def close(self) -> None:
        data = bytes(self.data)
        inner = self.drv.inner

        def retry() -> None:
            try:
                inner.put(self.key, data, **self.kw)
            except AlreadyExistsError:
                try:
                    landed = inner.read(self.key) == data
                except NotFoundError:
                    landed = False
                if not landed:
                    raise

        self.drv._call(Op("close", self.key, cond=self.cond), self.inner.close, retry=retry)

    def abort(self) -> None:
        kind = "abort_upload" if self.drv.capabilities.multipart_uploads else "abort"
        self.drv._call(Op(kind, self.key), self.inner.abort)


def _cond_label(exclusive: bool, if_generation: str | None) -> str:
    if if_generation is not None:
        return f"gen={if_generation}"
    return "excl" if exclusive else ""


class SchedDriver(Driver):
    """Any driver behind the scheduler: same facts, every primitive a scheduling point.

    Calls from threads other than its actor's (lease heartbeats) pass straight through.
    ``lock()`` is modelled by the scheduler: taking it is a scheduling point enabled only
    while no other actor holds it; releasing it is not a point.
    """

    def __init__(self, inner: Driver, sched: Scheduler, actor: str) -> None:  # noqa: D107
        self.inner, self.sched, self.actor = inner, sched, actor
        self.capabilities = inner.capabilities  # type: ignore[misc]
        self.url, self.root = inner.url, inner.root
        self.retry, self.operation_timeout = inner.retry, inner.operation_timeout
        self.block_size = inner.block_size
        self._secrets = ()
        conformance.skip(self, warn=False)  # (the scheduled actors' requests only)
        #: rename backends delete a tree in one step (memory); object stores key by key
        self.atomic_tree = inner.capabilities.atomic_rename

    def describe(self, key: str = "") -> str:
        return self.inner.describe(key)

    def _ctx(self) -> ActorCtx | None:
        ctx = getattr(_LOCAL, "ctx", None)
        if ctx is None or ctx.name != self.actor or ctx.sched is not self.sched:
            return None
        return ctx

    def _call(
        self,
        op: Op,
        fn: Callable[[], Any],
        *,
        retry: Callable[[], Any] | None = None,
        stale: Callable[[], Any] | None = None,
    ) -> Any:
        ctx = self._ctx()
        if ctx is None:
            return fn()
        return self.sched.point(ctx, op, fn, retry=retry, stale=stale)

    # writes
    def open_writer(
        self, key: str, *, exclusive: bool = False, if_generation: str | None = None
    ) -> Writer:
        kw = _cond_kwargs(exclusive, if_generation)
        if self._ctx() is None:
            return self.inner.open_writer(key, **kw)
        # a multipart upload starts when the writer opens: visible (recovery lists it)
        kind = "open_upload" if self.capabilities.multipart_uploads else "open_writer"
        w = self._call(
            Op(kind, key, cond=_cond_label(exclusive, if_generation)),
            lambda: self.inner.open_writer(key, **kw),
        )
        return _SchedWriter(self, key, w, exclusive, if_generation)

    def put(
        self, key: str, data: bytes, *, exclusive: bool = False, if_generation: str | None = None
    ) -> str | None:
        kw = _cond_kwargs(exclusive, if_generation)
        data = bytes(data)
        return self._call(
            Op("put", key, cond=_cond_label(exclusive, if_generation)),
            lambda: self.inner.put(key, data, **kw),
            retry=lambda: self.inner.put(key, data, **kw),
        )

    def put_volatile(
        self, key: str, data: bytes, *, if_generation: str | None = None
    ) -> str | None:
        kw = _cond_kwargs(False, if_generation)
        data = bytes(data)
        return self._call(
            Op("put_volatile", key, cond=_cond_label(False, if_generation)),
            lambda: self.inner.put_volatile(key, data, **kw),
            retry=lambda: self.inner.put_volatile(key, data, **kw),
        )

    def delete(self, key: str, *, if_generation: str | None = None) -> None:
        kw = _cond_kwargs(False, if_generation)
        self._call(
            Op("delete", key, cond=_cond_label(False, if_generation)),
            lambda: self.inner.delete(key, **kw),
            retry=lambda: self.inner.delete(key, **kw),
        )

    def delete_tree(self, prefix: str) -> None:
        if self._ctx() is None:
            return self.inner.delete_tree(prefix)
        if self.atomic_tree:
            return self._call(Op("delete_tree", prefix), lambda: self.inner.delete_tree(prefix))
        for key in sorted(self.find(prefix), reverse=True):  # one request per object
            self.delete(key)
        return None

    def rename(self, src: str, dst: str) -> None:
        self._call(Op("rename", src, dst), lambda: self.inner.rename(src, dst))

    def exchange(self, a: str, b: str) -> None:
        self._call(Op("exchange", a, b), lambda: self.inner.exchange(a, b))

    def makedirs(self, key: str) -> None:
        self._call(Op("makedirs", key), lambda: self.inner.makedirs(key))

    def fsync_dir(self, key: str) -> None:
        self._call(Op("fsync_dir", key), lambda: self.inner.fsync_dir(key))

    def abort_upload(self, key: str, upload_id: str) -> None:
        self._call(Op("abort_upload", key), lambda: self.inner.abort_upload(key, upload_id))

    # reads
    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self._call(Op("read", key), lambda: self.inner.read(key, start, end))

    def read_into(self, key: str, offset: int, out: memoryview, *, generation: str | None = None) -> int:
        return self._call(Op("read_into", key),
                          lambda: self.inner.read_into(key, offset, out, generation=generation))

    def iter_read(self, key: str, chunk_size: int | None = None) -> Iterator[bytes]:
        # one point for the whole (small) object: the chunks are read at once
        chunks = self._call(
            Op("iter_read", key), lambda: list(self.inner.iter_read(key, chunk_size))
        )
        yield from chunks

    def info(self, key: str) -> FileInfo:
        return self._call(Op("info", key), lambda: self.inner.info(key))

    def exists(self, key: str) -> bool:
        return self._call(Op("exists", key), lambda: self.inner.exists(key))

    def _listing(
        self,
        kind: str,
        prefix: str,
        fresh: Callable[[], Any],
        from_snapshot: Callable[[dict[str, StoredObject]], Any] | None,
    ) -> Any:
        ctx = self._ctx()
        if ctx is None:
            return fresh()

        def fresh_cached() -> Any:
            out = fresh()
            ctx.listing_cache[(kind, prefix)] = out
            return out

        def stale() -> Any:
            if (kind, prefix) in ctx.listing_cache:
                return ctx.listing_cache[(kind, prefix)]
            if ctx.start_snapshot is not None and from_snapshot is not None:
                return from_snapshot(ctx.start_snapshot)
            return fresh()  # no earlier answer to repeat (the fakes keep no snapshot)

        return self._call(Op(kind, prefix), fresh_cached, stale=stale)

    def listdir(self, prefix: str = "") -> list[Entry]:
        snap = None
        if isinstance(self.inner, ObjectModelDriver):
            inner = self.inner
            snap = lambda objs: inner.listdir(prefix, objs)  # noqa: E731
        return self._listing("listdir", prefix, lambda: self.inner.listdir(prefix), snap)

    def find(self, prefix: str = "") -> dict[str, FileInfo]:
        snap = None
        if isinstance(self.inner, ObjectModelDriver):
            inner = self.inner
            snap = lambda objs: inner.find(prefix, objs)  # noqa: E731
        return self._listing("find", prefix, lambda: self.inner.find(prefix), snap)

    def list_incomplete_uploads(self, prefix: str = "") -> list[tuple[str, str, float]]:
        return self._call(
            Op("list_uploads", prefix), lambda: self.inner.list_incomplete_uploads(prefix)
        )

    # the store lock
    def lock(self, timeout: float = 60.0) -> contextlib.AbstractContextManager[None]:
        ctx = self._ctx()
        if ctx is None:
            inner_lock = getattr(self.inner, "lock", None)
            return inner_lock(timeout) if inner_lock is not None else contextlib.nullcontext()
        return self._sched_lock(ctx)

    @contextlib.contextmanager
    def _sched_lock(self, ctx: ActorCtx) -> Iterator[None]:
        self.sched.point(ctx, Op("lock"), lambda: self.sched.take_lock(ctx))
        try:
            yield
        finally:
            self.sched.release_lock(ctx)

    def close(self) -> None:
        """The inner driver is shared by every actor: nothing to release here."""


# -- scenarios -------------------------------------------------------------------------
Program = Callable[[atomicstore.Store], None]


@dataclass
class Scenario:
    """Actors, the store they start from, and the faults of one schedule family.

    ``checkpoints`` are the (transaction) checkpoint names the invariants watch,
    ``onefiles`` one-file checkpoints, ``root_files`` files written by ``write_file``;
    ``initial`` names are committed (by writer ``setup``) before the actors start.
    ``clock_offsets`` set an actor's clock ahead (or behind) from the start.
    ``check``, if given, adds invariants of the scenario's own: it is called with the
    finished :class:`World` (every actor done, the store as they left it, before the
    checker's final recovery) and returns violations, reported like those of
    :func:`check_run`. It must not change the store (copy it: :meth:`ModelBackend.copy`).
    """

    name: str
    backend: str  # "object" | "rename" (models), or a label for an injected driver
    actors: dict[str, Program]
    checkpoints: tuple[str, ...] = ("A",)
    onefiles: tuple[str, ...] = ()
    root_files: tuple[str, ...] = ()
    initial: tuple[str, ...] = ()
    clock_offsets: dict[str, float] = field(default_factory=dict)
    faults: tuple[Fault, ...] = ()
    check: Callable[[World], list[str]] | None = None

    def __post_init__(self) -> None:
        for n in (*self.checkpoints, *self.onefiles, *self.root_files):
            assert "." not in n and "/" not in n, f"scenario names must be plain: {n!r}"

    def with_faults(self, faults: Sequence[Fault]) -> Scenario:
        return dataclasses.replace(self, faults=tuple(faults))

    def describe(self) -> str:
        faults = ", ".join(map(str, self.faults)) or "none"
        return f"{self.name} [{self.backend}] faults: {faults}"


@dataclass
class Transition:
    """A change of what a name's commit point holds, and who made it."""

    name: str
    step: int
    actor: str
    eid: int | None
    from_epoch: int
    to_epoch: int
    from_id: str | None
    to_id: str | None


@dataclass
class RecoveryTouch:
    """Objects a recovery actor removed (or renamed away) at one step."""

    step: int
    actor: str
    op: str
    keys: frozenset[str]
    live: frozenset[str]  # of those, keys of a checkpoint committed at that moment
    owners: dict[str, tuple[str, int | None]]  # key -> (actor, event) that wrote it
    in_flight: dict[str, str] = field(default_factory=dict)  # key -> why its save was live


@dataclass
class TraceEntry:
    step: int
    actor: str
    index: int
    what: str
    outcome: str = ""
    op: Op | None = None  # None for notes (crash, clock jump)

    def render(self) -> str:
        return f"{self.step:4d} {self.actor:>4} #{self.index:<3d} {self.what}" + (
            f" -> {self.outcome}" if self.outcome else ""
        )


class World:
    """Everything one run observes: the store (read directly, never scheduled), the
    history of each watched name's commit point, what recovery removed, what every actor
    was told, and the trace."""

    def __init__(
        self, scenario: Scenario, inner: Driver, clock: VirtualClock, backend: ModelBackend | None
    ) -> None:
        self.scenario, self.inner, self.clock, self.backend = scenario, inner, clock, backend
        self.marker_mode = not inner.capabilities.atomic_rename
        self.step = 0
        self.events: list[Event] = []
        self.trace: list[TraceEntry] = []
        self.transitions: list[Transition] = []
        self.touches: list[RecoveryTouch] = []
        self.written_by: dict[str, tuple[str, int | None]] = {}
        self.ctxs: dict[str, ActorCtx] = {}  # set by the scheduler
        self.step_clocks: dict[
            int, tuple[float, float]
        ] = {}  # step -> (storage, latest actor clock)
        self.names = (*scenario.checkpoints, *scenario.onefiles, *scenario.root_files)
        self.state: dict[str, str | None] = {n: self.state_id(n) for n in self.names}
        self.initial = dict(self.state)
        self.epoch: dict[str, int] = dict.fromkeys(self.names, 0)
        self._eids = itertools.count(1)

    def next_eid(self) -> int:
        return next(self._eids)

    # reading storage directly
    def commit_key(self, name: str) -> str:
        if name in self.scenario.checkpoints:
            return f"{name}/{MARKER_FILE}" if self.marker_mode else f"{name}/{MANIFEST_FILE}"
        return name

    def raw(self, key: str) -> bytes | None:
        if self.backend is not None:
            obj = self.backend.objects.get(key)
            return None if obj is None else obj.data
        try:
            return self.inner.read(key)
        except NotFoundError:
            return None

    def uploads(self) -> list[tuple[str, str, float]]:
        """Unfinished multipart uploads (garbage once their save is dead)."""
        if self.inner.capabilities.multipart_uploads:
            return self.inner.list_incomplete_uploads("")
        return []

    def keys(self, prefix: str = "") -> set[str]:
        if self.backend is not None:
            base = f"{prefix}/" if prefix else ""
            return {k for k in self.backend.objects if k.startswith(base) or k == prefix}
        found = set(self.inner.find(prefix))
        if prefix and self.raw(prefix) is not None:
            found.add(prefix)
        return found

    def state_id(self, name: str) -> str | None:
        """What ``name``'s commit point holds: the attempt a marker or manifest names,
        or a digest of a one-file checkpoint; None if nothing."""
        raw = self.raw(self.commit_key(name))
        if raw is None:
            return None
        if name in self.scenario.checkpoints:
            try:
                return str(json.loads(raw)["attempt"])
            except (ValueError, KeyError, TypeError):
                return "unreadable:" + hashlib.sha256(raw).hexdigest()[:12]
        return "bytes:" + hashlib.sha256(raw).hexdigest()[:12]

    def live_keys(self) -> dict[str, str]:
        """Objects of the checkpoints committed right now: key -> name."""
        out: dict[str, str] = {}
        for name in self.scenario.checkpoints:
            sid = self.state_id(name)
            if sid is None:
                continue
            if self.marker_mode:
                out[f"{name}/{MARKER_FILE}"] = name
                base = f"{name}/attempt-{sid}/"
                out.update({k: name for k in self.keys(name) if k.startswith(base)})
            else:
                out.update({k: name for k in self.keys(name) if k.startswith(f"{name}/")})
        for name in (*self.scenario.onefiles, *self.scenario.root_files):
            if self.raw(name) is not None:
                out[name] = name
        return out

    # hooks called by the scheduler around every granted operation (in the actor thread)
    def before_op(self, ctx: ActorCtx, op: Op, step: int) -> None:
        kind = op.base_kind
        ev = ctx.event
        if ev is not None and ev.name in self.epoch and not ev.wrote:
            # the generation a call began from: the last commit point it read before its
            # first write, else what was committed at its first write (both are ordered
            # against every commit of that name, as the reduction requires)
            if kind in READS and op.key in (ev.name, self.commit_key(ev.name)):
                ev.begin_epoch, ev.begin_read = self.epoch[ev.name], True
            elif kind in WRITES:
                if not ev.begin_read:
                    ev.begin_epoch = self.epoch[ev.name]
                ev.wrote = True
        if kind in ("read", "info", "exists") and op.key in ctx.own_leases:
            ctx.lease_checks.append((step, self.clock.of(ctx.name)))
        removing = ("delete", "delete_tree", "rename", "exchange", "abort_upload")
        if ctx.role == "recovery" and kind in removing:
            if kind == "abort_upload":
                open_ = {key for key, _uid, _t in self.uploads()}
                keys = {f"upload:{op.key}"} if op.key in open_ else set()
            elif kind == "delete":
                keys = {op.key} if self.raw(op.key) is not None else set()
            else:
                keys = self.keys(op.key) | (self.keys(op.key2) if kind == "exchange" else set())
            live = self.live_keys()
            owners = {k: self.written_by[k] for k in keys if k in self.written_by}
            now = self.clock.of(ctx.name)
            in_flight = {}
            for k, (actor, eid) in owners.items():
                why = self.in_flight(actor, eid, now)
                if why:
                    in_flight[k] = why
            self.touches.append(
                RecoveryTouch(
                    step,
                    ctx.name,
                    op.label(),
                    frozenset(keys),
                    frozenset(k for k in keys if k in live),
                    owners,
                    in_flight,
                )
            )

    def in_flight(self, actor: str, eid: int | None, now: float) -> str:
        """Why the save ``eid`` of ``actor`` is still in flight, as a recovery whose clock
        reads ``now`` must see it ('' if it is not): its writer is alive and within that
        save, and its lease was renewed less than ``ttl + grace`` ago, or it holds no lease
        at all (a live save recovery cannot tell from a dead one: the issue's row 6)."""
        ev = next((e for e in self.events if e.eid == eid), None)
        ctx = self.ctxs.get(actor)
        if ev is None or ctx is None or ctx.crashed or ev.outcome != "running":
            return ""
        leases = [
            mtime
            for key, (step, mtime, _own) in ctx.own_leases.items()
            if (ev.attempt and ev.attempt in key) or (ev.first_step or 0) <= step
        ]
        if leases:
            age = now - max(leases)
            return f"its lease is {age:.0f}s old (< ttl + grace)" if age < TTL + GRACE else ""
        return "its writer is alive and holds no lease"

    def after_op(self, ctx: ActorCtx, op: Op, step: int, *, told_ok: bool = True) -> None:
        kind = op.base_kind
        eid = ctx.event.eid if ctx.event is not None else None
        if kind == "open_upload" and told_ok:  # else nobody holds the upload: an orphan
            self.written_by[f"upload:{op.key}"] = (ctx.name, eid)
        if kind in ("put", "put_volatile", "close") and self.raw(op.key) is not None:
            self.written_by.setdefault(op.key, (ctx.name, eid))
            if op.key.startswith(LEASES + "/") and ctx.role != "recovery":
                ctx.own_leases[op.key] = (step, self.clock.now(), self.clock.of(ctx.name))
        elif kind in ("rename", "exchange"):
            self._move(op.key, op.key2, swap=kind == "exchange")
        if kind not in READS | LISTINGS | INVISIBLE | HARNESS_POINTS:
            self.observe(step, ctx.name, eid)

    def _move(self, src: str, dst: str, *, swap: bool) -> None:
        def sub(key: str, a: str, b: str) -> str | None:
            if key == a:
                return b
            return b + key[len(a) :] if key.startswith(a + "/") else None

        moved: dict[str, tuple[str, int | None]] = {}
        for key, who in list(self.written_by.items()):
            new = sub(key, src, dst) or (sub(key, dst, src) if swap else None)
            if new is not None:
                del self.written_by[key]
                moved[new] = who
        self.written_by.update(moved)

    def observe(self, step: int, actor: str, eid: int | None) -> None:
        """Record every change of a watched name's commit point (made by ``actor``)."""
        for name in self.names:
            sid = self.state_id(name)
            if sid != self.state[name]:
                self.epoch[name] += 1
                self.transitions.append(
                    Transition(
                        name,
                        step,
                        actor,
                        eid,
                        self.epoch[name] - 1,
                        self.epoch[name],
                        self.state[name],
                        sid,
                    )
                )
                self.state[name] = sid

    def id_at(self, name: str, epoch: int) -> str | None:
        """What ``name``'s commit point held at ``epoch`` (its generation: an attempt id).
        Generations are unique except "nothing", so comparing them is what a
        compare-and-swap does (a create-if-absent may see absent, present, absent)."""
        for t in self.transitions:
            if t.name == name and t.to_epoch == epoch:
                return t.to_id
        return self.initial[name]

    # rendering
    def attempt_labels(self) -> dict[str, str]:
        labels: dict[str, str] = {}
        counts: dict[str, int] = {}
        for ev in self.events:
            if ev.attempt and ev.attempt not in labels:
                counts[ev.actor] = counts.get(ev.actor, 0) + 1
                labels[ev.attempt] = f"<{ev.actor}#{counts[ev.actor]}>"
        return labels

    def normalise(self, text: str) -> str:
        labels = self.attempt_labels()
        text = _ATTEMPT_ID.sub(lambda m: labels.get(m.group(0), "<attempt?>"), text)
        return _TRASH_SUFFIX.sub("<hex>", text)

    def render_trace(self) -> list[str]:
        return [self.normalise(t.render()) for t in self.trace]


# -- the scheduler ---------------------------------------------------------------------
NEW, WAITING, RUNNING, DONE = "new", "waiting", "running", "done"


class _Signal:
    """A wake-up for one waiting thread: a binary semaphore over a raw lock (cheaper
    than an Event or a Condition). Signals given while nobody waits collapse into one;
    a waiter re-checks the state it waits for, so a spurious wake-up is harmless."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._guard = threading.Lock()

    def set(self) -> None:
        with self._guard:
            if self._lock.locked():
                self._lock.release()

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=timeout)


class _Worker:
    """A thread that runs actors' programs, one after another: schedules reuse them
    instead of starting a thread per actor per schedule (starting a thread and waiting
    for it to run costs as much as several scheduling steps). A worker whose program did
    not end (a hung run, abandoned by the watchdog) is never reused."""

    _idle: list[_Worker] = []
    _idle_lock = threading.Lock()

    def __init__(self) -> None:
        self.go = _Signal()
        self.job: tuple[Callable[[], None], _Signal] | None = None
        self.thread = threading.Thread(target=self._loop, name="actor-idle", daemon=True)
        self.thread.start()

    @classmethod
    def run(cls, fn: Callable[[], None], name: str) -> tuple[threading.Thread, _Signal]:
        """Run ``fn`` in an idle worker (a new one if none is idle); returns the worker's
        thread and a signal set when ``fn`` has returned."""
        with cls._idle_lock:
            worker = cls._idle.pop() if cls._idle else None
        if worker is None:
            worker = cls()
        done = _Signal()
        worker.thread.name = name
        worker.job = (fn, done)
        worker.go.set()
        return worker.thread, done

    def _loop(self) -> None:
        while True:
            if not self.go.wait(3600.0) or self.job is None:
                continue
            fn, done = self.job
            try:
                fn()  # Scheduler._main: catches everything
            finally:
                self.job = None
                self.thread.name = "actor-idle"
                with self._idle_lock:
                    self._idle.append(self)
                done.set()


@dataclass
class ChoiceState:
    """What an explorer sees at a choice point."""

    enabled: list[str]
    pending: dict[str, Footprint]  # every waiting actor, enabled or not
    last: str | None


class Explorer:
    """Chooses the next actor at each choice point (subclasses: DPOR/DFS, random, replay)."""

    def start_run(self) -> None:
        """Called before every schedule."""

    def choose(self, state: ChoiceState) -> str:
        raise NotImplementedError

    def executed(self, actor: str, fp: Footprint) -> None:
        """The chosen transition ran; ``fp`` is its footprint."""


class ReplayExplorer(Explorer):
    """Follows a recorded choice sequence, then keeps running the same actor."""

    def __init__(self, choices: Sequence[str] = ()) -> None:
        self.choices = list(choices)
        self.made: list[str] = []

    def start_run(self) -> None:
        self.made = []

    def choose(self, state: ChoiceState) -> str:
        i = len(self.made)
        if i < len(self.choices):
            c = self.choices[i]
            if c not in state.enabled:
                raise NondeterminismError(
                    f"replay: choice {i} ({c}) is not enabled: {state.enabled}"
                )
        else:
            c = state.last if state.last in state.enabled else state.enabled[0]
        self.made.append(c)
        return c


class RandomExplorer(ReplayExplorer):
    """Uniformly random among the enabled actors, seeded."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.rng = random.Random(seed)

    def start_run(self) -> None:
        super().start_run()
        self.rng = random.Random(self.seed)

    def choose(self, state: ChoiceState) -> str:
        c = self.rng.choice(state.enabled)
        self.made.append(c)
        return c


class NondeterminismError(AssertionError):
    """A replay diverged from the run it replays."""


class RunFailure(AssertionError):
    """A schedule could not complete (deadlock, watchdog)."""


@dataclass
class ActorCtx:
    """One actor: its program, store, thread and scheduling state."""

    name: str
    program: Program
    sched: Scheduler
    store: atomicstore.Store | None = None
    thread: threading.Thread | None = None
    state: str = NEW
    granted: bool = False
    pending: Op | None = None
    pending_index: int = -1
    index: int = 0  # scheduling points reached so far
    crashed: bool = False
    holds_lock: bool = False
    lock_changed: bool = False
    tail_everything: bool = False  # the running transition moved the clock or read stale
    role: str = ""
    event: Event | None = None
    outcome: str = ""
    own_leases: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    lease_checks: list[tuple[int, float]] = field(default_factory=list)
    listing_cache: dict[tuple[str, str], Any] = field(default_factory=dict)
    start_snapshot: dict[str, StoredObject] | None = None
    #: wakes this actor's thread when it is granted (or the run is aborted)
    wake: _Signal = field(default_factory=_Signal)
    #: set once the program (run by a :class:`_Worker`) has returned
    finished: _Signal | None = None


class Scheduler:
    """Runs the actors one operation at a time in the order an :class:`Explorer` picks."""

    def __init__(
        self,
        world: World,
        explorer: Explorer,
        *,
        eager_invisible: bool = True,
        watchdog: float = WATCHDOG,
    ) -> None:
        self.world, self.explorer = world, explorer
        self.eager_invisible, self.watchdog = eager_invisible, watchdog
        # hand-off: only the actor granted is woken (``ActorCtx.wake``), by the thread
        # that chose it; the main thread starts the actors, takes the first turn and is
        # woken at the end (``main_wake``)
        self.main_wake = _Signal()
        self.driving = False  # the actors take the turns (after they all started)
        self.current: tuple[ActorCtx, Footprint, bool, bool] | None = None
        self.over = False
        self.failure: BaseException | None = None
        self.ctxs: dict[str, ActorCtx] = {}
        world.ctxs = self.ctxs
        self.lock_holder: str | None = None
        self.aborted: str | None = None
        self.faults: dict[tuple[str, int], list[Fault]] = {}
        for f in world.scenario.faults:
            self.faults.setdefault((f.actor, f.at), []).append(f)
        self.choices: list[str] = []

    # called from actor threads ----------------------------------------------------------
    def point(
        self,
        ctx: ActorCtx,
        op: Op,
        fn: Callable[[], Any],
        *,
        retry: Callable[[], Any] | None = None,
        stale: Callable[[], Any] | None = None,
    ) -> Any:
        """Block until granted, then perform ``op`` (``fn``) with this point's faults."""
        index = ctx.index
        ctx.index += 1
        faults = self.faults.get((ctx.name, index), [])
        if ctx.crashed:
            raise SimulatedCrash(f"{ctx.name} crashed earlier ({op.label()})")
        if any(f.kind == "crash" for f in faults):
            ctx.crashed = True
            self.note(ctx, index, f"CRASH before {op.label()}")
            raise SimulatedCrash(f"{ctx.name} crashes before {op.label()}")
        kinds = {f.kind for f in faults}
        if op.kind in HARNESS_POINTS:  # replies and listings are storage's: not faulted here
            kinds -= {"lost_reply", "lost_reply_error", "stale_listing"}
        if "clock_jump" in kinds:  # time moves on while the actor waits here: a point of its own
            self._wait_for_grant(ctx, Op("clock_jump", op.key), index)
            for f in faults:
                if f.kind == "clock_jump":
                    self.jump(ctx, f.delta, f.scope, why=str(f))
        self._wait_for_grant(ctx, op, index)
        world, step = self.world, self.world.step
        stale_now = "stale_listing" in kinds and stale is not None
        call = stale if stale_now and stale is not None else fn
        if stale_now:
            ctx.tail_everything = True
        world.before_op(ctx, op, step)
        entry = TraceEntry(
            step, ctx.name, index, op.label() + (" (stale listing)" if stale_now else ""), op=op
        )
        world.trace.append(entry)
        try:
            result = call()
        except BaseException as exc:
            entry.outcome = f"{type(exc).__name__}"
            world.after_op(ctx, op, step, told_ok=False)
            if "lost_reply" in kinds and isinstance(exc, AlreadyExistsError):
                exc.retried = True  # type: ignore[attr-defined] # the client cannot tell
            raise
        reply_lost = "lost_reply_error" in kinds or ("lost_reply" in kinds and retry is None)
        world.after_op(ctx, op, step, told_ok=not reply_lost)
        entry.outcome = _summary(result)
        if reply_lost:
            entry.outcome += " (applied; reply lost: StorageError)"
            raise StorageError(
                f"{op.label()}: connection lost before the reply (the request was applied)"
            )
        if "lost_reply" in kinds:
            assert retry is not None
            entry.outcome += " (applied; reply lost: retried)"
            try:
                return self.point(ctx, Op("retry:" + op.kind, op.key, op.key2, op.cond), retry)
            except AlreadyExistsError as exc:
                exc.retried = True  # type: ignore[attr-defined]
                raise
        return result

    def _wait_for_grant(self, ctx: ActorCtx, op: Op, index: int) -> None:
        ctx.pending, ctx.pending_index, ctx.state = op, index, WAITING
        self._hand_on(ctx)
        while not ctx.granted:
            if self.aborted:
                raise _Aborted(self.aborted)
            ctx.wake.wait(1.0)
        ctx.granted, ctx.pending = False, None
        if ctx.event is not None and op.kind not in HARNESS_POINTS and not op.invisible:
            ev = ctx.event
            if ev.first_step is None:
                ev.first_step = self.world.step
            ev.last_step = self.world.step

    def jump(self, ctx: ActorCtx, delta: float, scope: str, why: str) -> None:
        self.world.clock.jump(delta, ctx.name, scope)
        ctx.tail_everything = True
        self.note(ctx, ctx.index, f"clock jump {delta:+.0f}s ({scope}; {why})")

    def note(self, ctx: ActorCtx, index: int, what: str) -> None:
        self.world.trace.append(TraceEntry(self.world.step, ctx.name, index, what))

    def take_lock(self, ctx: ActorCtx) -> None:
        assert self.lock_holder in (None, ctx.name), "lock granted while held"
        self.lock_holder, ctx.holds_lock, ctx.lock_changed = ctx.name, True, True

    def release_lock(self, ctx: ActorCtx) -> None:
        if self.lock_holder == ctx.name:
            self.lock_holder, ctx.holds_lock, ctx.lock_changed = None, False, True

    # the main loop (test thread) ----------------------------------------------------------
    def add(self, name: str, program: Program, store: atomicstore.Store) -> ActorCtx:
        ctx = ActorCtx(name, program, self, store)
        self.ctxs[name] = ctx
        return ctx

    def _main(self, ctx: ActorCtx) -> None:
        _LOCAL.ctx = ctx
        try:
            assert ctx.store is not None
            ctx.program(ctx.store)
            ctx.outcome = "done"
        except SimulatedCrash:
            ctx.outcome = "crashed"
        except _Aborted:
            ctx.outcome = "aborted"
        except BaseException as exc:  # noqa: BLE001 - reported as a failure of the run
            ctx.outcome = f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        finally:
            if ctx.holds_lock:  # a dead process's lock is released (flock)
                self.release_lock(ctx)
            ctx.state = DONE
            self._hand_on(ctx)
            _LOCAL.ctx = None

    def _quiesce(self) -> None:
        """Wait until every actor is blocked at a point or finished."""
        deadline = None
        while True:
            busy = [
                c.name
                for c in self.ctxs.values()
                if c.state == RUNNING or (c.state == NEW and c.thread is not None)
            ]
            if not busy:
                return
            if deadline is None:
                deadline = time.monotonic() + self.watchdog
            left = deadline - time.monotonic()
            if left <= 0:
                self.abort(
                    f"watchdog: {busy} did not reach a scheduling point within {self.watchdog}s"
                )
                raise RunFailure(self.aborted or "")
            self.main_wake.wait(min(left, 1.0))

    def abort(self, why: str) -> None:
        self.aborted = why
        for c in self.ctxs.values():
            c.wake.set()
        self.main_wake.set()

    def _pending_footprint(self, ctx: ActorCtx) -> Footprint:
        assert ctx.pending is not None
        kinds = {f.kind for f in self.faults.get((ctx.name, ctx.pending_index), [])}
        if "stale_listing" in kinds:
            return EVERYTHING
        fp = ctx.pending.footprint()
        return fp | LOCK_FOOTPRINT if ctx.holds_lock else fp

    def run(self) -> None:
        world = self.world
        snapshot_for = {f.actor for f in world.scenario.faults if f.kind == "stale_listing"}
        for name in sorted(self.ctxs):
            ctx = self.ctxs[name]
            if name in snapshot_for and world.backend is not None:
                ctx.start_snapshot = world.backend.snapshot()
            ctx.thread, ctx.finished = _Worker.run(
                lambda ctx=ctx: self._main(ctx), f"actor-{name}"
            )
            self._quiesce()
        for ctx in self.ctxs.values():
            ctx.tail_everything = ctx.lock_changed = False
        try:
            # from here on, each turn is taken by the thread that ended the last one
            # (:meth:`_hand_on`); the main thread takes the first and waits for the end
            self.driving = True
            first = self._step()
            if first is not None:
                first.wake.set()
                self._await_end()
            if self.failure is not None:
                raise self.failure
        finally:
            if self.aborted is None and any(c.state != DONE for c in self.ctxs.values()):
                self.abort("run ended early")
            for c in self.ctxs.values():
                if c.finished is not None:
                    c.finished.wait(5)

    def _step(self) -> ActorCtx | None:
        """One turn, once every actor waits at a point or is done: account for the
        transition that just ran, choose who goes next and grant it (without waking it).
        None when every actor is done."""
        world = self.world
        if self.current is not None:
            c, fp, lock_before, was_eager = self.current
            if lock_before or c.holds_lock or c.lock_changed:
                fp = fp | LOCK_FOOTPRINT
            if c.tail_everything:
                fp = EVERYTHING
            c.tail_everything = c.lock_changed = False
            if not was_eager:
                self.explorer.executed(c.name, fp)
            self.current = None
        waiting = [c for c in sorted(self.ctxs.values(), key=lambda c: c.name) if c.state == WAITING]
        if not waiting:
            return None
        enabled = [
            c
            for c in waiting
            if c.pending is not None
            and (c.pending.kind != "lock" or self.lock_holder in (None, c.name))
        ]
        if not enabled:
            raise RunFailure(
                f"deadlock: {[c.name for c in waiting]} wait for the lock held by "
                f"{self.lock_holder}"
            )
        eager = [
            c
            for c in enabled
            if self.eager_invisible
            and c.pending is not None
            and c.pending.invisible
            and not c.holds_lock
        ]
        if eager:
            chosen = eager[0]
        else:
            last = self.choices[-1] if self.choices else None
            name = self.explorer.choose(
                ChoiceState(
                    [c.name for c in enabled],
                    {c.name: self._pending_footprint(c) for c in waiting},
                    last,
                )
            )
            chosen = self.ctxs[name]
            self.choices.append(name)
        assert chosen.pending is not None
        self.current = (chosen, chosen.pending.footprint(), chosen.holds_lock, bool(eager))
        world.step += 1
        clocks = [world.clock.of(c.name) for c in self.ctxs.values()]
        world.step_clocks[world.step] = (world.clock.now(), max(clocks))
        chosen.state, chosen.granted = RUNNING, True
        return chosen

    def _hand_on(self, ctx: ActorCtx) -> None:
        """Called by ``ctx``'s thread when it reached a point or ended (every actor is
        then at a point or done): take the next turn here, and wake the chosen actor
        unless it is ``ctx`` itself; at the end of the run, or if the turn failed
        (deadlock, replay divergence, a schedule the reduction abandons: raised by the
        main thread), wake the main thread."""
        if not self.driving or self.aborted is not None:
            self.main_wake.set()
            return
        try:
            chosen = self._step()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            self.failure = exc
            chosen = None
        if chosen is None:
            self.over = True
            self.main_wake.set()
        elif chosen is not ctx:
            chosen.wake.set()

    def _await_end(self) -> None:
        """Wait until the actors have run the schedule to its end; abort the run if no
        actor reaches its next point within ``watchdog`` seconds."""
        step, deadline = -1, 0.0
        while not self.over:
            if self.world.step != step:
                step, deadline = self.world.step, time.monotonic() + self.watchdog
            left = deadline - time.monotonic()
            if left <= 0:
                busy = [c.name for c in self.ctxs.values() if c.state == RUNNING]
                self.abort(
                    f"watchdog: {busy} did not reach a scheduling point within {self.watchdog}s"
                )
                raise RunFailure(self.aborted or "")
            self.main_wake.wait(min(left, 1.0))

def _summary(result: Any) -> str:
    if result is None:
        return "ok"
    if isinstance(result, bool | int | str):
        return repr(result)
    if isinstance(result, bytes):
        return "bytes"  # not their length: markers and manifests hold the real time
    if isinstance(result, dict):
        return f"{len(result)} keys"
    if isinstance(result, list):
        return f"{len(result)} entries"
    if isinstance(result, FileInfo):
        return f"gen={getattr(result, 'generation', None)}"
    return type(result).__name__


# -- one schedule ----------------------------------------------------------------------
def make_store(driver: Driver, actor: str, clock: Callable[[], float]) -> atomicstore.Store:
    """The Store an actor (or the checker) uses: ttl of an hour, the scenario grace."""
    kw: dict[str, Any] = {"writer_id": f"w-{actor}", "lease_ttl": TTL, "grace": GRACE}
    if STORE_HAS_CLOCK:
        kw["clock"] = clock
    return atomicstore.Store(driver, **kw)


def _recover_at(st: atomicstore.Store, now: float) -> Any:
    return st.recover() if STORE_HAS_CLOCK else st.recover(now=now)


@dataclass
class RunResult:
    """One schedule: what happened, and what the invariants found."""

    scenario: Scenario
    world: World
    choices: list[str]
    violations: list[str] = field(default_factory=list)
    beyond_bounds: list[str] = field(default_factory=list)
    error: str | None = None
    pruned: bool = False  # abandoned by the reduction (sleep-blocked): not checked

    @property
    def failed(self) -> bool:
        return bool(self.error or (self.violations and not self.beyond_bounds))

    def report(self, trace: bool = True) -> str:
        w = self.world
        lines = [
            f"scenario {self.scenario.describe()}",
            f"choices ({len(self.choices)}): {' '.join(self.choices)}",
        ]
        if self.error:
            lines.append(f"ERROR: {w.normalise(self.error)}")
        lines += [f"VIOLATION: {w.normalise(v)}" for v in self.violations]
        lines += [f"beyond the documented bounds: {w.normalise(b)}" for b in self.beyond_bounds]
        lines.append("told:")
        lines += [f"  {w.normalise(e.describe())}" for e in w.events]
        if trace:
            lines.append("trace:")
            lines += [f"  {t}" for t in w.render_trace()]
        return "\n".join(lines)


def new_inner(scenario: Scenario, clock: VirtualClock) -> tuple[Driver, ModelBackend]:
    backend = ModelBackend(clock)
    models = {"object": ObjectModelDriver, "rename": RenameModelDriver}
    if scenario.backend not in models:
        raise ValueError(f"no model {scenario.backend!r}: pass inner_factory for a real driver")
    return models[scenario.backend](backend), backend


def run_schedule(
    scenario: Scenario,
    explorer: Explorer,
    *,
    inner_factory: Callable[[], Driver] | None = None,
    eager_invisible: bool = True,
    check: bool = True,
) -> RunResult:
    """Run the scenario once, choosing with ``explorer``, and check the invariants.
    ``inner_factory`` gives a fresh real driver (a fake S3/GCS store) instead of a model."""
    clock = VirtualClock(real=inner_factory is not None)
    backend: ModelBackend | None = None
    if inner_factory is None:
        inner, backend = new_inner(scenario, clock)
    else:
        inner = inner_factory()
    world = World(scenario, inner, clock, backend)
    setup = make_store(inner, "setup", clock.now)
    for name in scenario.initial:
        files = payload("setup", name)
        with setup.transaction(name) as txn:
            for path, data in files.items():
                txn.write_bytes(path, data)
        ev = Event(
            world.next_eid(),
            "save",
            "setup",
            name,
            files=files,
            attempt=txn.attempt,
            first_step=0,
            last_step=0,
            begin_epoch=world.epoch[name],
            outcome="ok",
        )
        world.events.append(ev)
        world.observe(0, "setup", ev.eid)
    clock.actor_offsets.update(scenario.clock_offsets)
    explorer.start_run()
    sched = Scheduler(world, explorer, eager_invisible=eager_invisible)
    for name, program in scenario.actors.items():
        st = make_store(SchedDriver(inner, sched, name), name, clock.for_actor(name))
        sched.add(name, program, st)
    result = RunResult(scenario, world, sched.choices)
    try:
        sched.run()
    except SleepBlocked:
        result.pruned = True
        return result
    except (RunFailure, NondeterminismError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    for ctx in sched.ctxs.values():
        if ctx.outcome.startswith("raised"):
            result.error = (result.error or "") + f"\nactor {ctx.name} {ctx.outcome}"
    if check and result.error is None:
        own = scenario.check(world) if scenario.check is not None else []
        result.violations = own + check_run(world)
        if result.violations:
            result.beyond_bounds = beyond_bounds(world, sched)
    return result


# -- the invariants --------------------------------------------------------------------
def _own_id(world: World, ev: Event) -> str | None:
    if ev.kind == "save":
        return ev.attempt
    data = ev.files.get("")
    return None if data is None else "bytes:" + hashlib.sha256(data).hexdigest()[:12]


def _commits_of(world: World, ev: Event) -> list[Transition]:
    """The transitions by which ``ev`` made its own content the committed one."""
    own = _own_id(world, ev)
    return [
        t
        for t in world.transitions
        if t.eid == ev.eid and t.name == ev.name and own is not None and t.to_id == own
    ]


def check_run(world: World) -> list[str]:
    """Invariants 1-5 (see the module docstring) over one finished schedule."""
    v: list[str] = []
    events = {e.eid: e for e in world.events}
    writes = [e for e in world.events if e.kind in ("save", "onefile", "write_file")]
    by_attempt = {e.attempt: e for e in writes if e.kind == "save" and e.attempt}

    def by(epoch: int, name: str) -> str:
        t = next((t for t in world.transitions if t.name == name and t.to_epoch == epoch), None)
        if t is None:
            return f"e{epoch} (initial)"
        ev = events.get(t.eid) if t.eid is not None else None
        return f"e{epoch} ({t.to_id}, by {ev.describe() if ev else t.actor} at step {t.step})"

    # 3. per name and generation at most one success: a commit replaced what it read
    for ev in writes:
        if not ev.ok:
            continue
        commits = _commits_of(world, ev)
        if not commits:
            v.append(
                f"inv3: {ev.describe()} was told it committed, but its content never became "
                f"the committed {ev.name}"
            )
        for t in commits:
            if not ev.overwrite and t.from_id is not None:
                v.append(
                    f"inv3: {ev.describe()} (no overwrite) was told it committed, but its commit "
                    f"point at step {t.step} replaced {by(t.from_epoch, ev.name)}"
                )
            elif ev.overwrite and t.from_id != world.id_at(ev.name, ev.begin_epoch or 0):
                v.append(
                    f"inv3: {ev.describe()} began at {by(ev.begin_epoch or 0, ev.name)}, but its "
                    f"commit point at step {t.step} replaced {by(t.from_epoch, ev.name)}: "
                    "not a compare-and-swap on what it read"
                )
    for ev in world.events:
        if ev.kind != "delete" or not ev.ok:
            continue
        removals = [t for t in world.transitions if t.eid == ev.eid and t.to_id is None]
        for t in removals:
            if t.from_id != world.id_at(ev.name, ev.begin_epoch or 0):
                v.append(
                    f"inv3: {ev.describe()} read {by(ev.begin_epoch or 0, ev.name)} but removed "
                    f"{by(t.from_epoch, ev.name)} at step {t.step}"
                )
    # ... and a call told a definite refusal changed nothing
    for ev in world.events:
        if not ev.definite_failure:
            continue
        if ev.kind in ("save", "onefile", "write_file"):
            mine = _commits_of(world, ev)
        elif ev.kind == "delete":
            mine = [t for t in world.transitions if t.eid == ev.eid and t.to_id is None]
        else:
            continue
        for t in mine:
            v.append(
                f"inv3: {ev.describe()} was told a definite refusal, yet at step {t.step} it "
                f"{'removed' if t.to_id is None else 'committed'} {ev.name} "
                f"(replacing {by(t.from_epoch, ev.name)})"
            )
    # 2. nothing told committed is lost unless a later delete/overwrite replaced it. A
    # writer removing a marker it wrote itself (a retry re-created it after a delete had
    # removed the commit: the writer takes it back) is no loss, provided an earlier commit
    # of it was removed by such a delete or overwrite.
    for ev in writes:
        commits = _commits_of(world, ev)
        if not ev.ok or not commits:
            continue
        legit, own, bad = False, None, None
        for c in commits:
            nxt = next(
                (t for t in world.transitions if t.name == ev.name and t.from_epoch == c.to_epoch),
                None,
            )
            if nxt is None:
                continue
            rep = events.get(nxt.eid) if nxt.eid is not None else None
            if rep is ev:
                own = own or nxt
                continue
            allowed = (
                rep is not None
                and not rep.definite_failure
                and (
                    rep.kind == "delete"
                    or (rep.kind in ("save", "onefile", "write_file") and rep.overwrite)
                )
            )
            if allowed:
                legit = True
            elif bad is None:
                bad = (nxt, rep)
        if bad is None and own is not None and not legit:
            bad = (own, ev)
        if bad is not None:
            nxt, rep = bad
            what = rep.describe() if rep else f"{nxt.actor} (outside any call)"
            v.append(
                f"inv2: {ev.describe()} was lost at step {nxt.step}: its commit point was "
                f"{'removed' if nxt.to_id is None else 'replaced'} by {what}"
            )
    # 4. recovery never removes committed data, nor an attempt whose writer then committed
    for touch in world.touches:
        for key, why in sorted(touch.in_flight.items()):
            v.append(
                f"inv4: recovery {touch.actor} at step {touch.step} ({touch.op}) removed {key} of a "
                f"save in flight: {why}"
            )
        if touch.live:
            v.append(
                f"inv4: recovery {touch.actor} at step {touch.step} ({touch.op}) removed objects "
                f"of a committed checkpoint: {sorted(touch.live)}"
            )
        for key, (_writer, eid) in sorted(touch.owners.items()):
            owner = events.get(eid) if eid is not None else None
            if owner is None or not owner.ok or owner.kind not in ("save", "onefile"):
                continue
            commits = _commits_of(world, owner)
            if not commits or touch.step < commits[0].step:
                v.append(
                    f"inv4: recovery {touch.actor} at step {touch.step} ({touch.op}) removed {key} "
                    f"of {owner.describe()} before it committed; that writer was told it committed"
                )
    # readers: a checkpoint that did not change while read is read whole and as written
    for ev in world.events:
        for r in ev.reads:
            changed = any(
                t.name == r.name and r.start_step < t.step <= r.end_step for t in world.transitions
            )
            if r.error and not r.storage_fault and not changed:
                v.append(
                    f"reader {ev.actor}: committed {r.name} did not change while it read it, "
                    f"yet reading failed: {r.error[:300]}"
                )
            elif r.complete:
                src = by_attempt.get(r.attempt or "")
                if src is None or src.files != r.files:
                    v.append(
                        f"reader {ev.actor}: {r.name} (attempt {r.attempt}) read bytes that are "
                        f"not its writer's: {sorted(r.files)}"
                    )
    # 1. every listed checkpoint opens, verifies and holds its writer's bytes
    checker = make_store(world.inner, "checker", world.clock.now)
    committed_before = _check_listed(world, checker, by_attempt, writes, v, when="at the end")
    # 5. after ttl + grace, one recovery leaves no garbage and a second finds nothing
    world.clock.jump(TTL + GRACE + 1)
    try:
        report = _recover_at(checker, world.clock.now())
    except Exception as exc:  # noqa: BLE001 - a violation, with the trace
        v.append(f"inv5: the final recovery failed: {type(exc).__name__}: {exc}")
        return v
    live = world.live_keys()
    left = sorted(k for k in world.keys("") if k not in live)
    left += [f"unfinished upload of {key}" for key, _uid, _t in world.uploads()]
    if left:
        v.append(
            f"inv5: after every actor finished and ttl + grace passed, recovery left garbage: "
            f"{left}\n  (it reported: {report.summary()})"
        )
    try:
        again = _recover_at(checker, world.clock.now())
        if again.actions:
            v.append(f"inv5: a second recovery still found work: {again.summary()}")
    except Exception as exc:  # noqa: BLE001
        v.append(f"inv5: a second recovery failed: {type(exc).__name__}: {exc}")
    committed_after = _check_listed(world, checker, by_attempt, writes, v, when="after recovery")
    if committed_after != committed_before:
        v.append(
            "inv1: recovery changed the committed checkpoints: "
            f"{committed_before} -> {committed_after}"
        )
    return v


def _check_listed(
    world: World,
    st: atomicstore.Store,
    by_attempt: dict[str, Event],
    writes: list[Event],
    v: list[str],
    *,
    when: str,
) -> dict[str, str | None]:
    """Invariant 1; returns name -> state of every committed name."""
    try:
        names = st.list()
    except Exception as exc:  # noqa: BLE001
        v.append(f"inv1 ({when}): list() failed: {type(exc).__name__}: {exc}")
        return {}
    for name in names:
        try:
            ck = st.open(name)
            ck.verify()
            files = {p: ck.read_bytes(p) for p in sorted(ck.files)}
        except Exception as exc:  # noqa: BLE001
            v.append(
                f"inv1 ({when}): listed checkpoint {name} does not open and verify: "
                f"{type(exc).__name__}: {exc}"
            )
            continue
        src = by_attempt.get(ck.manifest.attempt)
        if src is None or src.files != files:
            v.append(
                f"inv1 ({when}): {name} holds bytes no writer of attempt "
                f"{ck.manifest.attempt} wrote: {files}"
            )
    for name in (*world.scenario.onefiles, *world.scenario.root_files):
        raw = world.raw(name)
        if raw is not None and not any(e.name == name and e.files.get("") == raw for e in writes):
            v.append(f"inv1 ({when}): one-file {name} holds bytes no writer wrote: {raw[:60]!r}")
    return {n: world.state_id(n) for n in world.names}


def beyond_bounds(world: World, sched: Scheduler) -> list[str]:
    """Why this schedule is outside the documented bounds, if it is: a writer committed
    while its lease was valid by its own clock at its last lease check, but some live
    actor's clock had already passed that lease's ``mtime + ttl + grace`` (a pause
    between lease check and commit point, or clock skew, longer than ``grace``)."""
    out = []
    for ctx in sched.ctxs.values():
        for t in world.transitions:
            if t.actor != ctx.name or t.to_id is None:
                continue
            for step_w, mtime, own in [w for w in ctx.own_leases.values() if w[0] <= t.step]:
                checks = [c for c in ctx.lease_checks if step_w <= c[0] <= t.step]
                if not checks:
                    continue
                check_clock = checks[-1][1]
                latest = world.step_clocks.get(t.step, (0.0, 0.0))[1]
                if check_clock < own + TTL and latest >= mtime + TTL + GRACE:
                    out.append(
                        f"{ctx.name} committed {t.name} at step {t.step}: its lease was valid by "
                        f"its clock at its last check (step {checks[-1][0]}), but another clock "
                        f"was {latest - mtime - TTL:.0f}s past the lease's ttl (> grace)"
                    )
    return out


def signature(result: RunResult) -> tuple[Any, ...]:
    """A schedule's observable outcome (final objects and what everyone was told), with
    attempt ids normalised: for comparing explorers."""
    w = result.world
    objs = tuple(sorted(w.normalise(k) for k in w.keys("")))
    states = tuple(w.normalise(str(w.state_id(n))) for n in w.names)
    told = tuple(sorted((e.actor, e.kind, e.name, e.outcome) for e in w.events))
    found = tuple(sorted({re.sub(r"\d+", "N", w.normalise(v)) for v in result.violations}))
    return objs, states, told, found


def failure_kind(res: RunResult) -> str:
    """The invariants a failing schedule broke (for grouping): ``inv1 + inv4`` etc."""
    if res.error:
        return "run error: " + res.error.splitlines()[0][:80]
    tags = {re.sub(r"\s*\(.*", "", v.split(":", 1)[0]) for v in res.violations}
    return " + ".join(sorted(tags))


# -- explorers -------------------------------------------------------------------------
@dataclass
class _Node:
    """One state of the search: who could go, who is explored, who sleeps."""

    enabled: tuple[str, ...]
    pending: dict[str, Footprint]
    sleep: frozenset[str]
    chosen: str
    backtrack: set[str]
    done: set[str]

    def child_sleep(self) -> frozenset[str]:
        """The sleep set after ``chosen``: sleepers and siblings explored before it whose
        next transition is independent of it (their interleavings are covered)."""
        fp = self.pending[self.chosen]
        earlier = self.sleep | (self.done - {self.chosen})
        return frozenset(
            q for q in earlier if q in self.pending and not self.pending[q].conflicts(fp)
        )


class SleepBlocked(Exception):
    """Every enabled actor sleeps: this schedule only repeats explored ones."""


class DPORExplorer(Explorer):
    """Depth-first search over choice sequences, each schedule replayed from scratch.

    With ``reduce`` it is Flanagan and Godefroid's dynamic partial-order reduction
    (POPL 2005) with sleep sets: a new state gets one choice; whenever a pending
    transition races with an earlier dependent one that does not happen before it, the
    state before that earlier transition gets a backtrack point; a sibling already
    explored sleeps until a dependent transition wakes it, and a schedule where every
    enabled actor sleeps is abandoned (counted as pruned). Without ``reduce``, every
    enabled actor is a backtrack point of every state: all interleavings.
    """

    def __init__(self, reduce: bool = True) -> None:
        self.reduce = reduce
        self.nodes: list[_Node] = []
        self.replay = 0
        self.depth = 0
        self.seq: list[tuple[str, Footprint, dict[str, int]]] = []
        self.pc: dict[str, dict[str, int]] = {}

    def start_run(self) -> None:
        self.depth, self.seq, self.pc = 0, [], {}

    def choose(self, state: ChoiceState) -> str:
        d = self.depth
        if d < self.replay:
            node = self.nodes[d]
            if tuple(state.enabled) != node.enabled:
                raise NondeterminismError(
                    f"replay diverged at choice {d}: enabled {state.enabled}, "
                    f"recorded {list(node.enabled)}"
                )
        else:
            del self.nodes[d:]
            if self.reduce:
                self._races(state)
            sleep = self.nodes[d - 1].child_sleep() if self.reduce and d else frozenset()
            awake = [a for a in state.enabled if a not in sleep]
            if not awake:
                raise SleepBlocked(f"all of {state.enabled} sleep at choice {d}")
            first = state.last if state.last in awake else awake[0]
            node = _Node(
                tuple(state.enabled),
                dict(state.pending),
                sleep,
                first,
                {first} if self.reduce else set(state.enabled),
                {first},
            )
            self.nodes.append(node)
        self.depth += 1
        return node.chosen

    def executed(self, actor: str, fp: Footprint) -> None:
        vc = dict(self.pc.get(actor, {}))
        for a, f, v in self.seq:
            if a != actor and f.conflicts(fp):
                for k, n in v.items():
                    if n > vc.get(k, 0):
                        vc[k] = n
        vc[actor] = len(self.seq) + 1
        self.seq.append((actor, fp, vc))
        self.pc[actor] = vc

    def _hb(self, j: int, p: str) -> bool:
        a, _, v = self.seq[j]
        return a == p or v[a] <= self.pc.get(p, {}).get(a, 0)

    def _races(self, state: ChoiceState) -> None:
        k = len(self.seq)
        for p, fp_p in sorted(state.pending.items()):
            for i in range(k - 1, -1, -1):
                a_i, fp_i, _ = self.seq[i]
                if a_i == p or not fp_i.conflicts(fp_p) or self._hb(i, p):
                    continue
                node = self.nodes[i]
                cands = [
                    q
                    for q in node.enabled
                    if q == p
                    or any(self.seq[j][0] == q and self._hb(j, p) for j in range(i + 1, k))
                ]
                if not cands:
                    node.backtrack.update(node.enabled)
                elif not node.backtrack.intersection(cands):
                    node.backtrack.add(p if p in cands else cands[0])
                break

    def advance(self) -> bool:
        """Set up the next schedule; False when the search is complete."""
        for i in range(len(self.nodes) - 1, -1, -1):
            node = self.nodes[i]
            todo = sorted(node.backtrack - node.done - node.sleep)
            if todo:
                node.chosen = todo[0]
                node.done.add(todo[0])
                del self.nodes[i + 1 :]
                self.replay = i + 1
                return True
        return False


@dataclass
class ExploreStats:
    """What an exploration ran and found."""

    label: str
    schedules: int = 0
    pruned: int = 0
    failures: list[RunResult] = field(default_factory=list)
    failed: int = 0
    beyond: int = 0
    beyond_example: RunResult | None = None
    seconds: float = 0.0
    truncated: bool = False
    signatures: set[tuple[Any, ...]] = field(default_factory=set)
    kinds: dict[str, int] = field(default_factory=dict)

    def add(self, res: RunResult, *, keep: int = 3, signatures: bool = False) -> None:
        if res.pruned:
            self.pruned += 1
            return
        self.schedules += 1
        if signatures:
            self.signatures.add(signature(res))
        if res.failed:
            self.failed += 1
            self._keep(res, keep)
        elif res.violations:
            self.beyond += 1
            self.beyond_example = self.beyond_example or res

    def merge(self, other: ExploreStats, keep: int = 3) -> None:
        self.schedules += other.schedules
        self.pruned += other.pruned
        self.failed += other.failed
        self.beyond += other.beyond
        self.beyond_example = self.beyond_example or other.beyond_example
        for res in other.failures:
            self._select(res, keep)
        for kind, n in other.kinds.items():
            self.kinds[kind] = self.kinds.get(kind, 0) + n
        self.seconds += other.seconds
        self.truncated |= other.truncated
        self.signatures |= other.signatures

    def _keep(self, res: RunResult, keep: int) -> None:
        """Count the failure by kind; keep the shortest failing schedule of each kind
        (``keep`` kinds at most)."""
        kind = failure_kind(res)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self._select(res, keep)

    def _select(self, res: RunResult, keep: int) -> None:
        kind = failure_kind(res)
        same = [r for r in self.failures if failure_kind(r) == kind]
        if same and len(same[0].world.trace) <= len(res.world.trace):
            return
        if same:
            self.failures.remove(same[0])
        elif len(self.failures) >= keep:
            return
        self.failures.append(res)
        self.failures.sort(key=lambda r: len(r.world.trace))

    def summary(self) -> str:
        return (
            f"{self.label}: {self.schedules} schedules{' (TRUNCATED)' if self.truncated else ''}"
            f"{f' (+{self.pruned} abandoned by the reduction)' if self.pruned else ''}, "
            f"{self.failed} violating, {self.beyond} beyond the documented bounds, "
            f"{self.seconds:.1f}s"
        )

    def failure_report(self) -> str:
        parts = [self.summary(), "violations by kind (schedules):"]
        parts += [
            f"  {n:6d}  {kind}" for kind, n in sorted(self.kinds.items(), key=lambda kv: -kv[1])
        ]
        parts += [
            f"--- failing schedule {i + 1} ---\n{r.report()}" for i, r in enumerate(self.failures)
        ]
        return "\n".join(parts)


def explore_exhaustive(
    scenario: Scenario,
    *,
    reduce: bool = True,
    limit: int = 100_000,
    inner_factory: Callable[[], Driver] | None = None,
    signatures: bool = False,
) -> ExploreStats:
    """Every interleaving of ``scenario`` (up to the reduction), each checked."""
    t0 = time.perf_counter()
    stats = ExploreStats(scenario.describe())
    ex = DPORExplorer(reduce)
    while True:
        stats.add(run_schedule(scenario, ex, inner_factory=inner_factory), signatures=signatures)
        if not ex.advance():
            break
        if stats.schedules >= limit:
            stats.truncated = True
            break
    stats.seconds = time.perf_counter() - t0
    return stats


class _ProbeExplorer(ReplayExplorer):
    """One actor at a time: ``actor`` before the others (``first``) or after them."""

    def __init__(self, actor: str, first: bool) -> None:
        super().__init__()
        self.actor, self.first = actor, first

    def choose(self, state: ChoiceState) -> str:
        if self.first and self.actor in state.enabled:
            c = self.actor
        else:
            others = [a for a in state.enabled if a != self.actor] or state.enabled
            c = state.last if state.last in others else others[0]
        self.made.append(c)
        return c


def fault_variants(
    scenario: Scenario,
    actor: str,
    kinds: Sequence[str] = ("crash", "lost_reply"),
    *,
    first: bool = True,
) -> list[Scenario]:
    """The scenario with one more fault for ``actor``: for ``crash``, a crash before each
    of its visible operations; for ``lost_reply``, a lost reply of each of its
    conditional or commit-point writes; for ``stale_listing``, a stale answer to each of
    its listings. Indices come from one run where ``actor`` goes before the others
    (``first``) or after them (in other interleavings an index may fall on another
    operation: still a valid fault)."""
    probe = run_schedule(scenario, _ProbeExplorer(actor, first), check=False)
    watched = set(probe.world.names)
    out = []
    for t in probe.world.trace:
        if t.actor != actor or t.op is None or t.op.kind.startswith("retry:"):
            continue
        op = t.op
        commit_write = (
            op.kind in ("put", "close")
            and (op.key.endswith("/" + MARKER_FILE) or op.key in watched)
        ) or (op.kind in ("rename", "exchange") and op.key2 in watched)
        wanted = []
        if "crash" in kinds and not op.invisible:
            wanted.append("crash")
        if "lost_reply" in kinds and op.kind in WRITES and (op.cond or commit_write):
            wanted.append("lost_reply")
        if "stale_listing" in kinds and op.kind in ("find", "listdir"):
            wanted.append("stale_listing")
        out += [scenario.with_faults([*scenario.faults, Fault(k, actor, t.index)]) for k in wanted]
    return out


def explore_random(
    make: Callable[[random.Random], Scenario],
    seeds: Sequence[int],
    *,
    label: str,
    inner_factory: Callable[[], Driver] | None = None,
) -> ExploreStats:
    """One random schedule (and random scenario/faults from ``make``) per seed."""
    t0 = time.perf_counter()
    stats = ExploreStats(label)
    for seed in seeds:
        rng = random.Random(seed)
        scenario = make(rng)
        scenario = dataclasses.replace(scenario, name=f"{scenario.name} seed={seed}")
        stats.add(
            run_schedule(
                scenario, RandomExplorer(rng.randrange(2**32)), inner_factory=inner_factory
            )
        )
    stats.seconds = time.perf_counter() - t0
    return stats


def replay(result: RunResult, *, inner_factory: Callable[[], Driver] | None = None) -> RunResult:
    """Run the schedule of ``result`` again (same scenario, faults and choices)."""
    return run_schedule(
        result.scenario, ReplayExplorer(result.choices), inner_factory=inner_factory
    )
