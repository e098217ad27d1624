"""Fixtures of the end-to-end tests: one warm-started tiny model shared by the test session.

What it is: `warm_model`, a short supervised warm start (so that rewards vary within groups and
losses are not identically zero), made once per session; each run copies it into its folder.
The Slurm tests' `slurm_cluster` and `demo_dir` (from `slurm_harness.py`) are registered here so
that every module shares one of each.
What it is not: the run helpers (`e2e_harness.py`).
"""

from __future__ import annotations

import os

import pytest

from e2e_harness import SFT_STEPS, base_config, write_config
from slurm_harness import demo_dir, slurm_cluster  # noqa: F401 (fixtures of the Slurm tests, one per session)


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


