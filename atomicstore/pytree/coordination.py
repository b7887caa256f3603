"""Multi-host saves: the processes of one ``jax.distributed`` job agree through JAX's own
coordination service (its key-value store), never through storage.

Every collective call (a save, a delete, picking the step to restore) opens a
:class:`Session`. Sessions are numbered by a counter every process draws in the same
order, as the first thing the call does (before any argument is checked), so the
processes agree on the session even when one of them fails early or saves are issued
back to back; a process that fails publishes its error in the session, so the others
learn of it at once instead of at the timeout.

A coordinated save (:func:`coordinated_save`), keys under ``atomicstore/<n>/``:

1. process 0 runs its checks and opens the transaction (which takes the lease), then
   publishes the ``plan``: the attempt's prefix and the sharded arrays it expects (or the
   error that refused the save);
2. every process writes its shards under the prefix (durable before it reports) and
   publishes its ``report/<i>``: files, sizes, CRC32C (or its error);
3. process 0 waits for every report, adopts the files, writes what it writes (the state
   and the index), and commits, checking right before the commit point that its deadline
   has not passed and that no process gave up waiting; then it publishes the ``outcome``.

A process that dies or hangs is noticed when the timeout runs out: nothing is committed
and every surviving process raises :class:`~atomicstore.CoordinationError`. A process
that gives up waiting for the outcome publishes ``abandon/<i>`` first, which stops a late
process 0 from committing.

A coordinated restore (:meth:`Session.publish_plan`, :meth:`Session.await_plan`,
:func:`agree`): process 0 opens the checkpoint and publishes which save it opened (the
attempt, or a legacy file's generation) as the ``plan``; the others open the same name
and raise :class:`~atomicstore.PreconditionFailedError` unless they find that save; once
its own read is done, every process reports (``report/<i>``) and process 0 publishes the
``outcome``: every process returns, or every process raises (the library's own errors
with their class, so that a caller's retry takes the same branch everywhere).

A forked child of a process of the job (a data-loader worker) is not part of the job: the
coordination client it inherited cannot be used there, so its calls run alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..commit import Store, Transaction
from ..errors import (
    AtomicStoreError,
    ChecksumMismatchError,
    CoordinationError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionFailedError,
)
from .format import Shard, check_shards
from .sharded import LocalShard, ShardedLeaf, assemble, write_shards

log = logging.getLogger("atomicstore.coordination")

DEFAULT_TIMEOUT = 300.0
_lock = threading.Lock()
_counts: dict[str, int] = {}  # how many sessions of each call this process has opened
_opened: list[str] = []  # the namespaces of this process's sessions, in order
_cleared = 0  # process 0: the namespaces _opened[:_cleared] have been deleted
_forked = False  # a forked child of a process of the job: not part of it


def _after_fork_in_child() -> None:
    global _forked, _lock
    _forked = True
    _lock = threading.Lock()  # (a parent's thread may have held it at the fork)


os.register_at_fork(after_in_child=_after_fork_in_child)


def distributed_client() -> Any:
    """JAX's distributed runtime client, or None (jax not imported, or
    ``jax.distributed.initialize`` not called). Never initialises a backend."""
    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - a jax without it
        return None
    return distributed.global_state.client


def process_index_count() -> tuple[int, int]:
    """(this process's index, the number of processes) of the ``jax.distributed`` job,
    (0, 1) outside one."""
    if distributed_client() is None:
        return 0, 1
    import jax

    return jax.process_index(), jax.process_count()


def multihost() -> bool:
    """Is this process one of several of a ``jax.distributed`` job?"""
    return process_index_count()[1] > 1


def check_timeout(timeout: Any) -> float:
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise InvalidArgumentError("timeout must be a positive, finite number of seconds")
    return float(timeout)


def _why(exc: BaseException) -> str:
    msg = str(exc).strip()
    return f"{type(exc).__name__}: {msg.splitlines()[0] if msg else ''}"


class Session:
    """One collective call, as seen by one process. ``index``/``count`` are the process's
    index and the number of processes; ``what`` names the call (every process must make
    the same one)."""

    def __init__(self, what: str, timeout: float, *, client: Any = None, index: int = 0, count: int = 1,
                 background: bool = False) -> None:
        # first: every process opens it, whatever fails next. Sessions are named by the
        # call and how many times this process made that call, not by a global counter:
        # a process that skipped one call (it raised before making it) fails that call
        # only, and the processes agree again on the next one. A ``background`` session
        # (an upload to the persistent tier, in its own thread) is not in the order of the
        # caller's calls: ``forget_earlier`` never deletes it, its owner does
        # (:meth:`forget`)
        with _lock:
            n = _counts.get(what, 0)
            _counts[what] = n + 1
            self.ns = f"atomicstore/{hashlib.sha256(what.encode()).hexdigest()[:24]}/{n}"
            if not background:
                _opened.append(self.ns)
            self.order = len(_opened)
        self.what, self.timeout = what, check_timeout(timeout)
        self.client, self.index, self.count = client, index, count
        self.deadline = time.monotonic() + self.timeout
        self._sent: set[str] = set()
        if count > 1 and client is None:
            raise InvalidArgumentError("several JAX processes but no jax.distributed client: "
                                       "call jax.distributed.initialize() first")

    @classmethod
    def begin(cls, what: str, timeout: float = DEFAULT_TIMEOUT, *, background: bool = False) -> Session | None:
        """A session of the ``jax.distributed`` job this process is part of, or None in a
        single-process job. Call it first, before anything that may fail."""
        client = distributed_client()
        if client is None or _forked:  # (the child of a fork cannot use the parent's client)
            return None
        import jax

        if jax.process_count() == 1:
            return None
        return cls(what, timeout, client=client, index=jax.process_index(), count=jax.process_count(),
                   background=background)

    @property
    def main(self) -> bool:
        return self.index == 0

    @property
    def margin(self) -> float:
        """How much longer than process 0 the others wait for its outcome."""
        return min(30.0, 0.25 * self.timeout)

    def restart_clock(self) -> None:
        """Count the timeout from now (an async save starts its work later than its call)."""
        self.deadline = time.monotonic() + self.timeout

    # -- messages ------------------------------------------------------------------------
    def put(self, key: str, value: Any) -> None:
        if key in self._sent:
            return
        self._sent.add(key)
        if self.count > 1:
            self.client.key_value_set(f"{self.ns}/{key}", json.dumps(value))

    def get(self, key: str, who: str, *, margin: float = 0.0) -> Any:
        """The value ``who`` publishes as ``key``, waiting until the deadline (+ ``margin``)."""
        ms = max(1, int((self.deadline + margin - time.monotonic()) * 1000))
        try:
            return json.loads(self.client.blocking_key_value_get(f"{self.ns}/{key}", ms))
        except Exception as exc:  # noqa: BLE001 - jax raises its runtime's error type
            raise CoordinationError(
                f"{self.what}: {who} did not report within {self.timeout:.0f}s (it died, hung or is not "
                f"making the same call): {_why(exc)}"
            ) from None

    def error(self, exc: BaseException) -> dict[str, Any]:
        return {"error": _why(exc), "process": self.index, "type": type(exc).__name__}

    def fail(self, exc: BaseException, *, parts: bool = False) -> None:
        """Tell the others this process failed (what it owes them, as an error). With
        ``parts``, also where a :func:`coordinated_parts` exchange waits for this
        process: ``table`` / ``shards/<i>``."""
        err = self.error(exc)
        keys = ["plan", "outcome"] if self.main else [f"report/{self.index}"]
        if parts:
            keys.append("table" if self.main else f"shards/{self.index}")
        self._publish_soon([(k, err) for k in keys])

    def abandon(self) -> None:
        """This process stops waiting: a late process 0 must not commit."""
        self._publish_soon([(f"abandon/{self.index}", True)])

    def _publish_soon(self, items: list[tuple[str, Any]], wait: float = 1.0) -> None:
        """Publish on an error path without waiting more than ``wait`` seconds: the
        coordination service lives in process 0, and a paused process 0 (a stopped VM)
        must not hold the others' errors back. The publish completes if it resumes."""

        def publish() -> None:
            for k, v in items:
                try:
                    self.put(k, v)
                except Exception as pub:  # noqa: BLE001 - the others will time out instead
                    log.warning("could not publish %s of %s: %s", k, self.what, pub)

        t = threading.Thread(target=publish, name="atomicstore-publish", daemon=True)
        t.start()
        t.join(wait)

    def forget_earlier(self) -> None:
        """Process 0, once every process reported in this session: each process makes its
        calls one after another, so every process is done with all earlier sessions and
        their keys can go (the coordination service keeps them in memory otherwise)."""
        global _cleared
        with _lock:
            doomed, _cleared = _opened[_cleared : self.order - 1], max(_cleared, self.order - 1)
        for ns in doomed:
            try:
                self.client.key_value_delete(ns)
            except Exception:  # noqa: BLE001 - tidiness only
                break

    def forget(self) -> None:
        """Process 0: delete this session's keys (a background session, once every
        process is known to be done with it)."""
        if self.count > 1:
            try:
                self.client.key_value_delete(self.ns)
            except Exception:  # noqa: BLE001 - tidiness only
                pass

    def check_can_commit(self) -> None:
        """Right before the commit point (process 0): the deadline has not passed and no
        process gave up waiting."""
        if time.monotonic() > self.deadline:
            raise CoordinationError(f"{self.what}: the timeout of {self.timeout:.0f}s ran out before the "
                                    "commit; not committing (the other processes may have given up)")
        if self.count > 1:
            try:
                gone = self.client.key_value_dir_get(f"{self.ns}/abandon/")
            except Exception as exc:  # noqa: BLE001
                raise CoordinationError(f"{self.what}: cannot reach the coordination service: {_why(exc)}") from None
            if gone:
                raise CoordinationError(f"{self.what}: process(es) {sorted(k.rsplit('/', 1)[-1] for k, _ in gone)} "
                                        "gave up waiting; not committing")

    # -- a restore: process 0 picks the save, every process reads it --------------------
    def publish_plan(self, value: Any) -> None:
        """Process 0: publish what it chose (JSON) for the others' :meth:`await_plan`."""
        self.put("plan", {"what": self.what, "value": value})

    def await_plan(self) -> Any:
        """The others: what process 0 published; its error raises here (see :func:`agree`)."""
        plan = self.get("plan", "process 0")
        if "error" in plan:
            raise remote_error(self, plan)
        if plan.get("what") != self.what:
            raise CoordinationError(f"process 0 is making another call ({plan.get('what')}) than this "
                                    f"process ({self.what}): every process must make the same calls "
                                    "in the same order")
        return plan["value"]

    # -- one process decides, every process learns ---------------------------------------
    def decide(self, fn: Callable[[], Any]) -> Any:
        """Process 0 runs ``fn`` and publishes its (JSON) result; every process returns it.
        An error of process 0 raises there and, as :class:`CoordinationError`, everywhere."""
        if self.main:
            try:
                value = fn()
            except BaseException as exc:
                self.put("outcome", self.error(exc))
                raise
            self.put("outcome", {"value": value, "what": self.what})
            return value
        out = self.get("outcome", "process 0")
        if out.get("what", self.what) != self.what:
            raise CoordinationError(f"process 0 made another call ({out.get('what')}) than this process "
                                    f"({self.what}): every process must make the same calls in the same order")
        if "error" in out:
            raise CoordinationError(f"{self.what} failed in process 0: {out['error']}")
        return out["value"]


#: errors a collective restore raises with their own class in every process, so that a
#: caller's ``except`` (restore again, start afresh) takes the same branch everywhere
_SAME_CLASS: dict[str, type[AtomicStoreError]] = {
    c.__name__: c for c in (NotFoundError, PreconditionFailedError, CorruptionError, ChecksumMismatchError,
                            InvalidArgumentError)
}


def remote_error(session: Session, report: dict[str, Any]) -> AtomicStoreError:
    """The error another process published (``Session.error``), to raise here: with its
    class for the library's errors above, else :class:`CoordinationError`."""
    cls = _SAME_CLASS.get(str(report.get("type")), CoordinationError)
    return cls(f"{session.what} failed in process {report.get('process', 0)}: {report.get('error')}")


def agree(session: Session) -> None:
    """Once this process's own part of a collective restore succeeded: return when every
    process's did, raise the first failure otherwise (waiting for the others at most the
    timeout from now). A process whose own part failed calls :meth:`Session.fail`
    instead."""
    session.restart_clock()
    if session.main:
        for i in range(1, session.count):
            rep = session.get(f"report/{i}", f"process {i}")
            if "error" in rep:
                session.put("outcome", rep)  # the others learn process i's error itself
                raise remote_error(session, rep)
        session.forget_earlier()
        session.put("outcome", {"ok": True})
        return
    session.put(f"report/{session.index}", {"ok": True})
    out = session.get("outcome", "process 0", margin=session.margin)
    if not out.get("ok"):
        raise remote_error(session, out)


def coordinated_save(
    session: Session,
    store: Store,
    leaves: list[ShardedLeaf],
    shards: list[LocalShard],
    *,
    begin: Callable[[], Transaction],
    finish: Callable[[Transaction, dict[int, list[Shard]], Callable[[], None]], Any],
    name: Callable[[int, tuple[int, ...]], str],
    after: Callable[[], None] | None = None,
    threads: int = 8,
) -> Any:
    """Run one multi-host save (see the module docstring). Process 0 calls ``begin()`` to
    check and open the transaction, then ``finish(txn, shards_by_array, check)``, which
    writes the rest and commits, calling ``check()`` right before the commit point;
    returns what ``finish`` returns; the other processes return the published outcome
    (``{"ok", "attempt", "manifest"}``). ``name(n, start)`` names shard files. ``after()``
    (process 0: retention) runs after the commit and before the outcome is published, so
    that every process sees its effect once the call returns; its error is raised in
    process 0 only (the save is committed)."""
    if session.main:
        return _main(session, store, leaves, shards, begin, finish, name, after, threads)
    return _other(session, leaves, shards, store, name, threads)


def coordinated_parts(
    session: Session,
    store: Store,
    leaves: list[ShardedLeaf],
    shards: list[LocalShard],
    *,
    decide: Callable[[], dict[str, Any]],
    begin: Callable[[dict[str, Any]], Transaction],
    finish: Callable[[Transaction, dict[int, list[Shard]], list[dict[str, Any]]], Any],
    name: Callable[[int, tuple[int, ...]], str],
    replicas: list[LocalShard] = (),  # type: ignore[assignment]
    threads: int = 8,
) -> Any:
    """A multi-host save in which every process commits a checkpoint of its own, in its
    own ``store`` (a tiered manager's local tier): each holds the shard files this process
    wrote (its share, and a copy of each of ``replicas``: shards another process writes),
    and learns every process's share (their reports: file, size, CRC32C, and ``by``, the
    process that wrote it). Process 0's
    ``decide()`` (JSON) is handed to every process's ``begin(decision)``, which opens its
    transaction; ``finish(txn, shards_by_array, reports)`` writes the rest and commits.
    Returns what ``finish`` returns once every process committed its part; raises in
    every process if any failed."""
    txn = None
    try:
        if session.main:
            decision = decide()
            session.put("plan", {"what": session.what, "value": decision})
        else:
            decision = session.await_plan()
        txn = begin(decision)
        mine = [{**f, "by": session.index} for f in write_shards(store, txn.prefix, shards, name, threads)]
        copies = write_shards(store, txn.prefix, replicas, name, threads)
        if session.main:
            reports = [{"files": mine}] + [session.get(f"shards/{i}", f"process {i}")
                                            for i in range(1, session.count)]
            for i, rep in enumerate(reports):
                if "error" in rep:
                    raise CoordinationError(f"{session.what}: process {i} failed: {rep['error']}")
            by_array = _tiled(session, reports, leaves)
            files = [f for rep in reports for f in rep["files"]]
            session.put("table", {"what": session.what, "files": files})
        else:
            session.put(f"shards/{session.index}", {"files": mine})
            table = session.get("table", "process 0")
            if "error" in table:
                raise remote_error(session, table)
            files = table["files"]
            by_array = assemble(files, leaves)
        for f in mine + copies:  # (written at the attempt's prefix, not through the transaction)
            txn.adopt(f["file"], f["size"], f["crc32c"])
        out = finish(txn, by_array, files)
    except BaseException as exc:
        session.fail(exc, parts=True)
        if txn is not None and not txn.committed:
            _abort_within(txn, session.margin)
        raise
    agree(session)
    return out


def _main(session: Session, store: Store, leaves: list[ShardedLeaf], shards: list[LocalShard],
          begin: Callable[[], Transaction], finish: Callable[..., Any], name: Callable[..., str],
          after: Callable[[], None] | None, threads: int) -> Any:
    txn = None
    try:
        txn = begin()
        session.put("plan", {"what": session.what, "prefix": txn.prefix, "attempt": txn.attempt,
                             "leaves": [leaf.describe() for leaf in leaves]})
        reports = _reports(session, store, txn, shards, name, threads)
        by_array = _tiled(session, reports, leaves)
        for rep in reports:
            for f in rep["files"]:
                txn.adopt(f["file"], f["size"], f["crc32c"])
        out = finish(txn, by_array, session.check_can_commit)
    except BaseException as exc:
        session.fail(exc)  # first: the others learn now, not after the clean-up below
        if txn is not None and not txn.committed:
            _abort_within(txn, session.margin)
        raise
    _publish_outcome(session, txn, after)
    return out


def _reports(session: Session, store: Store, txn: Transaction, shards: list[LocalShard],
             name: Callable[..., str], threads: int) -> list[dict[str, Any]]:
    """Process 0's shards written into ``txn``, then every process's report (process 0's
    first) of the shard files it wrote; raise if any process failed."""
    reports = [{"files": write_shards(store, txn.prefix, shards, name, threads)}]
    for i in range(1, session.count):
        reports.append(session.get(f"report/{i}", f"process {i}"))
    if session.count > 1:
        session.forget_earlier()
    for i, rep in enumerate(reports):
        if "error" in rep:
            raise CoordinationError(f"{session.what}: process {i} failed: {rep['error']}")
    return reports


def _tiled(session: Session, reports: list[dict[str, Any]], leaves: list[ShardedLeaf]) -> dict[int, list[Shard]]:
    """The shards of each sharded array from the processes' ``reports``, checked to tile
    it by the reader's own rule, before anything is committed."""
    files = [f for rep in reports for f in rep["files"]]
    try:
        by_array = assemble(files, leaves)
        sizes = {f["file"]: f["size"] for f in files}
    except (KeyError, TypeError, ValueError) as exc:
        raise CoordinationError(f"{session.what}: malformed report: {exc}") from None
    for leaf in leaves:  # the reader's own rule, before anything is committed
        try:
            check_shards(by_array[leaf.n], leaf.shape, leaf.dtype.itemsize, sizes.get)
        except ValueError as exc:
            raise CoordinationError(
                f"{session.what}: the shards the processes wrote of {leaf.key} do not tile it ({exc}): "
                "do all processes hold the array with the same sharding?") from None
    return by_array


def _publish_outcome(session: Session, txn: Transaction, after: Callable[[], None] | None) -> None:
    """Committed: run ``after()`` (retention), then tell the others; ``after``'s error is
    raised here only after they were told (the save is committed)."""
    late: BaseException | None = None
    if after is not None:
        try:
            after()
        except Exception as exc:  # noqa: BLE001 - committed: raised here after the others are told
            late = exc
    man = txn.manifest
    session.put("outcome", {"ok": True, "attempt": txn.attempt,
                            "manifest": man.to_bytes().decode() if man is not None else None})
    if late is not None:
        raise late


def _abort_within(txn: Transaction, seconds: float) -> None:
    """Abort ``txn``, waiting at most ``seconds`` for its clean-up (deleting many shard
    objects can take long): process 0 must raise within the timeout plus the margin too.
    What the clean-up has not removed by then, it goes on removing in the background, and
    recovery removes whatever remains."""
    t = threading.Thread(target=_quiet_abort, args=(txn,), name="atomicstore-abort", daemon=True)
    t.start()
    t.join(seconds)


def _quiet_abort(txn: Transaction) -> None:
    try:
        txn.abort()
    except Exception as exc:  # noqa: BLE001 - recovery removes what is left
        log.warning("clean-up of the failed save %s: %s", txn.name, exc)


def _other(session: Session, leaves: list[ShardedLeaf], shards: list[LocalShard], store: Store,
           name: Callable[..., str], threads: int) -> dict[str, Any]:
    try:
        plan = session.get("plan", "process 0")
        if "error" in plan:
            raise CoordinationError(f"{session.what}: process 0 refused the save: {plan['error']}")
        if plan.get("what") != session.what:
            raise CoordinationError(f"process 0 is making another call ({plan.get('what')}) than this "
                                    f"process ({session.what}): every process must make the same calls "
                                    "in the same order")
        mine = [leaf.describe() for leaf in leaves]
        if plan["leaves"] != mine:
            raise InvalidArgumentError(
                f"{session.what}: process {session.index} holds other sharded arrays than process 0 "
                f"(here {[m[1] for m in mine]}, there {[p[1] for p in plan['leaves']]}; an array on the "
                "devices of one process only is seen whole there and sharded elsewhere: place it on "
                "every process's devices or fetch it to host first)")
        files = write_shards(store, plan["prefix"], shards, name, threads)
    except BaseException as exc:
        session.fail(exc)
        raise
    session.put(f"report/{session.index}", {"files": files})
    try:
        # a little longer than process 0, which gives up at its own deadline
        outcome: dict[str, Any] = session.get("outcome", "process 0", margin=session.margin)
    except CoordinationError as exc:
        session.abandon()
        raise CoordinationError(f"{exc}; whether the save committed is unknown until process 0 is back "
                                "(this process published that it gave up, so process 0 will not commit "
                                "after reading it)") from None
    if not outcome.get("ok"):
        raise CoordinationError(f"{session.what} was not committed: process {outcome.get('process', 0)} "
                                f"failed: {outcome.get('error')}")
    return outcome


__all__ = [
    "DEFAULT_TIMEOUT",
    "Session",
    "agree",
    "check_timeout",
    "coordinated_parts",
    "coordinated_save",
    "distributed_client",
    "multihost",
    "process_index_count",
    "remote_error",
]
