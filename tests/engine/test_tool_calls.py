"""Tool calls taken out of a chat reply (engine/serving/tool_calls.py), whole and streamed, and
through the server's chat endpoint with a scripted engine thread (the reply's tokens given, the
HTTP side and the tokenizer real)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from moelab.engine.config.config import EngineConfig
from moelab.engine.model.synth_tokenizer import (
    CHAT_TEMPLATE,
    CODER_CHAT_TEMPLATE,
    write_tokenizer_files,
)
from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.serving.server import Server
from moelab.engine.serving.tool_calls import (
    ToolCallStream,
    ToolParser,
    parser_for,
    split_reply,
    typed,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Tromsø", "days": 2}}'
REPLY = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + (
    '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>'
)


def _named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_whole_reply_splits_into_content_and_calls():
    content, calls = split_reply(REPLY)
    assert content == "Let me look."
    assert _named(calls) == [("get_weather", {"city": "Tromsø", "days": 2}),
                             ("get_time", {"tz": "CET"})]  # fmt: skip
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # no call: the text as it was; a block that is no call stays text, as written
    assert split_reply("  just words  ") == ("  just words  ", [])
    broken = "<tool_call>{not json}</tool_call> and <tool_call>[1, 2]</tool_call>"
    assert split_reply(broken) == (broken, [])
    # OpenAI's "parameters" spelling
    assert _named(
        split_reply('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')[1]
    ) == [("f", {"x": 1})]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_streamed_pieces_of_any_size_give_the_whole_replys_split(size):
    stream = ToolCallStream()
    content, calls = "", []
    for i in range(0, len(REPLY), size):
        text, made = stream.feed(REPLY[i : i + size])
        content, calls = content + text, calls + made
        assert "<" not in text  # no piece of a tag: REPLY's only "<" begin tags
    rest, more = stream.flush()
    assert (content + rest).strip() == "Let me look." and not more
    assert _named(calls) == _named(split_reply(REPLY)[1])
    assert stream.calls_made == 2


def test_a_tags_start_is_held_only_while_it_may_be_one():
    stream = ToolCallStream()
    assert stream.feed("a <tool_c") == ("a ", [])
    assert stream.feed("x b") == ("<tool_cx b", [])
    # a block the reply never closed comes out as text at the end
    assert stream.feed('<tool_call>{"name": ') == ("", [])
    assert stream.flush() == ('<tool_call>{"name": ', [])


class ScriptedWorker:
    """The engine thread's stand-in: the requests are answered with the replies' tokens in turn
    (one reply: every request with it), the last one ending it; `prompts` holds the prompt ids
    it was given, `requests` the requests themselves, `cancelled` the number of requests
    cancelled; `checkpointing`: an engine that keeps state checkpoints (a hybrid model's)."""

    status = "ok"

    def __init__(self, tokenizer: Tokenizer, *replies: str, checkpointing: bool = False) -> None:
        self.replies = [tokenizer.encode(reply) for reply in replies]
        spec = SimpleNamespace(vocab_size=tokenizer.vocab_size)
        scheduler = SimpleNamespace(checkpointing=checkpointing)
        self.engine = SimpleNamespace(
            tokenizer=tokenizer, spec=spec, max_context=4096, scheduler=scheduler
        )
        self.prompts: list[list[int]] = []
        self.requests: list = []
        self.cancelled = 0

    def submit(self, req, limit: int) -> None:
        ids = self.replies[len(self.prompts) % len(self.replies)]
        self.prompts.append(req.prompt_ids)
        self.requests.append(req)
        for i, token in enumerate(ids):
            req.deliver((token, "stop" if i == len(ids) - 1 else None, None))

    def cancel(self, req) -> None:
        self.cancelled += 1


def _app(tokenizer: Tokenizer, reply: str, reasoning: str = "off") -> TestClient:
    return served(ScriptedWorker(tokenizer, reply), reasoning)


def served(worker: ScriptedWorker, reasoning: str = "off", *flags: str) -> TestClient:
    """The server's app over `worker` with `moelab serve` flags, asked from this machine."""
    config = EngineConfig.from_flags([
        "--model-path", "m", "--served-model-name", "m", "--max-running-requests", "8",
        "--max-queued-requests", "8", "--generation-config", "off",
        "--reasoning-parser", reasoning, "--host", "127.0.0.1", *flags,
    ])  # fmt: skip
    return TestClient(Server(config, worker).app, base_url="http://127.0.0.1:8000")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ASK = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}


def test_the_chat_endpoint_answers_tool_calls_whole_and_streamed(tokenizer):
    client = _app(tokenizer, REPLY)
    choice = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    assert _named(choice["message"]["tool_calls"]) == _named(split_reply(REPLY)[1])
    with client.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me look."
    streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in streamed] == [0, 1]
    assert _named(streamed) == _named(choice["message"]["tool_calls"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # tool_choice "none", or no tools: the reply is text, tags and all
    for body in ({**ASK, "tool_choice": "none"}, {"messages": ASK["messages"]}):
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["message"]["content"] == REPLY and choice["finish_reason"] == "stop"
        assert "tool_calls" not in choice["message"]


def test_a_reply_without_calls_is_plain_content(tokenizer):
    client = _app(tokenizer, "Sunny, <tool_cx> not a tag.")
    choice = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Sunny, <tool_cx> not a tag."}
    assert choice["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def coder_tokenizer(tmp_path_factory) -> Tokenizer:
    """The synthetic tokenizer with Qwen3-Coder's chat template (the XML form)."""
    path = tmp_path_factory.mktemp("coder")
    write_tokenizer_files(path, 2048, "qwen3_coder")
    return Tokenizer(path)


def _history(arguments: str) -> dict:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
    ]}  # fmt: skip


def test_a_history_with_a_tool_call_renders_where_the_template_iterates_its_arguments(
    coder_tokenizer,
):
    worker = ScriptedWorker(coder_tokenizer, "Sunny in Paris.")
    client = served(worker)
    r = client.post("/v1/chat/completions", json=_history('{"city": "Paris", "days": 2}'))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Sunny in Paris."
    prompt = coder_tokenizer.decode(worker.prompts[-1], skip_special_tokens=False)
    assert (
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>"
    ) in prompt
    where = "messages[1].tool_calls[0].function.arguments"
    for arguments, why in (("{not json", "is not valid JSON"), ('["Paris"]', "JSON object")):
        r = client.post("/v1/chat/completions", json=_history(arguments))
        assert r.status_code == 400 and r.json()["error"]["param"] == where, r.text
        assert why in r.json()["error"]["message"]


# Qwen3-Coder's form: two calls, values of three types, one spanning lines
XML_REPLY = (
    "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nTromsø\n</parameter>\n"
    '<parameter=days>\n2\n</parameter>\n<parameter=detail>\n{"wind": true}\n</parameter>\n'
    "</function>\n</tool_call>\n<tool_call>\n<function=run>\n<parameter=command>\nls -l\n"
    "echo 1\n</parameter>\n</function>\n</tool_call>"
)
SCHEMA_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "detail": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}},
]  # fmt: skip
XML_CALLS = [
    ("get_weather", {"city": "Tromsø", "days": 2, "detail": {"wind": True}}),
    ("run", {"command": "ls -l\necho 1"}),
]
XML = ToolParser.of("qwen_xml", SCHEMA_TOOLS)


def test_the_xml_form_splits_into_calls_with_values_typed_by_the_schema():
    content, calls = XML.split(XML_REPLY)
    assert content == "I will check."
    assert _named(calls) == XML_CALLS
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # a block in the other form stays text
    hermes = '<tool_call>{"name": "run", "arguments": {}}</tool_call>'
    assert XML.split(hermes) == (hermes, [])
    # a parameter or function the model left unclosed ends where the next begins, or the block
    loose = (
        "<tool_call>\n<function=run>\n<parameter=command>\nls\n<parameter=cwd>\n/tmp\n</tool_call>"
    )
    assert _named(XML.split(loose)[1]) == [("run", {"command": "ls", "cwd": "/tmp"})]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_the_xml_form_streamed_in_pieces_of_any_size_gives_the_whole_replys_split(size):
    stream = XML.stream()
    content, calls = "", []
    for i in range(0, len(XML_REPLY), size):
        text, made = stream.feed(XML_REPLY[i : i + size])
        content, calls = content + text, calls + made
        assert "<" not in text
    rest, more = stream.flush()
    assert (content + rest).strip() == "I will check." and not more
    assert _named(calls) == XML_CALLS


def test_a_value_is_typed_only_where_its_schema_asks_and_the_text_is_one():
    assert typed("2", {"type": "integer"}) == 2
    assert typed("2.0", {"type": "integer"}) == 2
    assert typed("2.5", {"type": "number"}) == 2.5
    assert typed("two", {"type": "integer"}) == "two"
    assert typed("2", {"type": "string"}) == "2"
    assert typed("2", None) == "2"  # a parameter the schema does not name
    assert typed("True", {"type": "boolean"}) is True
    assert typed("null", {"type": ["string", "null"]}) is None
    assert typed("null", {"type": "string"}) == "null"
    assert typed("[1, 2]", {"anyOf": [{"type": "array"}, {"type": "string"}]}) == [1, 2]
    assert typed("NaN", {"type": "number"}) == "NaN"  # no JSON number
    assert typed(" keep  ", {"type": "string"}) == " keep  "


def test_the_form_is_the_chat_templates_unless_the_flag_names_one():
    assert parser_for(CHAT_TEMPLATE) == "hermes"
    assert parser_for(CODER_CHAT_TEMPLATE) == "qwen_xml"
    assert parser_for("{{ messages }}") is None and parser_for(None) is None
    assert parser_for("{{ messages }}", "qwen_xml") == "qwen_xml"
    assert parser_for(CODER_CHAT_TEMPLATE, "hermes") == "hermes"


def _events(client: TestClient, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _streamed_calls(events: list[dict]) -> list[dict]:
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    return [d["tool_calls"][0] for d in deltas if "tool_calls" in d]


def test_the_chat_endpoint_reads_calls_in_the_form_of_the_template_or_the_flag(coder_tokenizer):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": SCHEMA_TOOLS}
    client = served(ScriptedWorker(coder_tokenizer, XML_REPLY))
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"] == "I will check."
    assert _named(choice["message"]["tool_calls"]) == XML_CALLS
    assert choice["finish_reason"] == "tool_calls"
    events = _events(client, body)
    assert _named(_streamed_calls(events)) == XML_CALLS
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    hermes = served(
        ScriptedWorker(coder_tokenizer, XML_REPLY), "off", "--tool-call-parser", "hermes"
    )
    choice = hermes.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"] == XML_REPLY and choice["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory) -> Tokenizer:
    """The synthetic tokenizer with a template whose generation prompt opens <think>."""
    path = tmp_path_factory.mktemp("thinking")
    write_tokenizer_files(path, 2048, "qwen3_thinking")
    return Tokenizer(path)


def test_a_forced_call_opens_in_the_prompt_and_the_reply_goes_on_inside_it(
    tokenizer, coder_tokenizer, thinking_tokenizer
):
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [
        # Hermes, a named function: the reply begins with its arguments
        (tokenizer, named, '{"city": "Oslo"}}\n</tool_call>',
         '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '),
        # the XML form, any function: the reply begins with its name
        (coder_tokenizer, "required",
         "get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
         "<|im_start|>assistant\n<tool_call>\n<function="),
        # a prompt that opens the reasoning has it closed empty before the call
        (thinking_tokenizer, "required", 'get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
         '<think>\n\n</think>\n\n<tool_call>\n{"name": "'),
    ]  # fmt: skip
    for tok, choice, reply, opening in cases:
        worker = ScriptedWorker(tok, reply)
        client = served(worker, "think")
        body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": SCHEMA_TOOLS,
                "tool_choice": choice}  # fmt: skip
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert tok.decode(worker.prompts[-1], skip_special_tokens=False).endswith(opening)
        assert _named(message["tool_calls"]) == [("get_weather", {"city": "Oslo"})], message
        assert message["reasoning_content"] is None
        assert _named(_streamed_calls(_events(client, body))) == [("get_weather", {"city": "Oslo"})]


def test_a_forced_choice_that_cannot_be_made_is_refused(tokenizer, tmp_path):
    client = _app(tokenizer, REPLY)
    for body, why in [
        ({**ASK, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not among the request's tools"),
        ({"messages": ASK["messages"], "tool_choice": "required"}, "gives no tools"),
        ({**ASK, "tool_choice": "always"}, "must be"),
        ({**ASK, "parallel_tool_calls": "no"}, "true or false"),
    ]:  # fmt: skip
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert why in r.json()["error"]["message"]
    # a template that writes no tool calls: a call is forced only in the form the flag names
    write_tokenizer_files(tmp_path, 2048)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    plain = "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": plain}))
    worker = ScriptedWorker(Tokenizer(tmp_path), '{"city": "Oslo"}}</tool_call>')
    body = {**ASK, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = served(worker).post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    r = served(worker, "off", "--tool-call-parser", "hermes").post(
        "/v1/chat/completions", json=body
    )
    assert _named(r.json()["choices"][0]["message"]["tool_calls"]) == [
        ("get_weather", {"city": "Oslo"})
    ]


def test_without_parallel_tool_calls_the_reply_ends_at_its_first_call(tokenizer):
    worker = ScriptedWorker(tokenizer, REPLY)
    client = served(worker)
    body = {**ASK, "parallel_tool_calls": False}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert _named(choice["message"]["tool_calls"]) == [
        ("get_weather", {"city": "Tromsø", "days": 2})
    ]
    assert choice["finish_reason"] == "tool_calls"
    cancelled = worker.cancelled
    events = _events(client, body)
    assert _named(_streamed_calls(events)) == [("get_weather", {"city": "Tromsø", "days": 2})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert worker.cancelled > cancelled  # the engine stops generating at the call
