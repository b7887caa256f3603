"""The lower bounds pyproject.toml declares, as a pip constraints file: what the ``lowest``
cells of ``nox -s matrix`` install (every declared lower bound pinned with ``==``).

    python tools/lowest_constraints.py --extras s3,gcs,jax,torch --also flax
    python tools/lowest_constraints.py --extras s3,gcs,jax,orbax --raise jax==0.6.0

``--extras`` names the optional-dependency groups to take besides the runtime
``dependencies``; ``--also NAME`` takes NAME's bound from the ``test`` extra (a library the
compat modules serve that no user extra declares, e.g. flax); ``--raise NAME==V`` pins NAME
higher than its declared lower bound, where another lower bound of the same cell needs it
(say why where it is used). ``--tools`` prints instead the test extra less every package the
package itself declares: the test tools, installed without the suite's own floors.

Standard library only (tests/system/test_dependencies.py imports it, and any Python runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
#: the optional-dependency groups a user installs (the others are the project's own tools)
USER_EXTRAS = ("s3", "gcs", "jax", "torch", "orbax")
#: libraries the compat modules serve that only the test extra declares (no user extra
#: installs them: a user of atomicstore.compat.flax has flax already)
COMPAT_LIBRARIES = ("flax",)

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(?:;.*)?$")
_SPEC = re.compile(r"^\s*(===|==|~=|!=|<=|>=|<|>)\s*([A-Za-z0-9.*+!_-]+)\s*$")


def normalize(name: str) -> str:
    """PEP 503's normal form of a distribution name (``ml_dtypes`` -> ``ml-dtypes``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Requirement:
    """One requirement string of pyproject.toml: name, extras and version specifiers."""

    name: str
    extras: str
    specifiers: tuple[tuple[str, str], ...]

    @property
    def key(self) -> str:
        return normalize(self.name)

    @property
    def spec(self) -> str:
        """The specifiers as declared, comma-separated (``>=0.12.8,<0.13``)."""
        return ",".join(op + v for op, v in self.specifiers)

    @property
    def lower(self) -> str | None:
        """The declared lower bound (``>=``, ``==`` or ``~=``), if any."""
        for op, v in self.specifiers:
            if op in (">=", "==", "~=", "==="):
                return v
        return None


def parse(text: str) -> Requirement:
    """Parse a requirement string of the simple forms pyproject.toml uses."""
    m = _REQ.match(text)
    if not m:
        raise ValueError(f"cannot parse the requirement {text!r}")
    name, extras, rest = m.group(1), m.group(2) or "", m.group(3)
    specs = []
    for part in filter(None, (p.strip() for p in rest.split(","))):
        s = _SPEC.match(part)
        if not s:
            raise ValueError(f"cannot parse the version specifier {part!r} of {text!r}")
        specs.append((s.group(1), s.group(2)))
    return Requirement(name, extras, tuple(specs))


def declared(pyproject: Path = PYPROJECT) -> dict[str, list[Requirement]]:
    """Every requirement of pyproject.toml by group: ``dependencies`` and each extra
    (a self-reference such as ``atomicstore[...]`` left out)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = {"dependencies": project.get("dependencies", [])}
    groups.update(project.get("optional-dependencies", {}))
    own = normalize(project["name"])
    return {g: [r for r in map(parse, reqs) if r.key != own] for g, reqs in groups.items()}


def user_requirements(pyproject: Path = PYPROJECT) -> dict[str, Requirement]:
    """What a user of the package installs: the runtime dependencies and the user extras,
    by normal name (one requirement per name: the extras never repeat one)."""
    groups = declared(pyproject)
    out: dict[str, Requirement] = {}
    for group in ("dependencies", *USER_EXTRAS):
        for r in groups[group]:
            if r.key in out and out[r.key].spec != r.spec:
                raise ValueError(f"{r.name} is declared twice with different ranges")
            out[r.key] = r
    return out


def lowest(extras: list[str], also: list[str], raised: list[str],
           pyproject: Path = PYPROJECT) -> dict[str, str]:
    """Name -> version: the lower bound of every runtime dependency, of every requirement
    of ``extras`` and of the ``also`` names of the test extra, with ``raised`` pins
    (``NAME==V``) replacing the declared bound of NAME."""
    groups = declared(pyproject)
    reqs = list(groups["dependencies"])
    for extra in extras:
        if extra not in groups:
            raise ValueError(f"pyproject.toml has no extra {extra!r}")
        reqs += groups[extra]
    test = {r.key: r for r in groups.get("test", [])}
    for name in also:
        if normalize(name) not in test:
            raise ValueError(f"the test extra does not declare {name!r}")
        reqs.append(test[normalize(name)])
    pins: dict[str, str] = {}
    for r in reqs:
        if r.lower is None:
            raise ValueError(f"{r.name} declares no lower bound: nothing to pin")
        pins[r.key] = r.lower
    for text in raised:
        r = parse(text)
        if r.key not in pins or len(r.specifiers) != 1 or r.specifiers[0][0] != "==":
            raise ValueError(f"--raise takes NAME==VERSION of a pinned name, not {text!r}")
        pins[r.key] = r.specifiers[0][1]
    return pins


def tool_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The test extra less every package a user installs (the runtime dependencies and the
    user extras) and less :data:`COMPAT_LIBRARIES` (a cell installs those itself): pytest,
    the servers, hypothesis, ... with their own bounds."""
    groups = declared(pyproject)
    package = set(user_requirements(pyproject)) | set(COMPAT_LIBRARIES)
    return [f"{r.name}{r.extras}{r.spec}" for r in groups.get("test", []) if r.key not in package]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extras", default="", help="comma-separated extras besides the runtime dependencies")
    ap.add_argument("--also", action="append", default=[], help="a library of the test extra to pin")
    ap.add_argument("--raise", dest="raised", action="append", default=[], help="NAME==VERSION")
    ap.add_argument("--tools", action="store_true", help="print the test tools instead")
    ap.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    args = ap.parse_args(argv)
    if args.tools:
        lines = tool_requirements()
    else:
        extras = [e for e in args.extras.split(",") if e]
        lines = [f"{k}=={v}" for k, v in sorted(lowest(extras, args.also, args.raised).items())]
    text = "\n".join(lines) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
