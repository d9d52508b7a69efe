"""Anthropic's Messages API (engine/serving/anthropic_api.py) with Anthropic's own Python SDK as
the client: over a scripted engine thread where the reply must hold tool calls or reasoning (a
random-weight model writes neither), and against one real engine process (a thinking template,
the reasoning parser on, an API key) for whole and streamed messages, thinking blocks, the prefix
cache's usage, the context's end and errors."""

from __future__ import annotations

import json

import httpx
import pytest

from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.process.launch import stop_engine
from moelab.engine.synth_checkpoint import synthesize

from .served import serve
from .test_tool_calls import REPLY, ScriptedWorker, served

anthropic = pytest.importorskip("anthropic", reason="Anthropic's SDK is a test dependency")

KEY = "sk-local-test"
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "days": {"type": "integer"}}},
    },
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {}}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Tromsø?"}]
# the same tokens each time, and as many as max_tokens (the SDK has no field for either)
GREEDY = {"temperature": 0, "ignore_eos": True}


def sdk(http_client: httpx.Client, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=str(http_client.base_url), api_key=key, http_client=http_client, max_retries=0
    )


def scripted(tokenizer: Tokenizer, *replies: str, reasoning: str = "off", flags=()):
    """A server over a scripted engine thread, and the SDK's client of it."""
    worker = ScriptedWorker(tokenizer, *replies)
    return worker, sdk(served(worker, reasoning, *flags))


def test_tool_calls_and_reasoning_are_tool_use_and_thinking_blocks_whole_and_streamed(tokenizer):
    reply = f"<think>\nThe user wants the weather.\n</think>\n\n{REPLY}"
    _, client = scripted(tokenizer, reply, reasoning="think")
    message = client.messages.create(model="m", max_tokens=200, messages=ASK, tools=TOOLS)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, weather, time = message.content
    assert thinking.thinking == "The user wants the weather."
    assert text.text == "Let me look."
    assert (weather.name, weather.input) == ("get_weather", {"city": "Tromsø", "days": 2})
    assert (time.name, time.input) == ("get_time", {"tz": "CET"})
    assert weather.id.startswith("toolu_") and weather.id != time.id
    assert message.stop_reason == "tool_use" and message.role == "assistant"
    with client.messages.stream(model="m", max_tokens=200, messages=ASK, tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == [b.type for b in message.content]
    for a, b in zip(streamed.content, message.content, strict=True):
        assert a.model_dump(exclude={"id"}) == b.model_dump(exclude={"id"})
    assert streamed.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    # thinking shown as omitted: its block stays, empty
    hidden = {"type": "adaptive", "display": "omitted"}
    message = client.messages.create(model="m", max_tokens=200, messages=ASK, thinking=hidden)
    with client.messages.stream(model="m", max_tokens=200, messages=ASK, thinking=hidden) as stream:
        streamed = stream.get_final_message()
    for reply in (message, streamed):
        assert reply.content[0].type == "thinking" and reply.content[0].thinking == ""


def test_a_request_renders_as_the_chat_it_means(tokenizer):
    """System blocks, an assistant turn's thinking, text and tool_use, and a user turn's
    tool_result and text make the prompt the same chat completion would."""
    worker, client = scripted(tokenizer, "Sunny.")
    client.messages.create(
        model="m",
        max_tokens=20,
        system=[{"type": "text", "text": "You are terse."},
                {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "5 C, snow"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
    )  # fmt: skip
    chat = {
        "messages": [
            {"role": "system", "content": "You are terse.\n\nUse tools."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
             "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "5 C, snow"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [{"type": "function", "function": {"name": t["name"],
                   "parameters": t["input_schema"], **({"description": t["description"]}
                   if "description" in t else {})}} for t in TOOLS],
    }  # fmt: skip
    served(worker).post("/v1/chat/completions", json=chat)
    anthropic_prompt, chat_prompt = worker.prompts
    assert anthropic_prompt == chat_prompt
    text = tokenizer.decode(chat_prompt, skip_special_tokens=False)
    assert '"arguments": {"city": "Oslo"}' in text and "5 C, snow" in text
    count = client.messages.count_tokens(model="m", messages=ASK, tools=TOOLS).input_tokens
    worker.prompts.clear()
    client.messages.create(model="m", max_tokens=5, messages=ASK, tools=TOOLS)
    assert count == len(worker.prompts[0])


def test_stop_sequences_and_forced_tool_choices(tokenizer):
    _, client = scripted(tokenizer, "Sunny and warm. END of report.")
    message = client.messages.create(model="m", max_tokens=50, messages=ASK,
                                     stop_sequences=["never", "END"])  # fmt: skip
    assert message.content[0].text == "Sunny and warm."
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    # any tool: the prompt opens a call, and the reply names the function
    worker, client = scripted(tokenizer, 'get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    message = client.messages.create(model="m", max_tokens=50, messages=ASK, tools=TOOLS,
                                     tool_choice={"type": "any"})  # fmt: skip
    assert [(b.name, b.input) for b in message.content] == [("get_time", {"tz": "UTC"})]
    assert message.stop_reason == "tool_use"
    opening = '<|im_start|>assistant\n<tool_call>\n{"name": "'
    assert tokenizer.decode(worker.prompts[-1], skip_special_tokens=False).endswith(opening)
    # one named tool, and no calls after the first
    worker, client = scripted(tokenizer, REPLY.split('"arguments": ', 1)[1])
    message = client.messages.create(
        model="m", max_tokens=80, messages=ASK, tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert [(b.name, b.input) for b in message.content] == [
        ("get_weather", {"city": "Tromsø", "days": 2})
    ]


def test_errors_have_anthropics_shape(tokenizer):
    _, client = scripted(tokenizer, "Sunny.")
    bad = [
        ({"max_tokens": 10, "messages": [*ASK, {"role": "assistant", "content": "It is"}]},
         "messages[1]"),
        ({"max_tokens": 10, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
         "'image' block"),
        ({"max_tokens": 10, "messages": ASK,
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "custom tools"),
        ({"max_tokens": 10, "messages": ASK, "thinking": {"type": "always"}}, "thinking"),
        ({"max_tokens": 10, "messages": ASK, "output_config": {"format": {
            "type": "json_schema", "schema": {"type": "object"}}}}, "structured output"),
        ({"max_tokens": 10, "messages": ASK, "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "nope"}}, "not among the request's tools"),
    ]  # fmt: skip
    for body, why in bad:
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model="m", **body)
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        assert why in caught.value.body["error"]["message"]
    http = client._client
    r = http.post("/v1/messages", json={"model": "m", "messages": ASK})  # no max_tokens
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    r = http.get("/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post(
        "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["type"] == "error"


# a real engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = synthesize(
        tmp_path_factory.mktemp("thinking-model"),
        preset="tiny",
        routing_skew=1.0,
        seed=23,
        chat_template="qwen3_thinking",
    )
    engine = serve(
        model, tmp_path_factory.mktemp("log"), "--moe-cache-rate", "0.5",
        "--served-model-name", "tiny-agent", "--reasoning-parser", "think", "--api-key", KEY,
        "--max-context", "512",  # a reply that runs to the context's end stays short
    )  # fmt: skip
    yield engine
    stop_engine(engine)


@pytest.fixture()
def client(engine) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=engine.base_url, api_key=KEY, max_retries=0)


def test_a_real_engine_thinks_within_its_budget_then_answers_whole_and_streamed(client):
    kwargs = dict(
        model="tiny-agent", max_tokens=24, messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 6}, extra_body=GREEDY,
    )  # fmt: skip
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking and message.content[1].text
    assert message.usage.output_tokens == 24 and message.stop_reason == "max_tokens"
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    assert streamed.usage.output_tokens == 24
    # thinking disabled: the template's reasoning is closed in the prompt; the reply is text
    plain = client.messages.create(**{**kwargs, "thinking": {"type": "disabled"}})
    assert [b.type for b in plain.content] == ["text"]


def test_a_second_turn_reads_its_history_from_the_prefix_cache(client):
    system = "You answer questions about harbour towns. " * 12
    first_turn = [{"role": "user", "content": "Describe the harbour."}]
    kwargs = dict(model="tiny-agent", max_tokens=8, system=system,
                  thinking={"type": "disabled"}, extra_body={"temperature": 0})  # fmt: skip
    first = client.messages.create(messages=first_turn, **kwargs)
    assert first.usage.cache_read_input_tokens == 0
    second_turn = [*first_turn, {"role": "assistant", "content": "It is quiet."},
                   {"role": "user", "content": "And the market?"}]  # fmt: skip
    with client.messages.stream(messages=second_turn, **kwargs) as stream:
        second = stream.get_final_message()
    counted = client.messages.count_tokens(
        model="tiny-agent", system=system, messages=second_turn, thinking={"type": "disabled"}
    ).input_tokens
    usage = second.usage
    assert usage.cache_read_input_tokens >= 64 and usage.cache_read_input_tokens % 16 == 0
    assert usage.input_tokens + usage.cache_read_input_tokens == counted
    assert usage.cache_creation_input_tokens == 0


def test_max_tokens_past_the_context_ends_at_its_end(client, engine):
    context = httpx.get(engine.base_url + "/health").json()["max_model_len"]
    with client.messages.stream(
        model="tiny-agent", max_tokens=32000, messages=ASK,
        thinking={"type": "disabled"}, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        message = stream.get_final_message()
    total = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert message.usage.output_tokens == context - total
    assert message.stop_reason == "model_context_window_exceeded"


def test_a_forced_tool_call_opens_the_reply_of_a_real_engine(client):
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]
    message = client.messages.create(
        model="tiny-agent", max_tokens=6, messages=ASK, tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY,
    )  # fmt: skip
    # a random-weight model never closes the call: the reply is its text, from the opening on
    [text] = message.content
    assert text.text.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')


def test_the_key_is_taken_as_x_api_key_or_bearer_and_errors_are_anthropics(engine):
    ok = anthropic.Anthropic(base_url=engine.base_url, api_key=KEY, max_retries=0)
    assert ok.messages.count_tokens(model="tiny-agent", messages=ASK).input_tokens > 0
    bearer = anthropic.Anthropic(base_url=engine.base_url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model="tiny-agent", messages=ASK).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=engine.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="tiny-agent", max_tokens=4, messages=ASK)
    assert caught.value.body == {"type": "error", "error": {
        "type": "authentication_error",
        "message": "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
    }}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as caught:
        ok.messages.create(
            model="tiny-agent", max_tokens=4, messages=ASK, extra_body={"temperature": 5}
        )
    assert "temperature" in caught.value.body["error"]["message"]
    body = {"model": "tiny-agent", "max_tokens": 4, "messages": ASK, "stream": True,
            "temperature": 0, "thinking": {"type": "disabled"}}  # fmt: skip
    r = httpx.post(engine.base_url + "/v1/messages", headers={"x-api-key": KEY}, json=body)
    events = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event:")]
    data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert [d["type"] for d in data] == events
