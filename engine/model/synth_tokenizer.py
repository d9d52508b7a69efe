"""A real byte-level BPE tokenizer and ChatML chat template for synthetic checkpoints."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]

# ChatML as the Qwen family writes it, with tools and the enable_thinking switch.
CHAT_TEMPLATE = (
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
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


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


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens on the shipped corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(SPECIAL_TOKENS)),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] not in KEPT_IN_TEXT
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer_files(out: Path, vocab_size: int) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `out`."""
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    endoftext = tok.token_to_id("<|endoftext|>")
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "special": t not in KEPT_IN_TEXT,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    generation = {
        "eos_token_id": [eos, endoftext],
        "pad_token_id": endoftext,
        "do_sample": False,
        "transformers_version": "4.51.0",
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return tok
