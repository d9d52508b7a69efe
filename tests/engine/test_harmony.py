"""gpt-oss's chat format (engine/serving/harmony.py, the synthetic checkpoints' harmony template in
engine/model/synth_harmony.py): replies read whole and streamed, prompts rendered as
openai-harmony renders them, and the server's chat and Messages endpoints over a scripted engine
thread (tests/engine/test_tool_calls.py) with a harmony tokenizer."""

from __future__ import annotations

import json
from datetime import date

import pytest

from moelab.engine.model.synth_tokenizer import chat_template_for, write_tokenizer_files
from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.serving import harmony
from moelab.engine.serving.harmony import HarmonyStream, Header, split_harmony

from .test_tool_calls import ScriptedWorker, _named, served

THOUGHT = 'User asks: "What is the weather in Oslo?" Need to use get_weather.'
ANSWER = "It is sunny in Oslo."
CALL = '{"city": "Oslo", "days": 2}'
# what gpt-oss writes after the prompt's <|start|>assistant
REASONED = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
CALLED = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    f"<|message|>{CALL}<|call|>"
)


def _streamed(text: str, size: int, calls: bool = True, limit: int | None = None):
    stream = HarmonyStream(calls, limit)
    reasoning = content = ""
    made: list[dict] = []
    for i in range(0, len(text), size):
        r, c, m = stream.feed(text[i : i + size])
        reasoning, content, made = reasoning + r, content + c, made + m
    r, c, m = stream.flush()
    return reasoning + r, content + c, _named(made + m)


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "calls"),
    [
        (REASONED, THOUGHT, ANSWER, []),
        (CALLED, THOUGHT, "Checking the forecast.", [("get_weather", {"city": "Oslo", "days": 2})]),
        # the recipient in the role part, <|constrain|> right after the channel (as gpt-oss
        # writes it at times), and a call without arguments
        (
            "<|start|>assistant to=functions.get_weather<|channel|>commentary<|constrain|>json"
            f"<|message|>{CALL}<|call|>",
            None,
            "",
            [("get_weather", {"city": "Oslo", "days": 2})],
        ),
        ("<|channel|>commentary to=functions.now<|message|><|call|>", None, "", [("now", {})]),
        # cut short (max_tokens) inside the reasoning: all reasoning; inside the answer: its part
        ("<|channel|>analysis<|message|>half a thou", "half a thou", "", []),
        (
            "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>"
            "Sun",
            "x",
            "Sun",
            [],
        ),
        # a call cut short, or whose body is no JSON object: its body as content, as written
        (
            '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ',
            None,
            '{"a": ',
            [],
        ),
        ("<|channel|>commentary to=functions.f<|message|>[1, 2]<|call|>", None, "[1, 2]", []),
        # a reply in no harmony form: content as written, less its end token; a header cut
        # short (by max_tokens, or an end token): dropped
        ("just words, no channel", None, "just words, no channel", []),
        ("words, then the end<|return|>", None, "words, then the end", []),
        ("<|channel|>commentary to=functions.<|call|>", None, "", []),
        (f"<|channel|>final<|message|>{ANSWER}<|end|><|start|>assistant<|chan", None, ANSWER, []),
        # <|endoftext|>, gpt-oss's other end token, ends the reply too
        ("<|channel|>final<|message|>Sun.<|endoftext|>", None, "Sun.", []),
        # special-token lookalikes in a body stay text
        ("<|channel|>final<|message|>a <|b|> <|en c<|return|>", None, "a <|b|> <|en c", []),
    ],
)
def test_whole_and_streamed_replies_split_alike(text, reasoning, content, calls):
    whole = split_harmony(text)
    assert (whole[0], whole[1], _named(whole[2])) == (reasoning, content, calls)
    for size in (1, 2, 3, 5, 8, 13, 1000):
        assert _streamed(text, size) == (reasoning or "", content, calls), size


def test_a_streamed_reply_gives_its_reasoning_and_answer_as_they_come():
    stream = HarmonyStream()
    assert stream.feed("<|channel|>analysis<|mess") == ("", "", [])
    assert stream.feed("age|>Think") == ("Think", "", [])
    assert stream.inside
    assert stream.feed("ing.<|e") == ("ing.", "", [])  # a special token's start is held
    assert stream.feed("nd|><|start|>assistant<|channel|>final<|message|>Sun") == ("", "Sun", [])
    assert not stream.inside
    # a call's body is held until its end, then given as the call
    assert (
        stream.feed('<|end|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{"a"')[
            2
        ]
        == []
    )
    _, _, made = stream.feed(": 1}<|call|>")
    assert _named(made) == [("f", {"a": 1})]


def test_without_tools_a_call_is_content_and_a_limit_ends_the_reply():
    assert _streamed(CALLED, 4, calls=False) == (THOUGHT, "Checking the forecast." + CALL, [])
    twice = CALLED + "<|start|>assistant<|channel|>commentary to=functions.g<|message|>{}<|call|>"
    stream = HarmonyStream(limit=1)
    _, _, made = stream.feed(twice)
    assert _named(made) == [("get_weather", {"city": "Oslo", "days": 2})] and stream.full
    assert stream.feed("<|start|>assistant<|channel|>final<|message|>more") == ("", "", [])
    assert split_harmony(twice)[2][1]["function"]["name"] == "g"


@pytest.mark.parametrize(
    ("header", "channel", "recipient"),
    [
        ("<|channel|>analysis", "analysis", None),
        (
            "assistant<|channel|>commentary to=functions.a.b <|constrain|>json",
            "commentary",
            "functions.a.b",
        ),
        ("assistant to=functions.f<|channel|>commentary json", "commentary", "functions.f"),
        ("assistant to=browser.search<|channel|>analysis", "analysis", "browser.search"),
        ("assistant", None, None),
    ],
)
def test_a_header_gives_its_channel_and_recipient(header, channel, recipient):
    assert Header.parse(header) == Header(channel, recipient)


# the prompt ----------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_location",
                                      "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string",
                         "description": "The city and state, e.g. San Francisco, CA"},
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        }, "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "get_multiple_weathers",
        "description": "Gets the current weather in the provided list of locations.",
        "parameters": {"type": "object", "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", '
                                         '"New York, NY"]'},
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        }}}},
]  # fmt: skip


def _system(effort: str, tools: bool) -> str:
    """The system message as openai-harmony renders it (its format guide's example, with
    today's date as gpt-oss's template writes it)."""
    text = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {date.today():%Y-%m-%d}\n\n"
        f"Reasoning: {effort}\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message."
    )
    if tools:
        text += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return text + "<|end|>"


# openai-harmony's rendering of the developer message with these tools (its format guide)
DEVELOPER = """<|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations?: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|>"""


def test_the_template_renders_the_effort_the_tools_and_the_turns(harmony_tokenizer):
    tok = harmony_tokenizer
    ask = [{"role": "user", "content": "What is 2 + 2?"}]
    plain = tok.apply_chat_template(ask)
    assert plain == (
        _system("medium", False) + "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"
    )
    for effort in harmony.EFFORTS:
        assert tok.apply_chat_template(ask, reasoning_effort=effort).startswith(
            _system(effort, False)
        )
    turns = [
        {"role": "system", "content": "Use a friendly tone."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Simple."},
        {"role": "user", "content": "What is the weather like in SF?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need to use get_weather.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": {"location": "San Francisco"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true}'},
    ]  # fmt: skip
    rendered = tok.apply_chat_template(turns, tools=TOOLS, reasoning_effort="high")
    # an earlier turn's reasoning is dropped, the one after the last user message kept
    assert rendered == (
        _system("high", True) + DEVELOPER + "<|start|>user<|message|>What is 2 + 2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4.<|end|>"
        "<|start|>user<|message|>What is the weather like in SF?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need to use get_weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"location": "San Francisco"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '{"sunny": true}<|end|><|start|>assistant'
    )
    # the format's tokens are the tokenizer's special tokens: one token each
    for marker in harmony.MARKERS:
        assert len(tok.encode(marker)) == 1, marker
    assert tok.decode(tok.encode(rendered), skip_special_tokens=False) == rendered
    assert {tok.token_to_id(t) for t in ("<|return|>", "<|call|>")} <= tok.eos_token_ids


# the server ----------------------------------------------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ASK = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": WEATHER}


def _events(client, body: dict, path: str = "/v1/chat/completions") -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        return [json.loads(line.split("data: ", 1)[1]) for line in r.iter_lines()
                if line.startswith("data: {")]  # fmt: skip


def test_the_chat_endpoint_reads_a_harmony_reply_whole_and_streamed(harmony_tokenizer):
    # no --reasoning-parser: the template's format chooses harmony
    client = served(ScriptedWorker(harmony_tokenizer, CALLED))
    choice = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == THOUGHT
    assert choice["message"]["content"] == "Checking the forecast."
    assert _named(choice["message"]["tool_calls"]) == [("get_weather", {"city": "Oslo", "days": 2})]
    assert choice["finish_reason"] == "tool_calls"
    events = _events(client, ASK)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content", "") for d in deltas) == "Checking the forecast."
    streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in streamed] == [0]
    assert _named(streamed) == _named(choice["message"]["tool_calls"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # no special token's text reaches the client
    assert not any("<|" in json.dumps(d) for d in deltas)
    answered = served(ScriptedWorker(harmony_tokenizer, REASONED))
    message = answered.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}


def test_the_request_sets_the_reasoning_effort_and_forces_calls(harmony_tokenizer):
    tok = harmony_tokenizer
    worker = ScriptedWorker(tok, "<|message|>{}<|call|>")
    client = served(worker)
    body = {**ASK, "reasoning_effort": "low"}
    client.post("/v1/chat/completions", json=body)
    prompt = tok.decode(worker.prompts[-1], skip_special_tokens=False)
    assert "\nReasoning: low\n" in prompt and prompt.endswith("<|start|>assistant")
    r = client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    # a forced call: the prompt opens it, and the reply goes on inside it
    forced = {**ASK, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    client = served(ScriptedWorker(tok, '{"city": "Oslo"}<|call|>'))
    choice = client.post("/v1/chat/completions", json=forced).json()["choices"][0]
    assert _named(choice["message"]["tool_calls"]) == [("get_weather", {"city": "Oslo"})]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    worker = ScriptedWorker(tok, 'get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')
    client = served(worker)
    choice = client.post("/v1/chat/completions", json={**ASK, "tool_choice": "required"}).json()
    assert _named(choice["choices"][0]["message"]["tool_calls"]) == [
        ("get_weather", {"city": "Oslo"})
    ]
    prompt = tok.decode(worker.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith("<|start|>assistant<|channel|>commentary to=functions.")
    # tool_choice none: a call the model writes anyway is content
    client = served(ScriptedWorker(tok, CALLED))
    message = client.post("/v1/chat/completions", json={**ASK, "tool_choice": "none"}).json()
    assert message["choices"][0]["message"]["content"] == "Checking the forecast." + CALL


def test_a_reasoning_budget_ends_the_analysis_and_the_answer_follows(harmony_tokenizer):
    tok = harmony_tokenizer
    thought = "<|channel|>analysis<|message|>one two three four five six seven"
    worker = ScriptedWorker(tok, thought, f"{ANSWER}<|return|>")
    client = served(worker, "off", "--reasoning-budget", "3")
    ask = {"messages": ASK["messages"]}
    message = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]
    reply = tok.encode(thought)
    inside = reply[: len(tok.encode("<|channel|>analysis<|message|>")) + 3]
    assert message["reasoning_content"] == "one two three"
    assert message["content"] == ANSWER
    prompt, continuation = worker.prompts
    assert continuation == prompt + inside + tok.encode(harmony.CLOSING)
    # streamed alike
    deltas = [e["choices"][0]["delta"] for e in _events(client, ask) if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "one two three"
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    # 0: the prompt begins the answer itself
    worker = ScriptedWorker(tok, f"{ANSWER}<|return|>")
    client = served(worker)
    body = {**ask, "reasoning_budget": 0}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER, "reasoning_content": None}
    prompt = tok.decode(worker.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith("<|start|>assistant<|channel|>final<|message|>")


def test_the_messages_endpoint_gives_thinking_and_tool_use_blocks(harmony_tokenizer):
    tok = harmony_tokenizer
    worker = ScriptedWorker(tok, CALLED)
    client = served(worker)
    body = {
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "thinking": {"type": "enabled", "budget_tokens": 10000},
    }
    message = client.post("/v1/messages", json=body).json()
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0]["thinking"] == THOUGHT
    assert message["content"][2]["input"] == {"city": "Oslo", "days": 2}
    assert message["stop_reason"] == "tool_use"
    # the thinking budget asks for an effort; output_config.effort names one
    assert "\nReasoning: medium\n" in tok.decode(worker.prompts[-1], skip_special_tokens=False)
    client.post("/v1/messages", json={**body, "output_config": {"effort": "high"}})
    assert "\nReasoning: high\n" in tok.decode(worker.prompts[-1], skip_special_tokens=False)
    r = client.post("/v1/messages", json={**body, "output_config": {"effort": "max"}})
    assert r.status_code == 400 and "output_config.effort" in r.json()["error"]["message"]
    events = _events(client, body, "/v1/messages")
    kinds = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert kinds == ["thinking", "text", "tool_use"]
    assert (
        "".join(
            e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta"
        )
        == THOUGHT
    )


def test_the_flags_choose_harmony_for_a_template_that_does_not_say(tokenizer):
    # the Qwen template writes no channels: --reasoning-parser harmony reads the reply so
    client = served(ScriptedWorker(tokenizer, "<|channel|>final<|message|>Hi."), "harmony")
    message = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
    # the Qwen tokenizer has no harmony tokens: their text comes through as text, and reads so
    assert message == {"role": "assistant", "content": "Hi.", "reasoning_content": None}
    client = served(ScriptedWorker(tokenizer, CALLED), "off", "--tool-call-parser", "harmony")
    message = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
    assert _named(message["tool_calls"]) == [("get_weather", {"city": "Oslo", "days": 2})]


def test_the_history_reaches_gpt_osss_template_as_it_reads_it(tmp_path):
    write_tokenizer_files(tmp_path, 2048, "gpt_oss")
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    # gpt-oss's own template reads an assistant's reasoning as `thinking`, and refuses a message
    # with calls that has both a content and a thinking
    config["chat_template"] = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}"
        "{%- if m.tool_calls and m.content and m.thinking %}"
        "{{- raise_exception('Cannot pass both content and thinking') }}{%- endif %}"
        "{%- if m.thinking %}"
        "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
        "{%- endif %}"
        "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}"
        "{%- endif %}{%- endfor %}{{- '<|start|>assistant' }}"
    )
    path.write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    worker = ScriptedWorker(tok, REASONED)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}  # fmt: skip
    history = [
        *ASK["messages"],
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the weather.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    r = served(worker).post("/v1/chat/completions", json={**ASK, "messages": history})
    assert r.status_code == 200, r.json()
    prompt = tok.decode(worker.prompts[-1], skip_special_tokens=False)
    assert "<|channel|>analysis<|message|>Need the weather.<|end|>" in prompt
    assert "Checking." not in prompt


def test_a_gpt_oss_checkpoint_gets_the_harmony_template_unless_told():
    assert chat_template_for("gpt_oss") == "gpt_oss"
    assert chat_template_for("gpt_oss", "qwen3_coder") == "qwen3_coder"
    assert chat_template_for("qwen3_moe") == "qwen3"
