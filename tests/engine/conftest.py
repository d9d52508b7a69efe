"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest

from moelab.engine.model.synth_tokenizer import write_tokenizer_files
from moelab.engine.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """The synthetic checkpoints' tokenizer (a 2,048-token vocabulary, the Qwen chat template)."""
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path, 2048)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory) -> Tokenizer:
    """A synthetic gpt_oss checkpoint's tokenizer (`moelab synth --chat-template gpt_oss`: the
    harmony tokens and chat template)."""
    path = tmp_path_factory.mktemp("harmony")
    write_tokenizer_files(path, 2048, "gpt_oss")
    return Tokenizer(path)
