"""A third-party driver, registered through the ``atomicstore.drivers`` entry point only,
passes the shipped driver contract (acceptance 3 of issue 24).

The toy driver (tests/drivers/toy/toy_atomicstore_driver) is installed into a fresh
directory with a ``.dist-info`` naming its entry point, and its test file (a subclass of
:class:`atomicstore.testing.DriverContract`) runs in a pytest process of its own, with
neither this suite's conftest nor any registration but the entry point.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import atomicstore
from atomicstore.drivers import ENTRY_POINT_GROUP
from atomicstore.testing import DriverContract

TOY = Path(__file__).with_name("toy")
PACKAGE = "toy_atomicstore_driver"
#: the tree whose atomicstore this suite runs (first on the child's path)
SOURCE_ROOT = Path(atomicstore.__file__).resolve().parent.parent


def install_toy(site: Path, *, entry_point: bool) -> None:
    """Put the toy package in ``site`` (a directory for PYTHONPATH), with its
    ``.dist-info`` and entry point if ``entry_point``."""
    shutil.copytree(TOY / PACKAGE, site / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    if entry_point:
        dist = site / f"{PACKAGE}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-atomicstore-driver\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = {PACKAGE}:ToyDriver\n")


def child_env(site: Path) -> dict[str, str]:
    """This environment, with this tree's atomicstore and then ``site`` first on the path,
    and no pytest settings of the parent run (xdist workers, addopts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SOURCE_ROOT), str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    return env


def contract_cases() -> int:
    """How many test methods the contract holds (each runs once or more)."""
    return len([n for n in dir(DriverContract) if n.startswith("test_")])


def test_the_toy_package_registers_nothing_itself():
    source = (TOY / PACKAGE / "__init__.py").read_text()
    assert "register_driver" not in source and "entry_points" not in source


def test_without_its_entry_point_the_toy_protocol_is_unknown(tmp_path):
    """Importing the package registers nothing: only the entry point makes toy:// known."""
    install_toy(tmp_path / "site", entry_point=False)
    code = textwrap.dedent(f"""
        import {PACKAGE}, atomicstore
        try:
            atomicstore.open_store("toy://bucket")
        except atomicstore.UnknownProtocolError:
            print("unknown")
    """)
    out = subprocess.run([sys.executable, "-c", code], env=child_env(tmp_path / "site"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "unknown", out.stdout + out.stderr


def test_a_driver_registered_through_its_entry_point_passes_the_contract(tmp_path):
    site, run = tmp_path / "site", tmp_path / "run"
    install_toy(site, entry_point=True)
    run.mkdir()
    shutil.copy(TOY / "toy_driver_tests.py", run / "test_toy_driver.py")
    (run / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "junit.xml"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(run / "pytest.ini"),
         "--rootdir", str(run), f"--junitxml={report}", str(run / "test_toy_driver.py")],
        env=child_env(site), cwd=run, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    suites = ET.parse(report).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts
    cases = suite.findall("testcase")
    passed = [c for c in cases if not list(c)]  # (no failure, error or skipped child)
    contract = [c for c in passed if c.get("classname", "").endswith("TestToyDriver")]
    assert len(contract) >= contract_cases() >= 30, (len(contract), contract_cases())
    assert any(c.get("name") == "test_the_driver_comes_from_its_entry_point" for c in passed)
    assert len(passed) == counts["tests"]
