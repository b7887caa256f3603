"""Drop-in replacements for other checkpoint libraries' APIs (``compat.flax``)."""
