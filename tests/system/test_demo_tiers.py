"""``atomicstore demo --tiers`` (issue 25): real training processes killed with SIGKILL
mid-upload, a restart on the same machine restoring from the local tier, the machine lost,
training resumed from the persistent tier. The demo checks itself (a failed check exits
non-zero); the test checks its report and, on local disk, what it left in both tiers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import atomicstore
from atomicstore import demo


@pytest.mark.parametrize("store", ["local", "s3"])
def test_tiers_demo_loses_only_unpersisted_steps_and_resumes_bit_identical(store, tmp_path):
    r = subprocess.run([sys.executable, "-m", "atomicstore", "demo", "--tiers", "--store", store, "--dir",
                        str(tmp_path), "--json"], capture_output=True, text=True, timeout=600, env={**os.environ})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["ok"]
    stages: dict[str, list[str]] = {}
    for s in doc["stages"]:
        stages.setdefault(s["stage"], []).append(s["result"])
    assert stages["kill"] == [
        f"SIGKILL while step {s} was being persisted, its upload in flight (exit status -9)" for s in (30, 40)]
    assert stages["tiers"] == ["persistent tier lists [10], local tier [20, 30]: the upload of step 30 in "
                               "flight is not listed"]
    assert "restored step 30 from the local tier" in stages["restart"][0]
    assert "bit-identical" in stages["restart"][0]
    assert stages["ls"][0].endswith("10 persisted, 30 local+persisted, 40 persisting")  # the command's view
    assert "attempt" in stages["recover"][0] or "upload" in stages["recover"][0]  # the dead uploads removed
    assert "restored step 30 from the persistent tier" in stages["resume"][0]
    assert "bit-identical" in stages["resume"][0]
    assert "persistent tier [10, 30, 60], local tier [60]" in stages["finish"][0]
    # the lost machine's local tier is gone; the new machine's holds the last step only
    assert not (tmp_path / "machine-1").exists()
    new = atomicstore.open_store(str(tmp_path / "machine-2" / "local"))
    assert new.list() == ["checkpoint_60"]
    rep = new.recover(dry_run=True, grace=0)
    assert not rep.actions and not rep.in_flight
    if store != "local":
        return  # (the demo's S3 fake stopped with it)
    run = atomicstore.open_store(str(tmp_path / "run"))
    assert run.list() == ["checkpoint_10", "checkpoint_30", "checkpoint_60"]
    rep = run.recover(dry_run=True, grace=0)
    assert not rep.actions and not rep.in_flight  # no partial upload left behind
    # the persistent copy of step 30 (the one resumed from) is the deterministic run's state at step 30
    got = atomicstore.restore(str(tmp_path / "run" / "checkpoint_30"), target=demo._init(demo.TIER_BUFFER))
    want, _ = demo._train(demo._init(demo.TIER_BUFFER), 30)
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(demo._leaves(got), demo._leaves(want), strict=True))

