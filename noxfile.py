"""Sessions: ``tests`` (the suite CI runs), ``lint`` (ruff + mypy), ``docs`` (the documentation
site), ``bench`` (benchmarks against the anchors, printed side by side), ``build`` (sdist and
wheel, checked, installed and smoke-tested)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

# The CPU build of PyTorch (the test extra's torch>=2.4 would otherwise pull the newest
# release with several GB of CUDA packages); installed before the package so pip keeps it.
TORCH = "torch==2.13.0"

# The sessions that only need a working environment (tests, lint, docs, build) install with
# uv when it is there (`pip install nox uv`, as the README and CI do), else with pip. On
# this 2-core machine uv installed the suite's environment in 18 s (69 s compiling its
# bytecode, below, beside other work), the same 116 packages at the same versions as pip,
# which took about 3 min in CI's run and 8.5 min (7.7 of them CPU) beside another job
# (2026-11-27). The dependency matrix too: the same resolution as pip's (the newest
# releases, or a cell's pins), and uv does not read this machine's cap on pip's torch, so
# the newest cell gets PyPI's newest torch, as a user's `pip install` does elsewhere.
FAST_VENV = "uv|virtualenv"
# pip finds this machine's CPU build of torch through its configuration (find-links
# /opt/wheels); uv reads no pip configuration, so it is told here. Without the directory
# uv takes PyPI's build, as pip would.
if Path("/opt/wheels").is_dir():
    os.environ.setdefault("UV_FIND_LINKS", "/opt/wheels")
# uv must use the machine's interpreters (pyenv's, below), never download one
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
# and compile bytecode at install, as pip does: uv does not by default, and where
# PYTHONDONTWRITEBYTECODE is set (this machine, CI) every process then compiled numpy, jax
# and torch from source at import (12.5 s and 11.8 s of CPU against 8.4 s and 5.0 s to
# import them, beside other work): the suite's multi-process tests took twice as long
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


# pytest-xdist workers of the suite's runs. Three on this 2-core machine: in two, the whole
# suite kept 155 % of its CPU busy (it waits on servers, child processes and leases), 30 min
# (2026-11-28).
WORKERS = "3"

# The Pythons the package supports (pyproject's requires-python and classifiers say the same).
PYTHONS = ["3.11", "3.12", "3.13"]
# A session whose Python is not on the machine fails instead of being skipped.
nox.options.error_on_missing_interpreters = True
# pyenv's shims (how this machine kind has 3.12 and 3.13) answer only for active versions,
# and nox finds interpreters through them: make the installed version of each supported
# Python active after the active ones (so `python3` stays what it was). A nox started
# through pyenv's shim already has PYENV_VERSION set to the one version it runs on.
if shutil.which("pyenv"):
    _pyenv = [subprocess.run(["pyenv", *args], capture_output=True, text=True).stdout.strip()
              for args in (["version-name"], *(["latest", v] for v in PYTHONS))]
    _active = (os.environ.get("PYENV_VERSION") or _pyenv[0]).split(":")
    os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys(v for v in [*_active, *_pyenv[1:]] if v))


@nox.session(python=PYTHONS, venv_backend=FAST_VENV)
def tests(session: nox.Session) -> None:
    """Install the package with its test extra and run the whole suite."""
    # torch==2.13.0 on every Python. On 3.11 pip takes the machine's local CPU build. For
    # 3.12/3.13 no CPU build can be had (only PyPI is reachable, and PyPI's Linux x86_64
    # wheels are CUDA builds), so it is PyPI's CUDA build with its nvidia-* packages: about
    # 1.9 GB to download, 4.7 GB installed, 1.5 min. It runs every CPU op the tests use
    # without a GPU. `--no-deps` without the nvidia-* packages does not work:
    # libtorch_cpu.so itself links libcudart.so.13 and libcupti.so.13, so `import torch`
    # fails (ImportError: libcudnn.so.9), checked on 2026-11-22.
    session.install(TORCH)
    session.install("-e", ".[test]")
    # The Orbax integration's tests run in a process of their own: in one process after
    # an earlier test had imported gcsfs, Orbax's epath/gcsfs client retried a GCS request
    # for minutes (gcsfs reads its HNS switch at first import; conftest.py now sets it
    # first). The split stays as a guard.
    if not session.posargs:
        # The slow tests (every interleaving of the actors, every crash state, the API
        # model, real multi-process jobs: `pytest -m slow`) and the runs on SeaweedFS
        # (`-m seaweed`: the same protocol against a real server) check the protocol's
        # logic and the server's behaviour, which do not change with the Python version:
        # they run once, on the oldest Python; the other Pythons run everything else. (CI
        # runs the whole suite once, on 3.11, and on 3.13 the newest cell of the dependency
        # matrix: `matrix(newest)`, the parts whose outcome depends on a version.)
        select = [] if session.python == PYTHONS[0] else ["-m", "not slow and not seaweed"]
        session.run("pytest", "-q", *select, "tests/integrations/test_integration_orbax.py")
        # Worker processes (pytest-xdist, WORKERS): run alone, the suite kept one of this
        # 2-core machine's cores busy (81% CPU: it waits on servers, child processes and
        # leases). `loadfile`: a worker takes a module whole, in
        # order (a harness's last test totals the others' counts; module fixtures start
        # once). Not `loadgroup`: with pytest 9.2 it silently stops grouping (xdist #1386).
        session.run("pytest", "-q", "-n", WORKERS, "--dist", "loadfile", "--durations=25",
                    "--ignore=tests/integrations/test_integration_orbax.py", *select)
    else:
        session.run("pytest", "-q", *session.posargs)


@nox.session(venv_backend=FAST_VENV)
def lint(session: nox.Session) -> None:
    """ruff (style, imports, bugs) and mypy (types): the package under ``strict`` (set in
    pyproject.toml), and tests/typecheck, uses of the public API as a dependent writes
    them, whose ``assert_type`` checks fail if an annotation of the API changes."""
    session.install(TORCH)
    session.install("-e", ".[test]", "ruff>=0.5", "mypy>=1.10")
    session.run("ruff", "check", "atomicstore", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("mypy")
    session.run("mypy", "--strict", "tests/typecheck")


@nox.session(venv_backend=FAST_VENV)
def docs(session: nox.Session) -> None:
    """The documentation site (MkDocs + Material, API reference by mkdocstrings) into
    site/, strict (a broken link or anchor fails), then a check that every public name
    is in the reference with its docstring. No jax/torch/orbax: griffe reads the source."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", env={"NO_MKDOCS_2_WARNING": "1"})
    session.run("python", "tools/check_docs_reference.py", "site")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against raw I/O and the anchor libraries; prints a table of ratios."""
    session.install(TORCH)
    session.install("-e", ".[test,bench]")
    session.run("python", "benchmarks/run.py", *session.posargs)


# What `build` runs in the installed wheel, from a directory outside the source tree.
_SMOKE = """
import importlib.metadata, importlib.resources, pathlib, sys, sysconfig
import numpy as np
import atomicstore

site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
assert pathlib.Path(atomicstore.__file__).resolve().is_relative_to(site), atomicstore.__file__
assert atomicstore.__version__ == importlib.metadata.version("atomicstore"), atomicstore.__version__
assert importlib.resources.files("atomicstore").joinpath("py.typed").is_file(), "no py.typed"
import atomicstore.compat.flax, atomicstore.compat.fjformer
import atomicstore.integrations.torch, atomicstore.integrations.orbax

state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 7, "name": "smoke"}
atomicstore.save(sys.argv[1] + "/step_7", state)
back = atomicstore.restore(sys.argv[1] + "/step_7", target=state)
assert (back["w"] == state["w"]).all() and back["step"] == 7 and back["name"] == "smoke"
assert atomicstore.open_store(sys.argv[1]).list() == ["step_7"]
print("atomicstore", atomicstore.__version__, "from", atomicstore.__file__, ": smoke test ok")
"""


@nox.session(python="3.11", reuse_venv=False, venv_backend=FAST_VENV)
def build(session: nox.Session) -> None:
    """Build the sdist and the wheel (from the sdist), check them (twine check --strict and
    their contents), install the wheel with its extras in this fresh venv and smoke-test it
    from outside the source tree. The artifacts are left in .nox/build/tmp/dist."""
    import tarfile
    import tempfile
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent
    tmp = Path(session.create_tmp()).resolve()
    dist = tmp / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.install("build>=1.2", "twine>=6.1")
    session.run("python", "-m", "build", "--outdir", str(dist), str(root))
    (sdist,) = dist.glob("atomicstore-*.tar.gz")
    (wheel,) = dist.glob("atomicstore-*.whl")
    session.run("twine", "check", "--strict", str(sdist), str(wheel))

    # the sdist: what a build from it needs, plus the changelog; the test suite left out
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        in_sdist = {n.removeprefix(top + "/") for n in tar.getnames()}
    wanted = {"PKG-INFO", "pyproject.toml", "README.md", "CHANGELOG.md",
              "atomicstore/__init__.py", "atomicstore/py.typed", "atomicstore/cli.py"}
    wanted |= {p.name for p in root.glob("LICEN[CS]E*")}
    if missing := sorted(wanted - in_sdist):
        session.error(f"missing from {sdist.name}: {missing}")
    if extra := sorted(n for n in in_sdist if n.split("/")[0] in {"tests", "benchmarks", "examples"}):
        session.error(f"{sdist.name} has the test suite, benchmarks or examples: {extra[:5]}")
    if not any(n.startswith("LICEN") for n in in_sdist):
        session.error("no LICENSE in the sdist: Apache-2.0 asks for its text to go with it")
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
    if "atomicstore/py.typed" not in in_wheel or any(n.startswith("tests/") for n in in_wheel):
        session.error(f"{wheel.name}: no atomicstore/py.typed, or tests/ in it")

    # install the wheel (never the tree), the CPU build of torch first so that the torch
    # extra keeps it; every extra a user can name must resolve and import
    session.install(TORCH)
    session.install(f"{wheel}[s3,gcs,jax]")
    session.install(f"{wheel}[torch,orbax]")
    work = Path(tempfile.mkdtemp(prefix="atomicstore-smoke-"))  # outside the source tree
    with session.chdir(work):
        session.run("atomicstore", "--help", silent=True)
        session.run("python", "-c", _SMOKE, str(work / "ckpts"))
        session.run("atomicstore", "verify", str(work / "ckpts" / "step_7"))
        # the preemption demo: a JAX training child killed with SIGKILL mid-save, recovered
        session.run("atomicstore", "demo", env={"TMPDIR": str(work)})
    shutil.rmtree(work)


# The dependency matrix (docs/dependencies.md): the parts of the suite whose outcome depends
# on a dependency's version, run against the lowest versions pyproject.toml declares (on
# the oldest supported Python) and against the newest releases (on the newest one).
MATRIX_TESTS = {
    # torch DCP through the integration, 2 gloo ranks
    "torch": ["tests/integrations/test_integration_torch.py"],
    # the integration's contract in one process; needs DCP's stream extensions (torch>=2.7)
    "torch_contract": ["tests/integrations/test_torch_contract.py"],
    "flax": ["tests/compat/test_compat_flax.py", "tests/compat/test_compat_fjformer.py"],
    # real 2-process jax jobs (marked slow; named here, so they run)
    "multihost": ["tests/system/test_multihost.py", "tests/system/test_multihost_tiers.py"],
    # tiered checkpoints: uploads through the drivers, jax.monitoring events
    "tiers": ["tests/manager/test_tiers.py"],
    # round trips of every dtype (bfloat16, float8, ...), jax targets, sharded arrays
    "pytree": ["tests/pytree/test_pytree.py", "tests/pytree/test_pytree_entry_points.py", "tests/pytree/test_pytree_hostile.py",
               "tests/pytree/test_pytree_jax_targets.py", "tests/pytree/test_sharded_format.py"],
    # the drivers' protocol and the shipped driver contract over fsspec/s3fs/gcsfs/botocore
    # against the servers (-k below), and in a forked child (fsspec < 2025.3.1 keeps its
    # parent's event loop there)
    "drivers": ["tests/commit/test_protocol.py", "tests/drivers/test_drivers.py", "tests/drivers/test_parallel_io.py",
                "tests/drivers/test_fork_drivers.py", "tests/drivers/test_contract.py"],
    # Orbax in a process of its own (see `tests`)
    "orbax": ["tests/integrations/test_integration_orbax.py"],
}
# Left out of every cell (measured with --durations: half the tests' time, and nothing in
# them varies with a dependency): the crash-state enumeration of the one-file commit (a
# simulated POSIX/store model; the suite runs it in full) and the SeaweedFS cases (another
# S3 server, not another client: moto's cases cover s3fs/botocore).
_MATRIX_K = "not every_crash_point and not seaweed"
_DRIVERS_K = "s3 or gcs"


def _ran_from(file: str, classnames: set[str]) -> bool:
    """Whether a JUnit report's test classnames hold a test of ``file`` (a path under tests/)."""
    mod = ".".join(Path(file).with_suffix("").parts)
    return any(cn == mod or cn.startswith(mod + ".") for cn in classnames)


def _matrix_runs(groups: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The pytest runs of a cell, each named, with the groups it holds: ``drivers`` alone
    (its own ``-k``), ``orbax`` alone (a process of its own, see `tests`), every other group
    together in one run of WORKERS workers (one pytest per group left a core idle: 838 s of
    tests in matrix(newest), one after another)."""
    runs: dict[str, tuple[str, ...]] = {}
    rest = tuple(g for g in groups if g not in ("drivers", "orbax"))
    if rest:
        runs["+".join(rest)] = rest
    for alone in ("drivers", "orbax"):
        if alone in groups:
            runs[alone] = (alone,)
    return runs


class Cell(NamedTuple):
    """One cell of the matrix: what it installs and which MATRIX_TESTS groups it runs."""

    python: str
    extras: str  # the user extras installed besides the runtime dependencies
    lowest: bool  # every declared lower bound pinned (else the newest releases)
    groups: tuple[str, ...]
    # pinned too, from the test extra: flax (the compat modules' library) and boto3 (pip
    # backtracks through hundreds of boto3 releases to find the one of a pinned botocore)
    also: tuple[str, ...] = ("flax", "boto3")
    # pins above a declared lower bound that another lower bound of the cell forces
    raised: tuple[str, ...] = ()


MATRIX = {
    # orbax-checkpoint's only supported release (0.12.8) needs jax>=0.6.0, so jax 0.4.30
    # and Orbax cannot be installed together: `lowest` has no orbax extra (flax 0.10.0
    # brings its own old Orbax, which only flax uses) and `lowest-orbax` tests the orbax
    # extra at its lower bound with the jax it forces.
    "lowest": Cell(PYTHONS[0], "s3,gcs,jax,torch", True, ("torch", "flax", "multihost", "pytree", "drivers", "tiers")),
    "lowest-orbax": Cell(
        PYTHONS[0], "s3,gcs,jax,orbax", True, ("orbax",), also=("boto3",),
        # orbax-checkpoint 0.12.8 requires jax>=0.6.0, and jax 0.6.0 ml_dtypes>=0.5.0
        raised=("jax==0.6.0", "ml_dtypes==0.5.0")),
    "newest": Cell(PYTHONS[-1], "s3,gcs,jax,torch,orbax", False, tuple(MATRIX_TESTS)),
}
#: what the summary row names (pip freeze of the cell gives the rest)
_MATRIX_SHOWN = ["torch", "jax", "jaxlib", "flax", "orbax-checkpoint", "numpy", "ml-dtypes", "fsspec",
                 "s3fs", "gcsfs", "botocore", "aiobotocore", "isal", "msgpack", "tenacity", "google-crc32c"]


def _lowest_constraints() -> Any:
    """tools/lowest_constraints.py, imported (standard library only)."""
    spec = importlib.util.spec_from_file_location(
        "lowest_constraints", Path(__file__).resolve().parent / "tools" / "lowest_constraints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# pip freeze without pip (a uv environment has none): name==version of every distribution
_FREEZE = ("import importlib.metadata as m\n"
           "print('\\n'.join(sorted(f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions())))")


@nox.session(venv_backend=FAST_VENV)
@nox.parametrize(("python", "cell"), [(c.python, name) for name, c in MATRIX.items()], ids=list(MATRIX))
def matrix(session: nox.Session, cell: str) -> None:
    """One cell of the dependency matrix (docs/dependencies.md): install the lowest declared
    versions (``lowest``, ``lowest-orbax``) or the newest releases (``newest``), check what
    got installed, run the cell's tests and print its row of the table. Extra arguments go
    to every pytest run (e.g. ``-x``)."""
    import xml.etree.ElementTree as ET

    from packaging.version import Version

    c = MATRIX[cell]
    lc = _lowest_constraints()
    tmp = Path(session.create_tmp()).resolve()
    started = time.monotonic()
    # No cache: a cell's wheels (PyPI's CUDA build of torch among them, about 2 GB) are used
    # once; kept in a cache they would double the cell's footprint on a shared disk.
    uv = session.venv_backend == "uv"
    packages = ["--no-cache" if uv else "--no-cache-dir", "-e", f".[{c.extras}]", *c.also,
                *lc.tool_requirements()]
    if c.lowest:
        pins = lc.lowest(c.extras.split(","), list(c.also), list(c.raised))
        constraints = tmp / "lowest-constraints.txt"
        constraints.write_text("".join(f"{k}=={v}\n" for k, v in sorted(pins.items())))
        session.install("-c", str(constraints), *packages)
    else:
        pins = {}
        # the newest release of everything (uv's --upgrade upgrades every package, as pip's
        # eager strategy does in an environment reused from an earlier run)
        session.install("--upgrade", *([] if uv else ["--upgrade-strategy", "eager"]), *packages)
    freeze_text = session.run("python", "-c", _FREEZE, silent=True) or ""
    (tmp / "freeze.txt").write_text(freeze_text)
    freeze = {}
    for line in freeze_text.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            freeze[re.sub(r"[-_.]+", "-", name).lower()] = version.split("+")[0]
    wrong = {k: (v, freeze.get(k)) for k, v in pins.items()
             if k not in freeze or Version(freeze[k]) != Version(v)}
    if wrong:
        session.error(f"installed versions differ from the pins (pin, installed): {wrong}")
    installed = time.monotonic() - started

    # each test once, passed unless one of its reports failed, errored or skipped (JUnit gives
    # a test that errors in teardown a second <testcase>: counting <testsuite> totals made a
    # single such test "1/2")
    passed_by_test: dict[tuple[str, str, str], bool] = {}
    failed, unreported = [], []
    for run, groups in _matrix_runs(c.groups).items():  # every run runs, whatever an earlier gave
        report = tmp / f"junit-{run}.xml"
        report.unlink(missing_ok=True)
        files = [f for g in groups for f in MATRIX_TESTS[g]]
        args = ["-p", "no:cacheprovider", "--durations=10", f"--junitxml={report}", *files]
        args += ["-k", f"({_DRIVERS_K}) and {_MATRIX_K}" if run == "drivers" else _MATRIX_K]
        if len(files) > 1:  # WORKERS workers, a module whole to one (as in `tests`)
            args += ["-n", WORKERS, "--dist", "loadfile"]
        try:
            session.run("pytest", "-q", *args, *session.posargs)
            run_failed = False
        except nox.command.CommandFailed:
            run_failed = True
        if report.exists():
            cases = list(ET.parse(report).getroot().iter("testcase"))
            for group in groups:
                # a test's classname is its file's dotted path, then its class if any
                # (tests.drivers.test_contract.TestS3DriverOnMoto)
                mine = [c for c in cases if any(_ran_from(f, {c.get("classname", "")})
                                                for f in MATRIX_TESTS[group])]
                for case in mine:
                    key = (group, case.get("classname", ""), case.get("name", ""))
                    bad = any(child.tag in ("failure", "error", "skipped") for child in case)
                    passed_by_test[key] = passed_by_test.get(key, True) and not bad
                    if bad and group not in failed:
                        failed.append(group)
                # a file of the group that ran no test (all deselected or skipped at import) is
                # a failure too: pytest's own "no tests" exit code sees only the whole run
                ran = {c.get("classname", "") for c in mine}
                empty = [f for f in MATRIX_TESTS[group] if not _ran_from(f, ran)]
                skipped = [c.get("name") for c in mine if c.find("skipped") is not None]
                if empty or skipped:  # and a skipped test is no pass either
                    session.warn(f"matrix({cell}) {group}: no test ran from {empty}; skipped: {skipped[:5]}")
                    if group not in failed:
                        failed.append(group)
            if run_failed and not any(g in failed for g in groups):
                failed += list(groups)  # pytest failed outside any test (collection, a crash)
        else:  # pytest died before writing it: the row says so
            unreported += list(groups)
            failed += [g for g in groups if run_failed and g not in failed]
    passed, total = sum(passed_by_test.values()), len(passed_by_test)
    no_report = f" (no report from {', '.join(unreported)})" if unreported else ""
    tests_time = time.monotonic() - started - installed
    versions = ", ".join(f"{k} {freeze[k]}" for k in _MATRIX_SHOWN if k in freeze)
    session.log(f"matrix row: | {cell} | {session.python} | {versions} | {', '.join(c.groups)} | "
                f"{passed}/{total}{no_report} | install {installed:.0f} s + tests {tests_time:.0f} s |")
    if failed:
        session.error(f"matrix({cell}): failures in {', '.join(failed)} (pip freeze: {tmp / 'freeze.txt'})")
