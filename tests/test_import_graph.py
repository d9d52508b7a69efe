"""The package's import rules: no circles anywhere, the engine's subpackages in layers, and the
engine modules the manager imports free of torch (docs/architecture.md names them)."""

from __future__ import annotations

import subprocess
import sys

from tests.import_graph import cycles, import_graph

MANAGER = ("daemon", "console")
PACKAGE = ("engine", "kernels", "profiles", "autotune", "daemon", "console")

# what each part of the engine may import (beyond itself): each layer only those below it
ENGINE_LAYERS = {
    "engine.text": set(),
    "engine.model": {"engine.text", "kernels"},
    "engine.config": {"engine.model", "engine.text"},
    "engine.process": {"engine.config", "engine.text"},
    "engine.experts": {"engine.config", "engine.model", "engine.text", "kernels"},
    "engine.runtime": {"engine.config", "engine.experts", "engine.model", "engine.text", "kernels"},
    "engine.serving": {
        "engine.config", "engine.model", "engine.process", "engine.runtime", "engine.text",
    },
    "engine.bench": {
        "engine.config", "engine.experts", "engine.model", "engine.process", "engine.runtime",
        "engine.text", "kernels",
    },
}  # fmt: skip


def part_of(module: str) -> str:
    """engine.experts.cache -> engine.experts; kernels.fp8 -> kernels; engine.cli -> engine.cli."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "engine" else parts[0]


def test_the_package_imports_in_no_circle() -> None:
    assert cycles(import_graph(folders=PACKAGE)) == []


def test_the_engine_parts_import_only_the_layers_below_them() -> None:
    graph = import_graph(folders=("engine", "kernels"))
    parts = {part_of(m) for m in graph if m.startswith("engine.")}
    assert set(ENGINE_LAYERS) <= parts, "a layer was renamed: update ENGINE_LAYERS"
    crossings = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if part_of(module) in ENGINE_LAYERS
        for target in targets
        if part_of(target) != part_of(module)
        and part_of(target) not in ENGINE_LAYERS[part_of(module)]
    )
    assert crossings == []


def test_the_engine_modules_the_manager_imports_load_without_torch() -> None:
    """Every engine module reachable from the manager's side (daemon, console, profiles,
    autotune), imported in one process where any import of torch fails."""
    graph = import_graph(folders=PACKAGE)
    todo = [m for m in graph if part_of(m) in {"daemon", "console", "profiles", "autotune"}]
    reached: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    shared = sorted(m for m in reached if m.startswith("engine."))
    assert "engine.model.spec" in shared and "engine.config.memory" in shared
    code = "import sys; sys.modules['torch'] = None\n" + "".join(
        f"import moelab.{m}\n" for m in shared
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_daemon_and_the_console_import_in_no_circle() -> None:
    assert cycles(import_graph(folders=MANAGER)) == []


def test_the_engine_imports_in_no_circle_and_nothing_of_the_benchmark() -> None:
    """The engine reads the bandwidth profile `moelab bench bw` writes through its own module
    (engine/config/bandwidth.py): the benchmark's modules import the engine, never the other way."""
    graph = import_graph(folders=("engine",))
    assert cycles(graph) == []
    reached, todo = set(), ["engine.runtime.engine"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert sorted(m for m in reached if m.startswith("engine.bench")) == []


def test_the_routes_are_gathered_in_one_place() -> None:
    """The route modules (daemon/api_*.py) are imported by the composition root alone: the HTTP
    plumbing (daemon/http.py), the services and the console's pages import none of them."""
    graph = import_graph(folders=MANAGER)
    route_modules = {m for m in graph if m.startswith("daemon.api_")}
    assert len(route_modules) >= 4
    importers = {m for m, edges in graph.items() if edges & route_modules}
    assert importers == {"daemon.api"}
    assert graph["daemon.api"] == route_modules


def test_a_circle_is_found_however_its_imports_are_written(tmp_path) -> None:
    """The helper sees a circle closed by a relative import, one inside a function and one
    under TYPE_CHECKING; and none where a module only imports its own package."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import thing\n")
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    (package / "sub" / "__init__.py").write_text("from ..d import y\n")
    (package / "sub" / "e.py").write_text("from .. import d\n")
    (package / "d.py").write_text("import moelab.pkg.sub.e\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.sub.e"]]
