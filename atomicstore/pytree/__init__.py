"""Pytree layer: save/restore JAX and numpy trees through the commit layer.

The only layer that imports numpy (and jax, lazily, when a tree holds jax objects).

* :mod:`.format`: file names, the index and its parser (no I/O);
* :mod:`.writer`: :func:`save`, streaming a tree into a transaction;
* :mod:`.reader`: :func:`restore`, reading the leaves asked for;
* :mod:`.sharded`: arrays sharded across processes (shard files, region reads);
* :mod:`.coordination`: the processes of a ``jax.distributed`` job agreeing on a save;
* :mod:`.tree`, :mod:`.msgpack_io`, :mod:`.dtypes`: helpers below them.
"""

from .coordination import DEFAULT_TIMEOUT, Session, multihost
from .format import INDEX_FILE, STATE_FILE
from .reader import restore, restore_with_manifest
from .writer import PreparedSave, StateWriter, save

__all__ = ["DEFAULT_TIMEOUT", "INDEX_FILE", "STATE_FILE", "PreparedSave", "Session", "StateWriter", "multihost",
           "restore", "restore_with_manifest", "save"]
