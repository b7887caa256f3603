"""Exhaustive crash consistency of every write path (issue: recovery).

For each write path (save, overwrite, delete, retention clean-up, recovery itself) the
harness records the ordered mutating storage operations, then, for every prefix of that
sequence, simulates a crash right there, runs recovery as a restarted job would, and
checks:

* the committed checkpoints are exactly a state the operation passes through atomically
  (before or after it; for save + retention, also the state in between), and the final
  state once the operation returned;
* every committed checkpoint verifies and reads back bit-identical;
* nothing stale is left after recovery, and a second recovery finds nothing.

Backends: the POSIX power-loss model (only fsynced data and entries survive), real local
disk, memory, and the S3 and GCS fakes (a crash is: the writer stops issuing requests).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from crashsim import Crasher, CrashingDriver, PosixModel, PosixModelDriver, SimulatedCrash

import atomicstore
from atomicstore.commit.strategies import STAGING, TRASH
from atomicstore.drivers.local import LOCK_KEY

# exhaustive or multi-process: run in full once, on the oldest Python (noxfile `tests`)
# (the suite's xdist workers take a module whole, `--dist loadfile`: the last test here
# totals what the others did)
pytestmark = pytest.mark.slow

FUTURE = time.time() + 10**7  # recovery runs long after the crash: every lease is dead
State = dict[str, dict[str, bytes]]

V1 = {"params.bin": b"\x01" * 3000, "opt/state/mu.bin": b"\x02" * 1000, "meta.json": b'{"v": 1}'}
V2 = {"params.bin": b"\x03" * 2000, "opt/state/mu.bin": b"\x04" * 500, "extra.bin": b"\x05"}


def save(store: atomicstore.Store, name: str, files: dict[str, bytes], overwrite: bool = False) -> None:
    with store.transaction(name, overwrite=overwrite) as txn:
        for path, data in files.items():
            txn.write_bytes(path, data)


@dataclass
class Scenario:
    name: str
    setup: Callable[[atomicstore.Store], None]
    operation: Callable[[atomicstore.Store], None]
    states: list[State]  # the states the operation passes through, in order


def _leftovers(store: atomicstore.Store) -> None:
    """Committed A, plus what crashed saves and deletes leave behind."""
    save(store, "A", V1)
    for k in (3, 6):  # two saves of B that died part-way
        c = Crasher(crash_at=k)
        with pytest.raises(SimulatedCrash):
            save(atomicstore.Store(CrashingDriver(store.driver, c), lease_ttl=3600), "B", V2)
    save(store, "C", V2)
    c = Crasher(crash_at=3)  # a delete of C that died after un-publishing (durably)
    try:
        atomicstore.Store(CrashingDriver(store.driver, c)).delete("C")
    except SimulatedCrash:
        pass


SCENARIOS = [
    Scenario("save", lambda s: save(s, "A", V1), lambda s: save(s, "B", V2),
             [{"A": V1}, {"A": V1, "B": V2}]),
    Scenario("overwrite", lambda s: save(s, "A", V1), lambda s: save(s, "A", V2, overwrite=True),
             [{"A": V1}, {"A": V2}]),
    Scenario("delete", lambda s: (save(s, "A", V1), save(s, "B", V2)), lambda s: s.delete("A"),
             [{"A": V1, "B": V2}, {"B": V2}]),
    Scenario("retention", lambda s: (save(s, "A", V1), save(s, "B", V2)),
             lambda s: (save(s, "C", V1), s.delete("A")),
             [{"A": V1, "B": V2}, {"A": V1, "B": V2, "C": V1}, {"B": V2, "C": V1}]),
    Scenario("recovery", _leftovers, lambda s: s.recover(now=FUTURE), [{"A": V1}]),
]


# -- backends: how to get fresh storage, a crashing store on it, and the survivor --------
class Harness:
    kind = ""

    def fresh(self) -> Any: ...
    def plain(self, storage: Any) -> atomicstore.Store: ...
    def crashing(self, storage: Any, crasher: Crasher) -> atomicstore.Store:
        return atomicstore.Store(CrashingDriver(self.plain(storage).driver, crasher), lease_ttl=3600)

    def survivor(self, storage: Any) -> atomicstore.Store:
        return self.plain(storage)


class ModelHarness(Harness):
    """Local disk semantics with power loss: after the crash only durable state remains."""

    kind = "posix-model"

    def __init__(self, skip: Callable[[str], bool] = lambda site: False) -> None:
        self.skip = skip

    def fresh(self) -> Any:
        return {"model": PosixModel()}

    def plain(self, storage: Any) -> atomicstore.Store:
        return atomicstore.Store(PosixModelDriver(storage["model"], Crasher(), self.skip))

    def crashing(self, storage: Any, crasher: Crasher) -> atomicstore.Store:
        return atomicstore.Store(PosixModelDriver(storage["model"], crasher, self.skip), lease_ttl=3600)

    def survivor(self, storage: Any) -> atomicstore.Store:
        storage["model"] = storage["model"].crash()  # power loss
        return self.plain(storage)


class URLHarness(Harness):
    def __init__(self, kind: str, make_url: Callable[[], str], options: dict | None = None) -> None:
        self.kind, self.make_url, self.options = kind, make_url, options or {}

    def fresh(self) -> Any:
        return self.make_url()

    def plain(self, storage: Any) -> atomicstore.Store:
        return atomicstore.open_store(storage, **self.options)


def check_state(store: atomicstore.Store, allowed: list[State], final: bool, where: str) -> None:
    state: State = {}
    for name in store.list():
        store.verify(name)
        ckpt = store.open(name)
        state[name] = {p: ckpt.read_bytes(p) for p in ckpt.files}
    if final:
        assert state == allowed[-1], f"{where}: after the operation returned, state is {sorted(state)}"
    else:
        assert state in allowed, f"{where}: committed {sorted(state)} is no state the operation passes through"
    # nothing stale: every key belongs to a committed checkpoint
    expected: set[str] = set()
    for name in state:
        ckpt = store.open(name)
        expected |= {ckpt.key(p) for p in ckpt.files} | {ckpt.key("manifest.json")}
        if store.strategy.kind == "marker":
            expected.add(f"{name}/commit_success.txt")
    keys = set(store.driver.find("")) - {LOCK_KEY}
    assert keys == expected, f"{where}: stale keys after recovery: {sorted(keys - expected)}; missing {sorted(expected - keys)}"
    if store.driver.capabilities.directories:
        assert store.driver.listdir(STAGING) == [] and store.driver.listdir(TRASH) == [], where


def explore(h: Harness, sc: Scenario) -> int:
    """Run ``sc`` crashing before every operation in turn; return the states checked."""
    storage = h.fresh()
    sc.setup(h.plain(storage))
    counter = Crasher()
    sc.operation(h.crashing(storage, counter))
    total = counter.count
    assert total > 0
    for k in range(total + 1):
        storage = h.fresh()
        sc.setup(h.plain(storage))
        crasher = Crasher(crash_at=k if k < total else None)
        try:
            sc.operation(h.crashing(storage, crasher))
        except SimulatedCrash:
            pass
        else:
            assert k == total, f"op {k} of {total} did not crash"
        survivor = h.survivor(storage)
        survivor.recover(now=FUTURE)
        where = f"{h.kind}/{sc.name}: crash before op {k}/{total} ({crasher.log[-1] if crasher.log else 'start'})"
        check_state(survivor, sc.states, final=(k == total), where=where)
        again = survivor.recover(now=FUTURE)
        assert not again.actions, f"{where}: second recovery found {again.summary()}"
    return total + 1


CHECKED: dict[str, int] = {}


def _harness(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> Harness:
    if kind == "posix-model":
        return ModelHarness()
    if kind == "local":
        counter = iter(range(10**6))
        return URLHarness("local", lambda: str(tmp_path / f"s{next(counter)}"))
    if kind == "memory":
        return URLHarness("memory", lambda: f"memory://crash-{secrets.token_hex(6)}")
    server = request.getfixturevalue(f"{kind}_server")
    server.faults(None)
    bucket = server.new_bucket()
    return URLHarness(kind, lambda: server.url(bucket, secrets.token_hex(4)), server.storage_options())


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("kind", ["posix-model", "local", "memory", "s3", "gcs"])
def test_every_crash_point(kind, scenario, request, tmp_path):
    h = _harness(kind, request, tmp_path)
    n = explore(h, scenario)
    CHECKED[f"{kind}/{scenario.name}"] = n
    print(f"\n{kind}/{scenario.name}: {n} crash states checked")
    assert n >= 3


def test_report_crash_states_checked(request):
    """Runs last in this module: states the total number of crash states checked (in the
    run's summary, tests/conftest.py)."""
    total = sum(CHECKED.values())
    request.node.user_properties.append((
        "summary", f"crash-consistency harness: {total} crash states checked over {len(CHECKED)} "
                   f"backend/write-path pairs: {CHECKED}"))
    if len(CHECKED) == 25:  # the full matrix ran in this session
        assert total >= 300


# -- a missing fsync must be caught ---------------------------------------------------------
RENAME_FSYNC_SITES = [
    "file: staged data",
    "file: manifest",
    "dir: staged subdirectory",
    "dir: staging directory",
    "dir: store root",
]


def test_the_model_sees_every_fsync_of_the_rename_strategy():
    model = PosixModel()
    store = atomicstore.Store(PosixModelDriver(model, Crasher()))
    save(store, "A", V1)
    store.delete("A")
    assert set(RENAME_FSYNC_SITES) <= set(model.fsync_sites)


@pytest.mark.parametrize("site", RENAME_FSYNC_SITES)
def test_removing_any_one_fsync_is_caught(site):
    h = ModelHarness(skip=lambda s: s == site)
    failures = []
    for sc in SCENARIOS[:3]:  # save, overwrite, delete
        try:
            explore(h, sc)
        except (AssertionError, atomicstore.CorruptionError, atomicstore.NotFoundError) as exc:
            failures.append(f"{sc.name}: {str(exc).splitlines()[0]}")
    assert failures, f"removing the fsync '{site}' went unnoticed"
    print(f"\nwithout '{site}': {failures[0]}")


def test_all_fsyncs_present_passes_the_model():
    for sc in SCENARIOS:
        explore(ModelHarness(), sc)
