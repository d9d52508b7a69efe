"""gpt-oss's chat format through `moelab serve` as a real process: synthetic checkpoints with the
harmony tokenizer and chat template (`moelab synth --chat-template gpt_oss`, gpt_oss's default),
their replies steered by logit_bias (the weights are random), read by the OpenAI client whole and
streamed."""

from __future__ import annotations

import json

import pytest

from moelab.engine.model.spec import ARCHITECTURES
from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.process.launch import stop_engine
from moelab.engine.synth_checkpoint import synthesize

from .served import serve

openai = pytest.importorskip("openai", reason="the openai client is a test dependency")

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


# the checkpoints: the harmony tokenizer on a Qwen3 MoE, and on gpt-oss's own architecture with
# its experts in MXFP4 as OpenAI ships them, where the engine has it
CHECKPOINTS = [{"arch": "qwen3_moe", "chat_template": "gpt_oss"}]
if "gpt_oss" in ARCHITECTURES:
    CHECKPOINTS.append({"arch": "gpt_oss", "dtype": "mxfp4"})


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=lambda c: c["arch"])
def model(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("harmony-served")
    return synthesize(out, preset="tiny", seed=5, **request.param)


@pytest.fixture(scope="module")
def client(model, tmp_path_factory):
    engine = serve(model, tmp_path_factory.mktemp("log"), "--served-model-name", "oss")
    yield openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0)
    stop_engine(engine)


def _ask(client, stream: bool = False, **kwargs):
    return client.chat.completions.create(
        model="oss", messages=ASK, temperature=0, stream=stream, **kwargs
    )


def _bias(tok: Tokenizer, text: str) -> dict:
    [token] = tok.encode(text)
    return {str(token): 100}


def test_a_forced_call_ends_at_call_and_comes_as_a_tool_call(client, model):
    tok = Tokenizer(model)
    # the prompt opens the call; the model (biased) ends it at once with <|call|>, an end token
    kwargs = dict(
        tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=8,
        logit_bias=_bias(tok, "<|call|>"),
    )
    choice = _ask(client, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {})
    assert choice.message.content is None
    chunks = list(_ask(client, stream=True, **kwargs))
    [streamed] = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert streamed.function.name == "get_weather" and streamed.index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_answer_channel_is_content_and_the_effort_is_in_the_prompt(client, model):
    tok = Tokenizer(model)
    # a budget of 0 opens the final channel in the prompt; the reply (biased) repeats a word
    word = next(t for t in ("Sun", " the", "the") if len(tok.encode(t)) == 1)
    kwargs = dict(max_tokens=4, logit_bias=_bias(tok, word), extra_body={"reasoning_budget": 0})
    reply = _ask(client, **kwargs, reasoning_effort="low")
    message = reply.choices[0].message
    assert message.content == word * 4 and message.model_extra["reasoning_content"] is None
    prompt = tok.apply_chat_template(ASK, reasoning_effort="low") + "<|channel|>final<|message|>"
    assert reply.usage.prompt_tokens == len(tok.encode(prompt))
    assert "Reasoning: low" in prompt
    streamed = "".join(
        c.choices[0].delta.content or "" for c in _ask(client, stream=True, **kwargs) if c.choices
    )
    assert streamed == word * 4
    # the answer's end token ends the reply, and no special token's text reaches the client
    ended = _ask(client, max_tokens=8, logit_bias=_bias(tok, "<|return|>"),
                 extra_body={"reasoning_budget": 0}).choices[0]  # fmt: skip
    assert (ended.message.content, ended.finish_reason) == ("", "stop")
