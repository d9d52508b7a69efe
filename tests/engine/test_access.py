"""The engine's Host and Origin rules and CORS (engine/serving/access.py), over the real app.

The app runs over a scripted engine thread (tests/engine/test_tool_calls.py); the same rules on a
real `moelab serve` process: tests/engine/test_server.py and tests/daemon/test_lan.py.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from moelab.engine.config.args import build_parser
from moelab.engine.config.config import EngineConfig
from moelab.engine.serving.server import Server

from .test_tool_calls import ScriptedWorker

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENDPOINTS = [
    ("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/metrics", None),
    ("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", {"prompt": "x"}),
    ("POST", "/v1/cache/resize", {"moe_cache_size": 4}),
]  # fmt: skip
EVIL = "http://evil.example"
APP = "http://app.example:3000"


def engine_app(tokenizer, *flags: str, host: str = "127.0.0.1:8000") -> TestClient:
    """The app of `moelab serve --model-path m FLAGS`, asked from this machine by `host`."""
    config = EngineConfig.from_flags(["--model-path", "m", *flags])
    app = Server(config, ScriptedWorker(tokenizer, "Sunny.")).app
    return TestClient(app, base_url=f"http://{host}", client=("127.0.0.1", 50123))


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_a_host_the_engine_does_not_serve_is_refused_at_every_endpoint(
    tokenizer, method, path, body
):
    client = engine_app(tokenizer, host="evil.example:8000")  # DNS rebinding
    r = client.request(method, path, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_host"
    assert "--allow-host" in r.json()["error"]["message"]


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "[::1]:8000"])
def test_the_names_mgr_and_users_reach_a_loopback_engine_by_are_served(tokenizer, host):
    client = engine_app(tokenizer, host=host)
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_allow_host_adds_a_name(tokenizer):
    client = engine_app(tokenizer, "--allow-host", "llm.lan,gpu.example", host="llm.lan:8000")
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    other = engine_app(tokenizer, "--allow-host", "llm.lan", host="gpu.example:8000")
    assert other.get("/health").status_code == 400


@pytest.mark.parametrize("allowed", [None, EVIL, "*"])
def test_a_page_of_another_site_cannot_resize_the_cache(tokenizer, allowed):
    client = engine_app(tokenizer, *(["--allowed-origins", allowed] if allowed else []))
    # the attack: a simple cross-site POST, no preflight
    r = client.post(
        "/v1/cache/resize",
        content=b'{"moe_cache_size": 4}',
        headers={"Content-Type": "text/plain", "Origin": EVIL, "Sec-Fetch-Site": "cross-site"},
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "foreign_origin"
    assert "access-control-allow-origin" not in r.headers
    # a browser that sends no Origin still says where the request comes from
    r = client.post("/v1/cache/resize", json={"moe_cache_size": 4},
                    headers={"Sec-Fetch-Site": "same-site"})  # fmt: skip
    assert r.status_code == 403
    # nor can a listed origin's preflight open it
    r = client.options("/v1/cache/resize", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert r.status_code == 403


def test_inference_from_another_origin_needs_allowed_origins(tokenizer):
    preflight = {"Origin": APP, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    closed = engine_app(tokenizer)
    for r in (
        closed.post("/v1/chat/completions", json=CHAT, headers={"Origin": APP}),
        closed.options("/v1/chat/completions", headers=preflight),
    ):
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert f"--allowed-origins {APP}" in r.json()["error"]["message"]
        assert "access-control-allow-origin" not in r.headers
    # a page of the engine's own origin, and clients that are no browser, need nothing
    same = {"Origin": "http://127.0.0.1:8000", "Sec-Fetch-Site": "same-origin"}
    assert closed.post("/v1/chat/completions", json=CHAT, headers=same).status_code == 200
    assert closed.post("/v1/chat/completions", json=CHAT).status_code == 200

    opened = engine_app(tokenizer, "--allowed-origins", f"{APP},https://chat.example")
    r = opened.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    r = opened.post("/v1/chat/completions", json=CHAT,
                    headers={"Origin": APP, "Sec-Fetch-Site": "cross-site"})  # fmt: skip
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    assert r.json()["choices"][0]["message"]["content"] == "Sunny."
    r = opened.get("/v1/models", headers={"Origin": APP})
    assert r.headers["access-control-allow-origin"] == APP
    r = opened.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": EVIL})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


def test_reads_stay_open_but_only_listed_origins_may_read_them(tokenizer):
    client = engine_app(tokenizer)
    r = client.get("/health", headers={"Origin": EVIL, "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("bad", ["localhost:3000", "http://app.example/", "ftp://x", ""])
def test_allowed_origins_must_be_origins(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-path", "m", "--allowed-origins", bad])
