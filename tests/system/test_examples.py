"""The README's main-job command must keep working: run the quick-start example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import atomicstore

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_example_runs(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "restored weights are bit-identical: OK" in out.stdout
    assert "pytree saved and restored" in out.stdout
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [".atomicstore", "step_100", "tree_100"]


def test_torch_checkpointer_example_runs_in_one_process_and_under_torchrun(tmp_path):
    script = str(ROOT / "examples" / "torch_checkpointer.py")
    for cmd, store in (([sys.executable, script], "one"),
                       ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script], "two")):
        out = subprocess.run([*cmd, str(tmp_path / store)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "model, optimizer and train state identical: OK" in out.stdout
        st = atomicstore.open_store(str(tmp_path / store))
        assert st.list() == ["step10", "step20"]
        ranks = {p.split("_")[2] for p in st.manifest("step20").files if p.endswith(".distcp")}
        assert ranks == ({"0"} if store == "one" else {"0", "1"}), ranks
        assert st.read_file("train/step20.json") == b'{"step": 20, "tokens_seen": 2560}'
