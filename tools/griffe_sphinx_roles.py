"""A griffe extension for the documentation site: Sphinx roles in docstrings become links.

atomicstore's docstrings cross-reference with Sphinx roles (``:class:`Store```,
``:meth:`~atomicstore.Store.recover```, ``:func:`title <target>```). mkdocstrings renders
Markdown, where a role would show as literal text; this rewrites each role into an
optional cross-reference of mkdocs-autorefs: a link when the target is on the site, plain
code when it is not (a private helper, torch, the standard library), never a build
warning. The target is resolved in the scope of the documented object, as Sphinx does.
Used by ``mkdocs.yml`` (``extensions:``); the package itself is unchanged.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(?P<body>[^`]+)`")
TITLED = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>", re.S)
LITERAL = re.compile(r"(?m)(\S) ?::$(?=\n\n)")  # reST "Example::" before a code block


def _resolve(obj: griffe.Object, target: str, names: dict[str, str]) -> str:
    """The full path of ``target`` as written in ``obj``'s docstring (best effort): in
    ``obj``'s scope as Python would find it, else the one object of the package with that
    name."""
    target = target.strip().lstrip("~.").removesuffix("()")
    head, _, rest = target.partition(".")
    if head == obj.package.name:
        return target
    try:
        base = obj.resolve(head)
    except Exception:  # noqa: BLE001 - not in scope (e.g. only named in a docstring)
        base = names.get(head, head)
    return f"{base}.{rest}" if rest else base


def _replace(obj: griffe.Object, names: dict[str, str], match: re.Match[str]) -> str:
    body = match["body"]
    titled = TITLED.fullmatch(body.strip())
    if titled:
        target, title = titled["target"], " ".join(titled["title"].split())
    else:
        target = body.strip()
        shown = target.removeprefix("~")
        title = f"<code>{html.escape(shown.rsplit('.', 1)[-1] if target.startswith('~') else shown)}</code>"
    ident = html.escape(_resolve(obj, target, names), quote=True)
    return f'<autoref identifier="{ident}" optional>{title}</autoref>'


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and everything defined in it, recursively (not what it imports)."""
    out = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            out += _objects(member)  # type: ignore[arg-type]
    return out


def _rewrite(pkg: griffe.Module) -> None:
    objects = _objects(pkg)
    by_name: dict[str, list[str]] = {}
    for o in objects:
        by_name.setdefault(o.name, []).append(o.path)
    names = {n: paths[0] for n, paths in by_name.items() if len(paths) == 1}
    for o in objects:
        if o.docstring is None:
            continue
        text = LITERAL.sub(r"\1:", o.docstring.value)
        o.docstring.value = ROLE.sub(lambda m, o=o: _replace(o, names, m), text)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring of the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _rewrite(pkg)
