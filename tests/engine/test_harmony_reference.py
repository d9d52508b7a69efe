"""gpt-oss's format as this server reads and the synthetic template renders it, against OpenAI's
openai-harmony on the same conversations and replies, whole and token by token.

openai-harmony's encoding loads only the o200k vocabulary, checked by its SHA-256, which it would
download: these tests run where TIKTOKEN_ENCODINGS_BASE names a folder holding it, as .ci/run
makes one (tests/engine/o200k.py writes it from js-tiktoken's npm package or a gpt-oss
tokenizer.json), and are skipped elsewhere."""

from __future__ import annotations

import base64
import json
import os
from datetime import date

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.engine.model.synth_tokenizer import write_tokenizer_files
from moelab.engine.model.tokenizer import Tokenizer
from moelab.engine.serving.harmony import HarmonyStream, split_harmony

from .o200k import FILE, from_tokenizer_json
from .test_harmony import CALLED, DEVELOPER, REASONED, TOOLS, _named, _system

oh = pytest.importorskip("openai_harmony", reason="openai-harmony is a test dependency")

REPLIES = [
    REASONED,
    CALLED,
    # the recipient in the role part, <|constrain|> right after the channel
    "<|channel|>analysis<|message|>Call it.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary<|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>',
    "<|channel|>analysis<|message|>Two lines\nof thought, ünïcödé.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Done: 42 ✓<|return|>",
]


@pytest.fixture(scope="module")
def encoding():
    base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if not base or not os.path.isfile(os.path.join(base, FILE)):
        pytest.skip(
            "openai-harmony needs the o200k vocabulary on this machine: set "
            f"TIKTOKEN_ENCODINGS_BASE to a folder holding {FILE} (python -m tests.engine.o200k)"
        )
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def _conversation(effort: str, history: bool):
    """The conversation of test_harmony's template test in openai-harmony's objects, less the
    earlier turn's reasoning: gpt-oss's template drops it, openai-harmony keeps it while the
    conversation's last assistant message is not a final one."""
    system = (
        oh.SystemContent.new()
        .with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
        .with_conversation_start_date(f"{date.today():%Y-%m-%d}")
    )
    messages = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    if not history:
        messages.append(oh.Message.from_role_and_content(oh.Role.USER, "What is 2 + 2?"))
        return oh.Conversation.from_messages(messages)
    tools = [
        oh.ToolDescription.new(t["function"]["name"], t["function"]["description"],
                               parameters=t["function"].get("parameters"))
        for t in TOOLS
    ]  # fmt: skip
    developer = oh.DeveloperContent.new().with_instructions("Use a friendly tone.")
    assistant = oh.Role.ASSISTANT
    messages += [
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer.with_function_tools(tools)),
        oh.Message.from_role_and_content(oh.Role.USER, "What is 2 + 2?"),
        oh.Message.from_role_and_content(assistant, "4.").with_channel("final"),
        oh.Message.from_role_and_content(oh.Role.USER, "What is the weather like in SF?"),
        oh.Message.from_role_and_content(assistant, "Need to use get_weather.").with_channel(
            "analysis"
        ),
        oh.Message.from_role_and_content(assistant, '{"location": "San Francisco"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        oh.Message.from_author_and_content(
            oh.Author.new(oh.Role.TOOL, "functions.get_weather"), '{"sunny": true}'
        )
        .with_channel("commentary")
        .with_recipient("assistant"),
    ]
    return oh.Conversation.from_messages(messages)


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_the_template_renders_what_openai_harmony_renders(encoding, harmony_tokenizer, effort):
    tokens = encoding.render_conversation_for_completion(
        _conversation(effort, False), oh.Role.ASSISTANT
    )
    ask = [{"role": "user", "content": "What is 2 + 2?"}]
    ours = harmony_tokenizer.apply_chat_template(ask, reasoning_effort=effort)
    assert encoding.decode_utf8(tokens) == ours
    assert ours.startswith(_system(effort, False))


def test_a_conversation_with_tools_renders_as_openai_harmony_renders_it(
    encoding, harmony_tokenizer
):
    tokens = encoding.render_conversation_for_completion(
        _conversation("high", True), oh.Role.ASSISTANT
    )
    turns = [
        {"role": "system", "content": "Use a friendly tone."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "What is the weather like in SF?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need to use get_weather.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": {"location": "San Francisco"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true}'},
    ]  # fmt: skip
    ours = harmony_tokenizer.apply_chat_template(turns, tools=TOOLS, reasoning_effort="high")
    theirs = encoding.decode_utf8(tokens)
    assert theirs == ours
    assert DEVELOPER in theirs


def _theirs(encoding, tokens: list[int]) -> tuple[str, str, list[tuple[str, dict]]]:
    """openai-harmony's reading of a reply's tokens, as this server gives it: the analysis
    channel as reasoning, calls to functions as calls, the rest as content."""
    parser = oh.StreamableParser(encoding, oh.Role.ASSISTANT)
    for token in tokens:
        parser.process(token)
    reasoning, content, calls = "", "", []
    for message in parser.messages:
        text = "".join(part.text for part in message.content)
        if message.recipient and message.recipient.startswith("functions."):
            calls.append((message.recipient.removeprefix("functions."), json.loads(text)))
        elif message.channel == "analysis":
            reasoning += text
        else:
            content += text
    return reasoning, content, calls


@pytest.mark.parametrize("reply", REPLIES)
def test_a_reply_reads_as_openai_harmony_reads_it_whole_and_token_by_token(encoding, reply):
    tokens = encoding.encode(reply, allowed_special="all")
    assert encoding.decode_utf8(tokens) == reply
    theirs = _theirs(encoding, tokens)
    reasoning, content, calls = split_harmony(reply)
    assert (reasoning or "", content, _named(calls)) == theirs
    # token by token, as the engine decodes them (a character's bytes held until whole)
    stream = HarmonyStream()
    got_reasoning, got_content, got_calls = "", "", []
    parser = oh.StreamableParser(encoding, oh.Role.ASSISTANT)
    deltas = {"reasoning": "", "content": ""}
    done = 0
    for i, token in enumerate(tokens):
        parser.process(token)
        delta = parser.last_content_delta or ""
        if parser.current_channel == "analysis" and not parser.current_recipient:
            deltas["reasoning"] += delta
        elif not parser.current_recipient:
            deltas["content"] += delta
        text = encoding.decode(tokens[done : i + 1])
        if text.endswith("\ufffd"):
            continue
        done = i + 1
        r, c, m = stream.feed(text)
        got_reasoning, got_content, got_calls = got_reasoning + r, got_content + c, got_calls + m
    r, c, m = stream.flush()
    got = (got_reasoning + r, got_content + c, _named(got_calls + m))
    assert got == theirs
    assert (deltas["reasoning"], deltas["content"]) == theirs[:2]


def test_a_byte_level_vocabulary_is_written_as_ranks_of_its_bytes(tmp_path):
    # the synthetic tokenizer is byte-level as gpt-oss's is: each line is a token's bytes
    write_tokenizer_files(tmp_path, 512, "gpt_oss")
    tok = Tokenizer(tmp_path)
    lines = from_tokenizer_json(tmp_path / "tokenizer.json").splitlines()
    assert len(lines) == tok.vocab_size
    for rank, line in enumerate(lines):
        piece, written_rank = line.split(b" ")
        assert int(written_rank) == rank
        assert list(base64.b64decode(piece)) == tok.token_bytes(rank)


# text a message's body may hold: anything but what special tokens are spelled with
_BODY = st.text(st.characters(exclude_characters="<|", exclude_categories=("Cs",)), max_size=24)
_ARGUMENTS = st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=6), max_size=3)
_MESSAGE = st.one_of(
    st.tuples(st.sampled_from(["analysis", "final", "commentary"]), st.none(), _BODY),
    st.tuples(
        st.just("commentary"),
        st.sampled_from(["functions.get_weather", "functions.now"]),
        _ARGUMENTS.map(json.dumps),
    ),
)


def _written(messages: list[tuple[str, str | None, str]], role_part: list[bool]) -> str:
    """A reply of these messages as gpt-oss writes it after `<|start|>assistant`: a call's
    recipient in the channel's part of its header or the role's, a call ending at <|call|>, the
    last message at <|return|>, the others at <|end|>."""
    text = ""
    for i, (channel, recipient, body) in enumerate(messages):
        in_role = role_part[i]
        header = f"<|channel|>{channel}"
        if recipient:
            to = f" to={recipient}"
            header = (
                f"{to}{header} <|constrain|>json" if in_role else f"{header}{to} <|constrain|>json"
            )
        last = i == len(messages) - 1
        end = "<|call|>" if recipient else "<|return|>" if last else "<|end|>"
        text += ("" if i == 0 else "<|start|>assistant") + f"{header}<|message|>{body}{end}"
    return text


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(_MESSAGE, min_size=1, max_size=4), data=st.data())
def test_any_reply_reads_as_openai_harmony_reads_it(encoding, messages, data):
    role_part = data.draw(st.lists(st.booleans(), min_size=len(messages), max_size=len(messages)))
    reply = _written(messages, role_part)
    tokens = encoding.encode(reply, allowed_special="all")
    theirs = _theirs(encoding, tokens)
    reasoning, content, calls = split_harmony(reply)
    assert (reasoning or "", content, _named(calls)) == theirs
    size = data.draw(st.integers(1, 12))
    stream = HarmonyStream()
    got = ["", "", []]
    for i in range(0, len(reply), size):
        r, c, m = stream.feed(reply[i : i + size])
        got = [got[0] + r, got[1] + c, got[2] + m]
    r, c, m = stream.flush()
    assert (got[0] + r, got[1] + c, _named(got[2] + m)) == theirs
