"""A chat reply's reasoning taken out of its text (engine/serving/reasoning.py), whole and
streamed, and through the server's chat endpoint with a scripted engine thread
(tests/engine/test_tool_calls.py) and `--reasoning-parser think`."""

from __future__ import annotations

import json

import pytest

from moelab.engine.model.synth_tokenizer import CHAT_TEMPLATE, write_tokenizer_files
from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.serving.reasoning import (
    CLOSING,
    ReasoningBudget,
    ReasoningStream,
    opened_by_prompt,
    split_reasoning,
)

from .test_tool_calls import ASK, REPLY, ScriptedWorker, _app, _named, served, split_reply

THOUGHT = "The user wants the weather.\nI should call the tool."
REASONED = f"<think>\n{THOUGHT}\n</think>\n\nSunny in Oslo."


def _streamed(text: str, opened: bool, size: int) -> tuple[str, str]:
    stream = ReasoningStream(opened)
    reasoning = content = ""
    for i in range(0, len(text), size):
        r, c = stream.feed(text[i : i + size])
        reasoning, content = reasoning + r, content + c
    r, c = stream.flush()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "content"),
    [
        (REASONED, False, THOUGHT, "Sunny in Oslo."),
        # the prompt opened the block (DeepSeek-R1, Qwen3's thinking models of 2507)
        (f"{THOUGHT}\n</think>\n\nSunny.", True, THOUGHT, "Sunny."),
        # cut short (max_tokens) inside the reasoning: all reasoning
        ("<think>\nhalf a thou", False, "half a thou", ""),
        ("no tags at all ", False, None, "no tags at all "),
        # enable_thinking false: the template closed an empty block in the prompt
        ("Sunny.", False, None, "Sunny."),
        # a <think> after the reply began is text
        ("It said <think> once.", False, None, "It said <think> once."),
        ("  <think>x</think>y", False, "x", "y"),
        ("<think>\n\n</think>\n\nJust this.", False, None, "Just this."),
    ],
)
def test_whole_and_streamed_replies_split_alike(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)
    for size in (1, 2, 3, 5, 8, 1000):
        got = _streamed(text, opened, size)
        assert got == (reasoning or "", content), size


def test_a_tags_start_is_held_only_while_it_may_be_one():
    stream = ReasoningStream(False)
    assert stream.feed("  <thi") == ("", "")
    assert stream.feed("nk>a </thin") == ("a", "")
    assert stream.feed("g>  more") == (" </thing>  more", "")  # not the closing tag
    assert stream.feed("</think>\n") == ("", "")
    assert stream.feed("\nanswer") == ("", "answer")
    lone = ReasoningStream(False)
    assert lone.feed("<th") == ("", "") and lone.flush() == ("", "<th")


def test_the_prompt_opens_the_reasoning_where_it_ends_in_think(tmp_path):
    write_tokenizer_files(tmp_path, 2048)
    tok = Tokenizer(tmp_path)
    ask = [{"role": "user", "content": "hi"}]
    assert not opened_by_prompt(tok.apply_chat_template(ask))
    assert not opened_by_prompt(tok.apply_chat_template(ask, enable_thinking=False))
    assert opened_by_prompt("<|im_start|>assistant\n<think>\n")


def test_the_chat_endpoint_gives_reasoning_content_whole_and_streamed(tokenizer):
    client = _app(tokenizer, f"<think>\n{THOUGHT}\n</think>\n\n{REPLY}", reasoning="think")
    message = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT
    assert message["content"] == "Let me look."
    assert _named(message["tool_calls"]) == _named(split_reply(REPLY)[1])
    with client.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me look."
    # the reasoning comes before the content and the calls
    order = ["reasoning_content", "content", "tool_calls"]
    kinds = [next(k for k in order if d.get(k)) for d in deltas if any(map(d.get, order))]
    thought = [k == "reasoning_content" for k in kinds]
    assert thought == sorted(thought, reverse=True) and set(kinds) == set(order)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_the_reasoning_mentions_is_not_made(tokenizer):
    mention = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    client = _app(tokenizer, f"<think>I could write {mention}.</think>Sunny.", reasoning="think")
    choice = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]
    assert choice["message"] == {
        "role": "assistant", "content": "Sunny.", "reasoning_content": f"I could write {mention}."
    }  # fmt: skip
    assert choice["finish_reason"] == "stop"


def test_without_the_parser_or_reasoning_the_message_is_as_before(tokenizer):
    off = _app(tokenizer, REASONED)
    message = off.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": REASONED}
    plain = _app(tokenizer, "Sunny.", reasoning="think")
    body = {**ASK, "chat_template_kwargs": {"enable_thinking": False}}
    message = plain.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Sunny.", "reasoning_content": None}


def test_a_template_that_opens_the_reasoning_gives_it_without_the_tag(tmp_path):
    write_tokenizer_files(tmp_path, 2048)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # DeepSeek-R1's way: the generation prompt ends in an open <think>
    config["chat_template"] = (
        CHAT_TEMPLATE + "{%- if add_generation_prompt %}{{- '<think>\\n' }}{%- endif %}"
    )
    config_path.write_text(json.dumps(config))
    client = _app(Tokenizer(tmp_path), f"{THOUGHT}\n</think>\n\nSunny.", reasoning="think")
    message = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, "Sunny.")


def test_a_budget_counts_the_tokens_inside_the_block_and_ends_it_once_they_are_spent():
    # the prompt opened the block: every token counts
    budget = ReasoningBudget(3, opened=True)
    assert [budget.feed(t) for t in ("a", " b", " c", " d")] == [False, False, True, True]
    # the reply opens it: its tag does not count; a block closed in time needs no end
    budget = ReasoningBudget(2)
    assert [budget.feed(t) for t in ("<think>", "x", "</think>", "answer")] == [False] * 4
    budget = ReasoningBudget(2)
    assert [budget.feed(t) for t in ("<think>", "x", "y")] == [False, False, True]
    # no block at all: nothing to end
    budget = ReasoningBudget(0)
    assert [budget.feed(t) for t in ("plain", " text")] == [False, False]
    assert ReasoningBudget(0).feed("<think>")  # 0: the block ends as it opens


def _thinking_app(tmp_path, worker_replies: tuple[str, ...], *flags: str):
    write_tokenizer_files(tmp_path, 2048, "qwen3_thinking")
    tok = Tokenizer(tmp_path)
    worker = ScriptedWorker(tok, *worker_replies)
    return tok, worker, served(worker, "think", *flags)


def test_a_spent_budget_closes_the_reasoning_and_the_answer_follows(tmp_path):
    thought = "one two three four five six seven eight nine ten"
    tok, worker, client = _thinking_app(tmp_path, (thought, "Sunny."), "--reasoning-budget", "3")
    ask = {"messages": [{"role": "user", "content": "Weather?"}]}
    message = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]
    first = tok.encode(thought)[:3]
    assert message["reasoning_content"] == tok.decode(first).strip()
    assert message["content"] == "Sunny."
    # the first request was cancelled, and its continuation's prompt is the first's, the
    # reasoning's three tokens and the closing tag
    assert worker.cancelled == 1
    prompt, continuation = worker.prompts
    assert continuation == prompt + first + tok.encode(CLOSING)
    # streamed alike
    with client.stream("POST", "/v1/chat/completions", json={**ask, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == "Sunny."
    # a request's own budget wins; 0 closes the reasoning in the prompt itself
    body = {**ask, "reasoning_budget": 5}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == tok.decode(tok.encode(thought)[:5]).strip()
    requests = len(worker.prompts)
    message = client.post("/v1/chat/completions", json={**ask, "reasoning_budget": 0}).json()
    assert len(worker.prompts) == requests + 1  # no continuation
    assert tok.decode(worker.prompts[-1], skip_special_tokens=False).endswith("<think>\n" + CLOSING)
    r = client.post("/v1/chat/completions", json={**ask, "reasoning_budget": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_budget"


def test_a_budget_leaves_a_reply_that_thinks_within_it_alone(tmp_path):
    reply = "short\n</think>\n\nSunny."
    _, worker, client = _thinking_app(tmp_path, (reply,), "--reasoning-budget", "50")
    ask = {"messages": [{"role": "user", "content": "Weather?"}]}
    message = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("short", "Sunny.")
    assert worker.cancelled == 0 and len(worker.prompts) == 1
