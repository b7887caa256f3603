"""Check that the built documentation site documents the whole public API.

    python tools/check_docs_reference.py SITE_DIR

The public API is ``atomicstore.__all__`` plus the public names of the modules in
``MODULES`` (their ``__all__``, or for a module without one its top-level classes,
functions and constants whose names do not start with ``_``), and the public methods of
the classes in ``atomicstore.__all__``. Each must have a heading in the API reference of
the site built by ``mkdocs build`` (the anchor mkdocstrings gives it: ``atomicstore.Store``,
``atomicstore.integrations.torch.load``) followed by a non-empty docstring. The names are
read from the source with ``ast`` (so torch, orbax or moto need not be installed); a
module that does import is also checked to export what its source says. Exits 1 with
the list of what is missing. Run by ``nox -s docs`` after the build.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = [
    "atomicstore",
    "atomicstore.integrations.torch",
    "atomicstore.integrations.orbax",
    "atomicstore.compat.flax",
    "atomicstore.compat.fjformer",
    "atomicstore.testing.servers",
    "atomicstore.testing.faults",
    "atomicstore.testing.gcsfake",
]
#: classes of these modules' ``__all__`` must also document their public methods
METHODS_OF = ["atomicstore"]


def source_of(module: str) -> Path:
    path = ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def public_names(module: str) -> list[str]:
    """``__all__`` as written in the module's source, else its public top-level names."""
    tree = ast.parse(source_of(module).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_")]


def public_methods(cls: type) -> list[str]:
    """Methods and properties a class defines itself (not inherited), not starting with _."""
    return [n for n, v in vars(cls).items() if not n.startswith("_")
            and (inspect.isfunction(v) or isinstance(v, classmethod | staticmethod | property))]


class Reference(HTMLParser):
    """The docstring text under each mkdocstrings heading: ``{anchor: text}``.

    mkdocstrings renders an object as a heading (``class="doc doc-heading"``, the anchor
    in ``id``), an optional signature, then ``<div class="doc doc-contents">`` holding
    the docstring followed by the members (``doc-children``). Only the text outside the
    members, the base classes line and the signature counts."""

    SKIP = ("doc-children", "doc-class-bases", "doc-signature")

    def __init__(self) -> None:
        super().__init__()
        self.docs: dict[str, str] = {}
        self._pending: str | None = None  # a heading whose contents have not begun
        self._stack: list[tuple[str, str | None]] = []  # (tag, owner anchor or "" to skip)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        anchor = a.get("id")
        if "doc-heading" in classes and anchor:
            self._pending = anchor
            self.docs.setdefault(anchor, "")
        if tag not in ("div", "p"):
            return
        owner: str | None = None
        if "doc-contents" in classes and self._pending is not None:
            owner, self._pending = self._pending, None
        elif any(c in classes for c in self.SKIP):
            owner = ""
        self._stack.append((tag, owner))

    def handle_endtag(self, tag: str) -> None:
        if tag in ("div", "p"):
            while self._stack:
                if self._stack.pop()[0] == tag:
                    break

    def handle_data(self, data: str) -> None:
        for _, owner in reversed(self._stack):
            if owner is not None:
                if owner:
                    self.docs[owner] += data
                return


def main(site: Path) -> int:
    pages = sorted((site / "reference").rglob("*.html"))
    if not pages:
        print(f"no API reference under {site / 'reference'}: build the site first")
        return 1
    ref = Reference()
    for page in pages:
        ref.feed(page.read_text())
    expected: list[str] = []
    problems: list[str] = []
    for module in MODULES:
        names = public_names(module)
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # the docs session installs neither torch nor orbax
            print(f"{module}: not importable here ({exc.name or exc}), names read from the source")
            mod = None
        if mod is not None and hasattr(mod, "__all__") and sorted(mod.__all__) != sorted(names):
            problems.append(f"{module}: __all__ at run time differs from the source's")
        expected += [f"{module}.{n}" for n in names]
        if module in METHODS_OF and mod is not None:
            for n in names:
                obj = getattr(mod, n)
                if inspect.isclass(obj):
                    expected += [f"{module}.{n}.{m}" for m in public_methods(obj)]
    for anchor in expected:
        if anchor not in ref.docs:
            problems.append(f"{anchor}: not in the API reference")
        elif not ref.docs[anchor].strip():
            problems.append(f"{anchor}: in the API reference without a docstring")
    if problems:
        print(f"{len(problems)} public name(s) not documented in {site}:")
        print("\n".join(f"  {p}" for p in problems))
        return 1
    print(f"API reference complete: {len(expected)} public names and methods documented "
          f"({len(pages)} pages)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
