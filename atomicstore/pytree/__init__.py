"""Pytree layer: save/restore JAX and numpy trees through the commit layer.

The only layer that imports numpy (and jax, lazily, when a tree holds jax objects).
"""

from .api import INDEX_FILE, STATE_FILE, restore, save, split_url

__all__ = ["INDEX_FILE", "STATE_FILE", "restore", "save", "split_url"]
