"""docs/dependencies.md states what pyproject.toml declares: the range of every dependency a
user installs (runtime and the user extras, plus flax, which the compat modules serve), and
a lowest cell of the matrix that installed each declared lower bound. Raising a bound in
pyproject.toml without rerunning ``nox -s matrix`` and updating the page fails here.

Also the generator of the lowest cells' constraints (tools/lowest_constraints.py)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "dependencies.md"

_spec = importlib.util.spec_from_file_location("lowest_constraints", ROOT / "tools" / "lowest_constraints.py")
assert _spec is not None and _spec.loader is not None
lc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = lc
_spec.loader.exec_module(lc)

ROW = re.compile(r"^\|(.*)\|\s*$")


def table(heading: str) -> list[list[str]]:
    """The body rows of the first table under ``## heading`` of docs/dependencies.md."""
    text = DOC.read_text()
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/dependencies.md has no section {heading!r}"
    rows = [[c.strip() for c in r.group(1).split("|")] for line in m.group(1).splitlines()
            if (r := ROW.match(line))]
    assert len(rows) > 2 and set(rows[1][0]) <= set("-: "), f"no table under {heading!r}"
    return rows[2:]


def declared() -> dict[str, tuple[str, str]]:
    """normal name -> (range, needed by) as pyproject.toml declares them, in the doc's words."""
    groups = lc.declared()
    out = {}
    for group in ("dependencies", *lc.USER_EXTRAS):
        for r in groups[group]:
            out[r.key] = (r.spec, "always" if group == "dependencies" else f"[{group}]")
    for r in groups["test"]:
        if r.key in lc.COMPAT_LIBRARIES:
            out[r.key] = (r.spec, "compat")
    return out


def unticked(cell: str) -> str:
    return cell.replace("`", "").strip()


def documented() -> dict[str, tuple[str, str, str]]:
    """normal name -> (range, needed by, lowest tested) from the page's range table."""
    out = {}
    for row in table("Supported ranges"):
        name, spec, needed, lowest = (unticked(c) for c in row[:4])
        if name != "Python":
            out[lc.normalize(name)] = (spec, needed.split()[0], lowest)
    return out


def test_the_ranges_table_is_what_pyproject_declares():
    want = declared()
    got = documented()
    assert {k: v[:2] for k, v in got.items()} == want
    python = {unticked(r[0]): unticked(r[1]) for r in table("Supported ranges")}["Python"]
    assert python == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]


def test_every_lower_bound_is_the_lowest_tested_and_a_lowest_cell_installed_it():
    lows = {k: lc.parse(f"{k}{spec}").lower for k, (spec, _) in declared().items()}
    assert all(lows.values()), lows
    got = documented()
    for name, low in lows.items():
        assert name in got, f"docs/dependencies.md has no row for {name}"
        assert Version(got[name][2].split()[0]) == Version(low), (name, got[name][2], low)  # (notes after it)
    installed: dict[str, set[Version]] = {}
    for row in table("The matrix"):
        if row[0].strip("`").startswith("lowest"):
            for name, version in re.findall(r"([A-Za-z0-9_.-]+) ([0-9][^,;\s]*)", row[2]):
                installed.setdefault(lc.normalize(name), set()).add(Version(version))
    missing = {k: v for k, v in lows.items() if Version(v) not in installed.get(k, set())}
    assert not missing, f"no lowest cell of docs/dependencies.md installed these lower bounds: {missing}"


def test_the_generator_pins_each_lower_bound_and_raises_only_what_it_is_told(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "pkg"\ndependencies = ["numpy>=1.26", "ml_dtypes>=0.4"]\n'
        '[project.optional-dependencies]\n'
        's3 = ["s3fs>=2024.6.0", "botocore>=1.35.74"]\ngcs = []\njax = ["jax>=0.4.30"]\ntorch = []\n'
        'orbax = ["orbax-checkpoint>=0.12.8,<0.13"]\n'
        'test = ["pytest>=8", "moto[server,s3]>=5.2.5", "s3fs>=2026.9.0", "flax>=0.10", "boto3>=1.35.74"]\n'
        'all = ["pkg[s3,test]"]\n')
    assert lc.lowest(["jax", "orbax"], [], ["jax==0.6.0", "ml_dtypes==0.5.0"], pyproject) == {
        "numpy": "1.26", "ml-dtypes": "0.5.0", "jax": "0.6.0", "orbax-checkpoint": "0.12.8"}
    assert lc.lowest(["s3"], ["flax", "boto3"], [], pyproject) == {
        "numpy": "1.26", "ml-dtypes": "0.4", "s3fs": "2024.6.0", "botocore": "1.35.74", "flax": "0.10",
        "boto3": "1.35.74"}
    # the test tools keep their own bounds; the package's dependencies and flax are left out
    assert lc.tool_requirements(pyproject) == ["pytest>=8", "moto[server,s3]>=5.2.5", "boto3>=1.35.74"]
    for bad in (["torch==2.4"], ["jax>=0.6"], ["jax"]):  # not pinned, or not NAME==V
        with pytest.raises(ValueError, match="--raise"):
            lc.lowest(["jax"], [], bad, pyproject)
    with pytest.raises(ValueError, match="no extra 'nope'"):
        lc.lowest(["nope"], [], [], pyproject)
    with pytest.raises(ValueError, match="does not declare 'torch'"):
        lc.lowest([], ["torch"], [], pyproject)
    with pytest.raises(ValueError, match="cannot parse"):
        lc.parse("jax >= 0.4.30 and more")


def test_the_generator_runs_as_a_script_on_the_real_pyproject(tmp_path):
    out = tmp_path / "c.txt"
    subprocess.run([sys.executable, str(ROOT / "tools" / "lowest_constraints.py"), "--extras", "s3,gcs,jax,torch",
                    "--also", "flax", "-o", str(out)], check=True)
    pins = dict(line.split("==") for line in out.read_text().split())
    assert pins["jax"] == "0.4.30" and "orbax-checkpoint" not in pins and "flax" in pins
    assert set(pins) == {k for k, (_, needed) in declared().items() if needed not in ("[orbax]",)}
