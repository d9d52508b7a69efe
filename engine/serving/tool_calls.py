"""Tool calls out of a chat reply's text, in the two forms the Qwen family writes inside
<tool_call> blocks, as OpenAI's `tool_calls` (each call's arguments a JSON string of an object):

hermes (Qwen2.5, Qwen3, QwQ; JSON):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

qwen_xml (Qwen3-Coder, Qwen3.5; each argument's text, converted to the type the tool's JSON
schema gives that parameter):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

The form is the one the checkpoint's chat template writes (`parser_for`), or the one
`--tool-call-parser` names. A block that does not parse as a call stays in the content as it was
written. `ToolParser.opening` is the start of a call that a request forcing one (tool_choice
"required" or a named function) writes at the head of the reply, in the prompt, so that the
model goes on inside the call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "qwen_xml")

# a function block runs to its closing tag, or to the block's end where the model left it out
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
# a parameter's value runs to its closing tag, or to the next parameter or the function's end
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def parser_for(chat_template_source: str | None, choice: str = "auto") -> str | None:
    """The tool call form a request's reply is read in: `choice` where it names one, else the
    one the chat template writes (<function=...> blocks: qwen_xml; other <tool_call> blocks:
    hermes), or None where the template writes neither."""
    if choice != "auto":
        assert choice in PARSERS, choice
        return choice
    if not chat_template_source or OPEN not in chat_template_source:
        return None
    return "qwen_xml" if "<function=" in chat_template_source else "hermes"


@dataclass(frozen=True, slots=True)
class ToolParser:
    """How one request's tool calls are read from its reply: the form, and each offered tool's
    parameter schemas (by name), which type the XML form's values."""

    form: str
    parameters: dict[str, dict] = field(default_factory=dict)
    parallel: bool = True  # False: the reply's first call is its last (parallel_tool_calls)

    def __post_init__(self) -> None:
        assert self.form in PARSERS, self.form

    @classmethod
    def of(cls, form: str, tools: list[dict] | None, parallel: bool = True) -> ToolParser:
        """The parser of `form` for a request offering `tools` (OpenAI's tool objects)."""
        parameters = {}
        for tool in tools or ():
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                schema = function.get("parameters")
                properties = schema.get("properties") if isinstance(schema, dict) else None
                parameters[function["name"]] = properties if isinstance(properties, dict) else {}
        return cls(form, parameters, parallel)

    def calls(self, block: str) -> list[dict]:
        """The calls one block's text holds ([]: it is no call)."""
        if self.form == "hermes":
            return _hermes_block(block)
        return xml_calls(block, self.parameters)

    @property
    def limit(self) -> int | None:
        return None if self.parallel else 1

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.calls, self.limit)

    def split(self, text: str) -> tuple[str, list[dict]]:
        return split_reply(text, self.calls, self.limit)

    def opening(self, name: str | None) -> str:
        """The start of a call to `name` (None: to a function the model names), as this form
        writes it."""
        if self.form == "hermes":
            if name is None:
                return f'{OPEN}\n{{"name": "'
            return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        return f"{OPEN}\n<function=" if name is None else f"{OPEN}\n<function={name}>\n"


def new_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call of `name` with `arguments` (the JSON text of an object), a new id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def hermes_call(block: str) -> dict | None:
    """An OpenAI tool call from the JSON inside one block, or None where it is not one (not
    JSON, no name, or arguments that are not an object)."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # a JSON string of the object, as OpenAI writes them
        try:
            if not isinstance(json.loads(arguments or "{}"), dict):
                return None
        except ValueError:
            return None
        return new_call(call["name"], arguments or "{}")
    if not isinstance(arguments, dict):
        return None
    return new_call(call["name"], json.dumps(arguments, ensure_ascii=False))


def xml_calls(block: str, parameters: dict[str, dict]) -> list[dict]:
    """The calls of one block in the XML form, each <function=...> one, or [] where the block
    is not that form. A value is its text less one newline either side, typed by the tool's
    schema for that parameter (`typed`)."""
    if not block.lstrip().startswith("<function="):
        return []
    calls = []
    for match in _FUNCTION.finditer(block):
        name = match.group(1).strip()
        schema = parameters.get(name, {})
        arguments = {}
        for param in _PARAMETER.finditer(match.group(2)):
            key = param.group(1).strip()
            arguments[key] = typed(_unwrap(param.group(2)), schema.get(key))
        calls.append(new_call(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _unwrap(value: str) -> str:
    """A parameter's text without the newline the form puts after its tag and before its end."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _types(schema) -> set[str]:
    """The JSON types a parameter's schema allows (its `type`, or its anyOf/oneOf members')."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    members = schema.get("anyOf") or schema.get("oneOf") or []
    return set().union(*(_types(m) for m in members)) if isinstance(members, list) else set()


# the JSON types a parameter's text is parsed as JSON for, and what the parsed value must be
_JSON_KINDS: dict[str, Callable[[object], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def typed(text: str, schema) -> object:
    """A parameter's text as the JSON value its schema asks for: null, a boolean, a number, an
    object or an array where the schema allows it and the text is one; else the text."""
    types = _types(schema)
    value = text.strip()
    if "null" in types and value == "null":
        return None
    if "boolean" in types and value.lower() in ("true", "false"):
        return value.lower() == "true"
    kinds = types & _JSON_KINDS.keys()
    if kinds:
        try:
            parsed = json.loads(value, parse_constant=_not_json)
        except ValueError:
            return text
        if "integer" in kinds and isinstance(parsed, float) and parsed.is_integer():
            parsed = int(parsed)
        if any(_JSON_KINDS[kind](parsed) for kind in kinds):
            return parsed
    return text


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not JSON")  # NaN and Infinity: Python's decoder takes them


def _hermes_block(block: str) -> list[dict]:
    call = hermes_call(block)
    return [call] if call is not None else []


def split_reply(
    text: str, calls: Callable[[str], list[dict]] = _hermes_block, limit: int | None = None
) -> tuple[str, list[dict]]:
    """A whole reply's content (the text outside the calls, stripped where calls were taken)
    and its tool calls; `calls` reads a block (default: the Hermes form), `limit` ends the
    reply at that many calls."""
    stream = ToolCallStream(calls, limit)
    content, found = stream.feed(text)
    rest, more = stream.flush()
    content, found = content + rest, found + more
    return (content.strip() if found else content), found


@dataclass
class ToolCallStream:
    """Streamed text in, (content, calls) out: text outside the blocks as it comes, less a
    tail that may be the start of <tool_call>; each block once it closes, as its calls (or,
    where it holds none, as the text it was). `calls` reads a block (default: Hermes); once
    `limit` calls are made the reply has ended, and what follows is dropped."""

    calls: Callable[[str], list[dict]] = _hermes_block
    limit: int | None = None
    _held: str = ""  # text not yet given out: a possible opening tag, or an open block
    _inside: bool = False
    calls_made: int = 0

    @property
    def full(self) -> bool:
        """Whether the reply made its last call (`limit`)."""
        return self.limit is not None and self.calls_made >= self.limit

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        text = "" if self.full else self._held + piece
        self._held = ""
        content, calls = [], []
        while text and not self.full:
            if self._inside:
                end = text.find(CLOSE)
                if end < 0:
                    self._held = text
                    break
                block, text = text[:end], text[end + len(CLOSE) :]
                self._inside = False
                made = self.calls(block)
                if not made:
                    content.append(OPEN + block + CLOSE)
                if self.limit is not None:
                    made = made[: self.limit - self.calls_made]
                calls += made
                self.calls_made += len(made)
                continue
            start = text.find(OPEN)
            if start >= 0:
                content.append(text[:start])
                text = text[start + len(OPEN) :]
                self._inside = True
                continue
            keep = _partial_tag(text)
            content.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return "".join(content), calls

    def flush(self) -> tuple[str, list[dict]]:
        """The end of the reply: what is held goes out as text (a block left open included)."""
        held, self._held = self._held, ""
        if self.full:
            return "", []
        if self._inside:
            self._inside = False
            return OPEN + held, []
        return held, []


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` may begin <tool_call>."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
