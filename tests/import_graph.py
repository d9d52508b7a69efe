"""The import graph of moelab's modules, read from their source with `ast` (nothing is imported).

A module is named by its dotted path under `moelab` ("daemon.http", "console.pages.servers"); its
edges are every module of the graph it imports, at the top, inside a function or under
TYPE_CHECKING alike: an import moved into a function to break a circle still closes it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "moelab"


def module_files(root: Path, folders: Iterable[str]) -> dict[str, Path]:
    """Every module under `folders` (top-level subpackages of moelab), by dotted name."""
    found = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imported(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> set[str]:
    """The modules of `modules` an import statement names: `from x import y` names the module
    x.y where there is one, else x (y is one of x's attributes)."""
    if isinstance(node, ast.Import):
        names = {alias.name.removeprefix(f"{PACKAGE}.") for alias in node.names}
        return names & modules
    if node.level:
        base = package.split(".") if package else []
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join([*base, node.module] if node.module else base)
    else:
        prefix = (node.module or "").removeprefix(f"{PACKAGE}.")
    found = set()
    for alias in node.names:
        submodule = f"{prefix}.{alias.name}" if prefix else alias.name
        found.add(submodule if submodule in modules else prefix)
    return found & modules


def import_graph(root: Path = ROOT, folders: Iterable[str] = ()) -> dict[str, set[str]]:
    """module -> the modules of the graph it imports."""
    files = module_files(root, folders)
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = _package_of(name, path)
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(node, package, modules)
        graph[name] = {e for e in edges if e != name and not _is_parent(e, name)}
    return graph


def _is_parent(package: str, module: str) -> bool:
    """Importing a module runs its package's __init__ first: that is no dependency of its own."""
    return module.startswith(package + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected group of more than one module (or a module
    importing itself), sorted, found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative, so a deep graph does not reach Python's recursion limit
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1 or node in graph.get(node, ()):
                        found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def imports_into(graph: dict[str, set[str]], source: str, target: str) -> dict[str, set[str]]:
    """The modules of package `source` that import modules of package `target`, with those."""
    out = {}
    for module, edges in graph.items():
        if module == source or module.startswith(source + "."):
            hits = {e for e in edges if e == target or e.startswith(target + ".")}
            if hits:
                out[module] = hits
    return out
