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
