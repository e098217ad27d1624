"""Fixtures of the fault suite (tests/faults): the probes of a user's bad day, run as tests.

What it is: the end-to-end harness of tests/integration on the import path (`e2e_harness`:
`new_run`, `DarlRun`, `assert_nothing_left`), `warm_model` (a warm-started tiny model, made once
per session, as the integration tests make it) and `demo_tok` (the demo tokenizer).
What it is not: a test.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))

from e2e_harness import SFT_STEPS, base_config, write_config  # noqa: E402


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory) -> str:
    """A Hugging Face folder (model + demo tokenizer) after SFT_STEPS supervised steps."""
    from dataclasses import replace

    from megatron_darl import warmstart
    from megatron_darl.config import load_config

    root = str(tmp_path_factory.mktemp("warm"))
    cfg_dict = base_config(root, "builtin:tiny-qwen3")
    cfg_dict["model"] = {"hf_dir": "builtin:tiny-qwen3", "tokenizer": "builtin:demo"}
    cfg = load_config(write_config(os.path.join(root, "warm.yaml"), cfg_dict))
    cfg = replace(cfg, train=replace(cfg.train, sft_steps=SFT_STEPS))
    return warmstart.prepare_model(cfg).model.hf_dir


@pytest.fixture(scope="session")
def demo_tok(tmp_path_factory):
    from megatron_darl.data.tokenizers import load_tokenizer

    return load_tokenizer("builtin:demo", cache_dir=tmp_path_factory.mktemp("cache"))
