"""Fixtures of the data tests: the two tokenizers, each loaded once per session, offline."""

import pytest

from megatron_darl.data.tokenizers import load_tokenizer


@pytest.fixture(scope="session")
def demo_tok(tmp_path_factory):
    return load_tokenizer("builtin:demo", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def qwen_tok():
    return load_tokenizer("builtin:qwen3")
