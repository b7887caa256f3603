"""Sessions: ``tests`` (the suite CI runs), ``lint`` (ruff + mypy), ``docs`` (the documentation
site), ``bench`` (benchmarks against the anchors, printed side by side), ``build`` (sdist and
wheel, checked, installed and smoke-tested)."""

from __future__ import annotations

import os
import shutil
import subprocess

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

# The CPU build of PyTorch (the test extra's torch>=2.4 would otherwise pull the newest
# release with several GB of CUDA packages); installed before the package so pip keeps it.
TORCH = "torch==2.13.0"


# The exhaustive harnesses: run in full on PYTHONS[0] only (see `tests`).
HARNESSES = ["tests/test_interleavings.py", "tests/test_crash.py"]

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


@nox.session(python=PYTHONS)
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
        # The exhaustive harnesses (every interleaving of the actors, every crash state)
        # explore the protocol's logic, which does not change with the Python version:
        # they run in full once, on the oldest Python, and the other Pythons run the rest
        # (CI's time budget: .ci/run runs 3.11 and 3.13).
        harnesses = [] if session.python == PYTHONS[0] else [f"--ignore={h}" for h in HARNESSES]
        session.run("pytest", "-q", "tests/test_integration_orbax.py")
        session.run("pytest", "-q", "--durations=25", "--ignore=tests/test_integration_orbax.py",
                    *harnesses)
    else:
        session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (style, imports, bugs) and mypy (types): the package under ``strict`` (set in
    pyproject.toml), and tests/typecheck, uses of the public API as a dependent writes
    them, whose ``assert_type`` checks fail if an annotation of the API changes."""
    session.install(TORCH)
    session.install("-e", ".[test]", "ruff>=0.5", "mypy>=1.10")
    session.run("ruff", "check", "atomicstore", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("mypy")
    session.run("mypy", "--strict", "tests/typecheck")


@nox.session
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


@nox.session(python="3.11", reuse_venv=False)
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


# The newest torch `pip install torch` gives this machine kind (PyPI's CUDA build, which
# runs every CPU op the tests use without a GPU): the other end of the declared range.
TORCH_NEWEST = "torch==2.14.1"


@nox.session(python="3.11")
def tests_torch_newest(session: nox.Session) -> None:
    """The torch integration's tests on the newest torch (``TORCH_NEWEST``): the suite's
    own torch is the oldest tested (``TORCH``), so both ends of the range run."""
    session.install(TORCH_NEWEST)
    session.install("-e", ".[test]")
    session.run("python", "-c", "import torch; assert torch.__version__.startswith('2.14.1'), torch.__version__")
    session.run("pytest", "-q", "tests/test_integration_torch.py", "tests/test_torch_contract.py", *session.posargs)
