"""A real byte-level BPE tokenizer and chat templates for synthetic checkpoints: ChatML's (Qwen3's,
its thinking models', Qwen3-Coder's, Qwen3.5's) and gpt-oss's harmony (synth_harmony.py), each with
the special tokens its format is made of."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from . import synth_harmony

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]

# ChatML turns as Qwen3 writes them: tools offered in the system turn, an assistant's tool calls as
# JSON in <tool_call> blocks (the Hermes form), tool results in <tool_response> blocks of a user
# turn.
_QWEN3_TURNS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    '{{- \'You may call these tools; answer with <tool_call>{"name": ..., "arguments": ...}'
    "</tool_call>:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
# Qwen3's: the generation prompt, with an empty reasoning closed where enable_thinking is false
CHAT_TEMPLATE = _QWEN3_TURNS + (
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# Qwen3's thinking models of 2507 (and DeepSeek-R1): the generation prompt opens the reasoning
THINKING_CHAT_TEMPLATE = _QWEN3_TURNS + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

# Qwen3-Coder's form: the tools listed with their parameters, an assistant's tool calls as
# <function=...> blocks of <parameter=...> blocks, tool results in <tool_response> blocks of a user
# turn; no reasoning.
_SYSTEM_SPLIT = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system_message = messages[0].content %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
)
_XML_TOOL_CALLS = (
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments | items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
    "{%- if args_value is mapping or (args_value is sequence and args_value is not string) %}"
    "{{- args_value | tojson }}{%- else %}{{- args_value | string }}{%- endif %}"
    "{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
)
_TOOL_RESULTS = (
    "{%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user\\n' }}"
    "{%- endif %}"
    "{{- '<tool_response>\\n' + (message.content or '') + '\\n</tool_response>\\n' }}"
    "{%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_XML_FORMAT = (
    "\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>"
)
CODER_CHAT_TEMPLATE = (
    _SYSTEM_SPLIT + "{%- if system_message is defined or tools %}"
    "{{- '<|im_start|>system\\n' + (system_message or 'You are a helpful coding assistant.') }}"
    "{%- endif %}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}"
    "{{- '\\n<function>\\n<name>' + tool.name + '</name>' }}"
    "{{- '\\n<description>' + (tool.description or '') + '</description>\\n<parameters>' }}"
    "{%- for name, fields in ((tool.parameters or {}).properties or {}) | items %}"
    "{{- '\\n<parameter>\\n<name>' + name + '</name>' }}"
    "{%- if fields.type is defined %}{{- '\\n<type>' + (fields.type | string) + '</type>' }}"
    "{%- endif %}"
    "{{- '\\n</parameter>' }}"
    "{%- endfor %}"
    "{{- '\\n</parameters>\\n</function>' }}"
    "{%- endfor %}"
    "{{- '\\n</tools>" + _XML_FORMAT + "' }}"
    "{%- endif %}"
    "{%- if system_message is defined or tools %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content | trim + '\\n' }}{%- endif %}"
    + _XML_TOOL_CALLS
    + "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}" + _TOOL_RESULTS + "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3.5's (and Qwen3.6's): the tools as JSON in the system turn, an assistant's tool calls as
# Qwen3-Coder's <function=...> blocks, and reasoning: the generation prompt opens <think> (an empty
# one closed where enable_thinking is false), and an assistant turn after the last user message
# keeps its reasoning_content in a <think> block (earlier turns drop theirs, as Qwen's does).
QWEN3_5_CHAT_TEMPLATE = (
    _SYSTEM_SPLIT + "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:"
    "\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>" + _XML_FORMAT + "' }}"
    "{%- if system_message is defined %}{{- '\\n\\n' + system_message }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif system_message is defined %}"
    "{{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content and loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + message.reasoning_content | trim + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- (message.content or '') | trim }}"
    "{%- if message.tool_calls %}" + _XML_TOOL_CALLS + "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}" + _TOOL_RESULTS + "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)

# the chat templates a synthetic checkpoint may carry, by the name `moelab synth` takes
CHAT_TEMPLATES = {
    "qwen3": CHAT_TEMPLATE,
    "qwen3_thinking": THINKING_CHAT_TEMPLATE,
    "qwen3_coder": CODER_CHAT_TEMPLATE,
    "gpt_oss": synth_harmony.CHAT_TEMPLATE,
    "qwen3_5": QWEN3_5_CHAT_TEMPLATE,
}
# the chat template of an architecture whose models all speak one format (gpt-oss: harmony;
# Qwen3.5/3.6 MoE, in either layout: Qwen3.5's)
ARCH_CHAT_TEMPLATES = {
    "gpt_oss": "gpt_oss",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
}


def chat_template_for(arch: str, name: str | None = None) -> str:
    """The chat template a synthetic checkpoint of `arch` gets: `name`, else its architecture's
    format, else Qwen3's."""
    return name or ARCH_CHAT_TEMPLATES.get(arch, "qwen3")


def corpus_text() -> str:
    """The text corpus shipped with moelab (prose, Japanese, code)."""
    root = resources.files("moelab.engine.model") / "data" / "corpus"
    return "\n\n".join(
        (root / name).read_text(encoding="utf-8")
        for name in ("prose.txt", "japanese.txt", "code.txt")
    )


# Added tokens that decoding keeps, as Qwen3's tokenizer marks them (not special): the reasoning
# and tool-call tags a client reads in the text (the server parses the tool calls out of it)
KEPT_IN_TEXT = {"<think>", "</think>", "<tool_call>", "</tool_call>"}


def build_tokenizer(vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens on the shipped corpus, with
    `special_tokens` first, then fill its vocabulary up to `vocab_size` with words (" t3141",
    " t3142", ...). The corpus yields a few thousand tokens; a random-weight model of a real
    geometry (Qwen3's 151,936 ids) draws its tokens from the whole vocabulary, and an id the
    tokenizer lacks decodes to nothing: a client streaming such a model would see no text at
    all. The fillers are reached by no merge, so they change no text's encoding."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(special_tokens)),
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] not in KEPT_IN_TEXT
    vocab = data["model"]["vocab"]
    for n in range(len(vocab), vocab_size):
        word = f"\u0120t{n}"  # " t<n>" in the byte-level alphabet
        vocab[word if word not in vocab else f"{word}_"] = n
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer_files(
    out: Path, vocab_size: int, chat_template: str = "qwen3", extra_special: tuple[str, ...] = ()
) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json (with the chat template of that name, from
    CHAT_TEMPLATES) and generation_config.json into `out`; gpt_oss's with the harmony tokens;
    `extra_special`: more special tokens (a multimodal model's image and video markers)."""
    if chat_template == "gpt_oss":
        return _write_files(
            out, vocab_size, synth_harmony.SPECIAL_TOKENS, synth_harmony.EOS_TOKENS,
            synth_harmony.tokenizer_config(CHAT_TEMPLATES[chat_template]),
        )  # fmt: skip
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATES[chat_template],
        "clean_up_tokenization_spaces": False,
    }
    special = [*SPECIAL_TOKENS, *extra_special]
    return _write_files(out, vocab_size, special, ("<|im_end|>", "<|endoftext|>"), config)


def _write_files(
    out: Path, vocab_size: int, special: list[str], eos: tuple[str, ...], config: dict
) -> Tokenizer:
    tok = build_tokenizer(vocab_size, special)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "special": t not in KEPT_IN_TEXT,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for t in special
    }
    config = {"added_tokens_decoder": added, **config}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    pad = tok.token_to_id("<|endoftext|>")
    generation = {
        "eos_token_id": [tok.token_to_id(t) for t in eos],
        "pad_token_id": pad,
        "do_sample": False,
        "transformers_version": "4.51.0",
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return tok
