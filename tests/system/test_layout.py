"""The package's layering, checked from the source: imports point one way.

drivers <- commit <- pytree <- manager <- compat (and the cli/demo on top). Nothing
imports ``compat``; no module imports a private name of another module; the module
import graph (including imports inside functions and imports for type checkers only)
has no cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import parse_python

PKG = Path(__file__).resolve().parents[2] / "atomicstore"
LAYER = {"drivers": 0, "retry": 0, "errors": 0, "commit": 1, "pytree": 2, "manager": 3, "compat": 4,
         "integrations": 4, "testing": 4, "tiers": 3, "cli": 5, "demo": 5, "__main__": 6, "__init__": 6}


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported module, names imported from it) for every import in ``path``."""
    # imports for type checkers only (``if TYPE_CHECKING:``) count like any other: a
    # type-only back-reference is still a dependency pointing up or across
    tree = parse_python(path)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [a.name for a in node.names]
            for n in names:  # "from . import x" imports module x
                if f"{mod}.{n}" in known:
                    found.append((f"{mod}.{n}", []))
            found.append((mod, names))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return [(m, ns) for m, ns in found if m in known]


def graph() -> dict[str, list[tuple[str, list[str]]]]:
    mods = modules()
    return {n: imports(n, p, set(mods)) for n, p in mods.items()}


def layer(mod: str) -> int:
    parts = mod.split(".")
    return LAYER[parts[1]] if len(parts) > 1 else LAYER["__init__"]


def test_nothing_imports_compat_and_imports_point_down():
    for mod, deps in graph().items():
        for dep, _ in deps:
            if dep == "atomicstore" or mod.split(".")[1:2] == dep.split(".")[1:2]:
                continue  # the package root (for __version__) and siblings in one layer
            for top in (".compat", ".integrations"):  # on top: nothing else imports them
                if top in dep:
                    assert top in mod, f"{mod} imports {dep}"
            assert layer(dep) <= layer(mod), f"{mod} (layer {layer(mod)}) imports {dep} (layer {layer(dep)})"


def test_no_module_imports_a_private_name_of_another():
    for mod, deps in graph().items():
        for dep, names in deps:
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            assert not private, f"{mod} imports private {private} from {dep}"


def test_no_import_cycle():
    g = {m: {d for d, _ in deps if d != m and d != "atomicstore"} for m, deps in graph().items()}
    # a package imports its submodules from __init__; only cycles between modules count
    g = {m: {d for d in ds if not m.startswith(d + ".") and not d.startswith(m + ".")} for m, ds in g.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert len(state) > 30  # the whole package was walked


def test_the_pytree_layer_has_one_module_per_concern():
    names = {p.stem for p in (PKG / "pytree").glob("*.py")}
    assert {"format", "writer", "reader", "sharded", "coordination"} <= names
    assert "api" not in names
    assert not (PKG / "multiprocess.py").exists()


def test_commit_modules_stay_readable():
    """No module of the commit layer grows past ~700 lines (split it by job instead)."""
    long = {p.name: n for p in (PKG / "commit").glob("*.py") if (n := len(p.read_text().splitlines())) > 700}
    assert not long, f"commit/ modules over 700 lines: {long}"


def test_recovery_does_not_ask_which_strategy_it_faces():
    """Recovery works through the strategy's own classification of its layout: it never
    checks which strategy class it was given."""
    tree = parse_python(PKG / "commit" / "recovery.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            assert "Strategy" not in ast.unparse(node), ast.unparse(node)
    text = (PKG / "commit" / "recovery.py").read_text()
    assert "MarkerStrategy" not in text.replace(":meth:`MarkerStrategy.", "") and "RenameStrategy" not in text


#: a driver's mutating methods: only the commit layer calls them (drivers call their own)
MUTATING = {"put", "put_volatile", "delete", "delete_tree", "rename", "exchange", "open_writer",
            "abort_upload", "makedirs", "fsync_dir", "complete_later", "remove_empty_directory"}
#: receivers that name a driver: `x.driver`, `driver`, `d`, `drv`, `self._driver`, `self._d`
DRIVER_RECEIVER = re.compile(r"(?:^|\.)_?(?:driver|d|drv)$")


def driver_calls(path: Path) -> list[tuple[int, str, str]]:
    """(line, receiver, method) of every call ``<driver>.<method>(...)`` in ``path``."""
    out = []
    for node in ast.walk(parse_python(path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = ast.unparse(node.func.value)
            if DRIVER_RECEIVER.search(receiver):
                out.append((node.lineno, receiver, node.func.attr))
    return out


def test_only_the_commit_layer_calls_a_drivers_mutating_methods():
    found = []
    for mod, path in modules().items():
        top = mod.split(".")[1:2]
        if top in (["commit"], ["drivers"], ["testing"]):
            continue  # the commit layer; drivers themselves; test fakes that are drivers
        found += [f"{mod}:{line} {recv}.{meth}()" for line, recv, meth in driver_calls(path) if meth in MUTATING]
    assert not found, "mutating driver calls outside commit/:\n" + "\n".join(found)


def test_the_checker_sees_a_mutating_call(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f(store):\n    store.driver.delete('k')\n    d = store.driver\n    d.put('k', b'')\n")
    assert [(m, r) for _, r, m in driver_calls(p)] == [("delete", "store.driver"), ("put", "d")]


def test_every_test_file_sits_in_a_layer_folder():
    tests = Path(__file__).resolve().parents[1]
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, f"test files outside a layer folder: {loose}"
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert folders <= {"drivers", "commit", "pytree", "manager", "compat", "integrations", "system", "harness"}


def test_no_module_in_drivers_or_commit_is_over_700_lines():
    long = {mod: n for mod, p in modules().items()
            if mod.split(".")[1:2] in (["drivers"], ["commit"]) and (n := len(p.read_text().splitlines())) > 700}
    assert not long, long
    assert len((PKG / "integrations" / "orbax.py").read_text().splitlines()) <= 600


def test_the_module_map_names_every_module():
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    missing = []
    for path in modules().values():
        rel = path.relative_to(PKG).as_posix()
        if path.name == "__init__.py" and rel != "drivers/__init__.py":
            continue
        short = path.name  # a row may name several files of one folder after the first
        if f"`{rel}`" not in doc and f"`{short}`" not in doc and f", {short}" not in doc:
            missing.append(rel)
    assert not missing, f"docs/architecture.md does not map {missing}"
