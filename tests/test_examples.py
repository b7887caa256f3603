"""The README's main-job command must keep working: run the quick-start example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_example_runs(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "restored weights are bit-identical: OK" in out.stdout
    assert "pytree saved and restored" in out.stdout
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [".atomicstore", "step_100", "tree_100"]
