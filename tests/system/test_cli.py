"""The atomicstore command, driven as a subprocess against local disk and the S3 fake."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_backend, uncarried

import atomicstore
from atomicstore.compat import flax as ck

# the builder of sharded checkpoints of the pytree layer's tests (another folder)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pytree"))
from test_sharded_format import GRID, Sharded, W, build  # noqa: E402


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "atomicstore.cli", *args], capture_output=True, text=True,
                         timeout=300)
    if check is not None:
        assert out.returncode == check, (args, out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def opts(b) -> list[str]:
    return [x for k, v in b.options.items() for x in ("-o", f"{k}={json.dumps(v)}")]


@pytest.fixture(params=["local", "s3"])
def populated(request, tmp_path):
    b = make_backend(request.param, request, tmp_path)
    st = b.open()
    for step in (1, 2):
        atomicstore.save(f"{b.url}/checkpoint_{step}", {"params": {"w": np.full((4, 3), step, np.float32)},
                                                        "step": step}, store=st, metadata={"lr": 0.1})
    # a save whose writer died: written, never committed nor aborted, lease no longer renewed
    txn = b.open(lease_ttl=0.5).transaction("checkpoint_3")
    txn.write_bytes("state.msgpack", b"partial")
    txn._lease.stop()
    return b


def test_ls_verify_inspect_rm(populated):
    b, o = populated, opts(populated)
    out = json.loads(cli("ls", b.url, "--json", *o).stdout)
    assert [r["name"] for r in out["checkpoints"]] == ["checkpoint_1", "checkpoint_2"]
    assert out["checkpoints"][0]["step"] == "1" and out["checkpoints"][0]["files"] == 2  # state + index
    human = cli("ls", b.url, "--all", *o).stdout
    assert "checkpoint_2" in human and "checkpoint_3" in human  # uncommitted, shown with why
    assert "checkpoint_3" not in cli("ls", b.url, *o).stdout
    v = json.loads(cli("verify", b.url, "--json", *o).stdout)
    assert v["ok"] and len(v["results"]) == 2
    cli("verify", f"{b.url}/checkpoint_2", *o)
    ins = json.loads(cli("inspect", f"{b.url}/checkpoint_2", "--json", *o).stdout)
    w = next(lf for lf in ins["leaves"] if lf["path"] == "params/w")
    assert w["dtype"] == "float32" and w["shape"] == [4, 3] and w["bytes"] == 48
    assert ins["metadata"] == {"lr": 0.1}
    assert "params/w" in cli("inspect", f"{b.url}/checkpoint_2", *o).stdout
    cli("rm", f"{b.url}/checkpoint_1", *o)
    assert b.open().list() == ["checkpoint_2"]
    r = cli("rm", f"{b.url}/checkpoint_1", *o, check=3)
    assert "no checkpoint" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_ls_lists_a_damaged_checkpoint_with_the_reason(populated):
    """Issue 11 row 8: a committed checkpoint whose manifest cannot be read is listed as
    damaged, with why, next to the good ones (not an error for the whole listing)."""
    b, o = populated, opts(populated)
    st = b.open()
    prefix, _ = st.strategy.resolve("checkpoint_1")
    st.driver.put(f"{prefix}/manifest.json", b"\x00not a manifest")  # garbage over the manifest
    uncarried(st, "checkpoint_1")  # (and no copy of it in the commit marker)
    out = json.loads(cli("ls", b.url, "--all", "--json", *o).stdout)
    rows = {r["name"]: r for r in out["checkpoints"]}
    assert rows["checkpoint_1"]["kind"] == "damaged" and "manifest" in rows["checkpoint_1"]["why"]
    assert rows["checkpoint_2"]["kind"] == "checkpoint" and rows["checkpoint_2"]["files"] == 2
    human = cli("ls", b.url, "--all", *o).stdout
    line = next(ln for ln in human.splitlines() if ln.startswith("checkpoint_1"))
    assert "damaged:" in line and "manifest" in line
    assert "checkpoint_3" in human  # the uncommitted save is still reported


def test_recover_dry_run_then_real(populated):
    b, o = populated, opts(populated)
    time.sleep(1.0)  # the dead writer's lease (0.5 s) expires
    before = set(b.open().driver.find(""))
    dry = json.loads(cli("recover", b.url, "--dry-run", "--json", "--grace", "0", *o).stdout)
    assert dry["dry_run"] and dry["committed"] == ["checkpoint_1", "checkpoint_2"]
    assert any("checkpoint_3" in a["target"] for a in dry["actions"]), dry
    assert set(b.open().driver.find("")) == before  # the dry run changed nothing
    human = cli("recover", b.url, "--grace", "0", *o).stdout
    assert "checkpoint_3" in human
    assert "nothing uncommitted" in cli("ls", b.url, "--all", *o).stdout
    assert b.open().list() == ["checkpoint_1", "checkpoint_2"]


def test_cp_local_to_s3_and_back_verified(tmp_path, request):
    local = make_backend("local", request, tmp_path)
    s3 = make_backend("s3", request, tmp_path)
    atomicstore.save(f"{local.url}/ck", {"a": np.arange(100_000, dtype=np.float64)})
    out = json.loads(cli("cp", f"{local.url}/ck", f"{s3.url}/copy", "--json", "--dst-option",
                         f"endpoint_url={json.dumps(s3.options['endpoint_url'])}",
                         *[x for k, v in s3.options.items() if k != "endpoint_url"
                           for x in ("--dst-option", f"{k}={json.dumps(v)}")]).stdout)
    assert out["verified"] and out["bytes"] > 800_000
    got = atomicstore.restore(f"{s3.url}/copy", **s3.options)
    assert np.array_equal(got["a"], np.arange(100_000, dtype=np.float64))
    cli("cp", f"{s3.url}/copy", f"{local.url}/back", *opts(s3))
    assert atomicstore.open_store(local.url).list() == ["back", "ck"]
    # an existing destination is refused unless --force
    r = cli("cp", f"{local.url}/ck", f"{local.url}/back", check=5)
    assert "already exists" in r.stderr and "--force" in r.stderr
    cli("cp", f"{local.url}/ck", f"{local.url}/back", "--force")


def test_flax_files_are_listed_verified_and_copied(tmp_path):
    d = tmp_path / "flax"
    ck.save_checkpoint(d, {"w": np.ones(10)}, 5)
    ls = json.loads(cli("ls", str(d), "--json").stdout)
    assert [(r["name"], r["kind"]) for r in ls["checkpoints"]] == [("checkpoint_5", "flax file")]
    cli("verify", str(d / "checkpoint_5"))
    cli("cp", str(d / "checkpoint_5"), str(tmp_path / "other" / "checkpoint_5"), check=None)
    assert (tmp_path / "other" / "checkpoint_5").read_bytes() == (d / "checkpoint_5").read_bytes()


def test_corrupt_data_fails_verify_naming_file_and_leaf(tmp_path):
    root = tmp_path / "s"
    atomicstore.save(f"{root}/ck", {"a": np.zeros(1000, np.float32), "b": np.ones(1000, np.float32)})
    st = atomicstore.open_store(str(root))
    state = Path(root) / "ck" / "state.msgpack"
    raw = bytearray(state.read_bytes())
    off = raw.rfind(np.ones(4, np.float32).tobytes())  # inside leaf "b"
    raw[off] ^= 0xFF
    state.write_bytes(bytes(raw))
    r = cli("verify", f"{root}/ck", check=1)
    assert "CORRUPT" in r.stdout and "state.msgpack" in r.stdout and "leaf b" in r.stdout
    js = json.loads(cli("verify", str(root), "--json", check=1).stdout)
    assert not js["ok"] and js["results"][0]["leaf"] == "b"
    assert st.list() == ["ck"]  # verification changes nothing


@pytest.mark.parametrize("args,code,needle", [
    (["ls", "/definitely/not/here"], 3, "no such directory"),
    (["inspect", "nope"], 2, "does not name a checkpoint"),
    (["ls", "nosuchproto://x/y"], 2, "nosuchproto"),
    (["ls", "s3://bucket", "-o", "novalue"], 2, "KEY=VALUE"),
    (["verify", "s3://bucket/x", "-o", "endpoint_url=\"http://127.0.0.1:9\"", "-o", "key=\"k\"",
      "-o", "secret=\"hunter2-secret\""], 4, ""),
])
def test_user_errors_are_one_line_with_an_exit_code(args, code, needle, tmp_path):
    r = cli(*args, check=None)
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atomicstore ") and needle in lines[0], r.stderr
    assert "hunter2-secret" not in r.stderr


def test_demo_runs_and_asserts_its_own_success(tmp_path):
    r = subprocess.run([sys.executable, "-m", "atomicstore.cli", "demo", "--dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=600, env={**os.environ})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    stages = {s["stage"]: s["result"] for s in doc["stages"]}
    assert doc["ok"] and "SIGKILL while saving step 40" in stages["kill"]
    assert "attempt" in stages["recover"] and "bit-identical" in stages["resume"]
    mgr = atomicstore.CheckpointManager(str(tmp_path / "run"), recover=False)
    assert 40 not in mgr.all_steps() and mgr.latest_step() == 60


def test_python_dash_m_atomicstore_is_the_command():
    r = subprocess.run([sys.executable, "-m", "atomicstore", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("atomicstore "), r.stderr


# -- arrays sharded across processes (checkpoints built by hand, see test_sharded_format) ------
@pytest.fixture(params=["local", "s3"])
def sharded(request, tmp_path):
    b = make_backend(request.param, request, tmp_path)
    build(b.open(), "ck", {"params": {"w": Sharded(W, GRID), "b": np.ones(3, np.float32)}, "step": 7})
    return b


def test_inspect_shows_sharded_arrays_and_their_files(sharded):
    b, o = sharded, opts(sharded)
    ins = json.loads(cli("inspect", f"{b.url}/ck", "--json", *o).stdout)
    w = next(lf for lf in ins["leaves"] if lf["path"] == "params/w")
    assert (w["kind"], w["dtype"], w["shape"], w["bytes"]) == ("sh", "float32", [8, 6], 192)
    assert w["shards"] == [{"file": f"shards/0/{r}_{c}.bin", "start": [r, c], "shape": [4, 3], "bytes": 48}
                           for r in (0, 4) for c in (0, 3)]
    assert ins["total_bytes"] == 192 + 12
    plain = next(lf for lf in ins["leaves"] if lf["path"] == "params/b")
    assert "shards" not in plain and plain["kind"] == "nd" and plain["bytes"] == 12
    human = cli("inspect", f"{b.url}/ck", *o).stdout
    assert "1 sharded across processes" in human
    line = next(ln for ln in human.splitlines() if "params/w" in ln)
    assert "float32" in line and "(8, 6)" in line and "192 B" in line and "sharded, 4 shards" in line
    assert "shards/0/4_3.bin  [4:8, 3:6]  48 B" in human


def test_inspect_lists_the_first_shards_of_a_big_sharding(tmp_path):
    from atomicstore.cli import SHOW_SHARDS

    st = atomicstore.open_store(str(tmp_path / "s"))
    rows = SHOW_SHARDS + 4
    build(st, "ck", {"w": Sharded(np.zeros((rows, 2), np.int8), [((r, 0), (1, 2)) for r in range(rows)])})
    human = cli("inspect", f"{st.url}/ck").stdout
    assert f"sharded, {rows} shards" in human and "... and 4 more (--json lists them all)" in human
    assert sum("shards/0/" in ln for ln in human.splitlines()) == SHOW_SHARDS
    assert len(json.loads(cli("inspect", f"{st.url}/ck", "--json").stdout)["leaves"][0]["shards"]) == rows


def _damage(b, file: str, how: str) -> None:
    st = b.open()
    prefix, _ = st.strategy.resolve("ck")
    key = f"{prefix}/{file}"
    if how == "missing":
        st.driver.delete(key)
        return
    raw = bytearray(st.driver.read(key))
    if how == "flip":
        raw[len(raw) // 2] ^= 0x01
    else:  # truncated
        del raw[-4:]
    st.driver.put(key, bytes(raw))


@pytest.mark.parametrize("how, why", [("flip", "CRC32C"), ("truncated", "size"), ("missing", "missing")])
def test_verify_names_a_damaged_shard_file_and_its_leaf(sharded, how, why):
    b, o = sharded, opts(sharded)
    assert json.loads(cli("verify", f"{b.url}/ck", "--json", *o).stdout)["ok"]
    _damage(b, "shards/0/4_3.bin", how)
    r = cli("verify", f"{b.url}/ck", *o, check=1)
    assert "CORRUPT  ck: shards/0/4_3.bin, leaf params/w:" in r.stdout and why in r.stdout, r.stdout
    js = json.loads(cli("verify", b.url, "--json", *o, check=1).stdout)
    res = js["results"][0]
    assert not js["ok"] and (res["file"], res["leaf"]) == ("shards/0/4_3.bin", "params/w"), res
    # inspect reads only the index: it still shows the tree (a missing file is still in the manifest)
    cli("inspect", f"{b.url}/ck", *o)


def test_verify_still_names_a_damaged_state_leaf_next_to_sharded_arrays(sharded):
    b, o = sharded, opts(sharded)
    st = b.open()
    prefix, _ = st.strategy.resolve("ck")
    raw = bytearray(st.driver.read(f"{prefix}/state.msgpack"))
    off = raw.rfind(np.ones(3, np.float32).tobytes())  # params/b
    raw[off] ^= 0xFF
    st.driver.put(f"{prefix}/state.msgpack", bytes(raw))
    res = json.loads(cli("verify", f"{b.url}/ck", "--json", *o, check=1).stdout)["results"][0]
    assert (res["file"], res["leaf"]) == ("state.msgpack", "params/b"), res


def test_inspect_and_verify_refuse_an_index_whose_shards_do_not_tile(tmp_path):
    st = atomicstore.open_store(str(tmp_path / "s"))
    build(st, "ck", {"params": {"w": Sharded(W, [((0, 0), (4, 6)), ((2, 0), (4, 6))])}})  # rows 2-3 twice
    r = cli("inspect", f"{st.url}/ck", check=1)
    assert "index.msgpack" in r.stderr and "overlap" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # every file matches the manifest, but restore would refuse the checkpoint: verify says so
    r = cli("verify", f"{st.url}/ck", check=1)
    assert "CORRUPT  ck: index.msgpack, leaf params/w:" in r.stdout and "overlap" in r.stdout, r.stdout
