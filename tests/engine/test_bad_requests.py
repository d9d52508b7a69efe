"""Bad input at the engine: a 4xx naming the field, never a 5xx, and the server serves on.

A real `moelab serve` process over the tiny model, its context capped at 64 tokens so that a
generated request that happens to be valid ends quickly. Hypothesis throws generated bodies,
malformed JSON and odd content types at every endpoint.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from moelab.engine.config.config import EngineConfig
from moelab.engine.process.launch import start_engine, stop_engine, wait_ready
from moelab.engine.serving.server import Server
from moelab.engine.synth_checkpoint import synthesize
from tests.ports import free_port

from .test_tool_calls import ScriptedWorker

CACHE_SLOTS, KV_TOKENS = 16, 512
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI is not flaky
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = synthesize(root / "model", preset="tiny", routing_skew=1.0, seed=5)
    process = start_engine(
        ["--model-path", str(model), "--port", str(free_port()), "--device-memory", "1GiB",
         "--bank-dir", str(root / "bank"), "--max-context", "64",
         "--moe-cache-size", str(CACHE_SLOTS), "--kv-reserve-tokens", str(KV_TOKENS)],
        root / "engine.log",
    )  # fmt: skip
    try:
        wait_ready(process, timeout_s=300)
        with httpx.Client(base_url=process.base_url, timeout=120) as client:
            yield client
    finally:
        stop_engine(process)


def assert_error_shape(response: httpx.Response) -> dict:
    """The documented error: JSON `{"error": {"message", "type", "param", "code"}}`."""
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


def assert_anthropic_error_shape(response: httpx.Response) -> dict:
    """The Messages API's documented error: `{"type": "error", "error": {"type", "message"}}`."""
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert isinstance(body["error"]["type"], str) and body["error"]["message"]
    return body["error"]


def assert_answered(response: httpx.Response) -> None:
    """Not a 5xx; an error has the documented shape (Anthropic's under /v1/messages); a
    stream's error events too."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    anthropic = response.request.url.path.startswith("/v1/messages")
    if response.status_code >= 400:
        (assert_anthropic_error_shape if anthropic else assert_error_shape)(response)
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
        for event in map(json.loads, events):
            if anthropic and event.get("type") == "error":
                assert set(event["error"]) == {"type", "message"}
            elif "error" in event:
                assert set(event["error"]) == {"message", "type", "param", "code"}


def assert_serves(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "The harbour", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def post(client: httpx.Client, path: str, body: bytes, content_type: str | None = None):
    headers = {"content-type": content_type} if content_type is not None else {}
    return client.post(path, content=body, headers=headers)


# the issue's inputs, each answered 400 naming the field
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "x", "max_tokens": Infinity}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b"[" * 100_000, None),
        ("/v1/completions", b'{"prompt": "x", "top_k": NaN}', "top_k"),
        ("/v1/completions", b'{"prompt": "x", "seed": NaN}', "seed"),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "presence_penalty": NaN}', "presence_penalty"),
        ("/v1/completions", b'{"prompt": "x", "frequency_penalty": -Infinity}',
         "frequency_penalty"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 1e999}', "top_p"),
        ("/v1/completions", b'{"prompt": "x", "top_k": 1e30}', "top_k"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
         "messages[0].content"),
        # a lone surrogate as a key: the field is named without it, which JSON could not carry
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ""}], '
         b'"max_tokens": {"\\ud800": null}}', "max_tokens (a key)"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
         "messages[0].content[0].text"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
         b'{"messages": []}}', "chat_template_kwargs.messages"),
        ("/v1/cache/resize", b'{"moe_cache_size": 1e999}', "moe_cache_size"),
        ("/v1/cache/resize", b'{"kv_reserve_tokens": 99999999999999999999}', "kv_reserve_tokens"),
    ],
)  # fmt: skip
def test_the_issues_inputs_are_400s_naming_the_field(engine, path, body, param):
    r = post(engine, path, body, "application/json")
    assert r.status_code == 400, r.text
    assert assert_error_shape(r)["param"] == param
    assert_serves(engine)


# ---- generated requests ------------------------------------------------------------------------

TEXT = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=12)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and the infinities among them: json.dumps writes them as literals
    st.sampled_from([0, -1, 1, 2, 64, 2**31, 2**63, -(2**63) - 1, 0.5, 1e308, -0.0, ""]),
    TEXT,
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
SAMPLING_FIELDS = [
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
    "top_logprobs", "seed", "stop", "stream", "stream_options", "ignore_eos", "n", "echo",
    "suffix", "best_of", "response_format", "add_special_tokens", "user",
]  # fmt: skip
CHAT_FIELDS = ["tools", "tool_choice", "chat_template_kwargs"]
# a valid request with up to two fields given odd values (the prompt or the messages among
# them), so that the odd value is what is judged, and a valid one runs to the end
ODD_FIELDS = st.dictionaries(
    st.sampled_from([*SAMPLING_FIELDS, *CHAT_FIELDS, "prompt", "messages"]) | TEXT,
    JSON | st.integers(min_value=0, max_value=8),
    max_size=2,
)
ARGUMENTS = st.one_of(
    st.dictionaries(TEXT, JSON, max_size=2).map(json.dumps),  # as OpenAI clients send them
    TEXT,
    JSON,
)
TOOL_CALL = st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": TEXT}, optional={"arguments": ARGUMENTS})},
    optional={"id": TEXT},
)  # fmt: skip
ODD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | TEXT},
    optional={
        "content": TEXT | JSON | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": TEXT | JSON}), max_size=2),
        "tool_calls": st.lists(TOOL_CALL, max_size=2) | JSON,
        "name": TEXT | JSON,
        "tool_call_id": TEXT | JSON,
    },
)  # fmt: skip
MESSAGES = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system"]), "content": TEXT}
        ),
        st.fixed_dictionaries(
            {"role": st.just("assistant"), "content": st.none(),
             "tool_calls": st.lists(TOOL_CALL, min_size=1, max_size=2)}
        ),
        ODD_MESSAGE,
    ),
    min_size=1,
    max_size=3,
)  # fmt: skip
MAX_TOKENS = st.integers(min_value=1, max_value=4)


def _merged(base: dict, odd: dict) -> dict:
    return {**base, **odd}


COMPLETION_BODIES = st.one_of(
    st.builds(
        _merged,
        st.fixed_dictionaries(
            {"prompt": TEXT | st.lists(st.integers(0, 300), min_size=1, max_size=6),
             "max_tokens": MAX_TOKENS}
        ),
        ODD_FIELDS,
    ),
    JSON,  # not an object at all
)  # fmt: skip
CHAT_BODIES = st.one_of(
    st.builds(_merged, st.fixed_dictionaries({"messages": MESSAGES, "max_tokens": MAX_TOKENS}),
              ODD_FIELDS),
    JSON,
)  # fmt: skip
RESIZE_BODIES = st.one_of(
    st.dictionaries(
        st.sampled_from(["moe_cache_size", "kv_reserve_tokens"]) | TEXT,
        JSON | st.integers(min_value=0, max_value=2 * KV_TOKENS),
        min_size=1,
        max_size=2,
    ),
    JSON,
)
# the Messages API's: blocks of every kind it reads and some it refuses, and its own fields
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT | JSON}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT | JSON, "name": TEXT | JSON,
                           "input": st.dictionaries(TEXT, JSON, max_size=2) | JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT | JSON},
                          optional={"content": TEXT | JSON, "is_error": JSON}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking"]),
                           "thinking": TEXT | JSON}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document"]) | TEXT}),
    JSON,
)  # fmt: skip
ANTHROPIC_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]) | TEXT,
         "content": TEXT | st.lists(BLOCK, max_size=3) | JSON}
    ),
    min_size=1,
    max_size=3,
)  # fmt: skip
ANTHROPIC_FIELDS = st.dictionaries(
    st.sampled_from(["system", "tools", "tool_choice", "thinking", "stop_sequences", "stream",
                     "temperature", "top_k", "top_p", "model", "max_tokens", "messages",
                     "output_config", "metadata", "ignore_eos"]) | TEXT,
    JSON | st.integers(min_value=0, max_value=8),
    max_size=2,
)  # fmt: skip
MESSAGES_BODIES = st.one_of(
    st.builds(_merged, st.fixed_dictionaries({"messages": ANTHROPIC_MESSAGES,
                                              "max_tokens": MAX_TOKENS}), ANTHROPIC_FIELDS),
    JSON,
)  # fmt: skip
CONTENT_TYPES = st.sampled_from(
    ["application/json", "text/plain", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/json; charset=utf-16", "", None]
)  # fmt: skip
ENDPOINTS = [
    ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/v1/stats"), ("GET", "/metrics"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/cache/resize"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
]  # fmt: skip


def _restore_sizes(client: httpx.Client) -> None:
    for body in ({"moe_cache_size": CACHE_SLOTS}, {"kv_reserve_tokens": KV_TOKENS}):
        assert client.post("/v1/cache/resize", json=body).status_code == 200


@FUZZ
@given(body=COMPLETION_BODIES, content_type=CONTENT_TYPES)
def test_generated_completion_requests(engine, body, content_type):
    assert_answered(post(engine, "/v1/completions", json.dumps(body).encode(), content_type))
    assert_serves(engine)


@FUZZ
@given(body=CHAT_BODIES, content_type=CONTENT_TYPES)
@example(
    body={"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
    content_type="application/json",
)  # fmt: skip
def test_generated_chat_requests(engine, body, content_type):
    assert_answered(post(engine, "/v1/chat/completions", json.dumps(body).encode(), content_type))
    assert_serves(engine)


@FUZZ
@given(body=MESSAGES_BODIES, content_type=CONTENT_TYPES, counting=st.booleans())
@example(
    body={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
    content_type="application/json", counting=False,
)  # fmt: skip
def test_generated_messages_requests(engine, body, content_type, counting):
    path = "/v1/messages/count_tokens" if counting else "/v1/messages"
    assert_answered(post(engine, path, json.dumps(body).encode(), content_type))
    assert_serves(engine)


@settings(FUZZ, max_examples=60)
@given(body=RESIZE_BODIES)
def test_generated_resize_requests(engine, body):
    response = post(engine, "/v1/cache/resize", json.dumps(body).encode(), "application/json")
    assert_answered(response)
    if response.status_code == 200:  # a valid resize: back to the sizes the others assume
        _restore_sizes(engine)
    assert_serves(engine)


@FUZZ
@given(
    endpoint=st.sampled_from(ENDPOINTS) | st.tuples(st.sampled_from(["GET", "POST", "PUT"]),
                                                    st.sampled_from(["/", "/v1", "/v1/x"])),
    body=st.one_of(
        st.binary(max_size=64),
        TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.sampled_from([b"{", b'{"prompt": "x",}', b"NaN", b"\xff\xfe{", b'"\\ud800"',
                         b"[" * 5000 + b"]" * 5000, b"{}" * 3, b"", b"null"]),
    ),
    content_type=CONTENT_TYPES,
)  # fmt: skip
def test_malformed_bodies_at_every_endpoint(engine, endpoint, body, content_type):
    method, path = endpoint
    headers = {"content-type": content_type} if content_type is not None else {}
    response = engine.request(method, path, content=body, headers=headers)
    assert_answered(response)
    if path == "/v1/cache/resize" and response.status_code == 200:
        _restore_sizes(engine)
    assert_serves(engine)


# ---- errors nothing expected ------------------------------------------------------------------


class FailingWorker(ScriptedWorker):
    """An engine thread that fails every request it is given."""

    def submit(self, req, limit: int) -> None:
        raise RuntimeError("the engine thread is gone")

    def call(self, function):
        raise RuntimeError("the engine thread is gone")


def test_an_unexpected_error_is_a_json_500_and_routing_errors_are_json(tokenizer):
    config = EngineConfig.from_flags(["--model-path", "m"])
    app = Server(config, FailingWorker(tokenizer, "x")).app
    client = TestClient(app, base_url="http://127.0.0.1:8000", raise_server_exceptions=False)
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/stats")):
        body = {"prompt": "x", "max_tokens": 2} if method == "POST" else None
        r = client.request(method, path, json=body)
        assert r.status_code == 500
        error = assert_error_shape(r)
        assert error["code"] == "internal_error" and "log" in error["message"]
    r = client.post("/v1/messages", json={"max_tokens": 2, "messages": [
        {"role": "user", "content": "x"}]})  # fmt: skip
    assert r.status_code == 500 and assert_anthropic_error_shape(r)["type"] == "api_error"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.json()["error"]["message"]
