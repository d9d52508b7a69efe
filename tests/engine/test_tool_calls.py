"""Tool calls taken out of a chat reply (engine/serving/tool_calls.py), whole and streamed, and
through the server's chat endpoint with a scripted engine thread (the reply's tokens given, the
HTTP side and the tokenizer real)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from moelab.engine.config.config import EngineConfig
from moelab.engine.model.synth_tokenizer import write_tokenizer_files
from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.serving.server import Server
from moelab.engine.serving.tool_calls import ToolCallStream, split_reply

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
    """The engine thread's stand-in: every request is answered with `reply`'s tokens, the last
    one ending it; `prompts` holds the prompt ids it was given."""

    status = "ok"

    def __init__(self, tokenizer: Tokenizer, reply: str) -> None:
        self.ids = tokenizer.encode(reply)
        spec = SimpleNamespace(vocab_size=tokenizer.vocab_size)
        self.engine = SimpleNamespace(tokenizer=tokenizer, spec=spec, max_context=4096)
        self.prompts: list[list[int]] = []

    def submit(self, req, limit: int) -> None:
        self.prompts.append(req.prompt_ids)
        for i, token in enumerate(self.ids):
            req.deliver((token, "stop" if i == len(self.ids) - 1 else None, None))

    def cancel(self, req) -> None:
        pass


def _app(tokenizer: Tokenizer, reply: str, reasoning: str = "off") -> TestClient:
    return served(ScriptedWorker(tokenizer, reply), reasoning)


def served(worker: ScriptedWorker, reasoning: str = "off") -> TestClient:
    """The server's app over `worker`, asked from this machine."""
    config = EngineConfig.from_flags([
        "--model-path", "m", "--served-model-name", "m", "--max-running-requests", "8",
        "--max-queued-requests", "8", "--generation-config", "off",
        "--reasoning-parser", reasoning, "--host", "127.0.0.1",
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
    # a choice nothing could enforce
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.post("/v1/chat/completions", json={**ASK, "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_a_reply_without_calls_is_plain_content(tokenizer):
    client = _app(tokenizer, "Sunny, <tool_cx> not a tag.")
    choice = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Sunny, <tool_cx> not a tag."}
    assert choice["finish_reason"] == "stop"


# Qwen3-Coder's way of writing an assistant's tool calls (Qwen3.5's is the same): each argument
# as a <parameter=...> block, iterating the arguments' items, which needs them as a mapping
CODER_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments|items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
    "{%- set args_value = args_value if args_value is string else args_value|tojson|safe %}"
    "{{- args_value }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def coder_tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("coder")
    write_tokenizer_files(path, 2048)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": CODER_TEMPLATE})
    )
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
