"""Coding agents' sessions against one real engine on the tiny model with Qwen3-Coder's chat
template: the Claude-Code-shaped requests (tests/fixtures/agent_sessions) through the Messages
API with Anthropic's SDK, the Codex-shaped ones through the chat completions API with OpenAI's,
and `moelab bench agent` against that engine and against one it starts; the replayed session's
shape (engine/bench/agent_session.py) without an engine."""

from __future__ import annotations

import inspect
import itertools
import json
from pathlib import Path

import pytest

from moelab.engine.bench.agent_session import AgentSession, SessionShape
from moelab.engine.cli import main
from moelab.engine.process.launch import stop_engine
from moelab.engine.synth_checkpoint import synthesize

from .served import serve

anthropic = pytest.importorskip("anthropic", reason="Anthropic's SDK is a test dependency")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agent_sessions"
MODEL = "tiny-coder"
# each replayed turn's reply: the recorded max_tokens (32,000) would run to the context's end
REPLY_TOKENS = 12
PAGE = 16  # --kv-block-size


def recorded(name: str) -> list[dict]:
    """A fixture session's request bodies, in order."""
    return json.loads((FIXTURES / name).read_text())["requests"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(
        tmp_path_factory.mktemp("coder-model"),
        preset="tiny",
        routing_skew=1.0,
        seed=29,
        chat_template="qwen3_coder",
    )


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    engine = serve(model, tmp_path_factory.mktemp("log"), "--served-model-name", MODEL)
    yield engine
    stop_engine(engine)


def test_a_claude_code_session_runs_through_the_messages_api(engine):
    client = anthropic.Anthropic(base_url=engine.base_url, api_key="unused", max_retries=0)
    known = set(inspect.signature(client.messages.create).parameters)
    previous = 0
    for turn, body in enumerate(recorded("claude_code.json")):
        body = {**body, "model": MODEL, "max_tokens": REPLY_TOKENS, "ignore_eos": True}
        del body["stream"]
        kwargs = {k: v for k, v in body.items() if k in known}
        extra = {k: v for k, v in body.items() if k not in known}  # fields this SDK lacks
        with client.messages.stream(**kwargs, extra_body=extra) as stream:
            message = stream.get_final_message()
        usage = message.usage
        assert message.stop_reason == "max_tokens" and usage.output_tokens == REPLY_TOKENS
        counted = client.messages.count_tokens(
            **{k: v for k, v in kwargs.items() if k in ("model", "system", "tools", "messages")}
        ).input_tokens
        assert usage.input_tokens + usage.cache_read_input_tokens == counted
        # the history is the previous prompt, and the prefix cache holds its whole pages
        if turn:
            assert counted > previous
            assert previous - 2 * PAGE <= usage.cache_read_input_tokens <= previous
        previous = counted


def test_a_codex_session_runs_through_the_chat_completions_api(engine):
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0)
    previous = 0
    for turn, body in enumerate(recorded("codex.json")):
        body = {**body, "model": MODEL, "max_tokens": REPLY_TOKENS,
                "stream_options": {"include_usage": True}}  # fmt: skip
        chunks = list(client.chat.completions.create(**body, extra_body={"ignore_eos": True}))
        usage = chunks[-1].usage
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and usage.completion_tokens == REPLY_TOKENS
        cached = usage.prompt_tokens_details.cached_tokens
        if turn:
            assert usage.prompt_tokens > previous
            assert previous - 2 * PAGE <= cached <= previous
        previous = usage.prompt_tokens


def test_a_forced_call_in_the_xml_form_opens_the_reply_of_a_real_engine(engine):
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0)
    body = recorded("codex.json")[0]
    reply = client.chat.completions.create(
        model=MODEL, messages=body["messages"], tools=body["tools"], max_tokens=4,
        temperature=0, tool_choice={"type": "function", "function": {"name": "shell"}},
    )  # fmt: skip
    # a random-weight model never closes the call: the reply is its text, from the opening on
    assert reply.choices[0].message.content.startswith("<tool_call>\n<function=shell>\n")


def _bench(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = main(["bench", "agent", "--json", *args])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


SMALL = ("--turns", "3", "--system-tokens", "1500", "--tool-result-tokens", "100-200",
         "--reply-tokens", "6-10")  # fmt: skip


def test_the_agent_bench_replays_a_session_against_a_running_engine(engine, capsys):
    code, result, err = _bench(capsys, "--url", engine.base_url, *SMALL)
    assert code == 0, err
    turns = result["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert all(6 <= t["output_tokens"] <= 10 and t["ttft_s"] > 0 for t in turns)
    # each turn's prompt is the last one's and one more result: the cache holds most of it
    assert turns[0]["cached_tokens"] == 0
    assert all(t["hit_share"] > 0.5 for t in turns[1:])
    assert result["hit_share"] == pytest.approx(
        sum(t["cached_tokens"] for t in turns) / sum(t["prompt_tokens"] for t in turns)
    )
    assert result["session_s"] > 0 and result["agent_tok_s"] > 0 and result["decode_tok_s"] > 0
    assert result["max_model_len"] > turns[-1]["prompt_tokens"]
    assert "turn  prompt  cached" in err and "session: 3 turns" in err
    # a session longer than the context is refused before it starts
    code, result, err = _bench(capsys, "--url", engine.base_url, "--tool-result-tokens", "4000")
    assert code == 2 and result is None
    assert "tokens of context" in err and "--kv-reserve-tokens" in err


def test_the_agent_bench_starts_an_engine_of_its_own(model, tmp_path, capsys):
    flags = ("--model-path", str(model), "--device-memory", "1GiB", "--bank-dir",
             str(tmp_path / "bank"))  # fmt: skip
    code, result, err = _bench(capsys, *SMALL, "--", *flags)
    assert code == 0, err
    assert result["engine_flags"] == list(flags) and len(result["turns"]) == 3
    code, _, err = _bench(capsys, *SMALL)
    assert code == 2 and "--url" in err


# the session's shape, without an engine ----------------------------------------------------------


def test_a_shape_draws_the_same_sizes_from_its_seed_within_its_ranges():
    shape = SessionShape(turns=6, result_tokens=(10, 20), reply_tokens=(3, 5), seed=4)
    draws = shape.draws()
    assert draws == SessionShape(turns=6, result_tokens=(10, 20), reply_tokens=(3, 5),
                                 seed=4).draws()  # fmt: skip
    assert draws != SessionShape(turns=6, result_tokens=(10, 20), reply_tokens=(3, 5)).draws()
    assert draws[0][0] == 0 and all(10 <= result <= 20 for result, _ in draws[1:])
    assert all(3 <= reply <= 5 for _, reply in draws)
    for bad in ({"turns": 0}, {"result_tokens": (5, 2)}, {"reply_tokens": (0, 3)}):
        with pytest.raises(ValueError):
            SessionShape(**bad)


def test_a_shape_fitted_to_a_context_shrinks_its_system_prompt_and_results():
    shape = SessionShape()  # the issue's: 12k system prompt, 20 turns of 0.5-4k results
    assert shape.context_tokens > 32_768
    fitted = shape.fitted(32_768)
    assert fitted.context_tokens <= 32_768
    assert fitted.turns == shape.turns and fitted.reply_tokens == shape.reply_tokens
    assert fitted.system_tokens < shape.system_tokens
    assert shape.fitted(10**6) == shape


def test_each_request_of_a_session_is_the_last_one_and_one_more_turn():
    session = AgentSession(SessionShape(turns=4, system_tokens=300), 4.0, 100)
    bodies = [session.request(turn) for turn in range(4)]
    for before, after in itertools.pairwise(bodies):
        assert after["messages"][: len(before["messages"])] == before["messages"]
        assert len(after["messages"]) == len(before["messages"]) + 2
        assert after["system"] == before["system"] and after["tools"] == before["tools"]
    last = bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["user"] + ["assistant", "user"] * 3
    calls = [b["id"] for m in last for b in m["content"] if b["type"] == "tool_use"]
    results = [b["tool_use_id"] for m in last for b in m["content"] if b["type"] == "tool_result"]
    assert calls == results and len(set(calls)) == 3
    assert [b["max_tokens"] for b in bodies] == [reply for _, reply in session.draws]
    # another session of the same shape shares no prefix with this one
    other = AgentSession(SessionShape(turns=4, system_tokens=300), 4.0, 100)
    assert other.system[0]["text"] != session.system[0]["text"]
