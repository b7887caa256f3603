"""Every ```python example in README.md and docs/*.md runs, so the docs cannot rot.

The blocks of one page run in order, in one fresh process, with the object-store URLs
they use (s3://bucket, s3://my-bucket, gs://bucket) served by the S3 and GCS fakes
(reached through AWS_ENDPOINT_URL and STORAGE_EMULATOR_HOST, the variables botocore and
gcsfs read), local paths like /ckpts moved under a temporary directory, and the few
names an example takes from its surroundings (state, step, loss, ...) defined by a
prelude. An example that raises fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)
BUCKETS = ("bucket", "my-bucket")

PRELUDE = textwrap.dedent("""
    import os, numpy as np
    import jax.numpy as jnp
    import flax
    flax.config.update("flax_use_orbax_checkpointing", False)
    from flax.training import checkpoints as _flax_ckpt
    state = {"params": {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)}, "step": 0}
    step, start, end, loss = 1000, 0, 201, 0.5
    opts = {}  # credentials come from the environment here
    path_or_url = os.path.join(os.environ["DOCS_TMP"], "some-store")
    chunks = [b"x" * 1000, b"y" * 1000]
    opt_bytes = b"opt"
    ckpt_dir = os.path.join(os.environ["DOCS_TMP"], "ckpt_dir")
    def train_step(s):
        return s
    _flax_ckpt.save_checkpoint(os.path.join(os.environ["DOCS_TMP"], "flax_ckpts"), state, 5)
""")


def pages_with_examples() -> list[Path]:
    return [p for p in PAGES if BLOCK.search(p.read_text())]


@pytest.mark.parametrize("page", pages_with_examples(), ids=lambda p: p.name)
def test_examples_run(page, tmp_path, s3_server, gcs_server):
    for b in BUCKETS:
        for srv in (s3_server, gcs_server):
            try:
                srv.new_bucket(b)
            except Exception:  # noqa: BLE001 - created by an earlier page
                pass
    blocks = [textwrap.dedent(body) for _, body in BLOCK.findall(page.read_text())]
    code = PRELUDE + "\n".join(f"# --- example {i + 1}\n{b}" for i, b in enumerate(blocks))
    for local in ("/ckpts", "/flax_ckpts"):
        code = code.replace(f'"{local}', f'os.environ["DOCS_TMP"] + "{local}')
    # every run gets its own object prefixes, so pages never see each other's checkpoints
    code = re.sub(r'"(s3|gs)://(bucket|my-bucket)/', lambda m: f'"{m[1]}://{m[2]}/{tmp_path.name}/', code)
    env = {**os.environ, "DOCS_TMP": str(tmp_path), "AWS_ENDPOINT_URL": s3_server.endpoint,
           "AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
           "AWS_DEFAULT_REGION": "us-east-1", "STORAGE_EMULATOR_HOST": gcs_server.endpoint}
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, f"{page.name}: an example failed\n{out.stderr[-4000:]}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for p in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{p.name}" in readme, f"README does not link docs/{p.name}"
