"""kernels/ stands below the engine: the engine imports kernels, never the other way round."""

from __future__ import annotations

import ast
from pathlib import Path

import moelab.kernels

KERNELS = Path(moelab.kernels.__file__).parent


def imported_modules(path: Path, package: list[str]) -> set[str]:
    """Every module `path` (a module of `package`) imports, anywhere in it, by its absolute name:
    relative imports resolved, and `from PACKAGE import NAME` counted as PACKAGE.NAME too."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def test_no_module_of_kernels_imports_the_engine():
    modules = sorted(KERNELS.rglob("*.py"))
    assert len(modules) > 10
    crossings = {
        f"{path.relative_to(KERNELS)}: {name}"
        for path in modules
        for name in imported_modules(
            path, ["moelab", "kernels", *path.parent.relative_to(KERNELS).parts]
        )
        if name == "moelab.engine" or name.startswith("moelab.engine.")
    }
    assert not crossings


def test_relative_imports_resolve_to_their_absolute_names(tmp_path):
    source = tmp_path / "bench.py"
    source.write_text(
        "from . import draw\nfrom ..engine.sampling import RowDraw\nfrom .. import engine\n"
        "def f():\n    import moelab.engine.cli\n"
    )
    assert imported_modules(source, ["moelab", "kernels"]) == {
        "moelab.kernels", "moelab.kernels.draw", "moelab.engine.sampling",
        "moelab.engine.sampling.RowDraw", "moelab", "moelab.engine", "moelab.engine.cli",
    }  # fmt: skip
