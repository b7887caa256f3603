"""The rename strategy: stage in the reserved directory, rename onto the name.

See :mod:`atomicstore.commit.strategy` for the layout and ``docs/commit-protocol.md`` for
every step and what a crash at that step leaves behind.
"""

from __future__ import annotations

import logging
import posixpath
import secrets
from collections.abc import Callable, Mapping, Sequence

from ..errors import (
    AlreadyExistsError,
    CorruptionError,
    LeaseLostError,
    NotFoundError,
    StorageError,
)
from .claim import NameClaim
from .manifest import MAX_MANIFEST_BYTES, Manifest
from .names import MANIFEST_FILE, validate_name
from .strategy import (
    STAGING,
    TRASH,
    CommitStrategy,
    parent_dirs,
    read_capped,
    unreadable_generation,
)

log = logging.getLogger("atomicstore.commit")


class RenameStrategy(CommitStrategy):
    """Stage in a sibling directory, fsync everything, rename onto the final name.

    A plain commit is one ``rename(NOREPLACE)``. Overwrites and deletes compare the
    generation and swap under the driver's store lock (``flock`` on POSIX), so that a
    concurrent overwrite or delete cannot slip in between the comparison and the rename.
    """

    kind = "rename"
    in_place = False

    def attempt_prefix(self, name: str, attempt: str) -> str:
        return f"{STAGING}/{name}.{attempt}"

    _staging = attempt_prefix

    def begin(self, name: str, attempt: str, *, overwrite: bool = False) -> str:
        if self.driver.exists(name) and not self.empty_dir(name):
            if self.current(name) is None:
                if self.is_file(name):
                    raise self.native_over_one_file(name)
                raise self._not_a_checkpoint(name)
            if not overwrite:
                raise self._conflict(name)
            if not self.driver.capabilities.replaces_directories:
                raise StorageError(
                    f"cannot replace {self.driver.describe(name)} atomically: this filesystem "
                    "lacks renameat2(RENAME_EXCHANGE) (NFS, FUSE); delete the checkpoint, then save it"
                )
        return self._staging(name, attempt)  # created by the first file written into it

    def current(self, name: str) -> str | None:
        try:
            raw = read_capped(self.driver, f"{name}/{MANIFEST_FILE}", MAX_MANIFEST_BYTES)
        except NotFoundError:
            return None
        try:
            return Manifest.from_bytes(raw, where=name).attempt
        except CorruptionError:
            return unreadable_generation(raw)

    def publish(
        self, name: str, attempt: str, writer: str, manifest: bytes, *, overwrite: bool = False,
        expected: str | None = None, check: Callable[[], None] | None = None,
        claim: NameClaim | None = None, inline: Mapping[str, bytes] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        if ready is not None:
            ready()  # every file durable before the manifest (its error: the caller aborts)
        d = self.driver
        staging = self._staging(name, attempt)
        try:
            self._stage_manifest(staging, manifest)
            replaced = self._swap(staging, name, overwrite=overwrite, expected=expected, check=check)
        except LeaseLostError:
            self.discard(name, attempt)
            raise
        except AlreadyExistsError:
            self.discard(name, attempt)
            raise self._conflict(name) from None
        except NotFoundError:
            # the staging directory vanished: recovery claimed it, having fenced our lease
            self.discard(name, attempt)
            if check:
                check()  # LeaseLostError, the real reason
            raise
        except BaseException:
            self.discard(name, attempt)
            raise
        # Committed. A failure below leaves a committed (maybe not yet durable) checkpoint.
        if d.capabilities.durable_fsync:
            # Make the new entry durable. (The staging directory's entry was never made
            # durable, so its removal needs no fsync: the POSIX model in tests/crashsim.py
            # shows that an fsync of the staging parent here changes no crash state.)
            d.fsync_dir("")
        if replaced:  # the replaced checkpoint now sits at the staging name
            self._cleanup(staging)

    def _stage_manifest(self, staging: str, manifest: bytes) -> None:
        """Write the manifest into the staging directory, and make the directory durable."""
        d = self.driver
        w = d.open_writer(f"{staging}/{MANIFEST_FILE}")
        try:
            w.write(manifest)
            w.close()  # fsync of the manifest
        except BaseException:
            w.abort()
            raise
        if d.capabilities.durable_fsync:
            files = list(Manifest.from_bytes(manifest, where="staged manifest").files)
            for sub in parent_dirs(files):
                d.fsync_dir(f"{staging}/{sub}")
            d.fsync_dir(staging)

    def _swap(self, staging: str, name: str, *, overwrite: bool, expected: str | None,
              check: Callable[[], None] | None) -> bool:
        """Rename the staging directory onto ``name``: the commit point. True if it
        replaced a checkpoint (or an empty directory), which then sits at the staging name."""
        d = self.driver
        replaced = False
        if not overwrite:
            if check:
                check()
            try:
                d.rename(staging, name)  # the commit point (fails if recovery claimed staging)
            except AlreadyExistsError:
                with d.lock():  # an empty directory (a user's mkdir) is taken over
                    if not self.empty_dir(name):
                        raise
                    replaced = self._take_over_empty(staging, name)
        else:
            if check:  # (outside the store lock: a lease renewal takes it on POSIX)
                check()
            with d.lock():  # nobody else deletes or overwrites in between
                found = self.current(name)
                if found != expected:
                    raise AlreadyExistsError(f"{name}: generation {found}, expected {expected}")
                if expected is None and self.empty_dir(name):
                    replaced = self._take_over_empty(staging, name)
                elif expected is None:
                    d.rename(staging, name)  # the commit point
                else:
                    d.exchange(staging, name)  # the commit point of an overwrite
                    replaced = True
        return replaced

    def _not_a_checkpoint(self, name: str) -> AlreadyExistsError:
        """The refusal to write over ``name``, which exists and is no checkpoint: a file,
        or a directory of someone else's files (a stock DCP or Orbax checkpoint, a user's
        run directory), named with what it holds."""
        d = self.driver
        held = sorted(e.name + ("/" if e.is_dir else "") for e in d.listdir(name))
        what = (f"a directory holding {', '.join(held[:5])}" + (f" and {len(held) - 5} more" if len(held) > 5 else "")
                if held else "a file")
        return AlreadyExistsError(
            f"{d.describe(name)} exists and is not a checkpoint ({what}): atomicstore replaces only "
            "checkpoints it committed; remove it or save under another name"
        )

    def empty_dir(self, name: str) -> bool:
        """Whether ``name`` is an empty directory (made by a user's ``mkdir``,
        ``tempfile.mkdtemp`` or ``TemporaryDirectory``): never a checkpoint (a committed
        one holds its manifest), so a commit takes it over (:meth:`_take_over_empty`).
        A file never is one, though a driver may list nothing below it (memory): it may be
        a one-file checkpoint."""
        d = self.driver
        return (d.capabilities.directories and d.exists(name) and not d.find(name)
                and not d.listdir(name) and not self.is_file(name))

    def _take_over_empty(self, staging: str, name: str) -> bool:
        """Commit ``staging`` onto the empty directory ``name`` in one atomic step (the
        caller holds the store lock and checked it is empty): the two are exchanged, and
        the empty directory, now at the staging name, is removed after the commit (True).
        Without ``RENAME_EXCHANGE`` the driver's rename is ``rename(2)``, which replaces an
        empty directory atomically (False: nothing left to remove); a filesystem with
        NOREPLACE but not EXCHANGE is refused."""
        d = self.driver
        if d.capabilities.replaces_directories:
            d.exchange(staging, name)  # the commit point
            return True
        try:
            d.rename(staging, name)  # the commit point
        except AlreadyExistsError:
            raise StorageError(
                f"cannot commit onto the empty directory {d.describe(name)} atomically: this "
                "filesystem lacks renameat2(RENAME_EXCHANGE); remove the directory, then save"
            ) from None
        return False

    def discard(self, name: str, attempt: str) -> None:
        try:
            self.driver.delete_tree(self._staging(name, attempt))
        except Exception as exc:  # noqa: BLE001 - recovery removes what is left
            log.warning("could not remove staged %s: %s", name, exc)

    def resolve(self, name: str) -> tuple[str, bytes]:
        try:
            return name, read_capped(self.driver, f"{name}/{MANIFEST_FILE}", MAX_MANIFEST_BYTES)
        except NotFoundError:
            raise NotFoundError(f"no committed checkpoint {self.driver.describe(name)}") from None

    def list(self) -> list[str]:
        out = []
        for e in self.driver.listdir(""):
            if not e.is_dir or e.name.startswith("."):
                continue
            try:
                validate_name(e.name)
            except ValueError:
                continue
            if self.driver.exists(f"{e.name}/{MANIFEST_FILE}"):
                out.append(e.name)
        return out

    def claim(self, prefix: str) -> str | None:
        """Move the tree ``prefix`` into the trash in one atomic step (so that nothing can
        commit it any more) and return its trash prefix; None if it is gone already."""
        d = self.driver
        trash = f"{TRASH}/{posixpath.basename(prefix)}.{secrets.token_hex(4)}"
        d.makedirs(TRASH)
        try:
            d.rename(prefix, trash)
        except NotFoundError:
            return None
        return trash

    def take_tree(self, prefix: str) -> str | None:
        """Claim ``prefix`` into the trash (:meth:`claim`): a rename that commits it can no
        longer happen, and one that won keeps it (None then)."""
        return self.claim(prefix)

    def remove_keys(self, prefix: str, keys: Sequence[str]) -> bool:
        """The whole tree, claimed into the trash in one step (:meth:`remove_tree`)."""
        return self.remove_tree(prefix)

    def committed_names(self, points: set[str]) -> set[str]:
        """A checkpoint is a directory holding its manifest: listed (:meth:`list`)."""
        return set(self.list())

    def unpublish(self, name: str, *, if_generation: str | None = None) -> None:
        d = self.driver
        with d.lock():
            found = self.current(name)
            if found is None and not d.exists(name):
                raise NotFoundError(f"no committed checkpoint {d.describe(name)}")
            if if_generation is not None and found != if_generation:
                raise self._changed(name, if_generation, found)
            trash = self.claim(name)  # un-publish: the name is gone in one step
            if trash is None:
                raise NotFoundError(f"no committed checkpoint {d.describe(name)}")
            if d.capabilities.durable_fsync:
                d.fsync_dir("")
        d.delete_tree(trash)
