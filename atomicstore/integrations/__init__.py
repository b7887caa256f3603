"""Storage for other checkpoint libraries, committed through atomicstore.

* :mod:`atomicstore.integrations.torch`: ``AtomicStorageWriter`` / ``AtomicStorageReader``
  for ``torch.distributed.checkpoint`` (needs ``torch``);
* :mod:`atomicstore.integrations.orbax`: ``AtomicTemporaryPath`` for Orbax's
  ``temporary_path_class`` option (needs ``orbax-checkpoint``).

They sit on top of the library: nothing in atomicstore imports them, and importing this
package imports neither torch nor orbax.
"""
