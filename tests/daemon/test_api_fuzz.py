"""Generated requests against every route of mgr's JSON API: never a 5xx, always the error shape.

A real daemon (real SQLite file, real supervisor, catalog and benchmark service) is served by
uvicorn over HTTP in this process, so that two things can be replaced for the run: the
`moelab bench bw` child of "measure again" is a fake that prints an empty report, and the engine
launcher refuses to start anything (a test fails if it is asked to). No engine may start anyway: no
model is known, and the stored profile, server and benchmark run name a checkpoint that does not
exist, so each start, restart or resume must be refused before anything launches. Hypothesis runs
derandomized (a fixed seed) and without its example database, so every run sends the same
requests.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import Route

from moelab.console.main import build_app
from moelab.daemon import child
from moelab.daemon.api import api_routes
from moelab.daemon.schema import BenchmarkRun, Profile, Server
from moelab.daemon.service import Daemon
from moelab.engine.process import launch
from moelab.engine.text import Text

from .conftest import asgi_client, make_daemon, wait_for

MISSING_MODEL = "/nonexistent/moelab-fuzz/model"
API_ROUTES = api_routes()  # in build_app's order
FAKE_BENCH = 'import json; print(json.dumps({"results": [], "versions": {}}))'

# names that handlers read from bodies and query strings, so that generated requests reach them
# fmt: off
FIELDS = ["name", "model", "flags", "notes", "origin", "profile_id", "command", "recommended",
          "changes", "flag", "value", "toml", "threads", "token", "next", "mode", "objective",
          "clients", "base_flags", "pick_up", "only_flags", "min_gain", "side_tolerance"]
QUERY = ["limit", "lines", "kind", "since", "until", "all", "a", "b", "model", "mode", "objective",
         "clients", "profile_id", "pick_up", "only_flags", "profile", "context", "next"]
ODD_TEXT = [
    "", " ", "\x00", "\ud800", "nan", "NaN", "inf", "-inf", "-1", "0", "1", "2", "1.5", "1e400",
    "9" * 400, "true", "null", "../../etc/passwd", "~", "/", ".", "💥" * 50, "%", "%zz",
    "--api-key", "--moe-cache-rate", "x" * 2000, "stats", "picks", "decode", "quick", "aggregate",
    "moelab serve --model-path /x --bogus", 'name = "x"\nmodel = "/nonexistent"\n',
]
# fmt: on
LONG = "x" * 20_000  # in a body; a request line that long is refused by the HTTP server itself


def _texts() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=30))


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.sampled_from([0, 1, 2, -1, 2**63, 2**64]),
        st.floats(allow_nan=True, allow_infinity=True),
        _texts(),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(
                st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), inner, max_size=4
            ),
        ),
        max_leaves=8,
    )


OBJECTS = st.dictionaries(st.sampled_from(FIELDS), _json_values(), max_size=5)
BODIES = st.one_of(
    st.none(),
    OBJECTS.map(json.dumps),
    OBJECTS.map(json.dumps),
    OBJECTS.map(json.dumps),
    st.sampled_from(FIELDS).map(lambda field: json.dumps({field: LONG})),
    _json_values().map(json.dumps),
    st.sampled_from(
        [
            "{",
            "[1,",
            '{"name": }',
            "{" * 5000 + "}" * 5000,
            "[" * 100_000,
            "\ufeff{}",
            '{"a": 1e999999}',
            '{"model": "\\ud800"}',
            "token=%ff&next=%00",
        ]
    ),
    st.binary(max_size=64),
)
CONTENT_TYPES = st.sampled_from(
    ["application/json"] * 4
    + [
        None,
        "application/x-www-form-urlencoded",
        "text/plain",
        "application/toml",
        "multipart/form-data",
    ]
)
QUERIES = st.one_of(
    st.just(""),
    st.dictionaries(st.sampled_from(QUERY), _texts(), max_size=4).map(
        lambda q: urlencode(q, errors="surrogatepass")
    ),
    st.dictionaries(st.sampled_from(QUERY), _texts(), max_size=4).map(
        lambda q: urlencode(q, errors="surrogatepass")
    ),
    st.text(max_size=40).map(lambda t: quote(t, safe="=&", errors="surrogatepass")),
)
# ids that name a stored row or none; odd ones (not a number, past SQLite's integers) now and then
IDS = st.one_of(
    st.sampled_from(["1", "1", "2", "0", str(2**63 - 1), str(2**63), "9" * 30]),
    st.integers(min_value=0, max_value=2**80).map(str),
)
ODD_IDS = st.text(min_size=1, max_size=12).map(lambda t: quote(t, safe="", errors="surrogatepass"))
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
SUFFIXES = ["/", "/extra", "//", "/%00", "/.."]


def _fill(path: str, ids: list[str]) -> str:
    """A route's path with its parameters replaced by `ids`, in order."""
    values = iter(ids)
    return re.sub(r"\{\w+(:\w+)?\}", lambda _m: next(values), path)


@st.composite
def targets(draw: st.DrawFn, route: Route) -> tuple[str, str]:
    """(method, path) of a request to `route`: mostly as routed, one in five odd."""
    params = len(route.param_convertors)
    if draw(st.integers(0, 4)) > 0:
        methods = sorted((route.methods or {"GET"}) - {"HEAD"}) or ["GET"]
        method = draw(st.sampled_from(methods))
        ids = draw(st.lists(IDS, min_size=params, max_size=params))
        return method, _fill(route.path, ids)
    method = draw(st.sampled_from(METHODS))
    ids = draw(st.lists(st.one_of(IDS, ODD_IDS), min_size=params, max_size=params))
    return method, _fill(route.path, ids) + draw(st.sampled_from(["", *SUFFIXES]))


@dataclass
class Served:
    daemon: Daemon
    port: int
    log_path: Path
    launched: list[list[str]]

    def request(
        self,
        method: str,
        target: str,
        body: str | bytes | None = None,
        content_type: str | None = None,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": content_type} if content_type else {}
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        try:
            conn.request(method, target, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


def _seed(daemon: Daemon, log_path: Path) -> None:
    """Row 1 of profiles, servers and benchmark runs, each of a checkpoint that does not exist
    (again where a request before deleted it), so that generated ids find a row."""
    now = time.time()
    log_path.write_text("# starting: moelab serve --api-key k\nINFO loading\n")
    with daemon.store.session() as session:
        if session.get(Profile, 1) is None:
            session.add(
                Profile(
                    id=1,
                    name=f"gone {now}",
                    model=MISSING_MODEL,
                    flags=["--api-key", "k"],
                    created=now,
                    updated=now,
                )
            )
        if session.get(Server, 1) is None:
            session.add(
                Server(
                    id=1,
                    name="gone",
                    model=MISSING_MODEL,
                    flags=["--port", "8199"],
                    host="127.0.0.1",
                    port=8199,
                    device="cpu",
                    status="stopped",
                    log_path=str(log_path),
                    created=now,
                    stopped=now,
                )
            )
        if session.get(BenchmarkRun, 1) is None:
            session.add(
                BenchmarkRun(
                    id=1,
                    model=MISSING_MODEL,
                    mode="quick",
                    objective="decode",
                    status="done",
                    created=now,
                    updated=now,
                    finished=now,
                )
            )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("fuzz")
    launched: list[list[str]] = []

    def refuse_to_launch(flags: list[str], *args: Any, **kwargs: Any) -> launch.EngineProcess:
        launched.append(list(flags))
        raise AssertionError(f"a generated request started an engine: {flags}")

    fake = root / "fake_bench.py"
    fake.write_text(FAKE_BENCH)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(root / "home"))  # "~" in a generated path names an empty home
        patch.setattr(child, "moelab_argv", lambda args: [sys.executable, str(fake), *args])
        patch.setattr(launch, "start_engine", refuse_to_launch)
        daemon = make_daemon(root / "data", None)
        app = build_app(daemon)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(
            uvicorn.Config(app, log_level="critical", access_log=False, lifespan="on")
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        wait_for(lambda: server.started, 30, "uvicorn to start")
        answered = [(r.path, r.methods) for r in app.routes if r.path.startswith("/api/")]
        assert answered == [(r.path, r.methods) for r in API_ROUTES], "a route is not fuzzed"
        yield Served(daemon, sock.getsockname()[1], root / "server-1.log", launched)
        server.should_exit = True
        thread.join(timeout=30)


def _check(status: int, method: str, raw: bytes, what: str) -> None:
    assert status < 500, f"{what} -> {status}: {raw[:500]!r}"
    if status >= 400 and method != "HEAD":
        body = json.loads(raw)
        error = body["error"]
        # message_text: the message's stored form (engine/text.py), the same sentence
        assert {"message", "code"} <= set(error) <= {"message", "code", "message_text"}, body
        if "message_text" in error:
            assert str(Text.from_json(error["message_text"])) == error["message"], (what, body)
        assert isinstance(error["message"], str) and error["message"], (what, body)
        assert isinstance(error["code"], str) and error["code"], (what, body)


@pytest.mark.parametrize(
    "route", API_ROUTES, ids=lambda r: f"{','.join(sorted(r.methods or ()))} {r.path}"
)
def test_generated_requests_never_fail_the_server(served: Served, route: Route) -> None:
    _seed(served.daemon, served.log_path)

    @settings(
        max_examples=40,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(where=targets(route), query=QUERIES, body=BODIES, content_type=CONTENT_TYPES)
    def one_request(
        where: tuple[str, str], query: str, body: str | bytes | None, content_type: str | None
    ) -> None:
        method, path = where
        target = path + (f"?{query}" if query else "")
        status, raw = served.request(method, target, body, content_type)
        _check(status, method, raw, f"{method} {target[:200]} body={str(body)[:200]!r}")

    one_request()
    assert served.launched == []
    # the server still serves a normal request, read and write
    status, raw = served.request("GET", "/api/status")
    assert status == 200 and json.loads(raw)["pid"] == served.daemon.pid
    command = json.dumps({"command": "moelab serve --model-path /m --moe-cache-rate 0.5"})
    status, raw = served.request("POST", "/api/profiles/parse-command", command, "application/json")
    assert status == 200 and json.loads(raw)["flags"] == ["--moe-cache-rate", "0.5"]


# requests the generated ones found answered with a 500 once; each now gets a 4xx naming the field
FOUND = [
    ("POST", "/api/profiles", "[" * 100_000, 400, "nests"),
    ("POST", "/api/servers", '{"model": "\\ud800"}', 400, "model holds an unpaired surrogate"),
    ("PUT", "/api/profiles/1", '{"flags": ["--api-key", "\\udfff"]}', 400, "flags[1] holds"),
    ("POST", "/api/servers", json.dumps({"profile_id": 2**70}), 400, "profile_id must be"),
    ("POST", "/api/benchmarks", json.dumps({"model": "9" * 30}), 404, "unknown model"),
    ("GET", "/api/recommend?model=" + "9" * 30, None, 404, "unknown model"),
    ("GET", "/api/recommend?model=%C2%B2", None, 404, "unknown model"),
    ("GET", "/api/benchmarks/plan?model=" + "9" * 30, None, 404, "unknown model"),
    ("POST", "/api/hardware/measure", '{"model": "/x\\u0000y"}', 400, "unknown model"),
    ("GET", f"/api/profiles/{2**63}", None, 404, "no id is larger"),
    ("POST", "/api/servers/1/restart", None, 400, "no checkpoint at"),
]


@pytest.mark.parametrize(("method", "target", "body", "status", "says"), FOUND)
def test_requests_that_once_failed_the_server_are_refused_with_the_reason(
    served: Served, method: str, target: str, body: str | None, status: int, says: str
) -> None:
    _seed(served.daemon, served.log_path)
    got, raw = served.request(method, target, body, "application/json" if body else None)
    assert got == status, raw
    assert says in json.loads(raw)["error"]["message"]


def test_a_benchmark_of_a_known_model_refuses_a_profile_id_past_every_row(
    session_daemon: Daemon, demo_model: Path
) -> None:
    local = asgi_client(session_daemon, "127.0.0.1", "127.0.0.1:1901")
    body = {"model": str(demo_model), "mode": "quick", "profile_id": 2**70}
    response = local.post("/api/benchmarks", json=body)
    assert response.status_code == 400
    assert "profile_id must be a whole number" in response.json()["error"]["message"]
