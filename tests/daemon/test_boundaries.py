"""Who may do what on the manager's side: SQL is written in the daemon's store and services only,
the console reaches engines through the daemon, and a missing row is named in one place."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.import_graph import ROOT, import_graph, imports_into, module_files

# the modules that own tables and may query them; every other module of daemon/ and console/
# (the HTTP handlers, the console's pages) asks these
STORE_AND_SERVICES = {
    "daemon.store",
    "daemon.schema",
    "daemon.migrations",
    "daemon.audit",
    "daemon.retention",
    "daemon.telemetry",
    "daemon.measure",
    "daemon.catalog",
    "daemon.supervisor",
    "daemon.sampler",
    "daemon.profile_store",
    "daemon.benchmarks",
    "daemon.benchmark_store",
    "daemon.benchmark_setup",
    "daemon.benchmark_estimate",
}
SESSION_CALLS = {"execute", "get", "scalars", "scalar", "add", "delete", "flush", "merge", "query"}


def sql_in(path: Path) -> list[str]:
    """What in a module's source builds or runs SQL: a SQLAlchemy import, a session opened, a
    session's query or change."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found += [(node.lineno, f"import {n}") for n in names if n and "sqlalchemy" in n]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr == "session":
                found.append((node.lineno, ".session()"))
            elif (
                func.attr in SESSION_CALLS
                and isinstance(func.value, ast.Name)
                and func.value.id == "session"
            ):
                found.append((node.lineno, f"session.{func.attr}()"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_sql_is_written_only_in_the_store_and_the_services() -> None:
    modules = module_files(ROOT, ("daemon", "console"))
    assert set(modules) >= STORE_AND_SERVICES, "a module named here is gone: update the list"
    outside = {
        name: found
        for name, path in modules.items()
        if name not in STORE_AND_SERVICES and (found := sql_in(path))
    }
    assert outside == {}


def test_sql_in_a_handler_is_seen(tmp_path: Path) -> None:
    handler = tmp_path / "handler.py"
    handler.write_text(
        "from sqlalchemy import select\n\n"
        "def rows(daemon):\n"
        "    with daemon.store.session() as session:\n"
        "        return session.get(Profile, 1), session.scalars(select(Profile))\n"
    )
    assert sql_in(handler) == [
        "line 1: import sqlalchemy",
        "line 4: .session()",
        "line 5: session.get()",
        "line 5: session.scalars()",
    ]


def test_the_console_reaches_engines_only_through_the_daemon() -> None:
    """The console imports from the engine only its sentence type (engine/text.py, which every
    package that speaks to people shares); engines' logs, flags and processes come from the
    daemon."""
    graph = import_graph(ROOT, ("console", "daemon", "engine", "profiles", "autotune"))
    reached = imports_into(graph, "console", "engine")
    assert {module for edges in reached.values() for module in edges} <= {"engine.text"}, reached


def test_a_missing_row_is_named_in_one_place() -> None:
    """ "no profile 7", "no server 7", ...: each table's NotFound is made in one place, the
    store's row-or-404 helper, whatever asks for the row."""
    missing = ("no profile {", "no server {", "no benchmark run {", "no model {")
    sources = [
        p.read_text(encoding="utf-8") for p in module_files(ROOT, ("daemon", "console")).values()
    ]
    counts = {m: sum(s.count(f'Text("{m}') for s in sources) for m in missing}
    assert counts == dict.fromkeys(missing, 1)
