"""A prompt's special tokens, as transformers' tokenizer gives them: /v1/completions adds the
tokenizer's BOS where it has one (Mixtral's, Llama's), and a chat template that writes the BOS
itself does not get a second one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, processors

from moelab.engine.model.synth_tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    corpus_text,
    write_tokenizer_files,
)
from moelab.engine.model.tokenizer import Tokenizer

from .test_tool_calls import ScriptedWorker, served

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

TEXTS = ["The harbour town", " leading space", "朝の港は", "a\nb"]
MESSAGES = [{"role": "user", "content": "Tell me about the harbour."}]


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory) -> Path:
    """Tokenizer files that add a BOS, as Mixtral's do: `<s> $A` in tokenizer.json's
    post-processor, add_bos_token in tokenizer_config.json, and a chat template that writes
    {{ bos_token }} first."""
    path = tmp_path_factory.mktemp("bos")
    tok = build_tokenizer(2048)
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": "{{ bos_token }}" + CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def plain_tokenizer_dir(tmp_path_factory) -> Path:
    """The synthetic checkpoints' tokenizer: Qwen's kind, no BOS."""
    path = tmp_path_factory.mktemp("plain")
    write_tokenizer_files(path, 2048)
    return path


@pytest.mark.parametrize("which", ["bos_tokenizer_dir", "plain_tokenizer_dir"])
def test_completions_encode_the_prompt_as_transformers_does(request, which):
    path = request.getfixturevalue(which)
    reference = transformers.AutoTokenizer.from_pretrained(str(path))
    tokenizer = Tokenizer(path)
    worker = ScriptedWorker(tokenizer, "Sunny.")
    client = served(worker)
    for text in TEXTS:
        expected = reference(text)["input_ids"]
        r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert worker.prompts[-1] == expected
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
    bos = tokenizer.token_to_id("<s>")
    assert (worker.prompts[-1][0] == bos) == (which == "bos_tokenizer_dir")
    # a client whose prompt already holds the special tokens asks for none (vLLM's field)
    r = client.post(
        "/v1/completions", json={"prompt": TEXTS[0], "max_tokens": 2, "add_special_tokens": False}
    )
    assert r.status_code == 200
    assert worker.prompts[-1] == reference(TEXTS[0], add_special_tokens=False)["input_ids"]


def test_a_chat_template_that_writes_the_bos_gets_it_once(bos_tokenizer_dir):
    reference = transformers.AutoTokenizer.from_pretrained(str(bos_tokenizer_dir))
    tokenizer = Tokenizer(bos_tokenizer_dir)
    worker = ScriptedWorker(tokenizer, "Sunny.")
    r = served(worker).post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    text = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert worker.prompts[-1] == reference(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.token_to_id("<s>")
    assert worker.prompts[-1][0] == bos and worker.prompts[-1].count(bos) == 1


def test_a_synthetic_vocabulary_decodes_every_id_to_text():
    """A random-weight model draws from all of its ids, so the synthetic tokenizer fills the
    vocabulary past what the corpus trains with words that decode to text (a client streaming
    such a model times its tokens by their text), which no encoding reaches."""
    tok = build_tokenizer(8192)
    vocab = tok.get_vocab()
    fillers = sorted(i for t, i in vocab.items() if t.startswith("\u0120t") and t[2:] == str(i))
    assert tok.get_vocab_size() == 8192 and fillers == list(range(fillers[0], 8192))
    assert all(tok.decode([i]) == f" t{i}" for i in fillers)
    specials = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert all(tok.decode([i], skip_special_tokens=False) for i in range(8192))
    assert all(tok.decode([i]) for i in range(8192) if i not in specials)
    assert max(tok.encode(corpus_text()).ids) < fillers[0]
