"""No import circles on the manager's side: daemon/ and console/ read as layers."""

from __future__ import annotations

from tests.import_graph import cycles, import_graph

MANAGER = ("daemon", "console")


def test_the_daemon_and_the_console_import_in_no_circle() -> None:
    assert cycles(import_graph(folders=MANAGER)) == []


def test_the_engine_imports_in_no_circle_and_nothing_of_the_benchmark() -> None:
    """The engine reads the bandwidth profile `moelab bench bw` writes through its own module
    (engine/bandwidth.py): the benchmark's modules import the engine, never the other way."""
    graph = import_graph(folders=("engine",))
    assert cycles(graph) == []
    reached, todo = set(), ["engine.engine"]
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
