"""Issue 21, rows 3 and 8, and the class behind them: recovery's scope is the store's own
layout. What it removes is derived from the commit strategy's own names (attempts,
staging, leases, one-file uploads, its own temporaries), never from a name pattern a
user's checkpoint can also have, and never from keys another store (one nested below
the root) or the user could own."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from conftest import Backend, make_backend
from crashsim import Crasher, CrashingDriver, SimulatedCrash

import atomicstore

FUTURE = time.time() + 10**7
ATTEMPT_LIKE = "attempt-20260101T000000-0123456789ab"  # a valid name, shaped like an attempt


def nested(backend: Backend, sub: str = "run-42") -> Backend:
    url = os.path.join(backend.url, sub) if backend.kind == "local" else f"{backend.url}/{sub}"
    return Backend(backend.kind, url, backend.options, backend.server)


def save(store: atomicstore.Store, name: str, data: bytes = b"x" * 100) -> None:
    with store.transaction(name) as txn:
        txn.write_bytes("a.bin", data)


# -- row 3: S3 multipart uploads -------------------------------------------------------------
def _s3(request, tmp_path) -> Backend:
    return make_backend("s3", request, tmp_path)


@pytest.mark.parametrize("layout", ["nested", "bucket-root"])
def test_outer_recovery_leaves_a_nested_stores_live_upload(layout, request, tmp_path):
    """A store below another store's root saves a large file (its multipart upload open)
    while the outer store's recovery runs with grace=0, and again as if every lease had
    expired: the upload is not the outer store's (no attempt or one-file name of its own),
    so it is never aborted, and the inner save commits."""
    backend = _s3(request, tmp_path)
    bucket = backend.url.split("://")[1].split("/")[0]
    outer_url = backend.url if layout == "nested" else f"s3://{bucket}"
    inner = atomicstore.open_store(f"{backend.url}/run-42" if layout == "nested" else backend.url,
                                   block_size=5 * 2**20, lease_ttl=3600, **backend.options)
    outer = atomicstore.open_store(outer_url, **backend.options)
    txn = inner.transaction("step_1")
    f = txn.open("big.bin")
    data = os.urandom(11 * 2**20)
    f.write(data)  # two parts uploaded, the upload open
    assert len(inner.driver.list_incomplete_uploads("")) == 1
    for report in (outer.recover(grace=0), outer.recover(now=FUTURE)):
        assert not [a for a in report.actions if a.kind == "upload"], report.summary()
    f.close()
    txn.commit()
    inner.verify("step_1")
    assert inner.read_bytes("step_1", "big.bin") == data


def test_a_users_own_multipart_uploads_under_the_root_survive(request, tmp_path):
    """Multipart uploads the user started under the store root, at keys that are not in
    the store's layout (in a subdirectory; below a name but not in an attempt; right
    below the root under a name no checkpoint can have) are not the store's: recovery
    leaves them, even long after they started. A one-file save of the store that died with
    its upload open is still aborted."""
    backend = _s3(request, tmp_path)
    store = backend.open(block_size=5 * 2**20, lease_ttl=1)
    d = store.driver
    mine = {}
    for key in ("notes/big.bin", "step_1/attempt-x/big.bin", "my data.bin"):
        bucket, obj = d.split(key)
        out = d.call("create", key, lambda b=bucket, o=obj: d.s3call("create_multipart_upload", Bucket=b, Key=o))
        mine[key] = out["UploadId"]
    dead = store.one_file("checkpoint_3")
    dead.write(os.urandom(11 * 2**20))  # a one-file save whose process "dies" here
    report = store.recover(now=FUTURE)
    aborted = [a.target for a in report.actions if a.kind == "upload"]
    assert len(aborted) == 1 and aborted[0].startswith("checkpoint_3 ("), report.summary()
    left = {(k, u) for k, u, _ in d.list_incomplete_uploads("")}
    assert left == set(mine.items()), left
    assert not store.recover(now=FUTURE).actions


# -- the class: a nested store, on every backend ---------------------------------------------
def test_outer_recovery_never_touches_a_nested_store(backend, request):
    """A store nested one level below the root holds a committed checkpoint, one whose
    name looks like an attempt of the outer store's layout (such names are refused now;
    an older version or another tool could have made it: written key by key here), a save
    in flight, the leftovers of a crashed save and (local disk) a stale temporary of its
    own: the outer store's recovery, even treating every lease as expired, changes none of
    its keys. The inner store's own recovery then cleans its leftovers, and the save in
    flight commits."""
    outer = backend.open()
    inner_b = nested(backend)
    inner = inner_b.open(lease_ttl=3600)
    save(inner, "step_1")
    inner.driver.put(f"{ATTEMPT_LIKE}/commit_success.txt", b"a checkpoint's marker")
    inner.driver.put(f"{ATTEMPT_LIKE}/attempt-20260101T000000-abcdefabcdef/a.bin", b"its data")
    with pytest.raises(SimulatedCrash):
        save(atomicstore.Store(CrashingDriver(inner.driver, Crasher(crash_at=4)), lease_ttl=1), "lost")
    if backend.kind == "local":
        tmp = os.path.join(inner_b.url, ".trainer.json.put-1-0123456789ab")
        with open(tmp, "wb") as fh:
            fh.write(b"half")
        os.utime(tmp, (time.time() - 3600, time.time() - 3600))
    txn = inner.transaction("step_2")
    txn.write_bytes("a.bin", b"in flight")
    before = inner.driver.find("")
    report = outer.recover(now=FUTURE, grace=0, flax_prefix="step_")
    assert inner.driver.find("") == before, report.summary()
    assert not report.actions, report.summary()
    txn.commit()
    for name in ("step_1", "step_2"):
        inner.verify(name)
    own = inner.recover(now=FUTURE)
    assert own.actions, "the inner store's own recovery removes its crashed save"
    assert not inner.recover(now=FUTURE).actions


# -- row 8: names a user's checkpoint can have ----------------------------------------------
def test_committed_checkpoints_named_like_flax_staging_survive(backend):
    """Native checkpoints named ``checkpoint_tmp``, ``checkpoint_tmp_gda`` and
    ``checkpoint_7_gda`` (no ``checkpoint_7``; not the flax multi-process layout) and a
    one-file checkpoint named ``ckpt_tmp``, all older than grace: recovery with the flax
    prefix leaves every one of them (committed, whatever the name)."""
    store = backend.open()
    url = backend.url
    for name, n in (("checkpoint_tmp", 3), ("checkpoint_tmp_gda", 4), ("checkpoint_7_gda", 5)):
        atomicstore.save(os.path.join(url, name) if backend.kind == "local" else f"{url}/{name}",
                         {"x": np.arange(n)}, store=store)
    with store.one_file("ckpt_tmp") as f:
        f.write(b"a one-file checkpoint")
    for prefix in ("checkpoint_", "ckpt_"):
        report = backend.open().recover(now=FUTURE, grace=0, flax_prefix=prefix)
        assert not report.actions, report.summary()
    assert sorted(store.list()) == ["checkpoint_7_gda", "checkpoint_tmp", "checkpoint_tmp_gda"]
    for name, n in (("checkpoint_tmp", 3), ("checkpoint_tmp_gda", 4), ("checkpoint_7_gda", 5)):
        store.verify(name)
        got = atomicstore.restore(os.path.join(url, name) if backend.kind == "local" else f"{url}/{name}",
                                  store=store)
        assert got["x"].tolist() == list(range(n))
    assert store.driver.read("ckpt_tmp") == b"a one-file checkpoint"


def test_a_leased_save_named_like_flax_staging_is_left_in_flight(backend):
    """A save of ``checkpoint_tmp`` (and of ``checkpoint_9_gda``, whose main file does not
    exist) is in flight under a live lease when recovery runs with grace=0 and the flax
    prefix: both are in flight, left alone, and commit."""
    store = backend.open(lease_ttl=3600)
    txns = {}
    for name in ("checkpoint_tmp", "checkpoint_9_gda"):
        txns[name] = store.transaction(name)
        txns[name].write_bytes("a.bin", name.encode())
    report = backend.open().recover(grace=0, flax_prefix="checkpoint_")
    assert not report.actions, report.summary()
    for name, txn in txns.items():
        txn.commit()
        assert store.read_bytes(name, "a.bin") == name.encode()


def test_flax_multiprocess_gda_orphans_are_identified_by_their_layout(backend):
    """An orphaned ``_gda`` checkpoint of ``compat.flax``'s multi-process layout
    (``arrays.json`` and ``a<n>/<start>.bin`` shards, committed, its main file absent) is
    un-published and removed; a user's native checkpoint of the same shape of name but
    another layout is committed data and stays."""
    store = backend.open()
    with store.transaction("checkpoint_5_gda") as txn:
        txn.write_bytes("arrays.json", b'{"format": "atomicstore.gda/1", "arrays": []}')
        txn.write_bytes("a0/0_0.bin", b"\0" * 16)
    with store.transaction("checkpoint_6_gda") as txn:
        txn.write_bytes("weights.bin", b"user data")
    report = store.recover(now=FUTURE, flax_prefix="checkpoint_")
    assert [(a.kind, a.target) for a in report.actions if a.kind == "flax"] == [("flax", "checkpoint_5_gda")], \
        report.summary()
    assert sorted(store.list()) == ["checkpoint_6_gda"]
    store.verify("checkpoint_6_gda")
    store.recover(now=FUTURE)  # the un-published checkpoint's data, wherever it went
    assert not store.recover(now=FUTURE, flax_prefix="checkpoint_").actions


# -- the strategy owns its layout -----------------------------------------------------------
def test_each_strategy_classifies_only_its_own_layout():
    """Recovery removes only what the strategy classifies as its own: every key of its
    layout gets its kind (with name, attempt and tree), and a checkpoint's committed files,
    the user's files, flax-like names and keys below another store's root are FOREIGN."""
    from atomicstore.commit.strategies import (
        STAGING,
        TRASH,
        KeyKind,
        MarkerStrategy,
        RenameStrategy,
    )

    driver = atomicstore.open_store("memory://classify").driver
    att = "20260101T000000-0123456789ab"
    shared = {
        f".atomicstore/leases/step_1.{att}.json": (KeyKind.LEASE, "step_1", att, ""),
        ".atomicstore/claims/step_1.json": (KeyKind.CLAIM, "step_1", "", ""),
        ".atomicstore/conformance/p1/x": (KeyKind.PROBE, "", "", ".atomicstore/conformance/p1"),
        f"{STAGING}/step_1.{att}/a.bin": (KeyKind.ATTEMPT, "step_1", att, f"{STAGING}/step_1.{att}"),
        f"{TRASH}/step_1.{att}.ab12/a.bin": (KeyKind.TRASH, "", "", f"{TRASH}/step_1.{att}.ab12"),
        ".atomicstore/unknown/x": (KeyKind.FOREIGN, "", "", ""),
        "checkpoint_tmp": (KeyKind.ONE_FILE, "checkpoint_tmp", "", ""),
        "notes/readme.txt": (KeyKind.FOREIGN, "", "", ""),
        "checkpoint_tmp/a.bin": (KeyKind.FOREIGN, "", "", ""),
        "run-42/.atomicstore/leases/x.y.json": (KeyKind.FOREIGN, "", "", ""),
    }
    own = {
        "step_1/commit_success.txt": (KeyKind.MARKER, "step_1", "", ""),
        f"step_1/attempt-{att}/a.bin": (KeyKind.ATTEMPT, "step_1", att, f"step_1/attempt-{att}"),
        "step_1/attempt-not-an-id/a.bin": (KeyKind.FOREIGN, "", "", ""),
        f"run-42/attempt-{att}/a.bin": (KeyKind.FOREIGN, "", "", ""),  # another store's root
        "step_1/manifest.json": (KeyKind.FOREIGN, "", "", ""),
    }
    for strategy, layout in ((MarkerStrategy(driver), own),
                             (RenameStrategy(driver), dict.fromkeys(own, (KeyKind.FOREIGN, "", "", "")))):
        for key, want in {**shared, **layout}.items():
            kc = strategy.classify(key, listing=[key], nested={"run-42"})
            assert (kc.kind, kc.name, kc.attempt, kc.prefix) == want, (strategy.kind, key, kc)
