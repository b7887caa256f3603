"""flax's legacy layout, as recovery sees it: which top-level names may be its leftovers.

``flax.training.checkpoints`` commits ``<prefix><step>`` by writing ``<prefix>tmp`` (and,
for a multi-process save, ``<prefix>tmp_gda``) and renaming them; ``compat.flax`` adds a
``<prefix><step>_gda`` checkpoint committed before its main file. A name of that shape is
only ever a *candidate*: a committed checkpoint of any name (``checkpoint_tmp`` too) is
committed data, decided from its commit point read afresh, never by the name's pattern.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .manifest import Manifest

#: the files of ``compat.flax``'s multi-process ``<prefix><step>_gda`` checkpoint
#: (``ARRAYS_FILE`` and ``gda_file`` there): the only committed checkpoint recovery ever
#: un-publishes, and only when its main file is absent
GDA_ARRAYS = "arrays.json"
GDA_SHARD = re.compile(r"a\d+/\d+(?:_\d+)*\.bin")


def is_flax_gda(manifest: Manifest) -> bool:
    """True for the layout of ``compat.flax``'s ``_gda`` checkpoint: ``arrays.json`` and
    shard files ``a<n>/<start>.bin``, nothing else."""
    files = set(manifest.files)
    return GDA_ARRAYS in files and all(f == GDA_ARRAYS or GDA_SHARD.fullmatch(f) for f in files)


@dataclass(frozen=True)
class FlaxCandidate:
    """A top-level name that may be a leftover of flax's layout: staging (``<prefix>tmp``,
    ``<prefix>tmp_gda``) or the ``_gda`` of step ``main`` (``<prefix><step>_gda``) whose
    main file ``main`` did not exist when listed."""

    top: str
    staging: bool
    main: str | None

    @property
    def names(self) -> set[str]:
        """The checkpoint names a save in flight would hold a lease of."""
        return {self.top} | ({self.main} if self.main else set())

    @property
    def what(self) -> str:
        """How recovery names it in its report."""
        return "flax staging" if self.staging else "orphaned _gda directory"


def flax_candidates(tops: set[str], prefix: str) -> list[FlaxCandidate]:
    """Top-level names of flax's legacy layout that may be its leftovers, sorted: each is
    decided from storage by recovery, not by its name."""
    out: list[FlaxCandidate] = []
    for top in sorted(tops):
        if not top.startswith(prefix):
            continue
        rest = top[len(prefix):]
        if rest in ("tmp", "tmp_gda"):
            out.append(FlaxCandidate(top, True, None))
        elif rest.endswith("_gda") and f"{prefix}{rest[:-4]}" not in tops:
            try:
                float(rest[:-4])
            except ValueError:
                continue
            out.append(FlaxCandidate(top, False, top[: -len("_gda")]))
    return out
