"""Orbax saves through AtomicTemporaryPath: real Orbax, real fakes, real subprocesses.

Backends: local disk, and GCS (our fake, which honours ``ifGenerationMatch``) through
Orbax's own TensorStore ``gcs`` driver and epath/gcsfs. S3 is not among them: Orbax
0.12.8 builds a TensorStore ``file`` spec for every path that is not ``gs://`` (an
``s3://`` path fails with "Checkpoint path should be absolute", or, without OCDBT, is
written to a local directory named ``s3:``), so it cannot write to S3 at all; see
``docs/integrations.md`` ("Orbax").
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import in_forked_child
from orbax.checkpoint._src.path import temporary_paths

import atomicstore
from atomicstore.commit import inplace
from atomicstore.commit import steps as commit_steps
from atomicstore.integrations import orbax as aso
from atomicstore.integrations.orbax import AtomicTemporaryPath
from atomicstore.testing.faults import (
    FaultPlan,
    is_conditional,
    is_mutation,
    object_key,
    request_kind,
    writes_to,
)

WORKER = Path(__file__).with_name("orbax_worker.py")
ORBAX_BACKENDS = ["local", "gcs"]
FUTURE = 3600.0  # seconds: a view of the store from after every lease has expired


@dataclass
class Env:
    kind: str
    root: str  # the Orbax root directory (path or gs:// URL)
    cls: type[AtomicTemporaryPath]
    options: dict[str, Any]
    endpoint: str = "-"

    def later(self) -> type[AtomicTemporaryPath]:
        """The same class, seeing the store from FUTURE seconds ahead."""
        return self.cls.with_options(clock=lambda: time.time() + FUTURE)

    def store(self) -> atomicstore.Store:
        return self.cls.open_store(self.root)

    def listing(self) -> set[str]:
        return set(self.store().driver.find(""))


@pytest.fixture(params=ORBAX_BACKENDS)
def env(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    if request.param == "local":
        yield Env("local", str(tmp_path / "run"), AtomicTemporaryPath.with_options(lease_ttl=3.0), {})
        return
    srv = request.getfixturevalue("gcs_server")
    srv.faults(None)
    bucket = srv.new_bucket()
    # Orbax writes arrays with TensorStore's gcs driver and metadata with epath (gcsfs)
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", srv.endpoint)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", srv.endpoint)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    saved = fsspec.config.conf.get("gcs")
    fsspec.config.conf["gcs"] = {"endpoint_url": srv.endpoint, "token": "anon", "project": "test",
                                 "use_listings_cache": False}
    opts = {"endpoint_url": srv.endpoint, "token": "anon", "project": "test"}
    try:
        yield Env("gcs", f"gs://{bucket}/run", AtomicTemporaryPath.with_options(lease_ttl=3.0, **opts), opts,
                  srv.endpoint)
    finally:
        if saved is None:
            fsspec.config.conf.pop("gcs", None)
        else:
            fsspec.config.conf["gcs"] = saved


def tree(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 32), dtype=np.float32), "b": rng.standard_normal(32)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def manager(env: Env, cls: Any = None, item_names: Any = None, **kw: Any) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(temporary_path_class=env.cls if cls is None else cls, **kw)
    return ocp.CheckpointManager(env.root, item_names=item_names, options=options)


def steps(mgr: ocp.CheckpointManager) -> list[int]:
    """The steps ``mgr`` lists, read from storage now."""
    mgr.reload()
    return list(mgr.all_steps())


def stock_manager(env: Env) -> ocp.CheckpointManager:
    """Orbax with its default temporary path class (AtomicRename on disk, CommitFile on GCS)."""
    return ocp.CheckpointManager(env.root)


# -- the supported versions ----------------------------------------------------------------------
def test_the_installed_orbax_is_a_supported_version_with_the_option():
    aso.check_orbax_version(ocp.__version__)
    assert ocp.__version__ == aso.ORBAX_VERSION
    assert aso.has_temporary_path_option()
    for bad in ("0.12.7", "0.11.30", "0.13.0", "1.0"):
        with pytest.raises(aso.OrbaxVersionError, match="supports orbax-checkpoint"):
            aso.check_orbax_version(bad)
    aso.check_orbax_version("0.12.9rc1")
    with pytest.raises(atomicstore.InvalidArgumentError):
        aso.check_orbax_version(12)  # type: ignore[arg-type]
    assert issubclass(aso.OrbaxVersionError, atomicstore.AtomicStoreError)
    assert issubclass(AtomicTemporaryPath, ocp.path.atomicity_types.TemporaryPath)


# -- save, list, restore -------------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [True, False])
def test_manager_saves_and_restores_and_stock_orbax_reads_it(env: Env, async_save: bool):
    mgr = manager(env, enable_async_checkpointing=async_save)
    states = {1: tree(1), 2: tree(2)}
    for step, state in states.items():
        assert mgr.save(step, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
    assert steps(mgr) == [1, 2]
    assert same(mgr.restore(2, args=ocp.args.StandardRestore(states[2])), states[2])
    assert same(manager(env).restore(1), states[1])  # a fresh manager, no restore args

    # every file Orbax wrote is in the record, with its CRC32C, and re-reads clean
    for step in states:
        record = env.cls.verify(f"{env.root}/{step}")
        assert record.name == str(step) and any(p.startswith("default/") for p in record.files)
        assert "_CHECKPOINT_METADATA" in record.files
    keys = env.listing()
    assert not [k for k in keys if ".orbax-checkpoint-tmp" in k or "/staging/" in k or "leases/" in k]
    if env.kind == "local":  # an ordinary atomicstore checkpoint: stock Orbax ignores manifest.json
        assert env.store().list() == ["1", "2"]
        assert {"1/manifest.json", "1/commit_success.txt"} <= keys
        assert env.store().verify("2").files == env.cls.check_final(f"{env.root}/2").files
    else:  # in place, a conditional non-empty marker that is atomicstore's record of the step
        marker = json.loads(env.store().read_file("2/commit_success.txt"))
        assert marker["format"] == aso.COMMIT_FORMAT and marker["name"] == "2"
        assert set(marker["files"]) == set(record.files)
        claim = json.loads(env.store().read_file(f"2/{aso.CLAIM_FILE}"))
        assert claim["attempt"] == marker["attempt"]
        assert not [k for k in keys if "/attempt-" in k]  # no directory an Orbax reader would take for an item

    stock = stock_manager(env)  # Orbax's own classes list and restore what it saved
    assert stock.all_steps() == [1, 2]
    assert same(stock.restore(1), states[1])
    assert same(stock.restore(2, args=ocp.args.StandardRestore(states[2])), states[2])


def test_a_committed_step_is_refused_before_anything_is_written(env: Env):
    ckptr = ocp.StandardCheckpointer(temporary_path_class=env.cls)
    ckptr.save(f"{env.root}/7", tree(7))
    ckptr.wait_until_finished()
    before = env.listing()
    again = env.cls.from_final(f"{env.root}/7")
    with pytest.raises(atomicstore.CommitConflictError):
        asyncio.run(again.create())
    assert env.listing() == before
    assert same(ckptr.restore(f"{env.root}/7"), tree(7))


# -- two writers of one step ----------------------------------------------------------------------
def test_two_writers_of_one_step_exactly_one_commits(env: Env):
    reached, gate = threading.Event(), threading.Event()

    def hold() -> None:  # Orbax calls it after the data is written, right before finalize
        reached.set()
        gate.wait(60)

    paused = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler(), temporary_path_class=env.cls,
                                   async_options=ocp.AsyncOptions(post_finalization_callback=hold))
    step = f"{env.root}/5"
    paused.save(step, args=ocp.args.StandardSave(tree(50)))  # A: written, held before its commit
    assert reached.wait(60)
    if env.kind == "local":
        # B writes its own staging and commits first; A's commit is then refused and its
        # staging removed: none of A's bytes are in B's step
        quick = ocp.StandardCheckpointer(temporary_path_class=env.cls)
        quick.save(step, tree(51))
        quick.wait_until_finished()
        gate.set()
        with pytest.raises(Exception) as err:
            paused.wait_until_finished()
        assert _chain_has(err.value, atomicstore.CommitConflictError)
        winner = tree(51)
        assert not os.listdir(os.path.join(env.root, ".atomicstore", "staging"))
    else:
        # on an object store both would write in place: in this process B is refused as
        # it begins (A's items could not be told from B's); another process's B is refused
        # at create by A's claim (test_two_processes_save_one_step_through_the_atomic_manager)
        before = env.listing()
        attempt_a = json.loads(env.store().read_file(f"5/{aso.CLAIM_FILE}"))["attempt"]
        with pytest.raises(atomicstore.CommitConflictError, match="another save in this process"):
            env.cls.from_final(step)
        assert env.listing() == before
        gate.set()
        paused.wait_until_finished()
        winner = tree(50)
        assert json.loads(env.store().read_file("5/commit_success.txt"))["attempt"] == attempt_a
    record = env.cls.verify(step)  # every file is the winner's, as recorded
    assert record.files
    assert same(ocp.StandardCheckpointer(temporary_path_class=env.cls).restore(step), winner)
    assert same(ocp.StandardCheckpointer().restore(step), winner)
    assert not [k for k in env.listing() if "leases/" in k]


def test_a_writer_declared_dead_cannot_commit(env: Env):
    reached, gate = threading.Event(), threading.Event()

    def hold() -> None:
        reached.set()
        gate.wait(60)

    zombie = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler(), temporary_path_class=env.cls,
                                   async_options=ocp.AsyncOptions(post_finalization_callback=hold))
    zombie.save(f"{env.root}/6", args=ocp.args.StandardSave(tree(6)))
    assert reached.wait(60)  # everything written; paused right before its commit
    # another process, after this writer's lease expired, fences it and removes its attempt
    report = env.later().recover(env.root)
    assert report.actions
    gate.set()
    with pytest.raises(Exception) as err:
        zombie.wait_until_finished()
    assert _chain_has(err.value, atomicstore.LeaseLostError)
    assert steps(manager(env)) == [] and stock_manager(env).all_steps() == []
    assert not [k for k in env.listing() if k.startswith(("6/", ".atomicstore/staging/", ".atomicstore/leases/"))]


@pytest.mark.parametrize("kind", ["gcs"])  # a lost reply needs the HTTP fault injector
def test_a_lost_reply_to_the_commit_is_reconciled(kind: str, gcs_server: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    bucket = gcs_server.new_bucket()
    for k, v in (("TENSORSTORE_GCS_HTTP_URL", gcs_server.endpoint), ("STORAGE_EMULATOR_HOST", gcs_server.endpoint),
                 ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")):
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(fsspec.config.conf, "gcs", {"endpoint_url": gcs_server.endpoint, "token": "anon",
                                                    "project": "test", "use_listings_cache": False})
    cls = AtomicTemporaryPath.with_options(endpoint_url=gcs_server.endpoint, token="anon", project="test",
                                           retry=atomicstore.RetryPolicy(attempts=5, initial_wait=0.01,
                                                                         max_wait=0.1, deadline=30))
    root = f"gs://{bucket}/run"

    def marker_write(environ: dict) -> bool:  # the commit point, conditional
        return is_conditional(environ) and "commit_success.txt" in environ.get("QUERY_STRING", "")

    gcs_server.faults(FaultPlan(lost_reply_rate=1.0, applies_to=marker_write, budget=1))
    try:
        ckptr = ocp.StandardCheckpointer(temporary_path_class=cls)
        ckptr.save(f"{root}/4", tree(4))  # the marker lands, the reply is lost, the retry gets 412
        ckptr.wait_until_finished()
        assert gcs_server.injector.injected == 1
    finally:
        gcs_server.faults(None)
    assert same(ckptr.restore(f"{root}/4"), tree(4))
    record = json.loads(cls.open_store(root).read_file("4/commit_success.txt"))
    assert record["attempt"] == json.loads(cls.open_store(root).read_file(f"4/{aso.CLAIM_FILE}"))["attempt"]


def _chain_has(exc: BaseException | None, cls: type) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, cls):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


# -- CheckpointManager: AtomicCheckpointManager never forces ----------------------------------------
def atomic_manager(env: Env, **kw: Any) -> aso.AtomicCheckpointManager:
    return aso.AtomicCheckpointManager(env.root, options=ocp.CheckpointManagerOptions(
        temporary_path_class=env.cls, **kw))


class Holder:
    """tests/integrations/orbax_worker.py in ``hold`` mode: another process saving ``step`` through an
    AtomicCheckpointManager, held right before its commit until ``gate`` exists."""

    def __init__(self, env: Env, step: int, seed: int, gate: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), env.root, env.endpoint, "hold", str(step), str(seed), str(gate)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=str(WORKER.parents[2]))
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("EXIT")

    def expect(self, prefix: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line != "EXIT", f"the worker exited before {prefix}"
            if line.startswith(prefix):
                return line

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_the_atomic_manager_never_deletes_a_step_another_writer_committed(env: Env):
    # B opened its manager before A committed step 5: its listing does not know the step
    b = atomic_manager(env, enable_async_checkpointing=False)
    plain = manager(env)  # ocp.CheckpointManager with the class, also opened before
    a = atomic_manager(env)
    assert a.save(5, args=ocp.args.StandardSave(tree(50)))
    a.wait_until_finished()
    committed = env.cls.check_final(f"{env.root}/5")
    before = env.listing()

    with pytest.raises(aso.StepConflictError, match="refused before writing anything") as err:
        b.save(5, args=ocp.args.StandardSave(tree(51)))
    assert isinstance(err.value, atomicstore.CommitConflictError)  # and Orbax's StepAlreadyExistsError
    assert isinstance(err.value, ocp.checkpoint_manager.StepAlreadyExistsError)
    assert env.listing() == before  # nothing deleted, nothing written
    assert env.cls.check_final(f"{env.root}/5").attempt == committed.attempt
    assert env.cls.verify(f"{env.root}/5").files == committed.files
    assert same(stock_manager(env).restore(5), tree(50))  # A's step, whole

    # B goes on saving; a step it lists itself is refused with the same error
    assert b.save(6, args=ocp.args.StandardSave(tree(6)))
    with pytest.raises(aso.StepConflictError):  # force=True: save whatever should_save says
        b.save(6, args=ocp.args.StandardSave(tree(7)), force=True)
    assert steps(b) == [5, 6] and same(b.restore(6), tree(6))

    # the stock manager's force=True deletes A's step before the class is asked: said out loud
    with pytest.warns(aso.ForcedOverwriteWarning, match="force=True"):
        plain.save(5, args=ocp.args.StandardSave(tree(52)))
        plain.wait_until_finished()
    assert env.cls.check_final(f"{env.root}/5").attempt != committed.attempt


def test_the_atomic_manager_needs_the_class():
    with pytest.raises(atomicstore.InvalidArgumentError, match="temporary_path_class"):
        aso.AtomicCheckpointManager("/nonexistent/x", options=ocp.CheckpointManagerOptions(
            temporary_path_class=ocp.path.atomicity.AtomicRenameTemporaryPath, create=False))
    options = ocp.CheckpointManagerOptions(create=False)
    mgr = aso.AtomicCheckpointManager("/nonexistent/x", options=options)
    assert options.temporary_path_class is None  # the caller's options are left alone
    assert isinstance(mgr, ocp.CheckpointManager)


def test_two_processes_save_one_step_through_the_atomic_manager(env: Env, tmp_path: Path):
    gate = tmp_path / "gate"
    a = Holder(env, 5, 50, gate)
    try:
        a.expect("HELD")  # A wrote everything; held right before its commit
        b = atomic_manager(env)
        before = env.listing()
        if env.kind == "gcs":
            # A writes in place: B is refused before it writes or deletes anything
            with pytest.raises(aso.StepConflictError):
                b.save(5, args=ocp.args.StandardSave(tree(51)))
            # a writer that gets past Orbax's check is refused at create by A's claim
            late = env.cls.from_final(f"{env.root}/5")
            with pytest.raises(atomicstore.CommitConflictError, match="refused before writing"):
                asyncio.run(late.create())
            assert env.listing() == before
            gate.touch()
            assert a.expect("RESULT") == "RESULT ok"
            winner = 50
        else:
            # A stages where nobody looks: B commits first, A's rename is refused
            assert b.save(5, args=ocp.args.StandardSave(tree(51)))
            b.wait_until_finished()
            gate.touch()
            result = a.expect("RESULT")
            assert "CommitConflictError" in result.split(), result
            winner = 51
        assert a.proc.wait(60) == 0
    finally:
        a.stop()
    assert steps(manager(env)) == [5] and stock_manager(env).all_steps() == [5]
    assert same(stock_manager(env).restore(5), tree(winner))  # the winner's bytes only
    env.cls.verify(f"{env.root}/5")
    assert not [k for k in env.listing() if k.startswith((".atomicstore/leases/", ".atomicstore/staging/5."))]


# -- one process, several saves of one object-store step --------------------------------------------
def _items(i: int) -> Any:
    return ocp.args.Composite(params=ocp.args.StandardSave(tree(i)), extra=ocp.args.JsonSave({"who": i}))


def _restore_items(env: Env) -> dict:
    mgr = ocp.CheckpointManager(env.root, item_names=("params", "extra"))  # stock Orbax
    return mgr.restore(5, args=ocp.args.Composite(params=ocp.args.StandardRestore(tree(0)),
                                                  extra=ocp.args.JsonRestore()))


@pytest.mark.parametrize("env", ["gcs"], indirect=True)
def test_two_threads_save_one_step_exactly_one_commits(env: Env, gcs_server: Any):
    # taking the step is slow (the claim's PUT stalls): the second save begins meanwhile
    gcs_server.faults(FaultPlan(stalls=[(writes_to(f"5/{aso.CLAIM_FILE}"), 2.0)]))
    results: dict[int, Any] = {}

    def save(i: int) -> None:
        mgr = aso.AtomicCheckpointManager(env.root, item_names=("params", "extra"),
                                          options=ocp.CheckpointManagerOptions(
                                              temporary_path_class=env.cls, enable_async_checkpointing=False))
        try:
            mgr.save(5, args=_items(i))
            mgr.wait_until_finished()
            results[i] = "ok"
        except Exception as exc:  # noqa: BLE001 - checked below
            results[i] = exc

    first = threading.Thread(target=save, args=(1,))
    first.start()
    deadline = time.monotonic() + 60
    while not [k for k in env.listing() if k.startswith(".atomicstore/leases/5.")]:
        assert time.monotonic() < deadline and first.is_alive(), results
        time.sleep(0.05)
    second = threading.Thread(target=save, args=(2,))  # the first holds its lease, its claim in flight
    second.start()
    first.join(120)
    second.join(120)
    gcs_server.faults(None)
    assert results[1] == "ok", results
    assert isinstance(results[2], atomicstore.CommitConflictError), results
    keys = env.listing()
    # no item was taken for a step of its own (no claim, marker or lease inside the step)
    assert not [k for k in keys if k.count("/") > 1 and k.rsplit("/", 1)[1] in (aso.CLAIM_FILE, "commit_success.txt")]
    assert not [k for k in keys if k.startswith(".atomicstore/leases/")]
    assert steps(manager(env)) == [5]
    back = _restore_items(env)
    assert same(back["params"], tree(1)) and back["extra"] == {"who": 1}


@pytest.mark.parametrize("env", ["gcs"], indirect=True)
def test_a_save_orbax_dropped_before_create_holds_up_no_other(env: Env, gcs_server: Any):
    reached, gate = threading.Event(), threading.Event()

    def hold() -> None:  # holds the first save only, right before its commit
        if not reached.is_set():
            reached.set()
            gate.wait(60)

    handler = ocp.CompositeCheckpointHandler(composite_options=ocp.CompositeOptions(temporary_path_class=env.cls))
    ckptr = ocp.AsyncCheckpointer(handler, temporary_path_class=env.cls,
                                  async_options=ocp.AsyncOptions(post_finalization_callback=hold))
    ckptr.save(f"{env.root}/4", args=_items(4))
    assert reached.wait(60)

    # A: Orbax makes the temporary path of step 5 (which reads what is at the step), then
    # waits for the previous save before it creates it
    probed = threading.Event()

    def probe(environ: dict) -> bool:
        if request_kind(environ) == "head" and (object_key(environ) or "").endswith(f"5/{aso.CLAIM_FILE}"):
            probed.set()
        return False

    gcs_server.faults(FaultPlan(stalls=[(probe, 0.0)]))
    outcome: list[Any] = []

    def save_a() -> None:
        try:
            ckptr.save(f"{env.root}/5", args=_items(5))
            ckptr.wait_until_finished()
            outcome.append("ok")
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    t = threading.Thread(target=save_a)
    t.start()
    assert probed.wait(60)
    # B: a save of step 5 that Orbax drops after making its temporary path and before its
    # create (as it does when the destination exists or the previous save failed)
    dropped = env.cls.from_final(f"{env.root}/5")
    gcs_server.faults(None)
    began = time.monotonic()
    gate.set()
    t.join(120)
    assert outcome == ["ok"] and time.monotonic() - began < 60, outcome  # A's items took A's step
    assert steps(manager(env)) == [4, 5]
    back = _restore_items(env)
    assert same(back["params"], tree(5)) and back["extra"] == {"who": 5}
    del dropped


# -- a writer declared dead while its marker is in flight -------------------------------------------
@pytest.mark.parametrize("env", ["gcs"], indirect=True)
def test_a_marker_landing_after_its_writer_was_declared_dead_is_taken_back(env: Env, gcs_server: Any):
    cls = env.cls.with_options(lease_ttl=1.0, grace=0)
    in_flight = threading.Event()
    is_marker = writes_to("5/commit_success.txt")

    def marker_put(environ: dict) -> bool:  # the commit point, delayed in the network
        if is_marker(environ) and environ.get("REQUEST_METHOD") != "DELETE" and not in_flight.is_set():
            in_flight.set()
            return True
        return False

    def renewal(environ: dict) -> bool:  # and the writer's lease renewals with it (a partition)
        return (in_flight.is_set() and is_conditional(environ) and environ.get("REQUEST_METHOD") != "DELETE"
                and ".atomicstore/leases/" in (object_key(environ) or ""))

    gcs_server.faults(FaultPlan(stalls=[(marker_put, 6.0), (renewal, 6.0)]))
    errors: list[BaseException] = []

    def save() -> None:
        ckptr = ocp.StandardCheckpointer(temporary_path_class=cls)
        try:
            ckptr.save(f"{env.root}/5", tree(5))
            ckptr.wait_until_finished()
        except Exception as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    t = threading.Thread(target=save)
    t.start()
    assert in_flight.wait(60)
    deadline = time.monotonic() + 5
    while (judged := cls.judge(f"{env.root}/5")).state != "stale":  # its lease expired (ttl 1 s, grace 0)
        assert time.monotonic() < deadline, judged
        time.sleep(0.1)
    report = cls.recover(env.root)  # another process would do the same: fence, files, claim
    assert [a.target for a in report.actions if a.kind == "orbax"] == ["5"]
    t.join(60)
    gcs_server.faults(None)
    assert errors and _chain_has(errors[0], atomicstore.LeaseLostError), errors
    assert not [k for k in env.listing() if k.startswith("5/")]  # the marker was taken back
    assert steps(manager(env)) == [] and stock_manager(env).all_steps() == []
    mgr = atomic_manager(env)  # and the step can be saved again
    assert mgr.save(5, args=ocp.args.StandardSave(tree(55)))
    mgr.wait_until_finished()
    assert same(stock_manager(env).restore(5), tree(55))


@pytest.mark.parametrize("env", ["gcs"], indirect=True)
def test_recovery_removes_a_marker_whose_claim_and_files_are_gone(env: Env):
    mgr = atomic_manager(env)
    for step in (1, 2, 3):
        mgr.save(step, args=ocp.args.StandardSave(tree(step)))
    mgr.wait_until_finished()
    d = env.store().driver
    # 1: only the marker is left (a dead writer's, landed after recovery removed its step)
    for k in d.find("1"):
        if not k.endswith("/commit_success.txt"):
            d.delete(k)
    # 2: claim and some files gone (a committed step damaged by a plain delete): left alone
    d.delete(f"2/{aso.CLAIM_FILE}")
    d.delete("2/_CHECKPOINT_METADATA")
    d.put("4/commit_success.txt", b"Checkpoint commit was successful")  # stock Orbax's: never touched
    assert stock_manager(env).all_steps() == [1, 2, 3, 4]  # stock Orbax lists what it cannot restore
    assert env.cls.recover(env.root).actions == []  # younger than grace: its writer may take it back
    report = env.later().recover(env.root)
    assert [(a.kind, a.target) for a in report.actions] == [("marker", "1/commit_success.txt")]
    keys = env.listing()
    assert not [k for k in keys if k.startswith("1/")]
    assert {"2/commit_success.txt", "4/commit_success.txt"} <= keys
    env.cls.verify(f"{env.root}/3")
    fresh = atomic_manager(env)  # the step is free again
    assert fresh.save(1, args=ocp.args.StandardSave(tree(11)), force=True)  # (below the latest step)
    fresh.wait_until_finished()
    assert same(stock_manager(env).restore(1), tree(11))


# -- a save killed mid-write -----------------------------------------------------------------------
def test_a_save_killed_mid_write_is_never_listed_and_recovery_removes_it(env: Env):
    proc = subprocess.Popen([sys.executable, str(WORKER), env.root, env.endpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=str(WORKER.parents[2]))
    try:
        lines: list[str] = []
        deadline = time.time() + 60
        while not lines or lines[-1] != "MIDWRITE 2":
            line = proc.stdout.readline().strip() if proc.stdout else ""
            assert line or proc.poll() is None, f"worker died: {lines}"
            if line:
                lines.append(line)
            assert time.time() < deadline, lines
        assert lines == ["COMMITTED 1", "MIDWRITE 2"]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()

    keys = env.listing()
    partial = sorted(k for k in keys if not k.startswith("1/") and "tail/part-0.bin" in k)
    assert partial, keys  # the attempt had written data when it died
    assert not [k for k in keys if "tail/part-1.bin" in k and not k.startswith("1/")]

    # nothing lists it: Orbax through the integration, stock Orbax, atomicstore
    restore_args = ocp.args.Composite(params=ocp.args.StandardRestore({"w": np.zeros(65536, np.float32),
                                                                        "b": np.zeros(16)}))
    assert steps(manager(env)) == [1]
    assert stock_manager(env).all_steps() == [1]
    assert env.store().list() == ["1"]
    assert manager(env).restore(1, args=restore_args)["params"]["w"][5] == 5.0

    # in flight as far as anyone can tell (its lease was renewed moments ago): untouched
    # by Orbax's own tmp cleanup through validate(), and by recovery
    tmp = _attempt_path(env, keys)
    assert not ocp.path.step.is_path_temporary(tmp, temporary_path_cls=env.cls)
    assert ocp.path.step.is_path_temporary(tmp, temporary_path_cls=env.later())
    orbax_cleanup(env, env.cls)
    assert env.cls.recover(env.root).actions == [] and env.listing() == keys

    if env.kind == "local":
        report = env.store().recover(now=time.time() + FUTURE)  # store.recover() is the whole cleanup
    else:
        # the commit layer never deletes keys it does not own: it fences the dead lease,
        # the in-place files stay (listed by nobody) for the integration's recovery
        env.store().recover(now=time.time() + FUTURE)
        assert partial[0] in env.listing()
        # Orbax's cleanup through validate() sees it as provably uncommitted and dead
        assert ocp.path.step.is_path_temporary(tmp, temporary_path_cls=env.later())
        report = env.cls.recover(env.root, now=time.time() + FUTURE)
        assert [a.target for a in report.actions if a.kind == "orbax"] == ["2"]
    assert report.actions
    left = env.listing()
    assert all(k.startswith("1/") or k == ".atomicstore/lock" for k in left), sorted(left)
    assert {k for k in keys if k.startswith("1/")} == {k for k in left if k.startswith("1/")}
    env.cls.verify(f"{env.root}/1")

    # the step can be saved again, and both Orbax and stock Orbax read it
    mgr = manager(env, item_names=("params",))
    mgr.save(2, args=ocp.args.Composite(params=ocp.args.StandardSave(tree(2))))
    mgr.wait_until_finished()
    assert steps(mgr) == [1, 2]
    back = stock_manager(env).restore(2, args=ocp.args.Composite(params=ocp.args.StandardRestore(tree(2))))
    assert same(back["params"], tree(2))


def _attempt_path(env: Env, keys: set[str]) -> str:
    if env.kind == "local":
        (staging,) = {k.split("/")[2] for k in keys if k.startswith(".atomicstore/staging/")}
        return os.path.join(env.root, ".atomicstore", "staging", staging)
    return f"{env.root}/2"


# -- what validate / validate_final accept ----------------------------------------------------------------
def orbax_cleanup(env: Env, cls: Any) -> None:
    """What ``CheckpointManagerOptions(cleanup_tmp_directories=True)`` runs when a manager
    opens: Orbax deletes every child of the root that ``cls.validate`` accepts."""
    asyncio.run(temporary_paths.cleanup_temporary_paths(env.root, temporary_path_cls=cls))


def test_only_provably_uncommitted_dead_attempts_are_temporary(env: Env):
    later = env.later()
    mgr = manager(env)
    mgr.save(1, args=ocp.args.StandardSave(tree(1)))
    mgr.wait_until_finished()
    live = env.cls.from_final(f"{env.root}/3")  # a save in flight in this process
    asyncio.run(live.create())
    d = env.store().driver
    d.put("9.orbax-checkpoint-tmp-1/x", b"stock Orbax's staging, in flight or not: not ours")
    d.put("8/_CHECKPOINT_METADATA", b"{}")  # a step directory without our claim (stock Orbax's)

    def temporary(cls: Any, p: str) -> bool:
        return ocp.path.step.is_path_temporary(p, temporary_path_cls=cls)

    children = [f"{env.root}/{n}" for n in ("1", "8", "9.orbax-checkpoint-tmp-1", ".atomicstore")]
    assert not any(temporary(c, p) for c in (env.cls, later) for p in children)
    assert not temporary(env.cls, str(live.get()))  # its lease is alive
    assert temporary(later, str(live.get()))  # seen from after its lease expired: dead
    orbax_cleanup(env, env.cls)
    assert env.cls.judge(live.get()).state == "in_flight"
    # Orbax's own cleanup, through validate(), seen from the future: the dead attempt only
    # (on disk it lives in atomicstore's staging, which Orbax never lists; recovery removes it)
    orbax_cleanup(env, later)
    assert d.exists("9.orbax-checkpoint-tmp-1/x") and d.exists("8/_CHECKPOINT_METADATA")
    assert env.cls.verify(f"{env.root}/1")
    if env.kind == "gcs":
        assert not [k for k in env.listing() if k.startswith("3/")]
    else:
        assert os.path.isdir(str(live.get()))
        later.recover(env.root)
        assert not os.path.exists(str(live.get()))
    live.abort()
    assert not [k for k in env.listing() if k.startswith(("3/", ".atomicstore/leases/", ".atomicstore/staging/"))]
    assert steps(manager(env)) == [1]


def test_a_damaged_or_foreign_step_is_not_listed(env: Env):
    mgr = manager(env)
    for step in (1, 2, 3):
        mgr.save(step, args=ocp.args.StandardSave(tree(step)))
    mgr.wait_until_finished()
    store = env.store()

    def biggest(step: int) -> str:
        files = env.cls.check_final(f"{env.root}/{step}").files
        return max(files, key=lambda p: files[p].size)

    store.driver.delete(f"1/{biggest(1)}")  # partly deleted (a crash inside a plain rmtree)
    big = biggest(2)
    if env.kind == "gcs":
        data = store.driver.read(f"2/{big}")
        store.driver.put(f"2/{big}", bytes(reversed(data)))  # same size, other bytes
        store.driver.put("3/commit_success.txt", b"Checkpoint commit was successful")  # stock's marker
    else:
        with open(os.path.join(env.root, "2", big), "r+b") as f:
            f.write(b"\xff" * 8)  # same size, other bytes: only a full read can tell
        store.delete("3")
    assert steps(manager(env)) == ([] if env.kind == "gcs" else [2])
    with pytest.raises(atomicstore.ChecksumMismatchError):
        env.cls.verify(f"{env.root}/2")
    with pytest.raises((atomicstore.ChecksumMismatchError, atomicstore.NotFoundError)):
        env.cls.verify(f"{env.root}/1")
    with pytest.raises(ocp.path.atomicity_types.ValidationError, match="missing"):
        env.cls.check_final(f"{env.root}/1")


# -- arguments ----------------------------------------------------------------------------------
def test_arguments_are_validated(tmp_path: Path):
    for bad in ({"lease_ttl": 0}, {"lease_ttl": -1}, {"grace": -1}, {"operation_timeout": True},
                {"clock": 5}):
        with pytest.raises(atomicstore.InvalidArgumentError):
            AtomicTemporaryPath.with_options(**bad)
    with pytest.raises(atomicstore.InvalidArgumentError):
        AtomicTemporaryPath.from_final(tmp_path / "has space")
    with pytest.raises(atomicstore.InvalidArgumentError, match="snapshots"):
        AtomicTemporaryPath.from_final(tmp_path / "1", snapshot_type=object())
    with pytest.raises(atomicstore.InvalidArgumentError, match="mode"):
        AtomicTemporaryPath.from_final(tmp_path / "1", file_options=ocp.options.FileOptions(
            path_permission_mode=0o17777))
    with pytest.raises(atomicstore.InvalidArgumentError):
        AtomicTemporaryPath.open_store(3)
    with pytest.raises(atomicstore.InvalidArgumentError):
        AtomicTemporaryPath.recover(tmp_path, dry_run="yes")  # type: ignore[arg-type]
    with pytest.raises(atomicstore.InvalidArgumentError):
        AtomicTemporaryPath.recover(tmp_path, grace=-1)
    handle = AtomicTemporaryPath.from_temporary(tmp_path / ".atomicstore" / "staging" / "4.20260101T000000-abc")
    assert str(handle.get_final()) == str(tmp_path / "4") and handle.attempt == "20260101T000000-abc"
    with pytest.raises(atomicstore.TransactionError):
        asyncio.run(handle.finalize())
    with pytest.raises(atomicstore.TransactionError):
        asyncio.run(handle.create())
    with pytest.raises(atomicstore.NotFoundError):
        AtomicTemporaryPath.verify(tmp_path / "4")


# -- an empty step directory (a crash's leftover, or a user's mkdir) never blocks a save -------------
def make_empty_step(env: Env, name: str, subdirs: tuple[str, ...] = ()) -> None:
    """What a crash or a user leaves: a step directory holding no file (on GCS: the zero-byte
    ``<step>/`` placeholder objects a console "create folder" or ``gsutil`` writes)."""
    if env.kind == "local":
        os.makedirs(os.path.join(env.root, name), exist_ok=True)
        for sub in subdirs:
            os.makedirs(os.path.join(env.root, name, sub), exist_ok=True)
        return
    fs = fsspec.filesystem("gs")
    for sub in ("", *subdirs):
        fs.pipe(f"{env.root[len('gs://'):]}/{name}/{sub + '/' if sub else ''}", b"")


def step_exists(env: Env, name: str) -> bool:
    """Orbax's own test (``epath.Path.exists``), the one that refuses a save without force."""
    from etils import epath

    return epath.Path(f"{env.root}/{name}").exists()


def test_an_empty_step_directory_left_behind_never_blocks_a_save(env: Env):
    mgr = atomic_manager(env, enable_async_checkpointing=False)
    assert mgr.save(1, args=ocp.args.StandardSave(tree(1)))
    make_empty_step(env, "2", ("default",))  # left an hour ago, as far as this class can tell
    assert step_exists(env, "2")
    later = aso.AtomicCheckpointManager(env.root, options=ocp.CheckpointManagerOptions(
        temporary_path_class=env.later(), enable_async_checkpointing=False))
    assert later.save(2, args=ocp.args.StandardSave(tree(2)))  # taken over, not refused
    later.wait_until_finished()
    assert steps(manager(env)) == [1, 2] and stock_manager(env).all_steps() == [1, 2]
    assert same(stock_manager(env).restore(2), tree(2))
    env.cls.verify(f"{env.root}/2")
    if env.kind == "gcs":  # the placeholders went with the takeover: only the save's objects
        for placeholder in ("2/", "2/default/"):
            with pytest.raises(atomicstore.NotFoundError):
                env.store().driver.info(placeholder)


def test_recovery_removes_an_empty_step_directory_once_untouched_for_grace(env: Env):
    mgr = atomic_manager(env, enable_async_checkpointing=False)
    assert mgr.save(1, args=ocp.args.StandardSave(tree(1)))
    make_empty_step(env, "2", ("default", "default/d"))
    before = env.listing()
    report = env.cls.recover(env.root)  # just made: another saver may be about to write into it
    assert not [a for a in report.actions if a.target == "2"] and "2" in report.in_flight
    assert step_exists(env, "2")
    dry = env.later().recover(env.root, dry_run=True)
    assert [(a.kind, a.target) for a in dry.actions if a.target == "2"] == [("orbax", "2")]
    assert step_exists(env, "2") and env.listing() == before
    report = env.later().recover(env.root)
    (act,) = [a for a in report.actions if a.target == "2"]
    assert act.kind == "orbax" and "empty" in act.reason
    assert not step_exists(env, "2")
    assert env.listing() == {k for k in before if k != "2" and not k.startswith("2/")} or env.kind == "local"
    env.cls.verify(f"{env.root}/1")  # committed steps untouched
    again = atomic_manager(env)
    assert again.save(2, args=ocp.args.StandardSave(tree(2)))  # free again
    # an async save: finished here, before tmp_path goes (a passing test's is removed at its
    # end), or its tensorstore write fails in the background and its callback, run later on
    # a closed loop, fails whatever test runs then
    again.wait_until_finished()
    again.close()
    env.cls.verify(f"{env.root}/2")


def test_an_empty_step_directory_just_made_by_another_saver_is_left_to_it(env: Env):
    mgr = atomic_manager(env, enable_async_checkpointing=False)
    make_empty_step(env, "3")  # another saver created it just now, and is about to write into it
    with pytest.raises(aso.StepConflictError, match="empty") as err:
        mgr.save(3, args=ocp.args.StandardSave(tree(3)))
    assert "another saver" in str(err.value) and "recovery removes it" not in str(err.value)
    assert not [a for a in env.cls.recover(env.root).actions if a.target == "3"]
    assert step_exists(env, "3")
    # the other saver writes: nothing of it is touched, now or later (it is no longer empty)
    d = env.store().driver
    if env.kind == "local":
        Path(env.root, "3", "data").write_bytes(b"the other saver's")
    else:
        fsspec.filesystem("gs").pipe(f"{env.root[len('gs://'):]}/3/data", b"the other saver's")
    assert not [a for a in env.later().recover(env.root).actions if a.target == "3"]
    assert d.read("3/data") == b"the other saver's"
    later = aso.AtomicCheckpointManager(env.root, options=ocp.CheckpointManagerOptions(
        temporary_path_class=env.later(), enable_async_checkpointing=False))
    with pytest.raises(aso.StepConflictError, match="already exists"):
        later.save(3, args=ocp.args.StandardSave(tree(3)))
    assert d.read("3/data") == b"the other saver's"


@pytest.mark.parametrize("actor", ["recover", "save"])
def test_a_saver_writing_into_the_empty_directory_while_it_is_taken_is_never_destroyed(
        env: Env, gcs_server: Any, monkeypatch: pytest.MonkeyPatch, actor: str):
    """Recovery (or a save taking the directory over) judged the step directory empty and
    old; the other saver writes into it right before the removal: the removal must fail,
    the saver's bytes stay."""
    make_empty_step(env, "4")
    reached, go = threading.Event(), threading.Event()
    if env.kind == "local":
        real_rmdir = os.rmdir
        target = os.path.join(env.root, "4")

        def rmdir(path: Any, *a: Any, **kw: Any) -> None:  # the scheduler: holds the removal
            if os.fspath(path) == target and not reached.is_set():
                reached.set()
                assert go.wait(60)
            real_rmdir(path, *a, **kw)

        monkeypatch.setattr(os, "rmdir", rmdir)
    else:
        def placeholder_delete(environ: dict) -> bool:  # holds the conditional delete of "4/"
            if (environ.get("REQUEST_METHOD") == "DELETE" and (object_key(environ) or "").endswith("run/4/")
                    and not reached.is_set()):
                reached.set()
                assert go.wait(60)
            return False

        gcs_server.faults(FaultPlan(stalls=[(placeholder_delete, 0.0)]))
    outcome: list[Any] = []

    def act() -> None:
        try:
            if actor == "recover":
                outcome.append(env.later().recover(env.root))
            else:
                mgr = aso.AtomicCheckpointManager(env.root, options=ocp.CheckpointManagerOptions(
                    temporary_path_class=env.later(), enable_async_checkpointing=False))
                outcome.append(mgr.save(4, args=ocp.args.StandardSave(tree(4))))
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    t = threading.Thread(target=act)
    t.start()
    assert reached.wait(60), outcome
    # the other saver: it (re)creates the directory and writes into it
    if env.kind == "local":
        Path(env.root, "4", "data").write_bytes(b"the other saver's")
    else:
        fs = fsspec.filesystem("gs")
        fs.pipe(f"{env.root[len('gs://'):]}/4/", b"")
        fs.pipe(f"{env.root[len('gs://'):]}/4/data", b"the other saver's")
    go.set()
    t.join(60)
    gcs_server.faults(None)
    assert env.store().driver.read("4/data") == b"the other saver's"
    assert step_exists(env, "4")
    if actor == "recover":
        (report,) = outcome
        assert not [a for a in report.actions if a.target == "4"], report.summary()
    else:
        (err,) = outcome
        assert isinstance(err, aso.StepConflictError), outcome
    assert steps(manager(env)) == []



# == the four questions, for every public entry point (the table: docs/integrations.md) ============
# -- 1. what it reads is deleted or replaced between two of its requests: restore ------------------
GATE: dict[str, threading.Event] = {}


class GateHandler(ocp.CheckpointHandler):
    """An item holding one JSON value; its restore waits at ``GATE["go"]`` (after setting
    ``GATE["reached"]``) before it reads: a scheduler point inside an Orbax restore."""

    def save(self, directory: Any, args: Any) -> None:
        (directory / "value.json").write_text(json.dumps(args.value))

    def restore(self, directory: Any, args: Any = None) -> Any:
        if "reached" in GATE:
            GATE["reached"].set()
            assert GATE["go"].wait(60)
        return json.loads((directory / "value.json").read_text())


@ocp.args.register_with_handler(GateHandler, for_save=True)
@dataclasses.dataclass
class GateSave(ocp.args.CheckpointArgs):
    value: Any = None


@ocp.args.register_with_handler(GateHandler, for_restore=True)
@dataclasses.dataclass
class GateRestore(ocp.args.CheckpointArgs):
    pass


def test_a_step_deleted_and_saved_again_during_a_restore_is_an_error_not_a_mix(env: Env):
    names = ("params", "gate")
    mgr = aso.AtomicCheckpointManager(env.root, item_names=names, options=ocp.CheckpointManagerOptions(
        temporary_path_class=env.cls, enable_async_checkpointing=False))
    mgr.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(tree(1)), gate=GateSave(1)))
    GATE.update(reached=threading.Event(), go=threading.Event())
    outcome: list[Any] = []

    def restore() -> None:
        reader = aso.AtomicCheckpointManager(env.root, item_names=names, options=ocp.CheckpointManagerOptions(
            temporary_path_class=env.cls, enable_async_checkpointing=False))
        try:
            outcome.append(reader.restore(5, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(tree(0)), gate=GateRestore())))
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    t = threading.Thread(target=restore)
    t.start()
    try:
        assert GATE["reached"].wait(60), outcome
        # the reader is inside its restore: another job deletes step 5 and saves it again
        other = aso.AtomicCheckpointManager(env.root, item_names=names, options=ocp.CheckpointManagerOptions(
            temporary_path_class=env.cls, enable_async_checkpointing=False))
        other.delete(5)
        other.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(tree(2)), gate=GateSave(2)))
    finally:
        GATE["go"].set()
        t.join(60)
        GATE.clear()
    (got,) = outcome
    assert isinstance(got, atomicstore.PreconditionFailedError), got  # never a silent mix
    assert "replaced while it was being read" in str(got)
    back = mgr.restore(5, args=ocp.args.Composite(params=ocp.args.StandardRestore(tree(0)), gate=GateRestore()))
    assert same(back["params"], tree(2)) and back["gate"] == 2  # a restore now: one save, whole


# -- 2. hostile or oversized input ---------------------------------------------------------------------
@pytest.mark.parametrize("env", ["gcs"], indirect=True)
def test_hostile_or_oversized_records_are_refused_and_never_acted_on(env: Env):
    mgr = atomic_manager(env, enable_async_checkpointing=False)
    for step in range(1, 8):
        mgr.save(step, args=ocp.args.StandardSave(tree(step)))
    d = env.store().driver
    good = json.loads(d.read("1/commit_success.txt"))
    hostile = {
        1: b"\xff\xfe not json",
        2: json.dumps({**good, "name": "2", "files": {"../../outside": {"size": 1, "crc32c": "00000000"}}}).encode(),
        3: json.dumps({**good, "name": "3", "files": {"x": {"size": -5, "crc32c": "00000000"}}}).encode(),
        4: json.dumps({**good, "name": "9"}).encode(),  # another step's record
        5: b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the parser's stack
        6: b"{" + b" " * (inplace.MAX_RECORD_BYTES + 1) + b"}",  # larger than any record may be
    }
    for step, raw in hostile.items():
        d.put(f"{step}/commit_success.txt", raw)
    d.put(f"7/{aso.CLAIM_FILE}", b" " * (inplace.MAX_STEP_CLAIM_BYTES + 1))  # an oversized claim
    before = env.listing()
    for step in hostile:
        with pytest.raises(ocp.path.atomicity_types.ValidationError):
            env.cls.check_final(f"{env.root}/{step}")
        with pytest.raises(atomicstore.CorruptionError):
            env.cls.verify(f"{env.root}/{step}")
        assert env.later().judge(f"{env.root}/{step}").state != "stale"  # never cleaned up
    assert env.later().judge(f"{env.root}/7").state != "stale"
    assert steps(manager(env)) == [7]  # step 7's record is intact: only its claim is junk
    assert [a for a in env.later().recover(env.root).actions if not a.target.startswith(".atomicstore")] == []
    assert env.listing() == before  # nothing hostile was acted on


def test_a_hostile_tree_of_empty_directories_is_not_walked_without_bound(env: Env):
    if env.kind == "local":
        for i in range(commit_steps.MAX_EMPTY_DIRS + 1):
            os.makedirs(os.path.join(env.root, "8", str(i)))
    else:
        fs = fsspec.filesystem("gs")
        fs.pipe({f"{env.root[len('gs://'):]}/8/{i}/": b"" for i in range(commit_steps.MAX_EMPTY_DIRS + 1)})
    report = env.later().recover(env.root)  # too big to be judged: left alone, no error
    assert not [a for a in report.actions if a.target == "8"] and step_exists(env, "8")


# -- 3. a read-only store -----------------------------------------------------------------------------
@pytest.mark.parametrize("env", ["gcs"], indirect=True)
def test_read_only_credentials_restore_list_verify_and_refuse_saves_writing_nothing(env: Env, gcs_server: Any):
    mgr = atomic_manager(env, enable_async_checkpointing=False)
    mgr.save(1, args=ocp.args.StandardSave(tree(1)))
    before = env.listing()
    gcs_server.faults(FaultPlan(deny=is_mutation))
    try:
        ro = atomic_manager(env, enable_async_checkpointing=False)  # opens for reading
        assert steps(ro) == [1] and same(ro.restore(1), tree(1))
        env.cls.verify(f"{env.root}/1")
        assert env.cls.check_final(f"{env.root}/1").name == "1"
        assert env.later().recover(env.root, dry_run=True).actions == []
        with pytest.raises(atomicstore.StorageError):
            ro.save(2, args=ocp.args.StandardSave(tree(2)))
    finally:
        gcs_server.faults(None)
    assert env.listing() == before


READ_ONLY_ORBAX_CHILD = textwrap.dedent("""
    import errno, os, sys
    import numpy as np, orbax.checkpoint as ocp, atomicstore
    from atomicstore.integrations.orbax import AtomicCheckpointManager, AtomicTemporaryPath
    root = sys.argv[1]
    try:
        open(os.path.join(root, "probe"), "w")
        sys.exit("the directory is writable")
    except OSError as exc:
        assert exc.errno == errno.EROFS, exc
    mgr = AtomicCheckpointManager(root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    assert mgr.all_steps() == [1], mgr.all_steps()
    assert float(mgr.restore(1)["w"][3]) == 3.0
    AtomicTemporaryPath.verify(os.path.join(root, "1"))
    assert AtomicTemporaryPath.recover(root, dry_run=True).actions == []
    try:
        mgr.save(2, args=ocp.args.StandardSave({"w": np.zeros(4)}))
        sys.exit("a save to a read-only directory succeeded")
    except atomicstore.StorageError as exc:
        print("REFUSED", type(exc).__name__)
    print("OK")
""")


def test_a_read_only_mount_restores_lists_verifies_and_refuses_saves(tmp_path: Path):
    """A real EROFS (a bind mount remounted read-only in the child's own mount namespace,
    which root cannot bypass)."""
    src, ro = tmp_path / "ckpts", tmp_path / "ro"
    ro.mkdir()
    mgr = aso.AtomicCheckpointManager(str(src), options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    mgr.save(1, args=ocp.args.StandardSave({"w": np.arange(4, dtype=np.float32)}))
    before = sorted(str(p.relative_to(src)) for p in src.rglob("*"))
    script = 'mount --bind "$1" "$2" && mount -o remount,ro,bind "$2" && exec "$3" -c "$4" "$2"'
    out = subprocess.run(["unshare", "-rm", "--propagation", "private", "sh", "-c", script, "sh",
                          str(src), str(ro), sys.executable, READ_ONLY_ORBAX_CHILD],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.endswith("OK\n"), out.stdout + out.stderr[-3000:]
    assert "REFUSED StorageError" in out.stdout
    assert sorted(str(p.relative_to(src)) for p in src.rglob("*")) == before


# -- 4. a forked process --------------------------------------------------------------------------
def _forked_child(root: str, holder: dict, q: Any) -> None:
    try:
        live = holder["live"]
        refused = []
        for call in (lambda: asyncio.run(live.finalize()), live.abort):
            try:
                call()
            except atomicstore.TransactionError as exc:
                refused.append("forked child" in str(exc))
        holder.clear()
        gc.collect()  # the worker drops what it inherited (its finalizer runs here)
        cls = type(live)
        record = cls.verify(f"{root}/1")  # the integration's entry points work in the child
        cls.check_final(f"{root}/1")
        report = cls.recover(root)  # the parent's save holds a live lease: left alone
        q.put(("ok", refused, record.name, [a.target for a in report.actions]))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", repr(exc)))


def test_a_forked_child_never_touches_its_parents_save_in_flight(env: Env):
    mgr = atomic_manager(env, enable_async_checkpointing=False)
    mgr.save(1, args=ocp.args.StandardSave(tree(1)))
    holder = {"live": env.cls.from_final(f"{env.root}/5")}  # the parent's save of step 5, in flight
    asyncio.run(holder["live"].create())
    live = holder["live"]
    got, _ = in_forked_child(_forked_child, env.root, holder)
    assert got == ("ok", [True, True], "1", []), got
    # the parent's save goes on: its attempt is intact and commits
    if env.kind == "local":
        Path(str(live.get()), "x").write_bytes(b"parent's")
    else:
        env.store().driver.put("5/x", b"parent's")
    asyncio.run(live.finalize())
    assert env.cls.check_final(f"{env.root}/5").files["x"].size == len(b"parent's")
