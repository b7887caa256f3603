"""One name holds one checkpoint: a directory-layout (native) save never lands on a name
that holds a one-file checkpoint (flax's layout), and a one-file save never lands on a
native checkpoint, on every backend (model-based test, finding F8).

Before the fix the memory driver took the flax file over as if it were an empty
directory (destroying it), and S3/GCS committed the native checkpoint *beside* the
object ``<name>`` (deleting it made the old flax file reappear).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Backend

import atomicstore
from atomicstore.compat import flax as checkpoints
from atomicstore.errors import AlreadyExistsError, CommitConflictError, InvalidArgumentError


def user_keys(store: atomicstore.Store) -> dict[str, Any]:
    """Every object outside the reserved directory, with its generation."""
    return {k: i.generation for k, i in store.driver.find("").items() if not k.startswith(".atomicstore/")}


@pytest.mark.parametrize("overwrite", [False, True])
def test_native_save_over_a_one_file_checkpoint_is_refused(backend: Backend, overwrite: bool) -> None:
    o = backend.options
    checkpoints.save_checkpoint(backend.url, {"v": 1}, 1, prefix="tree_", storage_options=o)
    store = backend.open()
    before = user_keys(store)
    assert "tree_1" in before  # a single file/object at exactly <root>/tree_1
    with pytest.raises((AlreadyExistsError, InvalidArgumentError)) as exc:
        atomicstore.save(f"{backend.url}/tree_1", {"v": 2}, overwrite=overwrite, **o)
    assert not isinstance(exc.value, CommitConflictError)
    assert "single-file" in str(exc.value) and "tree_1" in str(exc.value), str(exc.value)
    assert user_keys(store) == before  # nothing written, nothing taken over
    assert not [k for k in store.driver.find("") if k.startswith(".atomicstore/leases/")]
    assert store.list() == []
    assert checkpoints.restore_checkpoint(backend.url, None, prefix="tree_", storage_options=o) == {"v": 1}


@pytest.mark.parametrize("overwrite", [False, True])
def test_one_file_save_over_a_native_checkpoint_is_refused(backend: Backend, overwrite: bool) -> None:
    o = backend.options
    atomicstore.save(f"{backend.url}/tree_1", {"v": 2}, **o)
    store = backend.open()
    before = user_keys(store)
    with pytest.raises((AlreadyExistsError, InvalidArgumentError)):
        with store.one_file("tree_1", overwrite=overwrite) as f:
            f.write(b"not a native checkpoint")
    assert user_keys(store) == before
    assert store.list() == ["tree_1"]
    assert atomicstore.restore(f"{backend.url}/tree_1", **o) == {"v": 2}


def test_an_empty_directory_is_still_taken_over(tmp_path: Any) -> None:
    """The take-over of a user's empty directory (``mkdir``) stays: only files are refused."""
    (tmp_path / "store" / "tree_1").mkdir(parents=True)
    atomicstore.save(str(tmp_path / "store" / "tree_1"), {"v": 3})
    assert atomicstore.restore(str(tmp_path / "store" / "tree_1")) == {"v": 3}
