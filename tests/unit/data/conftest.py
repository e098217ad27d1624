"""Fixtures of the data tests: the Qwen3 tokenizer, loaded once per session, offline (the demo
tokenizer, `demo_tok`, is the whole suite's: tests/conftest.py)."""

import pytest

from megatron_darl.data.tokenizers import load_tokenizer


@pytest.fixture(scope="session")
def qwen_tok():
    return load_tokenizer("builtin:qwen3")
