"""The commit layer's adapters for the layers above it (commit/adapters.py): deleting a
flax one-file step with its ``_gda`` arrays while other actors write the same names."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import make_backend

import atomicstore
from atomicstore.commit.adapters import delete_one_file_step
from atomicstore.compat import flax as ck

BACKENDS = ["local", "s3", "gcs", "seaweed"]


def committed_step_with_arrays(store: atomicstore.Store) -> None:
    with store.one_file("checkpoint_5") as f:
        f.write(b"step five")
    with store.transaction("checkpoint_5_gda") as txn:
        txn.write_bytes("arr", b"old arrays")


@pytest.mark.parametrize("kind", BACKENDS)
def test_retention_leaves_a_save_of_the_arrays_in_flight_alone(kind, request, tmp_path):
    # writer W saves checkpoint_5_gda (its lease alive) while another job's flax save of
    # step 6 with keep=1 retires step 5: W's attempt is W's, and its commit verifies
    b = make_backend(kind, request, tmp_path)
    store = b.open()
    with store.one_file("checkpoint_5") as f:
        f.write(b"step five")
    txn = store.transaction("checkpoint_5_gda")
    txn.__enter__()
    txn.write_bytes("first.bin", b"A" * 1000)
    ck.save_checkpoint(b.url, {"v": np.array(6.0)}, step=6, keep=1, storage_options=b.options)
    assert not store.driver.exists("checkpoint_5")  # the step itself was retired
    txn.write_bytes("second.bin", b"B" * 1000)
    txn.__exit__(None, None, None)
    store.verify("checkpoint_5_gda")
    assert store.open("checkpoint_5_gda").read_bytes("first.bin") == b"A" * 1000


class CommitsRightAfterDelete(atomicstore.Store):
    """A scheduler for one interleaving: right after this store's delete of ``name``
    returns, another job commits a new checkpoint of that name."""

    def __init__(self, base: atomicstore.Store, other: atomicstore.Store, name: str) -> None:
        self.__dict__.update(base.__dict__)
        self.other, self.name_to_race = other, name
        self.raced = False

    def delete(self, name: str, **kw: Any) -> None:
        super().delete(name, **kw)
        if name == self.name_to_race and not self.raced:
            self.raced = True
            with self.other.transaction(name) as txn:
                txn.write_bytes("arr", b"the other job's arrays")


@pytest.mark.parametrize("kind", BACKENDS)
def test_arrays_committed_after_retention_deleted_the_old_ones_stay(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    store = b.open()
    committed_step_with_arrays(store)
    racing = CommitsRightAfterDelete(store, b.open(writer_id="other-job"), "checkpoint_5_gda")
    assert delete_one_file_step(racing, "checkpoint_5", "checkpoint_5_gda")
    assert racing.raced
    assert store.list() == ["checkpoint_5_gda"]
    store.verify("checkpoint_5_gda")
    assert store.open("checkpoint_5_gda").read_bytes("arr") == b"the other job's arrays"


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_step_replaced_after_it_was_judged_is_kept(kind, request, tmp_path):
    b = make_backend(kind, request, tmp_path)
    store = b.open()
    committed_step_with_arrays(store)
    judged = store.driver.info("checkpoint_5").generation
    with b.open(writer_id="other-job").one_file("checkpoint_5", overwrite=True) as f:
        f.write(b"step five, again")
    assert not delete_one_file_step(store, "checkpoint_5", "checkpoint_5_gda", if_generation=judged)
    assert store.driver.read("checkpoint_5") == b"step five, again"
    assert store.list() == ["checkpoint_5_gda"]  # nothing deleted


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_plain_arrays_directory_goes_with_its_step(kind, request, tmp_path):
    # flax's own _gda arrays (files written by flax, no checkpoint of ours): retired with
    # the step, every file of them
    b = make_backend(kind, request, tmp_path)
    store = b.open()
    with store.one_file("checkpoint_5") as f:
        f.write(b"step five")
    for path in ("checkpoint_5_gda/a/0", "checkpoint_5_gda/a/.zarray", "checkpoint_5_gda/b"):
        store.write_file(path, b"flax's bytes")
    assert delete_one_file_step(store, "checkpoint_5", "checkpoint_5_gda")
    assert not store.driver.find("checkpoint_5_gda")
    assert not store.driver.exists("checkpoint_5")
