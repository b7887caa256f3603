"""A drop-in replacement for ``flax.training.checkpoints`` (the legacy API).

Switch with one import::

    from atomicstore.compat import flax as checkpoints   # was: from flax.training import checkpoints

Same names, signatures and on-disk layout (one msgpack file ``<dir>/<prefix><step>`` per
step, readable by flax and written byte-for-byte as flax writes it), same rules for
``keep``, ``keep_every_n_steps``, ``overwrite`` and float steps. What is safer: the file
is streamed (no bytes object of the whole state), committed atomically through the
driver (staged and fsynced then ``rename(NOREPLACE)`` on POSIX; a conditional upload on
S3 and GCS, where flax copies and deletes), two writers of one step cannot both commit,
and leftovers of a crash are removed by recovery. ``gs://`` and ``s3://`` URLs work
unchanged; every function also takes ``storage_options=`` for fsspec.

Arrays sharded across processes (``save_checkpoint_multiprocess``) use flax's layout,
``<prefix><step>`` plus a ``<prefix><step>_gda`` directory, mapped onto the same shard
writing, coordination and region reads as the native multi-host save
(:mod:`atomicstore.pytree.sharded`, :mod:`atomicstore.pytree.coordination`); see
``docs/multiprocess.md``.

Orbax step directories (what flax >= 0.8 writes by default) are restored through Orbax,
as flax restores them, so swapping the import loses no checkpoint; saving always writes
the legacy format (``orbax_checkpointer`` is refused there). ``gda_manager`` is accepted
and ignored: no manager is needed.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..commit import Store, Transaction, path_argument
from ..commit.adapters import delete_one_file_step
from ..commit.locator import is_local, store_at
from ..commit.names import FLOAT_RE
from ..errors import (
    AtomicStoreError,
    CommitConflictError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
)
from ..manager import READ_EVENT, WRITE_EVENT, check_retention, check_step, record_event
from ..pytree import DEFAULT_TIMEOUT, Session, StateWriter
from ..pytree import msgpack_io as mp
from ..pytree import restore as restore_tree
from ..pytree.coordination import check_timeout, coordinated_save
from ..pytree.dtypes import parse_dtype
from ..pytree.format import Shard, check_shards, dimension
from ..pytree.sharded import ShardedLeaf, ShardReader, local_shards, restore_array, split_tree
from ..pytree.tree import Path, children, path_str, rebuild, snapshot_tree, walk_leaves

log = logging.getLogger("atomicstore.compat.flax")

SIGNED_FLOAT_RE = FLOAT_RE
UNSIGNED_FLOAT_RE = re.compile(r"[-+]?((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)")  # sign is a separator
MODULE_NUM_RE = re.compile(r"(.*)_\d+$")
SCHEME_RE = re.compile("^(?P<scheme>[a-z][a-z0-9.+-]+://)?(?P<path>.*)", re.I)
#: suffix of the directory beside a step file that holds its arrays sharded across processes
#: (flax's ``<prefix><step>_gda``)
MP_ARRAY_POSTFIX = "_gda"
#: prefix of the string that stands in the step file for a leaf stored in the ``_gda``
#: directory (flax's placeholder)
MP_ARRAY_PH = "//GDAPlaceholder:"
ARRAYS_FILE = "arrays.json"
ARRAYS_FORMAT = "atomicstore.gda/1"
COMMIT_SUCCESS_FILE = "commit_success.txt"
ORBAX_FILES = {"checkpoint", "_METADATA", "manifest.ocdbt"}

PyTree = Any


def _flax_error_base() -> tuple[type, ...]:
    """flax's own ``InvalidCheckpointError`` when flax is installed, so that resume code
    written for flax (``except flax.errors.InvalidCheckpointError``) catches ours."""
    try:
        from flax.errors import InvalidCheckpointError as FlaxInvalidCheckpointError
    except ImportError:  # flax not installed: nothing of flax's to be caught as
        return ()
    return (FlaxInvalidCheckpointError,)


class InvalidCheckpointError(InvalidArgumentError, *_flax_error_base()):  # type: ignore[misc]
    """A checkpoint cannot be stored where a checkpoint at the same or a later step
    exists (pass ``overwrite=True``). Same message as flax's error of that name; an
    instance of ``flax.errors.InvalidCheckpointError`` too when flax is installed (and of
    ``ValueError``, as all argument errors of atomicstore)."""

    def __init__(self, path: str, step: Any) -> None:
        # (ValueError's __init__: flax's would append its documentation link)
        InvalidArgumentError.__init__(self, f'Trying to save an outdated checkpoint at step: "{step}" and '
                                            f'path: "{path}".')
        self.path, self.step = path, step

    def __reduce__(self) -> tuple[Any, ...]:  # (flax's error unpickles as a plain FlaxError)
        return (type(self), (self.path, self.step))


# -- helpers with flax's exact behaviour -------------------------------------------------------
def natural_sort(file_list: Iterable[str], signed: bool = True) -> list[str]:
    """Natural sort for filenames with numerical substrings (flax's rule):
    ``file_1, file_10, file_2 -> file_1, file_2, file_10`` and
    ``file_0.1, file_-0.2, file_2.0 -> file_-0.2, file_0.1, file_2.0``."""
    float_re = SIGNED_FLOAT_RE if signed else UNSIGNED_FLOAT_RE

    def maybe_num(s: str) -> Any:
        return float(s) if float_re.match(s) else s

    return sorted(file_list, key=lambda s: [maybe_num(c) for c in float_re.split(s)])


def safe_normpath(path: str) -> str:
    """Normalise a path, keeping a URL scheme (``gs://a//b/`` -> ``gs://a/b``)."""
    match = SCHEME_RE.match(path)
    assert match is not None
    d = match.groupdict()
    return (d["scheme"] or "") + os.path.normpath(d["path"])


def convert_pre_linen(params: PyTree) -> PyTree:
    """Rename pre-Linen submodules (numbered across classes, ``Conv_0, Dense_1``) to Linen
    names (numbered per class, ``Conv_0, Dense_0``); Linen params come back unchanged."""
    if not isinstance(params, Mapping):
        return params
    renamed: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for name in natural_sort(params.keys()):
        value = params[name]
        match = MODULE_NUM_RE.match(name)
        if match:
            module = match.group(1)
            num = counts.get(module, 0)
            name = f"{module}_{num}"
            counts[module] = num + 1
        renamed[name] = convert_pre_linen(value)
    if type(params).__name__ == "FrozenDict" and hasattr(type(params), "unfreeze"):
        return type(params)(renamed)  # type: ignore[call-arg]
    return renamed


class AsyncManager:
    """Runs saves in a background thread, one at a time, in order (flax's class).

    ``save_checkpoint(..., async_manager=am)`` returns once the state is copied to host;
    an error in the background save is raised by the next ``wait_previous_save`` (which
    every ``save_checkpoint`` with this manager calls first).
    """

    def __init__(self, max_workers: int = 1) -> None:
        if not isinstance(max_workers, int) or max_workers < 1:
            raise InvalidArgumentError("max_workers must be a positive int")
        self.max_workers = max_workers
        self._start()

    def _start(self) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.max_workers,
                                                              thread_name_prefix="atomicstore-flax")
        self.save_future: concurrent.futures.Future[Any] | None = None
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a forked child the parent's worker thread does not exist (a task submitted to
        its executor would never run): a new executor; the parent's save is the parent's."""
        if self._pid != os.getpid():
            if self.save_future is not None and not self.save_future.done():
                log.warning("AsyncManager used in a forked child while its parent's save was in flight: that "
                            "save belongs to the parent, the child does not wait for it")
            self._start()

    def wait_previous_save(self) -> None:
        """Block until the previous save finished; raise its error if it failed."""
        self._forked()
        fut, self.save_future = self.save_future, None
        if fut is not None:
            if not fut.done():
                log.warning("the previous async save_checkpoint has not finished yet; waiting for it")
            fut.result()

    def save_async(self, task: Callable[[], Any]) -> None:
        """Run ``task`` after the previous one."""
        self.wait_previous_save()  # (in a forked child: on an executor of its own)
        self.save_future = self.executor.submit(task)


# -- storage ------------------------------------------------------------------------------
_recovered: set[tuple[str, str]] = set()


def _store(path: str, storage_options: Mapping[str, Any] | None, prefix: str | None = None) -> Store:
    """The store rooted at ``path`` (opened once per process: :func:`store_at`), recovered
    once per process when ``prefix`` is given."""
    opts = dict(storage_options or {})
    st = store_at(os.path.abspath(path.removeprefix("file://")) if is_local(path) else path, **opts)
    if prefix is not None and (st.url, prefix) not in _recovered:
        report = st.recover(flax_prefix=prefix)
        if report.actions:
            log.info("%s", report.summary())
        _recovered.add((st.url, prefix))
    return st


def _kind(path: str, storage_options: Mapping[str, Any] | None) -> str | None:
    """'dir', 'file' or None (missing) without creating anything."""
    if is_local(path):
        p = path.removeprefix("file://")
        return "dir" if os.path.isdir(p) else "file" if os.path.exists(p) else None
    parent, _, base = path.rstrip("/").rpartition("/")
    if not base or parent.endswith(":/"):  # a bucket
        return "dir"
    st = _store(parent, storage_options)
    if st.driver.exists(base):
        return "file"
    return "dir" if st.driver.listdir(base) else None


def _step_names(st: Store, prefix: str) -> list[str]:
    """Names of committed flax checkpoints ``<prefix><step>`` (no staging, no ``_gda``):
    files, and directories that are committed checkpoints. On an object store a prefix
    ``<name>/`` is also what a directory-layout save of ``<name>`` in flight (or killed
    before recovery) leaves; it counts only once its commit point is there (one more
    listing, of the committed names, when the store root has such a prefix)."""
    out: set[str] = set()
    committed: set[str] | None = None
    for e in st.driver.listdir(""):
        name = e.name.rstrip("/")
        rest = name[len(prefix):]
        if not name.startswith(prefix) or rest.startswith("tmp") or name.endswith(MP_ARRAY_POSTFIX):
            continue
        try:
            float(rest)
        except ValueError:
            continue
        if e.is_dir and not st.driver.capabilities.atomic_rename:
            if committed is None:
                committed = set(st.list())
            if name not in committed:
                continue
        out.add(name)
    return natural_sort(list(out))


def _join(ckpt_dir: str, name: str) -> str:
    return os.path.join(ckpt_dir, name) if is_local(ckpt_dir) else f"{ckpt_dir.rstrip('/')}/{name}"


def _step_of(name: str, prefix: str) -> float:
    return float(name[len(prefix):])


# -- saving ------------------------------------------------------------------------------
def _check_save(ckpt_dir: Any, step: Any, prefix: Any, keep: Any, keep_every_n_steps: Any, async_manager: Any,
                orbax_checkpointer: Any) -> tuple[Any, str]:
    """The arguments both saves share, checked: (step, normalised ckpt_dir)."""
    if orbax_checkpointer is not None:
        raise InvalidArgumentError("orbax_checkpointer is not supported: atomicstore writes flax's legacy format")
    if async_manager is not None and not isinstance(async_manager, AsyncManager):
        raise InvalidArgumentError("async_manager must be an atomicstore.compat.flax.AsyncManager")
    check_retention(prefix, keep, keep_every_n_steps)
    return check_step(step), safe_normpath(path_argument(ckpt_dir, "ckpt_dir"))


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: PyTree,
    step: int | float,
    prefix: str = "checkpoint_",
    keep: int = 1,
    overwrite: bool = False,
    keep_every_n_steps: int | None = None,
    async_manager: AsyncManager | None = None,
    orbax_checkpointer: Any = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Save ``target`` as ``<ckpt_dir>/<prefix><step>`` in flax's legacy format, atomically.

    Args as flax's: ``keep`` newest checkpoints are kept plus, with
    ``keep_every_n_steps``, one every n steps among the older ones; without
    ``overwrite``, a step that is not newer than every existing one raises
    :class:`InvalidCheckpointError`; with it, the same step is replaced atomically and
    newer ones are removed. With ``async_manager`` the state is copied to host and the
    write and commit run in the background. Returns the checkpoint's path.

    Raises :class:`~atomicstore.CommitConflictError` if another writer committed the step
    first.
    """
    step, ckpt_dir = _check_save(ckpt_dir, step, prefix, keep, keep_every_n_steps, async_manager,
                                 orbax_checkpointer)
    start = time.monotonic()
    if async_manager:
        async_manager.wait_previous_save()
    st = _store(ckpt_dir, storage_options, prefix)
    name = f"{prefix}{step}"
    path = _join(ckpt_dir, name)
    _check_newer(st, prefix, name, path, step, overwrite)
    _check_not_native(st, name)
    if async_manager is not None:  # (the writer checks as it writes: here before returning)
        _check_depth(target)
    writer = StateWriter(target if async_manager is None else snapshot_tree(target, True), sort_keys=False)

    def task() -> None:
        with st.one_file(name, overwrite=overwrite) as f:
            writer.write(f)
        log.info("saved checkpoint at %s", path)
        _remove_invalid(st, name, prefix, keep, overwrite, keep_every_n_steps)
        record_event(WRITE_EVENT, time.monotonic() - start)

    if async_manager:
        async_manager.save_async(task)
    else:
        task()
    return path


def _check_depth(target: PyTree) -> None:
    """Refuse a tree nested deeper than any reader reads back (``msgpack_io.MAX_DEPTH``,
    the limit the writer and every reader share), without recursion."""
    stack: list[tuple[Any, int, Path]] = [(target, 0, ())]
    while stack:
        node, depth, at = stack.pop()
        if depth > mp.MAX_DEPTH:
            raise InvalidArgumentError(f"target nested {depth} levels deep at {path_str(at)}: at most "
                                       f"{mp.MAX_DEPTH} (the deepest nesting a reader accepts)")
        kids = children(node, False)
        if kids is not None:
            stack.extend((child, depth + 1, (*at, k)) for k, child in kids[1])


def _check_newer(st: Store, prefix: str, name: str, path: str, step: Any, overwrite: bool) -> None:
    """flax's rule: without ``overwrite``, ``name`` must be newer than every committed step."""
    names = _step_names(st, prefix)
    if not overwrite and (name in names or (names and natural_sort([*names, name])[-1] != name)):
        raise InvalidCheckpointError(path, step)


def _check_not_native(st: Store, name: str) -> None:
    """A flax file cannot replace a native (directory) checkpoint of the same name: the two
    layouts cannot be swapped in one atomic step."""
    try:
        native = st.exists(name)
    except CorruptionError:  # committed, its commit point unreadable: still a checkpoint
        native = True
    if native:
        raise InvalidArgumentError(
            f"{st.driver.describe(name)} is a native checkpoint (a directory, e.g. saved by CheckpointManager): "
            "a flax one-file checkpoint cannot replace it, the two layouts cannot be swapped in one atomic step; "
            "delete it first (atomicstore rm), or save under another prefix")


def _remove_invalid(st: Store, name: str, prefix: str, keep: int, overwrite: bool,
                    keep_every_n_steps: int | None) -> None:
    """flax's clean-up after a commit: newer steps go when overwriting, then all but the
    ``keep`` newest, except one every ``keep_every_n_steps``. A step's main file (its
    commit point) goes first, then its ``_gda`` directory, so a crash in between leaves
    arrays without a step, which recovery removes, never a listed step without its arrays."""
    names = _step_names(st, prefix)
    doomed = []
    if overwrite and name in names:
        i = names.index(name) + 1
        doomed += names[i:]
        names = names[:i]
    last_kept = -float("inf")
    for old in names[:-keep] if len(names) > keep else []:
        s = _step_of(old, prefix)
        if keep_every_n_steps and s and s - last_kept >= keep_every_n_steps:
            last_kept = s
            continue
        doomed.append(old)
    # the generations judged, read before any delete: a step another writer replaced
    # after this is not the step retention judged, and is kept
    judged = {old: _generation_of(st, old) for old in doomed}
    for old in doomed:
        log.info("removing checkpoint %s", st.driver.describe(old))
        # the main file is the commit point: un-published first, at the generation judged
        delete_one_file_step(st, old, old + MP_ARRAY_POSTFIX, if_generation=judged[old])


def _generation_of(st: Store, name: str) -> str | None:
    """The generation of the one-file checkpoint ``name`` now (None: no such file, or a
    backend without generations; the delete then reads its own)."""
    try:
        return st.driver.info(name).generation
    except AtomicStoreError:
        return None


def save_checkpoint_multiprocess(
    ckpt_dir: str | os.PathLike[str],
    target: PyTree,
    step: int | float,
    prefix: str = "checkpoint_",
    keep: int = 1,
    overwrite: bool = False,
    keep_every_n_steps: int | None = None,
    async_manager: AsyncManager | None = None,
    gda_manager: Any = None,
    orbax_checkpointer: Any = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> str:
    """flax's multi-process save: every process calls it, with the same arguments, in the
    same order. Arrays sharded across processes go to ``<prefix><step>_gda`` (each
    process writes the shards it holds, each distinct shard once) and process 0 commits
    the main file once every process has reported; in a single process this is
    :func:`save_checkpoint`. A process that fails, dies or does not report within
    ``timeout`` seconds means no commit, and every surviving process raises
    :class:`~atomicstore.CoordinationError`. ``gda_manager`` is accepted and ignored.
    Returns the main file's path."""
    session = Session.begin(f"save_checkpoint_multiprocess of step {step} in {ckpt_dir}",
                            check_timeout(timeout))
    if session is None:  # one process holds every array whole
        return save_checkpoint(ckpt_dir, target, step, prefix, keep, overwrite, keep_every_n_steps,
                               async_manager, orbax_checkpointer, storage_options=storage_options)
    try:
        step, ckpt_dir = _check_save(ckpt_dir, step, prefix, keep, keep_every_n_steps, async_manager,
                                     orbax_checkpointer)
        name = f"{prefix}{step}"
        path = _join(ckpt_dir, name)
        start = time.monotonic()
        if async_manager:
            async_manager.wait_previous_save()
        st = _store(ckpt_dir, storage_options, prefix if session.main else None)
        state, leaves, arrays = split_tree(target)
        shards = local_shards(leaves, arrays, to_host=async_manager is not None)  # the device-to-host snapshot
        if session.main and async_manager:
            state = snapshot_tree(state, True)
    except BaseException as exc:
        session.fail(exc)
        raise

    def task() -> None:
        session.restart_clock()
        save_gda(session, st, prefix, name, state, leaves, shards, overwrite,
                 after=lambda: _remove_invalid(st, name, prefix, keep, overwrite, keep_every_n_steps))
        record_event(WRITE_EVENT, time.monotonic() - start)

    if async_manager:
        async_manager.save_async(task)
    else:
        task()
    return path


def gda_file(n: int, start: tuple[int, ...]) -> str:
    """The file of the shard at ``start`` of the ``n``-th sharded array, in ``_gda``."""
    return f"a{n}/" + ("_".join(map(str, start)) or "0") + ".bin"


def save_gda(session: Session, st: Store, prefix: str, name: str, state: Any, leaves: list[ShardedLeaf],
             shards: list[Any], overwrite: bool, after: Callable[[], None] | None = None) -> None:
    """The flax layout of a coordinated save: the shards and ``arrays.json`` are one
    checkpoint ``<name>_gda``; once it is committed process 0 commits the main file
    ``<name>`` (the step's commit point), in which each sharded array is flax's
    placeholder naming the ``_gda`` attempt."""
    gda = name + MP_ARRAY_POSTFIX

    def begin() -> Transaction:
        _check_newer(st, prefix, name, st.driver.describe(name), name[len(prefix):], overwrite)
        try:
            return st.transaction(gda, overwrite=overwrite)
        except CommitConflictError:
            raise CommitConflictError(
                f"step {name} is being saved (or was saved) by another job: {gda} is committed. "
                "If a crashed save left it without its main file, recovery removes it after "
                "its grace period; pass overwrite=True to replace it",
                name=gda,
            ) from None

    def finish(txn: Transaction, by_array: dict[int, list[Shard]], can_commit: Callable[[], None]) -> None:
        meta = {"format": ARRAYS_FORMAT, "arrays": [
            {"key": leaf.key, "dtype": leaf.dtype.name, "shape": list(leaf.shape),
             "shards": [{"file": s.file, "start": list(s.start), "shape": list(s.shape), "crc32c": s.crc32c,
                         "blocks": list(s.blocks or []), "block": s.block} for s in by_array[leaf.n]]}
            for leaf in leaves]}
        txn.write_bytes(ARRAYS_FILE, json.dumps(meta).encode())
        txn.commit(check=can_commit)
        can_commit()
        bound = rebuild(state, lambda _p, v: f"{MP_ARRAY_PH}{v.key}@{txn.attempt}" if isinstance(v, ShardedLeaf) else v)
        with st.one_file(name, overwrite=overwrite) as f:  # the commit point of the step
            StateWriter(bound, sort_keys=False).write(f)

    coordinated_save(session, st, leaves, shards, begin=begin, finish=finish, name=gda_file, after=after)


# -- listing and restoring -------------------------------------------------------------------
def _all_checkpoints(ckpt_dir: str, prefix: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    if _kind(ckpt_dir, storage_options) != "dir":
        return []
    return [_join(ckpt_dir, n) for n in _step_names(_store(ckpt_dir, storage_options), prefix)]


def latest_checkpoint(ckpt_dir: str | os.PathLike[str], prefix: str = "checkpoint_", *,
                      storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The path of the latest committed checkpoint in ``ckpt_dir``, or None."""
    check_retention(prefix)
    found = _all_checkpoints(path_argument(ckpt_dir, "ckpt_dir"), prefix, storage_options)
    return found[-1] if found else None


def available_steps(ckpt_dir: str | os.PathLike[str], prefix: str = "checkpoint_", step_type: type = int, *,
                    storage_options: Mapping[str, Any] | None = None) -> list[int | float]:
    """Steps of the committed checkpoints in ``ckpt_dir``, in natural order."""
    check_retention(prefix)
    if step_type not in (int, float):
        raise InvalidArgumentError("step_type must be int or float")
    out = []
    for path in _all_checkpoints(path_argument(ckpt_dir, "ckpt_dir"), prefix, storage_options):
        rest = path[path.rfind(prefix) + len(prefix):]
        try:
            out.append(step_type(rest))
        except ValueError:
            raise InvalidArgumentError(f"checkpoint {path} has a step that is not an {step_type.__name__}; "
                                       "pass step_type=float") from None
    return out


def restore_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: Any | None,
    step: int | float | None = None,
    prefix: str = "checkpoint_",
    parallel: bool = True,
    gda_manager: Any = None,
    allow_partial_mpa_restoration: bool = False,
    orbax_checkpointer: Any = None,
    orbax_transforms: dict[str, Any] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> PyTree:
    """Restore the latest checkpoint in ``ckpt_dir`` (or ``step``, or the file
    ``ckpt_dir`` names), as flax does: with ``target`` None the state dict; otherwise
    ``target``'s structure and types. A missing directory, or one without checkpoints,
    returns ``target`` unchanged; a missing ``step`` raises ``ValueError``
    (:class:`~atomicstore.InvalidArgumentError`). Damaged data raises
    :class:`~atomicstore.CorruptionError` naming the file and leaf. Arrays saved across
    processes (``_gda``) are read back from their shards, checksums checked. A checkpoint
    replaced or deleted by another job while it is read raises
    :class:`~atomicstore.PreconditionFailedError` (restore again), never a mix."""
    check_retention(prefix)
    ckpt_dir = safe_normpath(path_argument(ckpt_dir, "ckpt_dir"))
    start = time.monotonic()
    orbax = False
    if step is not None:
        step = check_step(step)
        path = _join(ckpt_dir, f"{prefix}{step}")
        if _kind(path, storage_options) is None:
            raise InvalidArgumentError(f"Matching checkpoint not found: {path}")
    else:
        kind = _kind(ckpt_dir, storage_options)
        if kind is None:
            log.info("found no checkpoint directory at %s", ckpt_dir)
            return target
        if kind == "dir" and _is_orbax(ckpt_dir, storage_options):  # the directory is one checkpoint
            path, orbax = ckpt_dir, True
        elif kind == "dir":
            latest = latest_checkpoint(ckpt_dir, prefix, storage_options=storage_options)
            if latest is None:
                log.info("found no checkpoint files in %s with prefix %s", ckpt_dir, prefix)
                return target
            path = latest
        else:
            path = ckpt_dir
    parent, name = (os.path.split(os.path.abspath(path)) if is_local(path) else path.rstrip("/").rsplit("/", 1))
    st = _store(parent, storage_options)
    if orbax or _lists_orbax(st, name):
        out = _restore_orbax(path, target, orbax_checkpointer, orbax_transforms)
        record_event(READ_EVENT, time.monotonic() - start)
        return out
    log.info("restoring legacy flax checkpoint from %s", path)
    before = _version(st, name)
    try:
        out = restore_tree(f"{st.url}/{name}", target, store=st)
    except NotFoundError:
        # a key of the target the checkpoint lacks (the version read is still there): that
        # error, naming the key; else another job removed or replaced it since it was listed
        if before is not None and _version(st, name) == before:
            raise
        raise PreconditionFailedError(f"{st.driver.describe(name)} was deleted or replaced while it was being read "
                                      "(another job's delete, overwrite or retention): restore again") from None
    if has_placeholders(out):
        out = restore_placeholders(st, name, out, target, allow_partial=allow_partial_mpa_restoration)
    record_event(READ_EVENT, time.monotonic() - start)
    return out


def _version(st: Store, name: str) -> tuple[Any, ...] | None:
    """Which version of checkpoint ``name`` is there now: the attempt that committed a native
    checkpoint, the generation (size, mtime) of a one-file checkpoint; None if none is."""
    try:
        return ("native", st.open(name).manifest.attempt)
    except AtomicStoreError:
        pass
    try:
        info = st.driver.info(name)
    except AtomicStoreError:
        return None
    return ("file", info.generation, info.size, info.mtime)


# -- Orbax step directories (what flax >= 0.8 writes by default) ------------------------------------
def _is_orbax(path: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Is the directory ``path`` an Orbax checkpoint (it holds one of Orbax's files)?"""
    if is_local(path):  # (no store opened: nothing is created beside the user's directory)
        p = path.removeprefix("file://")
        return any(os.path.exists(os.path.join(p, f)) for f in ORBAX_FILES)
    parent, _, name = path.rstrip("/").rpartition("/")
    if parent.endswith(":/"):  # a bucket
        return _lists_orbax(_store(path, storage_options), "")
    return _lists_orbax(_store(parent, storage_options), name)  # (the store _kind opened)


def _lists_orbax(st: Store, name: str) -> bool:
    return bool({e.name for e in st.driver.listdir(name)} & ORBAX_FILES)  # (a file lists nothing)


def _restore_orbax(path: str, target: Any, checkpointer: Any, transforms: dict[str, Any] | None) -> Any:
    """Restore an Orbax checkpoint directory as flax's ``restore_checkpoint`` does (so a
    user who swapped the import keeps every checkpoint flax wrote), through Orbax."""
    try:
        import orbax.checkpoint as ocp
        from flax import serialization
        from flax.training import orbax_utils
    except ImportError as exc:
        raise InvalidArgumentError(
            f"{path} is an Orbax checkpoint (flax >= 0.8 writes them by default); restoring it needs "
            f"the packages orbax-checkpoint and flax (pip install orbax-checkpoint flax): {exc}") from None
    log.info("restoring Orbax checkpoint from %s through Orbax", path)
    if checkpointer is None:
        checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    elif isinstance(checkpointer, ocp.AsyncCheckpointer):
        checkpointer.wait_until_finished()
    kwargs: dict[str, Any] = {}
    if target is not None:
        kwargs["restore_args"] = orbax_utils.restore_args_from_target(target)
        if isinstance(getattr(checkpointer, "_handler", None), ocp.PyTreeCheckpointHandler):
            kwargs["transforms"] = orbax_utils.maybe_construct_transformations(target, transforms)
    try:
        restored = serialization.to_state_dict(checkpointer.restore(path, item=target, **kwargs))
    except Exception as exc:  # noqa: BLE001 - whatever Orbax raises, named as ours
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CorruptionError(f"{path}: Orbax could not restore this checkpoint: {type(exc).__name__}: {msg}",
                              path=path) from exc
    return serialization.from_state_dict(target, restored) if target is not None else restored


# -- arrays of the _gda layout ------------------------------------------------------------------
def has_placeholders(tree: Any) -> bool:
    """Does a restored main file hold flax placeholders of sharded arrays?"""
    return any(isinstance(v, str) and v.startswith(MP_ARRAY_PH) for _, v in walk_leaves(tree))


_BOUND = re.compile(r"(?s)(.*)@(\d{8}T\d{6}-[0-9a-f]{12})")


def _parse_placeholder(leaf: str) -> tuple[str, str | None]:
    """(array key, ``_gda`` attempt or None for files written before attempts were named)."""
    body = leaf[len(MP_ARRAY_PH):]
    m = _BOUND.fullmatch(body)
    return (m.group(1), m.group(2)) if m else (body, None)


def gda_arrays(st: Store, name: str, threads: int) -> tuple[Any, dict[str, ShardReader]]:
    """(the ``_gda`` checkpoint of step ``name``, a reader per array key), every length
    and checksum in ``arrays.json`` checked before anything is allocated."""
    gda = name + MP_ARRAY_POSTFIX
    try:
        ckpt = st.open(gda)
    except NotFoundError:
        raise CorruptionError(f"{st.driver.describe(name)} has sharded arrays but {gda} is not committed",
                              path=gda) from None
    where = ckpt.where(ARRAYS_FILE)
    files = ckpt.files
    readers = {}
    try:
        meta = json.loads(ckpt.read_bytes(ARRAYS_FILE))
        if meta["format"] != ARRAYS_FORMAT:
            raise ValueError(f"format {meta['format']!r}")
        for a in meta["arrays"]:
            key = a["key"]
            if not isinstance(key, str):
                raise ValueError("array key is not a string")
            dt = parse_dtype(a["dtype"], path=ARRAYS_FILE, leaf=key, where=where)
            shape = tuple(dimension(n) for n in a["shape"])
            shards = []
            for sh in a["shards"]:
                blocks = sh.get("blocks")
                if blocks is not None and (not isinstance(blocks, list) or "crc32c" not in sh):
                    raise ValueError(f"shard {sh.get('file')!r}: bad block checksums")
                shards.append(Shard(sh["file"], tuple(dimension(n) for n in sh["start"]),
                                    tuple(dimension(n) for n in sh["shape"]), sh.get("crc32c"),
                                    tuple(blocks) if blocks is not None else None,
                                    dimension(sh.get("block", 1)) or 1))
            check_shards(shards, shape, dt.itemsize, lambda f: files[f].size if f in files else None)
            if any(s.blocks is not None and any(type(c) is not int or not 0 <= c < 2**32 for c in s.blocks)
                   for s in shards):
                raise ValueError("bad block checksums")
            readers[key] = ShardReader(ckpt, key, dt, shape, shards, threads)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptionError(f"{where}: unreadable array index: {exc}", path=ARRAYS_FILE) from None
    return ckpt, readers


def restore_placeholders(st: Store, name: str, tree: Any, target: Any, *, allow_partial: bool = False,
                         threads: int = 8) -> Any:
    """Replace each placeholder in ``tree`` (restored from main file ``name``) by its
    array: on the target's sharding where the target has a ``jax.Array`` or
    ``jax.ShapeDtypeStruct`` with a sharding there (each process reads only the byte
    ranges its devices need), else as a full numpy array."""
    ckpt, readers = gda_arrays(st, name, threads)
    targets = dict(walk_leaves(target)) if target is not None else {}
    str_targets = {tuple(str(k) for k in p): v for p, v in targets.items()}

    def fill(path: Path, leaf: Any) -> Any:
        if not (isinstance(leaf, str) and leaf.startswith(MP_ARRAY_PH)):
            return leaf
        key, attempt = _parse_placeholder(leaf)
        if attempt is not None and attempt != ckpt.manifest.attempt:
            raise CorruptionError(
                f"{st.driver.describe(name)} was saved with the arrays of attempt {attempt}, but "
                f"{name}{MP_ARRAY_POSTFIX} holds attempt {ckpt.manifest.attempt} (another "
                "job replaced them): refusing to mix two saves", path=name, leaf=key)
        reader = readers.get(key)
        if reader is None:
            raise CorruptionError(f"{ckpt.where(ARRAYS_FILE)}: no array {key!r}", path=ARRAYS_FILE, leaf=key)
        t: Any = str_targets.get(tuple(str(k) for k in path))
        if getattr(t, "sharding", None) is None and target is not None and t is None and allow_partial:
            return leaf
        return restore_array(reader, t)

    return rebuild(tree, fill)


__all__ = [
    "AsyncManager",
    "InvalidCheckpointError",
    "MP_ARRAY_PH",
    "MP_ARRAY_POSTFIX",
    "available_steps",
    "convert_pre_linen",
    "latest_checkpoint",
    "natural_sort",
    "restore_checkpoint",
    "safe_normpath",
    "save_checkpoint",
    "save_checkpoint_multiprocess",
    "restore_placeholders",
    "has_placeholders",
]
