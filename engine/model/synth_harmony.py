"""The harmony format's special tokens and a chat template that renders it, as gpt-oss's
checkpoints carry them, for synthetic checkpoints (`moelab synth --chat-template gpt_oss`).

The template renders what OpenAI's openai-harmony renders for the same conversation: the system
message (the model's identity, the knowledge cutoff, the date, `Reasoning:` with the
`reasoning_effort` variable, medium where it is not given, the valid channels), the developer
message (the system prompt as `# Instructions`, the tools as TypeScript types in a `functions`
namespace), the turns (an assistant's reasoning as an analysis message where it comes after the
last user turn, its answer in the final channel, each call in the commentary channel with its
recipient, a tool's result from `functions.NAME`), and the generation prompt `<|start|>assistant`.
"""

from __future__ import annotations

# The tokens the format's structure is made of (gpt-oss's o200k_harmony encoding; all special)
SPECIAL_TOKENS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]
# the reply ends at <|return|> (its answer given) or <|call|> (a call awaits its result)
EOS_TOKENS = ("<|return|>", "<|endoftext|>", "<|call|>")

# a JSON schema's type as TypeScript: enums as a union of their values, arrays as `T[]`,
# integers as number, anything else as `any`
_TS_TYPE = (
    "{%- macro ts_type(schema) -%}"
    "{%- if schema.enum is defined -%}"
    "{%- for value in schema.enum -%}{{- value | tojson }}{%- if not loop.last %} | {% endif -%}"
    "{%- endfor -%}"
    "{%- elif schema.type == 'string' -%}string"
    "{%- elif schema.type in ['number', 'integer'] -%}number"
    "{%- elif schema.type == 'boolean' -%}boolean"
    "{%- elif schema.type == 'array' -%}{{- ts_type(schema['items'] or {}) }}[]"
    "{%- else -%}any{%- endif -%}"
    "{%- endmacro -%}"
)
_TOOLS = (
    "{%- macro render_tools(tools) -%}"
    "{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for tool in tools -%}"
    "{%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif -%}"
    "{%- if tool.description %}{{- '// ' + tool.description + '\\n' }}{%- endif -%}"
    "{%- set params = tool.parameters or {} -%}"
    "{%- if params.properties -%}"
    "{{- 'type ' + tool.name + ' = (_: {\\n' }}"
    "{%- for name, schema in params.properties | items -%}"
    "{%- if schema.description %}{{- '// ' + schema.description + '\\n' }}{%- endif -%}"
    "{{- name }}{%- if name not in (params.required or []) %}?{%- endif -%}"
    "{{- ': ' + ts_type(schema) + ',' }}"
    "{%- if schema.default is defined %}{{- ' // default: ' + schema.default | string }}"
    "{%- endif -%}"
    "{{- '\\n' }}"
    "{%- endfor -%}"
    "{{- '}) => any;\\n\\n' }}"
    "{%- else -%}"
    "{{- 'type ' + tool.name + ' = () => any;\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- '} // namespace functions' }}"
    "{%- endmacro -%}"
)
CHAT_TEMPLATE = (
    _TS_TYPE + _TOOLS + "{%- if reasoning_effort is not defined or reasoning_effort is none %}"
    "{%- set reasoning_effort = 'medium' %}{%- endif -%}"
    "{%- if model_identity is not defined %}"
    "{%- set model_identity = 'You are ChatGPT, a large language model trained by OpenAI.' %}"
    "{%- endif -%}"
    "{{- '<|start|>system<|message|>' + model_identity + '\\nKnowledge cutoff: 2024-06\\n' }}"
    "{{- 'Current date: ' + strftime_now('%Y-%m-%d') + '\\n\\nReasoning: ' + reasoning_effort }}"
    "{{- '\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for "
    "every message.' }}"
    "{%- if tools %}"
    "{{- \"\\nCalls to these tools must go to the commentary channel: 'functions'.\" }}"
    "{%- endif -%}"
    "{{- '<|end|>' }}"
    "{%- if messages and messages[0].role in ['system', 'developer'] -%}"
    "{%- set instructions = messages[0].content -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- if instructions is defined or tools -%}"
    "{{- '<|start|>developer<|message|>' }}"
    "{%- if instructions is defined %}{{- '# Instructions\\n\\n' + instructions }}"
    "{%- if tools %}{{- '\\n\\n' }}{%- endif -%}{%- endif -%}"
    "{%- if tools %}{{- render_tools(tools) }}{%- endif -%}"
    "{{- '<|end|>' }}"
    "{%- endif -%}"
    # the reasoning of the turns after the last user message stays (the model goes on with it
    # between its calls); an earlier turn's is dropped, as openai-harmony drops it
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in turns -%}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in turns -%}"
    "{%- if message.role not in ['user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown message role: ' + message.role) }}"
    "{%- endif -%}"
    "{%- if message.role == 'user' -%}"
    "{{- '<|start|>user<|message|>' + (message.content or '') + '<|end|>' }}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if message.reasoning_content and loop.index0 > ns.last_user -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content }}"
    "{{- '<|end|>' }}"
    "{%- endif -%}"
    "{%- if message.content -%}"
    "{%- set channel = 'commentary' if message.tool_calls else 'final' -%}"
    "{{- '<|start|>assistant<|channel|>' + channel + '<|message|>' + message.content + '<|end|>' }}"
    "{%- endif -%}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif -%}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary' }}"
    "{{- ' <|constrain|>json<|message|>' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif -%}"
    "{{- '<|call|>' }}"
    "{%- endfor -%}"
    "{%- else -%}"
    # a tool's result comes from the function whose call it answers (by its id, else the
    # last call made)
    "{%- set found = namespace(name='') -%}"
    "{%- for earlier in turns[:loop.index0] -%}"
    "{%- for call in earlier.tool_calls or [] -%}"
    "{%- if not message.tool_call_id or call.id == message.tool_call_id -%}"
    "{%- set found.name = call.function.name if call.function is defined else call.name -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endfor -%}"
    "{{- '<|start|>functions.' + (found.name or message.name or 'tool') }}"
    "{{- ' to=assistant<|channel|>commentary<|message|>' + (message.content or '') + '<|end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif -%}"
)


def tokenizer_config(chat_template: str) -> dict:
    """tokenizer_config.json's fields as gpt-oss's has them (the special tokens themselves are
    the caller's added tokens)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
    }
