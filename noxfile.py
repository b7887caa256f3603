"""Sessions: ``tests`` (the suite CI runs), ``lint`` (ruff + mypy), ``bench`` (benchmarks
against the anchors, printed side by side)."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

# The CPU build of PyTorch (the test extra's torch>=2.4 would otherwise pull the newest
# release with several GB of CUDA packages); installed before the package so pip keeps it.
TORCH = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    """Install the package with its test extra and run the whole suite."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    # The Orbax integration's tests run in a process of their own: in one process after
    # tests/test_faults.py's stalled object-store requests, Orbax's epath/gcsfs client
    # waits forever in its first GCS request (not yet understood; the tests pass alone).
    if not session.posargs:
        session.run("pytest", "-q", "tests/test_integration_orbax.py")
        session.run("pytest", "-q", "--ignore=tests/test_integration_orbax.py")
    else:
        session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (style, imports, bugs) and mypy (types) over the package."""
    session.install(TORCH)
    session.install("-e", ".[test]", "ruff>=0.5", "mypy>=1.10")
    session.run("ruff", "check", "atomicstore", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against raw I/O and the anchor libraries; prints a table of ratios."""
    session.install(TORCH)
    session.install("-e", ".[test,bench]")
    session.run("python", "benchmarks/run.py", *session.posargs)
