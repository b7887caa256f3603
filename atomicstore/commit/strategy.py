"""The commit strategy's protocol, its layout constants, and how it classifies keys.

Two strategies implement :class:`CommitStrategy`: :class:`~atomicstore.commit.rename.RenameStrategy`
for backends whose driver declares ``atomic_rename`` (POSIX, memory) and
:class:`~atomicstore.commit.marker.MarkerStrategy` for the others (object stores).
``docs/commit-protocol.md`` walks every step of both and what a crash at that step
leaves behind.

Layout below the store root::

    rename:  <name>/                      committed: files + manifest.json
             .atomicstore/staging/<name>.<attempt>/   in flight
             .atomicstore/trash/<name>.<attempt>/     being deleted
    marker:  <name>/commit_success.txt    the commit point (names the attempt)
             <name>/attempt-<attempt>/    files + manifest.json of one attempt
    both:    .atomicstore/leases/, .atomicstore/claims/, .atomicstore/conformance/

Each strategy classifies the keys of its own layout (:meth:`CommitStrategy.classify`):
recovery removes only what a strategy recognises as its own, and never a key it cannot
classify (:attr:`KeyKind.FOREIGN`).
"""

from __future__ import annotations

import enum
import logging
import posixpath
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..drivers.spec import Driver
from ..errors import (
    AlreadyExistsError,
    CommitConflictError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
)
from .claim import NameClaim, parse_claim_key
from .conformance import CONFORMANCE_PREFIX
from .lease import parse_lease_key
from .manifest import sha256
from .names import ATTEMPT_PREFIX as ATTEMPT_PREFIX
from .names import RESERVED_DIR, validate_name

log = logging.getLogger("atomicstore.commit")

STAGING = f"{RESERVED_DIR}/staging"
TRASH = f"{RESERVED_DIR}/trash"


def new_attempt_id() -> str:
    """A unique, time-ordered id for one commit attempt."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(6)


class KeyKind(enum.StrEnum):
    """What a key below the store root is, in a strategy's layout."""

    ATTEMPT = "attempt"  #: a file of one attempt (staged, or ``<name>/attempt-<id>/``)
    MARKER = "marker"  #: a commit point that names an attempt (``<name>/commit_success.txt``)
    LEASE = "lease"  #: the lease of an attempt
    CLAIM = "claim"  #: the claim of a name around a commit request
    TRASH = "trash"  #: a tree being deleted
    PROBE = "probe"  #: scratch of a conformance check
    TEMP = "temp"  #: the driver's temporary file of a single-file write
    ONE_FILE = "one-file"  #: ``<name>`` itself: a one-file checkpoint (or its upload)
    FOREIGN = "foreign"  #: not this strategy's: committed data, another store's, the user's


@dataclass(frozen=True)
class KeyClass:
    """A key as its strategy classified it: its kind, and for the kinds that have them
    the checkpoint name, the attempt id and the prefix of the tree it belongs to (an
    attempt's, a trash entry's, a conformance check's)."""

    kind: KeyKind
    name: str = ""
    attempt: str = ""
    prefix: str = ""


FOREIGN = KeyClass(KeyKind.FOREIGN)


def valid_name(name: str) -> bool:
    """Whether ``name`` is a valid checkpoint name (no exception)."""
    try:
        validate_name(name)
    except InvalidArgumentError:
        return False
    return True


def staged_attempt(dirname: str) -> tuple[str, str]:
    """(name, attempt) of a staging or trash entry ``<name>.<attempt>``."""
    name, dot, attempt = dirname.rpartition(".")
    return (name if dot else dirname), attempt


class CommitStrategy(ABC):
    """How files staged under one attempt become one committed checkpoint.

    A committed checkpoint's *generation* is the id of the attempt it holds (or, for one
    whose manifest or marker is unreadable, ``unreadable:<digest>``): overwrites and
    deletes are compare-and-swap operations on the generation their caller read.
    """

    #: short name shown in reprs and docs
    kind: str
    #: True where a committed attempt's files stay at its attempt prefix and a separate
    #: commit point names the attempt (marker): an attempt prefix is then only removed
    #: once no commit point names it. False where committing moves the staged tree onto
    #: its name (rename): a staged attempt is never a committed one.
    in_place: ClassVar[bool] = False

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    @abstractmethod
    def begin(self, name: str, attempt: str, *, overwrite: bool = False) -> str:
        """Prepare an attempt; return the key prefix its files are written under.
        Raises :class:`CommitConflictError` early if ``name`` is already committed (unless
        ``overwrite``)."""

    @abstractmethod
    def current(self, name: str) -> str | None:
        """The generation of committed ``name``, read afresh; None if it is not committed."""

    @abstractmethod
    def publish(
        self, name: str, attempt: str, writer: str, manifest: bytes, *, overwrite: bool = False,
        expected: str | None = None, check: Callable[[], None] | None = None,
        claim: NameClaim | None = None, inline: Mapping[str, bytes] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Write the manifest and make the attempt the committed ``name`` (the commit
        point). Raises :class:`CommitConflictError` if another attempt won. With
        ``overwrite``, the checkpoint of generation ``expected`` (None: no checkpoint) is
        replaced in the same atomic step, and its data removed afterwards; if ``name`` is
        at another generation by then, :class:`CommitConflictError`. ``check`` (the
        writer's lease check) runs after everything is written and made durable, right
        before the commit point: nothing this attempt writes comes after it. ``claim`` (the
        name's claim, on object stores: ``commit/claim.py``) is held around the commit
        point; the rename strategy needs none (a directory and a file cannot share a
        name there). ``inline``: small files of the attempt, whole, by path, which the
        commit point may carry for readers (the marker strategy does, within
        :data:`~atomicstore.commit.manifest.MARKER_INLINE_BYTES`). ``ready()`` returns once
        every file of the attempt is complete at its key, or raises the first failure;
        it is called before anything is checked under the claim (the marker strategy
        calls it while its manifest and claim are on their way, the rename strategy
        before it writes the manifest). Its error is raised as it is, with nothing
        discarded: the caller aborts the transaction, which first ends the files'
        uploads."""

    @abstractmethod
    def attempt_prefix(self, name: str, attempt: str) -> str:
        """Where the files of an attempt are staged."""

    @abstractmethod
    def discard(self, name: str, attempt: str) -> None:
        """Remove the data of an uncommitted attempt (best effort)."""

    @abstractmethod
    def resolve(self, name: str) -> tuple[str, bytes]:
        """(data prefix, manifest bytes) of committed ``name``; :class:`NotFoundError`
        if it is not committed."""

    @abstractmethod
    def list(self) -> list[str]:
        """Names of committed checkpoints (unsorted)."""

    def committed(self) -> dict[str, str | None]:
        """Committed names, each with the storage generation of its commit point as the
        same listing saw it (None where a listing does not give one cheaply). A
        generation names one commit point forever: see :meth:`resolve_at`."""
        return dict.fromkeys(self.list())

    def resolve_at(self, name: str, generation: str) -> tuple[str, bytes]:
        """Like :meth:`resolve`, but only if the commit point of ``name`` is still at
        ``generation`` (:class:`PreconditionFailedError` otherwise, :class:`NotFoundError`
        if it is gone), read in the same request as the commit point itself."""
        raise PreconditionFailedError(f"{self.driver.describe(name)}: no generations on this backend")

    def resolve_ahead(self, name: str, generation: str | None, ahead: Sequence[str]
                      ) -> tuple[str, bytes, dict[str, bytes]]:
        """:meth:`resolve` (or :meth:`resolve_at` ``generation``), and the files ``ahead``
        of the checkpoint (paths relative to it), read beside its manifest where that
        saves a round trip. Best effort, unchecked: a file missing from the result (not
        read ahead, gone, over :data:`READ_AHEAD_BYTES`) is read later in the usual way,
        and the caller checks what it uses against the manifest. Here: none read ahead."""
        prefix, raw = self.resolve(name) if generation is None else self.resolve_at(name, generation)
        return prefix, raw, {}

    @abstractmethod
    def unpublish(self, name: str, *, if_generation: str | None = None) -> None:
        """Delete ``name``: remove the commit point first, then the data. Only the
        generation read when the delete starts (or ``if_generation``) is removed: a newer
        checkpoint of the same name is never deleted (:class:`PreconditionFailedError`)."""

    # -- the layout, for recovery ------------------------------------------------------
    def classify(self, key: str, *, listing: Collection[str] = (), nested: Collection[str] = ()) -> KeyClass:
        """What ``key`` (from one listing of the root, or an upload's key) is in this
        strategy's layout. ``listing`` is that listing's keys and ``nested`` the
        directories below the root that are other stores' roots: keys there are never
        this store's. Anything not recognised is :attr:`KeyKind.FOREIGN`."""
        if self.driver.is_temporary(key) and not key.startswith((STAGING + "/", TRASH + "/")) and (
                f"/{ATTEMPT_PREFIX}" not in key):
            return KeyClass(KeyKind.TEMP)  # (never a file staged by a save)
        if key.startswith(RESERVED_DIR + "/"):
            return self.classify_reserved(key)
        return self.classify_top(key, listing, nested)

    def classify_reserved(self, key: str) -> KeyClass:
        """A key of the reserved directory. Its layout is the store's, whichever strategy
        opened it (one-file saves stage there on rename backends, and a root moved from
        one backend to another keeps what was left there), so both strategies share it."""
        lk = parse_lease_key(key)
        if lk is not None:
            return KeyClass(KeyKind.LEASE, lk[0], lk[1])
        claimed = parse_claim_key(key)
        if claimed is not None:
            return KeyClass(KeyKind.CLAIM, claimed)
        if key.startswith(CONFORMANCE_PREFIX + "/"):
            return KeyClass(KeyKind.PROBE, prefix="/".join(key.split("/", 3)[:3]))
        if key.startswith(STAGING + "/"):
            dirname = key[len(STAGING) + 1 :].split("/", 1)[0]
            name, attempt = staged_attempt(dirname)
            return KeyClass(KeyKind.ATTEMPT, name, attempt, f"{STAGING}/{dirname}")
        if key.startswith(TRASH + "/"):
            return KeyClass(KeyKind.TRASH, prefix=f"{TRASH}/{key[len(TRASH) + 1 :].split('/', 1)[0]}")
        return FOREIGN

    def classify_top(self, key: str, listing: Collection[str], nested: Collection[str]) -> KeyClass:
        """A key outside the reserved directory: here only ``<name>`` itself (a one-file
        checkpoint) is recognised; a strategy whose attempts live below their name
        recognises those too."""
        if "/" not in key and valid_name(key) and key not in nested:
            return KeyClass(KeyKind.ONE_FILE, key)
        return FOREIGN

    def reserved_trees(self) -> Iterator[KeyClass]:
        """The staging and trash entries of the reserved directory as directories (on
        backends with directories: an empty one does not show in a listing of files)."""
        if not self.driver.capabilities.directories:
            return
        for e in self.driver.listdir(STAGING):
            name, attempt = staged_attempt(e.name)
            yield KeyClass(KeyKind.ATTEMPT, name, attempt, f"{STAGING}/{e.name}")
        for e in self.driver.listdir(TRASH):
            yield KeyClass(KeyKind.TRASH, prefix=f"{TRASH}/{e.name}")

    def committed_names(self, points: set[str]) -> set[str]:
        """The names committed, given the names whose commit point one listing showed
        (the marker strategy's are the listing's; see :class:`RenameStrategy`)."""
        return points

    def named_attempt(self, name: str) -> str | None:
        """The attempt the commit point of ``name`` names, for nominating only (no
        generation: never for a conditional write)."""
        return self.current(name)

    def repair_point(self, name: str, attempt: str, *, dry_run: bool
                     ) -> tuple[str | None, tuple[str, str] | None]:
        """Repair the commit point of ``name`` if it names ``attempt``, whose data is gone
        (only where :attr:`in_place`). Returns (the attempt ``name`` holds afterwards,
        (the key repaired, what was done) or None if nothing was)."""
        return attempt, None

    def take_tree(self, prefix: str) -> str | None:
        """Make the uncommitted tree ``prefix`` uncommittable and return where it now is,
        to be removed; None if it is gone already. Here it stays where it is (what may
        still commit it is decided by reading its commit point and lease)."""
        return prefix

    def remove_tree(self, prefix: str) -> bool:
        """Remove the uncommitted tree ``prefix`` (:meth:`take_tree` first); False if it
        was gone (a concurrent commit or another recovery took it)."""
        taken = self.take_tree(prefix)
        if taken is None:
            return False
        self.driver.delete_tree(taken)
        return True

    def remove_keys(self, prefix: str, keys: Sequence[str]) -> bool:
        """Remove the uncommitted tree ``prefix`` that one listing showed as ``keys``
        (leftovers of another layout: flax's). Object stores remove the keys listed, not
        the prefix: a save of that name starting now writes keys of its own there."""
        for k in keys:
            self.driver.delete(k)
        return True

    def _cleanup(self, prefix: str) -> None:
        """Remove a replaced checkpoint's data after a commit: a failure here must not
        make a commit that happened look failed (recovery removes what is left)."""
        try:
            self.driver.delete_tree(prefix)
        except Exception as exc:  # noqa: BLE001 - logged; recovery removes it
            log.warning("committed, but could not remove the replaced data %s: %s",
                        self.driver.describe(prefix), exc)

    def is_file(self, name: str) -> bool:
        """Whether ``name`` itself is a single file/object (a one-file checkpoint, such as
        flax's, lives there); a directory or a prefix is not."""
        try:
            self.driver.info(name)
        except NotFoundError:
            return False
        return True

    def has_checkpoint(self, name: str) -> bool:
        """Whether a directory-layout checkpoint is committed as ``name`` (what a one-file
        save must not land on: :meth:`one_file_over_native`)."""
        return self.current(name) is not None

    def native_over_one_file(self, name: str) -> AlreadyExistsError:
        """The refusal to save a directory-layout checkpoint as ``name``, which holds a
        single file: the two layouts cannot be swapped in one atomic step (and a marker
        committed beside the object would leave two checkpoints under one name)."""
        return AlreadyExistsError(
            f"{self.driver.describe(name)} holds a single-file checkpoint (flax's layout, or "
            "another single file): a directory-layout checkpoint cannot replace it, because the "
            "two layouts cannot be swapped atomically; delete it first or save under another name"
        )

    def one_file_over_native(self, name: str) -> AlreadyExistsError:
        """The refusal to save a one-file checkpoint as ``name``, which holds a committed
        directory-layout checkpoint (the converse of :meth:`native_over_one_file`)."""
        return AlreadyExistsError(
            f"{self.driver.describe(name)} holds a directory-layout checkpoint: a single-file "
            "(flax) checkpoint cannot replace it, because the two layouts cannot be swapped "
            "atomically; delete it first or save under another name"
        )

    def _conflict(self, name: str, winner: str | None = None) -> CommitConflictError:
        return CommitConflictError(
            f"checkpoint {self.driver.describe(name)} was committed by another writer"
            + (f" ({winner})" if winner else ""),
            name=name,
            winner=winner,
        )

    def _changed(self, name: str, expected: str | None, found: str | None) -> PreconditionFailedError:
        return PreconditionFailedError(
            f"checkpoint {self.driver.describe(name)} changed since it was read "
            f"(expected {expected or 'none'}, found {found or 'none'})"
        )



#: Most bytes of a file read ahead beside a manifest (:meth:`CommitStrategy.resolve_ahead`):
#: a larger one is read the usual way, once the manifest gives its size.
READ_AHEAD_BYTES = 4 * 2**20
#: most files one :meth:`~atomicstore.Store.open` reads ahead
MAX_READ_AHEAD = 8


def read_capped(driver: Driver, key: str, limit: int) -> bytes:
    """``key``, but at most ``limit + 1`` bytes of it: a marker or manifest read from
    storage is hostile input, and one over its limit is refused by its parser
    (:class:`CorruptionError`) without ever being read whole."""
    return driver.read(key, 0, limit + 1)


def unreadable_generation(raw: bytes) -> str:
    """The generation of a commit point whose bytes cannot be parsed."""
    return f"unreadable:{sha256(raw)[:16]}"


def parent_dirs(paths: Sequence[str]) -> list[str]:
    """Every directory that holds one of ``paths``, deepest first ('' excluded)."""
    dirs: set[str] = set()
    for p in paths:
        d = posixpath.dirname(p)
        while d:
            dirs.add(d)
            d = posixpath.dirname(d)
    return sorted(dirs, key=lambda d: (-d.count("/"), d))


