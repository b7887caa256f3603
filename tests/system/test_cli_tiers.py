"""``atomicstore ls URL --local-dir DIR``: each step's tiers (issue 25), and the four
questions for the new door: a step deleted between the listing and the reading of its
manifest, hostile input (a file, a URL, the persistent tier, a checkpoint as the local
dir), a read-only (and an unreadable) local dir, and a forked process.

The tiers are made by a real tiered ``CheckpointManager``; a step that is "persisting"
(due, not yet in the persistent tier) is made by deleting its persistent copy, as an
upload that has not committed yet leaves it (the tiered demo, ``test_demo_tiers.py``,
shows one left by a training process killed mid-upload).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from conftest import Backend, in_forked_child, make_backend
from test_cli import cli, opts
from test_cli_contract import run

import atomicstore
from atomicstore.cli import main
from atomicstore.drivers.local import LocalDriver


def tiered(b: Backend, local: str, steps: tuple[int, ...] = (1, 2, 3, 4)) -> dict[int, Any]:
    """Steps saved through ``CheckpointManager(b.url, local_dir=local)``, every other one
    persisted (1 and 3), all kept locally; the manager's own view of their tiers."""
    mgr = atomicstore.CheckpointManager(b.url, storage_options=b.options, keep=5, local_dir=local, local_keep=5,
                                        persist_every_n_steps=2)
    for s in steps:
        mgr.save(s, {"w": np.full(8, s, np.float32)})
    mgr.wait_until_finished()
    state = mgr.tier_state()
    mgr.close()
    return state


def tiers_of(out: str) -> dict[int, str]:
    return {int(r["step"]): r["tiers"] for r in json.loads(out)["checkpoints"]}


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    return make_backend(request.param, request, tmp_path)


def test_ls_local_dir_shows_each_steps_tiers(backend, tmp_path):
    b, local = backend, str(tmp_path / "local")
    state = tiered(b, local)
    doc = json.loads(cli("ls", b.url, "--local-dir", local, "--json", *opts(b)).stdout)
    got = {int(r["step"]): r["tiers"] for r in doc["checkpoints"]}
    assert got == {1: "local+persisted", 2: "local", 3: "local+persisted", 4: "local"}
    # the same as the manager's own view (persisted there: in the persistent tier, maybe also local)
    assert {s: ("persisted" in t) for s, t in got.items()} == {s: str(t) == "persisted" for s, t in state.items()}
    assert doc["local_dir"] == local and all(r["kind"] == "checkpoint" and r["files"] == 2 for r in doc["checkpoints"])
    human = cli("ls", b.url, "--local-dir", local, *opts(b)).stdout
    assert "TIERS" in human and "local+persisted" in human and f"local {local}" in human
    # without --local-dir, ls is what it was: the persistent tier only, no tiers column
    plain = json.loads(cli("ls", b.url, "--json", *opts(b)).stdout)
    assert [r["step"] for r in plain["checkpoints"]] == ["1", "3"] and "tiers" not in plain["checkpoints"][0]
    assert "TIERS" not in cli("ls", b.url, *opts(b)).stdout


def test_ls_local_dir_tells_persisting_from_local(backend, tmp_path):
    """A local step due to be persisted and not (yet) in the persistent tier is
    ``persisting`` when it is newer than the newest persisted step (its upload is queued
    or running, or a restarted job resumes it), else ``local`` (no job uploads it); a
    persisted step whose local copy local retention removed is ``persisted``."""
    b, local = backend, str(tmp_path / "local")
    tiered(b, local)
    remote, loc = b.open(), atomicstore.open_store(local)

    def tiers() -> dict[int, str]:
        return tiers_of(cli("ls", b.url, "--local-dir", local, "--json", *opts(b)).stdout)

    loc.delete("checkpoint_1")
    assert tiers() == {1: "persisted", 2: "local", 3: "local+persisted", 4: "local"}
    remote.delete("checkpoint_3")  # as the upload of step 3 leaves it before its commit point
    assert tiers() == {1: "persisted", 2: "local", 3: "persisting", 4: "local"}
    # another job persisted a newer step: no upload of 3 will ever run (a restarted job skips it)
    atomicstore.save(f"{b.url}/checkpoint_5", {"w": np.ones(2)}, **b.options)
    assert tiers() == {1: "persisted", 2: "local", 3: "local", 4: "local", 5: "persisted"}


def test_ls_local_dir_reports_a_damaged_local_copy(tmp_path):
    b, local = Backend("local", str(tmp_path / "store")), tmp_path / "local"
    tiered(b, str(local))
    for s in (3, 4):  # 3 is persisted too; 4 only local
        (local / f"checkpoint_{s}" / "manifest.json").write_bytes(b"{not json")
    r = cli("ls", b.url, "--local-dir", str(local), "--json")
    rows = {int(x["step"]): x for x in json.loads(r.stdout)["checkpoints"]}
    assert rows[3]["tiers"] == "local+persisted" and rows[3]["kind"] == "checkpoint" and rows[3]["local_damaged"]
    assert rows[4]["tiers"] == "local" and rows[4]["kind"] == "damaged" and rows[4]["why"]
    human = cli("ls", b.url, "--local-dir", str(local)).stdout
    assert "local copy damaged" in human and "damaged:" in human


def test_ls_all_local_dir_shows_what_a_crash_left_in_each_tier(tmp_path):
    b, local = Backend("local", str(tmp_path / "store")), str(tmp_path / "local")
    tiered(b, local)
    for root, name in ((local, "checkpoint_5"), (b.url, "checkpoint_6")):  # a dead writer's save in each tier
        txn = atomicstore.open_store(root, lease_ttl=0.5).transaction(name)
        txn.write_bytes("state.msgpack", b"partial")
        txn._lease.stop()
    doc = json.loads(cli("ls", b.url, "--local-dir", local, "--all", "--json").stdout)
    assert set(tiers_of(json.dumps(doc))) == {1, 2, 3, 4}  # neither partial save is listed as a step
    held = {"local": doc["local_uncommitted"] + doc["local_in_flight"], "store": doc["uncommitted"] + doc["in_flight"]}
    assert any("checkpoint_5" in json.dumps(x) for x in held["local"]), doc
    assert any("checkpoint_6" in json.dumps(x) for x in held["store"]), doc
    assert not any("checkpoint_6" in json.dumps(x) for x in held["local"]), doc
    human = cli("ls", b.url, "--local-dir", local, "--all").stdout
    assert "in the local tier" in human and "checkpoint_5" in human
    assert "local_uncommitted" not in json.loads(cli("ls", b.url, "--all", "--json").stdout)


# -- the four questions: deleted between the listing and the reading of its manifest -------------
@pytest.mark.parametrize("step, left", [(2, {1: "local+persisted", 3: "local+persisted", 4: "local"}),
                                        (3, {1: "local+persisted", 2: "local", 3: "persisted", 4: "local"})])
def test_ls_local_dir_skips_a_local_step_deleted_between_the_listing_and_its_manifest(
        step, left, tmp_path, monkeypatch):
    """Local retention (or the job's overwrite) deletes a local step right after ls listed
    the local tier: a step only local disappears from the listing, a step also persisted
    stays, as ``persisted``; exit 0, no error. The deletion runs right before the first
    read of that step's files in the local tier (a hook in the local driver's reads; the
    command and the commit layer run unchanged)."""
    b, local = Backend("local", str(tmp_path / "store")), str(tmp_path / "local")
    tiered(b, local)
    inside = os.path.join(local, f"checkpoint_{step}") + os.sep
    fired: list[str] = []

    def hooked(meth: Any) -> Any:
        def read(self: LocalDriver, key: str, *a: Any, **kw: Any) -> Any:
            if not fired and self.path(key).startswith(inside):
                fired.append(key)
                atomicstore.open_store(local).delete(f"checkpoint_{step}")
            return meth(self, key, *a, **kw)
        return read

    for name in ("read", "read_into", "iter_read", "info"):
        monkeypatch.setattr(LocalDriver, name, hooked(getattr(LocalDriver, name)))
    code, out, err = run("ls", b.url, "--local-dir", local, "--json")
    assert fired and code == 0, (fired, code, err)
    assert tiers_of(out) == left


# -- the four questions: hostile input ---------------------------------------------------------------
def test_ls_local_dir_refuses_what_is_not_a_local_tier(tmp_path):
    b, local = Backend("local", str(tmp_path / "store")), tmp_path / "local"
    tiered(b, str(local))
    (tmp_path / "afile").write_text("x")
    (tmp_path / "multi" / "process-0").mkdir(parents=True)
    (tmp_path / "multi" / "process-1").mkdir()
    for arg, code, needle in ((str(tmp_path / "nope"), 3, "no such directory"),
                              (str(tmp_path / "afile"), 2, "is not a directory"),
                              ("s3://bucket/local", 2, "is a URL"),
                              (f"file://{local}", 2, "is a URL"),
                              (b.url, 2, "is the persistent tier itself"),
                              (str(local / "checkpoint_2"), 2, "inside checkpoint"),
                              (str(local / "checkpoint_2" / "state.msgpack"), 2, "is not a directory"),
                              (str(tmp_path / "multi"), 2, "process-0")):
        r = cli("ls", b.url, "--local-dir", arg, check=None)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == code and len(lines) == 1 and needle in lines[0], (arg, r.returncode, r.stderr)
        j = cli("ls", b.url, "--local-dir", arg, "--json", check=None)
        assert json.loads(j.stdout) == {"error": lines[0].split("error: ", 1)[1], "exit": code}
    # a process's own local tier of a multi-host job is listed
    assert cli("ls", b.url, "--local-dir", str(tmp_path / "multi" / "process-1"), "--json").returncode == 0
    assert atomicstore.open_store(str(local)).list() == [f"checkpoint_{s}" for s in (1, 2, 3, 4)]


# -- the four questions: a read-only local dir ---------------------------------------------------------
UNPRIVILEGED = textwrap.dedent("""
    import contextlib, io, json, os, sys
    from atomicstore.cli import main
    url, local = sys.argv[1], sys.argv[2]
    try:  # this process must not be able to write there: else the test proves nothing
        open(os.path.join(local, "probe"), "w").close()
        writable = True
    except PermissionError:
        writable = False
    res = {"euid": os.geteuid(), "writable": writable}
    for key, extra in (("", []), ("all_", ["--all"])):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["ls", url, "--local-dir", local, "--json", *extra])
        res.update({key + "code": code, key + "out": out.getvalue(), key + "err": err.getvalue()})
    print(json.dumps(res))
""")

#: capabilities that let root ignore file permissions (linux/capability.h)
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER = 1, 2, 3
PR_CAPBSET_DROP = 24


def _drop_root_powers() -> None:
    """In the child before exec: as root, drop the capabilities that bypass file
    permissions from the bounding set, so the exec'd process is root without them and a
    chmod binds it (as it binds any other user)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def unprivileged_ls(url: str, local: str, tmp_path: Any) -> dict[str, Any]:
    script = tmp_path / "unprivileged.py"
    script.write_text(UNPRIVILEGED)
    r = subprocess.run([sys.executable, str(script), url, local], capture_output=True, text=True, timeout=120,
                       preexec_fn=_drop_root_powers)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_ls_local_dir_on_a_read_only_and_an_unreadable_local_tier(tmp_path):
    """chmod a-w: ls (and ls --all) reads the local tier as usual and writes nothing to it; chmod 000: one
    line naming the permission error, exit 4. The command runs in a process for which the
    chmod binds (checked: it cannot create a file there), also when the suite runs as root."""
    b, local = Backend("local", str(tmp_path / "store")), tmp_path / "local"
    tiered(b, str(local))
    before = {p: p.stat().st_mtime_ns for p in local.rglob("*")}
    modes = {p: p.stat().st_mode for p in [local, *local.rglob("*")]}
    try:
        for p in [local, *local.rglob("*")]:
            if p.is_dir():
                p.chmod(0o555)
        got = unprivileged_ls(b.url, str(local), tmp_path)
        assert got["writable"] is False, "the chmod does not bind the command's process"
        assert got["code"] == 0 and got["all_code"] == 0, (got["err"], got["all_err"])
        assert tiers_of(got["out"]) == {1: "local+persisted", 2: "local", 3: "local+persisted", 4: "local"}
        assert json.loads(got["all_out"])["local_uncommitted"] == []  # (recovery's dry run reads only)
        local.chmod(0o000)
        got = unprivileged_ls(b.url, str(local), tmp_path)
        for key in ("", "all_"):
            lines = got[key + "err"].strip().splitlines()
            assert got[key + "code"] == 4 and len(lines) == 1 and "ermission denied" in lines[0], got
    finally:
        for p, m in modes.items():
            p.chmod(m)
    assert {p: p.stat().st_mtime_ns for p in local.rglob("*")} == before  # nothing written


# -- the four questions: a forked process --------------------------------------------------------------
def _ls_in_child(url: str, local: str, options: list[str], q: Any) -> None:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["ls", url, "--local-dir", local, "--json", *options])
    q.put((code, out.getvalue()))


def test_ls_local_dir_in_a_forked_child_of_a_process_that_ran_it(backend, tmp_path):
    """A data-loader worker forked from a process that already ran ``ls`` (its stores are
    cached per process, an S3 client among them) lists the same tiers."""
    b, local = backend, str(tmp_path / "local")
    tiered(b, local)
    code, out, err = run("ls", b.url, "--local-dir", local, "--json", *opts(b))
    assert code == 0, err
    (child_code, child_out), exitcode = in_forked_child(_ls_in_child, b.url, local, opts(b))
    assert exitcode == 0 and child_code == 0
    assert tiers_of(child_out) == tiers_of(out) == {1: "local+persisted", 2: "local", 3: "local+persisted",
                                                    4: "local"}
