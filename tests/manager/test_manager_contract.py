"""CheckpointManager holds the contract at every public method (issue 21, rows 4, 5, 9, 10,
and the four questions: read while overwritten or deleted, hostile or oversized input, a
read-only store, a forked process). The table is in docs/manager.md."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import make_backend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atomicstore
from atomicstore import CheckpointManager
from atomicstore.commit.manifest import MAX_MANIFEST_BYTES, MAX_METADATA_BYTES
from atomicstore.testing.faults import FaultPlan, is_mutation, object_key

NAN, INF = float("nan"), float("inf")


def tree(v: float) -> dict:
    return {"w": np.full(4, v, np.float32), "step": v}


def manager(b, **kwargs) -> CheckpointManager:
    return CheckpointManager(b.url, storage_options=b.options, **kwargs)


def stored_keys(b) -> list[str]:
    """Every key under the store's root (staging, leases and trash included)."""
    return sorted(b.open().driver.find(""))


def same(a: object, b: object) -> bool:
    """Equal JSON values, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# -- row 4: NaN metrics ----------------------------------------------------------------------
METRICS = {"loss": NAN, "acc": 0.5, "eval": {"ppl": INF, "hist": [1.0, -INF, NAN, None]}, "n": 3}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_nan_metrics_are_saved_and_read_back(backend, async_save):
    """Row 4: the loss diverged. The step is saved with its NaN (and inf) metrics, which
    read back as floats; the manifest stays strict JSON (non-finite values are listed
    apart, see docs/manager.md)."""
    with manager(backend, keep=3, async_save=async_save) as mgr:
        mgr.save(1, tree(1), metrics=METRICS)
    again = manager(backend, keep=3)
    assert again.all_steps() == [1]
    assert same(again.metadata(1)["metrics"], METRICS), again.metadata(1)["metrics"]
    assert again.restore(1)["step"] == 1
    _, manifest = again.store.strategy.resolve("checkpoint_1")

    def no_constants(c: str) -> None:
        raise AssertionError(f"manifest is not strict JSON: {c}")

    doc = json.loads(manifest, parse_constant=no_constants)
    assert doc["metadata"]["metrics"]["loss"] is None


def test_only_metrics_may_hold_nan(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=True)
    for what in ("metadata", "items"):
        with pytest.raises(atomicstore.InvalidArgumentError, match=what):
            mgr.save(1, tree(1), **{what: {"x": NAN}})
    mgr.close()
    assert mgr.all_steps() == []


def huge() -> dict:
    """An argument whose JSON exceeds what a manifest may hold."""
    return {"blob": "x" * (MAX_METADATA_BYTES + 1)}


def deep(n: int) -> dict:
    v: object = 1.0
    for _ in range(n):
        v = {"a": v}
    return {"d": v}


BAD_ARGS = [
    ("metadata", {"metadata": {"f": print}}),
    ("metadata", {"metadata": [1, 2]}),
    ("metrics", {"metrics": {"loss": object()}}),
    ("metrics", {"metrics": deep(10_000)}),  # (json.dumps alone: RecursionError)
    ("metrics", {"metrics": deep(200)}),
    ("items", {"items": {7: "seven"}}),
    ("items", {"items": {"": 1}}),
    ("force", {"force": "yes"}),
    ("milestone", {"milestone": 1}),
    ("ephemeral", {"ephemeral": None}),
    ("copy", {"copy": "no"}),
    ("metadata", {"metadata": huge()}),
    ("items", {"items": huge()}),
    ("metrics", {"metrics": huge()}),
]


@pytest.mark.parametrize("what,kwargs", BAD_ARGS, ids=[f"{w}-{i}" for i, (w, _) in enumerate(BAD_ARGS)])
def test_async_save_validates_its_arguments_before_returning(tmp_path, what, kwargs):
    """Row 4: whatever can be checked is checked before ``save`` returns, naming the
    argument; nothing is started in the background and nothing is written."""
    mgr = CheckpointManager(tmp_path / "s", async_save=True)
    before = set(threading.enumerate())
    with pytest.raises(atomicstore.InvalidArgumentError, match=what):
        mgr.save(1, tree(1), **kwargs)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("atomicstore-save")]
    mgr.close()  # nothing failed in the background either
    assert mgr.all_steps() == []
    assert not list((tmp_path / "s").rglob("*.json")), "not even a lease"


def test_a_step_whose_name_is_not_valid_is_refused_before_returning(tmp_path):
    mgr = CheckpointManager(tmp_path, prefix="p" * 190 + "_", async_save=True)
    with pytest.raises(atomicstore.InvalidArgumentError, match="name"):
        mgr.save(1.0000000000000002, tree(1))  # 190 + 1 + 18 characters
    with pytest.raises(atomicstore.InvalidArgumentError, match="prefix"):
        CheckpointManager(tmp_path, prefix="ckpt step ")  # no name it makes is valid
    mgr.close()


@pytest.mark.parametrize("where", ["save", "wait_until_finished", "close", "restore"])
def test_a_background_failure_surfaces_at_the_next_call(request, tmp_path, where):
    """Row 4: a background save that fails (the store refuses its writes: 403) is raised
    by the next save, wait_until_finished, close or restore, as the library's own error;
    never only logged."""
    b = make_backend("s3", request, tmp_path)
    mgr = manager(b, async_save=True, keep=5)
    mgr.save(1, tree(1))
    mgr.wait_until_finished()

    def step_2(env: dict) -> bool:
        return is_mutation(env) and "checkpoint_2" in (object_key(env) or "")

    b.faults(FaultPlan(deny=step_2))
    mgr.save(2, tree(2))
    if where == "save":
        for t in threading.enumerate():  # the save of step 2 has failed
            if t.name == "atomicstore-save-2":
                t.join()
    with pytest.raises(atomicstore.StorageError, match="background save failed.*checkpoint_2"):
        if where == "save":
            mgr.save(3, tree(3))
        elif where == "restore":
            mgr.restore(1)
        else:
            getattr(mgr, where)()
    b.faults(None)
    assert mgr.all_steps() == [1]
    if where != "close":
        mgr.save(3, tree(3))
        mgr.close()
        assert mgr.all_steps() == [1, 3]


# -- row 5: best_fn and NaN -------------------------------------------------------------------
@pytest.mark.parametrize("mode,values", [("min", [0.3, None, 0.9, 0.5, 0.1]),
                                         ("max", [0.7, None, 0.1, 0.5, 0.9])])
@pytest.mark.parametrize("missing", ["nan", "absent"])
def test_nan_from_best_fn_ranks_as_worst(mode, values, missing):
    """Row 5: best_fn returns NaN for the step without the metric (or the metric saved is
    NaN): it ranks as worst, like a step without metrics."""
    url = f"memory://r5-{secrets.token_hex(4)}"
    mgr = CheckpointManager(url, keep=2, best_mode=mode, best_fn=lambda m: m.get("loss", NAN))
    for step, v in enumerate(values, 1):
        metrics = {"loss": v} if v is not None else {"loss": NAN} if missing == "nan" else None
        mgr.save(step, tree(step), metrics=metrics)
    assert mgr.all_steps() == [1, 5]


SCORES = st.one_of(st.none(), st.just(NAN), st.just(INF), st.just(-INF),
                   st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.5]))


def model_kept(values: list[float | None], keep: int, mode: str) -> list[int]:
    """The docs' rule, step by step: after each save, the ``keep`` best stay; no number
    (no metrics, no such metric, NaN) ranks below every number; among equals the newer
    ranks first."""
    def rank(step: int) -> tuple[float, int]:
        v = values[step - 1]
        if v is None or math.isnan(v):
            return (-INF, step)
        return (v if mode == "max" else -v, step)

    kept: list[int] = []
    for step in range(1, len(values) + 1):
        kept = sorted(sorted([*kept, step], key=rank, reverse=True)[:keep])
    return kept


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(SCORES, min_size=1, max_size=7), keep=st.integers(1, 3),
       mode=st.sampled_from(["min", "max"]), how=st.sampled_from(["key", "nan"]))
def test_retention_by_best_fn_matches_a_simple_model(values, keep, mode, how):
    """Row 5: over random metric sequences with NaN, missing metrics and infinities, the
    steps kept are exactly the model's."""
    fn = (lambda m: m["loss"]) if how == "key" else (lambda m: m.get("loss", NAN))
    mgr = CheckpointManager(f"memory://r5p-{secrets.token_hex(6)}", keep=keep, best_mode=mode, best_fn=fn)
    for step, v in enumerate(values, 1):
        mgr.save(step, {"s": step}, metrics=None if v is None else {"loss": v})
    assert mgr.all_steps() == model_kept(values, keep, mode), values


# -- row 9: read-only store -------------------------------------------------------------------
def leave_a_crashed_save(b) -> None:
    """Step 1 committed, and the leftovers of a save of step 2 that crashed (its lease
    expires; recovery, run by a later clock, removes them)."""
    from crashsim import Crasher, CrashingDriver, SimulatedCrash

    mgr = manager(b)
    mgr.save(1, tree(1))
    crashing = atomicstore.Store(CrashingDriver(b.open().driver, Crasher(crash_at=4)), lease_ttl=3600)
    with pytest.raises(SimulatedCrash):
        with crashing.transaction("checkpoint_2") as txn:
            txn.write_bytes("a.bin", b"x" * 100)
            txn.write_bytes("b.bin", b"y" * 100)


READ_ONLY_CHILD = textwrap.dedent("""
    import errno, logging, os, sys, time
    import numpy as np, atomicstore
    root = sys.argv[1]
    try:
        open(os.path.join(root, "probe"), "w")
        sys.exit("the directory is writable")
    except OSError as exc:
        assert exc.errno == errno.EROFS, exc
    records = []
    class Keep(logging.Handler):
        def emit(self, r): records.append(r)
    logging.getLogger("atomicstore").addHandler(Keep())
    future = lambda: time.time() + 10**6  # every leftover is stale: recovery would remove it
    store = atomicstore.open_store(root, clock=future)
    assert store.recover(dry_run=True).actions, "there are leftovers to remove"
    for _ in range(2):
        mgr = atomicstore.CheckpointManager(root, store=atomicstore.open_store(root, clock=future))
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    assert mgr.restore()["step"] == 1 and mgr.metadata(1)["step"] == 1 and mgr.items(1) == {}
    warned = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    print("WARNED", warned[0].getMessage().replace(chr(10), " "))
    for call in (lambda: mgr.save(2, {"w": np.ones(2)}), lambda: mgr.delete(1)):
        try:
            call()
            sys.exit("a write to a read-only directory succeeded")
        except atomicstore.StorageError as exc:
            print("REFUSED", type(exc).__name__)
    mgr.close()
    print("OK")
""")


def test_read_only_directory_opens_for_reading(tmp_path):
    """Row 9: an evaluation job sees the checkpoint directory through a read-only mount
    (a bind mount remounted read-only in the child's own mount namespace: a real EROFS,
    which root cannot bypass) while a crashed save's leftovers are there. Opening runs
    recovery, which cannot remove them: that is logged once, and list, metadata and
    restore work; save and delete raise StorageError."""
    src, ro = tmp_path / "ckpts", tmp_path / "ro"
    ro.mkdir()
    from conftest import Backend

    leave_a_crashed_save(Backend("local", str(src)))
    script = 'mount --bind "$1" "$2" && mount -o remount,ro,bind "$2" && exec "$3" -c "$4" "$2"'
    out = subprocess.run(["unshare", "-rm", "--propagation", "private", "sh", "-c", script, "sh",
                          str(src), str(ro), sys.executable, READ_ONLY_CHILD],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.endswith("OK\n"), out.stdout + out.stderr
    assert "read" in out.stdout.split("WARNED", 1)[1].split("\n")[0]
    assert out.stdout.count("REFUSED StorageError") == 2
    assert atomicstore.open_store(src).recover(now=time.time() + 10**6).actions  # still there


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_read_only_bucket_opens_for_reading(request, tmp_path, caplog, kind):
    """Row 9 on object stores: read-only credentials (every mutating request answered 403
    by the fault layer)."""
    b = make_backend(kind, request, tmp_path)
    leave_a_crashed_save(b)
    b.faults(FaultPlan(deny=is_mutation))

    def future() -> float:
        return time.time() + 10**6

    with caplog.at_level(logging.WARNING, logger="atomicstore"):
        for _ in range(2):
            mgr = CheckpointManager(b.url, store=b.open(clock=future))
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "read" in warned[0].getMessage(), caplog.text
    assert mgr.all_steps() == [1] and mgr.restore()["step"] == 1 and mgr.metadata(1)["step"] == 1
    with pytest.raises(atomicstore.StorageError):
        mgr.save(2, tree(2))
    with pytest.raises(atomicstore.StorageError):
        mgr.delete(1)
    b.faults(None)
    assert b.open(clock=future).recover(dry_run=True).actions  # left for a writer


# -- row 10: manifests larger than readers accept ---------------------------------------------
@pytest.mark.parametrize("kind,what,async_save", [
    ("memory", "metadata", False), ("memory", "metrics", True), ("local", "items", False),
    ("local", "metadata", True), ("s3", "items", True), ("s3", "metrics", False)])
def test_an_oversized_manifest_is_refused_before_anything_is_committed(request, tmp_path, kind, what,
                                                                       async_save):
    """Row 10: the writer refuses what readers would refuse (one limit), naming the
    argument, its size and the limit, before anything is written."""
    b = make_backend(kind, request, tmp_path)
    mgr = manager(b, async_save=async_save)
    mgr.save(1, tree(1))
    mgr.wait_until_finished()
    before = stored_keys(b)
    big = {"blob": "x" * (MAX_MANIFEST_BYTES // 2), "more": "y" * (MAX_MANIFEST_BYTES // 2)}
    with pytest.raises(atomicstore.InvalidArgumentError) as info:
        mgr.save(2, tree(2), **{what: big})
    msg = str(info.value)
    assert what in msg and f"{len(json.dumps(big)):,}" in msg and f"{MAX_MANIFEST_BYTES:,}" in msg, msg
    mgr.close()
    assert mgr.all_steps() == [1] and stored_keys(b) == before


def test_arguments_that_fit_alone_but_not_together_are_refused(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=True)
    half = {"x": "x" * (MAX_METADATA_BYTES // 2 + 10)}
    with pytest.raises(atomicstore.InvalidArgumentError, match="metadata.*items|items.*metadata"):
        mgr.save(1, tree(1), metadata=half, items=half)
    mgr.close()
    assert mgr.all_steps() == [] and not list(tmp_path.rglob("*.json"))


def test_a_long_data_order_item_is_refused(tmp_path):
    """The issue's example: ``items={"data_order": list(range(9_000_000))}``."""
    mgr = CheckpointManager(f"memory://r10-{secrets.token_hex(4)}")
    with pytest.raises(atomicstore.InvalidArgumentError, match="items.*data_order|items"):
        mgr.save(1, tree(1), items={"data_order": list(range(9_000_000))})
    assert mgr.all_steps() == [] and not mgr.store.driver.find("")


def test_the_largest_metadata_a_writer_accepts_is_readable():
    """Writer and reader share one limit: the largest metadata the writer accepts commits
    and reads back; one byte more is refused."""
    url = f"memory://r10m-{secrets.token_hex(4)}"
    store = atomicstore.open_store(url)
    pad = MAX_METADATA_BYTES - len(json.dumps({"x": ""}))
    atomicstore.save(f"{url}/big", {"w": np.ones(2)}, store=store, metadata={"x": "x" * pad})
    assert len(store.manifest("big").metadata["x"]) == pad
    with pytest.raises(atomicstore.InvalidArgumentError, match=f"metadata.*{MAX_METADATA_BYTES:,}"):
        atomicstore.save(f"{url}/big2", {"w": np.ones(2)}, store=store, metadata={"x": "x" * (pad + 1)})
    assert store.list() == ["big"]
    assert [k for k in store.driver.find("") if "big2" in k] == []


def test_a_transaction_whose_file_list_is_too_large_commits_nothing(tmp_path):
    """The manifest's size is checked again at commit (its file list counts too): over
    the limit, commit raises InvalidArgumentError and the ``with`` block aborts."""
    store = atomicstore.open_store(tmp_path)
    long = "/".join(c * 240 for c in "abcd")  # (components of at most 255 characters)
    with pytest.raises(atomicstore.InvalidArgumentError, match="manifest"):
        with store.transaction("many") as txn:
            txn.write_bytes("real.bin", b"x")
            for i in range(MAX_MANIFEST_BYTES // 1000):
                txn.adopt(f"{long}{i}", 1, 0)
    assert store.list() == []
    assert not store.recover(now=time.time() + 10**6).actions, "the attempt was discarded"


# -- the four questions -----------------------------------------------------------------------
def test_steps_under_names_the_manager_does_not_write_are_not_listed(tmp_path):
    """Hostile input from storage: names that parse as a step but are not the name of that
    step (``checkpoint_05``, ``checkpoint_1_000``, ``checkpoint_1e1``) are not steps: a
    listed step is always one ``restore`` can open."""
    mgr = CheckpointManager(tmp_path, keep=10)
    mgr.save(1, tree(1))
    for alias in ("checkpoint_05", "checkpoint_1_000", "checkpoint_1e1", "checkpoint_+7", "checkpoint_01"):
        atomicstore.save(f"{tmp_path}/{alias}", tree(0))
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    mgr.save(2, tree(2))  # (retention ignores them too)
    assert mgr.all_steps() == [1, 2] and mgr.restore()["step"] == 2


@pytest.mark.parametrize("meta", [
    {"metrics": "high", "step": 3},
    {"items": [["a", 1]], "step": 3},
    {"metrics": {"loss": None}, "metrics_nonfinite": [[["loss", "deeper"], "nan"]], "step": 3},
    {"metrics": {"loss": 1.0}, "metrics_nonfinite": "nan", "step": 3},
    {"metrics": {}, "metrics_nonfinite": [[[], "nan"]], "step": 3},
    {"metrics": {"l": None}, "metrics_nonfinite": [[["l"], "__import__('os')"]], "step": 3},
    {"milestone": "yes", "step": 3},
    {"metrics": {"l": None}, "metrics_nonfinite": [[["l"], ["nan"]]], "step": 3},
])
def test_hostile_stored_metadata_is_data(tmp_path, caplog, meta):
    """A step whose manifest metadata was written by someone else (another tool, or
    tampered with) never crashes the manager with a TypeError: metadata and items raise
    CorruptionError naming the step, retention keeps it without counting it (warned)."""
    mgr = CheckpointManager(tmp_path, keep=1, best_fn=lambda m: m["loss"], best_mode="min")
    atomicstore.save(f"{tmp_path}/checkpoint_3", tree(3), metadata=meta)
    with pytest.raises(atomicstore.CorruptionError, match="checkpoint_3"):
        mgr.metadata(3)
    with pytest.raises(atomicstore.CorruptionError, match="checkpoint_3"):
        mgr.items(3)
    with caplog.at_level(logging.WARNING, logger="atomicstore.manager"):
        mgr.save(4, tree(4), metrics={"loss": 1.0})
        mgr.save(5, tree(5), metrics={"loss": 0.5})
    assert mgr.all_steps() == [3, 5] and "checkpoint_3" in caplog.text
    assert mgr.restore(3)["step"] == 3  # the tree itself is intact


def test_deeply_nested_stored_metrics_are_data(tmp_path):
    """A manifest written by hand (no writer of this library nests metadata deeper than
    MAX_METADATA_DEPTH) whose non-finite list points into 500-deep metrics: CorruptionError,
    never a RecursionError."""
    atomicstore.save(f"{tmp_path}/checkpoint_3", tree(3))
    store = atomicstore.open_store(tmp_path)
    prefix, raw = store.strategy.resolve("checkpoint_3")
    doc = json.loads(raw)
    doc["metadata"] = {"metrics": deep(500), "metrics_nonfinite": [[["d"], "nan"]]}
    (tmp_path / prefix / "manifest.json").write_text(json.dumps(doc))
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(atomicstore.CorruptionError, match="checkpoint_3.*deeper"):
        mgr.metadata(3)
    assert mgr.restore(3)["step"] == 3


def test_metadata_of_a_plain_save_reads_with_defaults(tmp_path):
    """A step saved by ``atomicstore.save`` (no manager metadata) is a step like any other."""
    atomicstore.save(f"{tmp_path}/checkpoint_3", tree(3), metadata={"note": "by hand"})
    mgr = CheckpointManager(tmp_path, keep=1, best_fn=lambda m: m["loss"])
    assert mgr.items(3) == {} and mgr.metadata(3)["note"] == "by hand"
    mgr.save(4, tree(4), metrics={"loss": 1.0})
    assert mgr.all_steps() == [4]


def test_restore_of_a_step_deleted_since_it_was_listed_is_not_found(request, tmp_path):
    """Deleted between two requests: ``latest_step()`` listed step 2, another process
    deletes it before ``restore(2)`` reads it: NotFoundError, never a partial tree."""
    b = make_backend("s3", request, tmp_path)
    mgr = manager(b, keep=5)
    mgr.save(1, tree(1))
    mgr.save(2, tree(2))
    step = mgr.latest_step()
    manager(b, keep=5, recover=False).delete(step)
    with pytest.raises(atomicstore.NotFoundError):
        mgr.restore(step)
    with pytest.raises(atomicstore.NotFoundError):
        mgr.metadata(step)
    assert mgr.restore()["step"] == 1


def test_two_managers_saving_one_step_commit_once(tmp_path):
    """Overwritten between two requests: manager A checked that step 2 is new, then B
    commits step 2 before A commits (A's background write is held at its first file):
    A's save fails with CommitConflictError at the next call, B's checkpoint is intact."""
    gate, entered = threading.Event(), threading.Event()
    base = atomicstore.open_store(tmp_path).driver

    class Gated(type(base)):  # type: ignore[misc]
        def open_writer(self, key, **kwargs):
            if "checkpoint_2." in key and not entered.is_set():
                entered.set()
                gate.wait(30)
            return super().open_writer(key, **kwargs)

    a = CheckpointManager(str(tmp_path), keep=5, async_save=True,
                          store=atomicstore.Store(Gated(base.fs, base.root, url=base.url)))
    b = CheckpointManager(str(tmp_path), keep=5, recover=False)
    a.save(2, tree(20))
    assert entered.wait(30)
    b.save(2, tree(21))
    gate.set()
    with pytest.raises(atomicstore.CommitConflictError, match="background save failed"):
        a.wait_until_finished()
    assert a.all_steps() == [2] and a.restore(2)["step"] == 21
    a.store.verify("checkpoint_2")


FORK_CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np, atomicstore
    root = sys.argv[1]
    mgr = atomicstore.CheckpointManager(root, keep=3, async_save=True)
    mgr.save(1, {"w": np.ones(3)}, metrics={"loss": float("nan")}, items={"it": 1})
    mgr.wait_until_finished()
    pid = os.fork()
    if pid == 0:
        out = []
        try:
            out.append(mgr.all_steps() == [1] and mgr.latest_step() == 1)
            out.append(mgr.metadata(1)["metrics"]["loss"] != mgr.metadata(1)["metrics"]["loss"])
            out.append(mgr.items(1) == {"it": 1} and bool(mgr.restore()["w"].sum() == 3))
            try:
                mgr.save(2, {"w": np.ones(3)})
                out.append(False)
            except atomicstore.InvalidArgumentError as exc:
                out.append("forked child" in str(exc))
            own = atomicstore.CheckpointManager(root, keep=3)
            own.save(2, {"w": np.ones(3) * 2})
            own.save(2.5, {"w": np.ones(3) * 2})
            mgr.delete(2.5)  # (through the inherited manager)
            mgr.wait_until_finished()
            mgr.close()
            out.append(own.all_steps() == [1, 2])
        except BaseException as exc:
            print("CHILD FAILED", repr(exc), flush=True)
            os._exit(1)
        print("CHILD", out, flush=True)
        os._exit(0 if all(out) else 1)
    _, status = os.waitpid(pid, 0)
    mgr.save(3, {"w": np.ones(3) * 3})
    mgr.close()
    assert mgr.all_steps() == [1, 2, 3], mgr.all_steps()
    print("PARENT", os.waitstatus_to_exitcode(status), flush=True)
""")


def test_a_forked_child_reads_through_its_parents_manager(tmp_path):
    """Forked process: the reading methods and ``delete`` work in the child; ``save`` is
    refused with a clear error; wait_until_finished and close return at once (the parent's
    background threads do not exist there); the child saves through its own manager; the
    parent's manager is unaffected."""
    out = subprocess.run([sys.executable, "-c", FORK_CHILD, str(tmp_path / "s")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CHILD [True, True, True, True, True]" in out.stdout and "PARENT 0" in out.stdout, out.stdout


def test_restore_and_delete_check_their_arguments(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, tree(1))
    for bad in ("1", True, NAN, INF, [1]):
        with pytest.raises(atomicstore.InvalidArgumentError):
            mgr.restore(bad)
        with pytest.raises(atomicstore.InvalidArgumentError):
            mgr.delete(bad)
        with pytest.raises(atomicstore.InvalidArgumentError):
            mgr.metadata(bad)
    assert mgr.all_steps() == [1]


# -- attack report B5, B6 and best_fn ------------------------------------------------------------
def test_force_saving_an_equal_float_step_replaces_the_step(tmp_path):
    """2.0 and 2 are one step: ``force=True`` replaces step 2 atomically under the name it
    was committed with, never a second checkpoint ``checkpoint_2.0`` of the same step (B5)."""
    m = CheckpointManager(str(tmp_path), keep=5)
    m.save(1, {"s": np.ones(1)})
    m.save(2, {"s": np.full(1, 2.0)})
    with pytest.raises(atomicstore.InvalidArgumentError, match="not newer"):
        m.save(2.0, {"s": np.full(1, 3.0)})
    m.save(2.0, {"s": np.full(1, 3.0)}, force=True)
    assert m.all_steps() == [1, 2]
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["checkpoint_1", "checkpoint_2"]
    assert m.restore(2)["s"][0] == 3.0


@pytest.mark.parametrize("async_save", [True, False])
def test_save_of_a_too_deep_or_cyclic_tree_is_refused_before_returning(tmp_path, async_save):
    """No raw RecursionError from an async save's snapshot: InvalidArgumentError naming the
    depth, before ``save`` returns; the manager stays usable and nothing is committed (B6)."""
    deep: dict[str, object] = {"leaf": 1}
    for _ in range(5000):
        deep = {"a": deep}
    cyc: list[object] = []
    cyc.append(cyc)
    m = CheckpointManager(str(tmp_path), async_save=async_save)
    for tree in (deep, {"l": cyc}):
        with pytest.raises(atomicstore.InvalidArgumentError, match="200"):
            m.save(1, tree)
    m.save(2, {"a": np.ones(2)})
    m.wait_until_finished()
    assert m.all_steps() == [2]
    m.close()


def test_best_fn_returning_an_int_beyond_a_float_ranks_as_the_best(tmp_path):
    """``best_fn`` giving 10**400 (a Python int no float holds) is the best score, not a
    failing best_fn ranked last."""
    m = CheckpointManager(str(tmp_path), keep=1, best_fn=lambda mt: mt["score"], best_mode="max")
    m.save(1, {"a": np.ones(1)}, metrics={"score": 10**400})
    m.save(2, {"a": np.ones(1)}, metrics={"score": 5})
    assert m.all_steps() == [1]
    m.close()
