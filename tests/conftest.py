"""Shared pytest setup: one thread per process (small CPU machines), GPU tests skip with a reason,
and the fixtures more than one folder uses, defined once: `warm_model` (a warm-started tiny model,
made once per session), `warm_tool_model` (the same with the demo's tool tokens, taught to call
the Python tool), `demo_tok` (the demo tokenizer) and `sandbox_runs_here` (the code sandbox
runs on this machine). Harnesses live in `tests/helpers/`. Two plugins are registered here: the
expected-skips check (`--expected-skips FILE`, tests/helpers/expected_skips.py: a pass whose skips
differ from its list fails) and the measured durations (tests/helpers/durations.py: `slow` marks
and the `--fast` tier from tests/durations.json, `--record-durations`)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at test time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from tests.helpers import durations, expected_skips


def pytest_addoption(parser):
    expected_skips.pytest_addoption(parser)
    durations.pytest_addoption(parser)


def pytest_configure(config):
    expected_skips.pytest_configure(config)
    durations.pytest_configure(config)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_rank(monkeypatch):
    """A world of one learner rank on gloo, torch at one thread; Megatron's groups and
    torch.distributed torn down after, also when the test failed with a learner open."""
    import torch

    from megatron_darl.channel.ports import free_port
    from megatron_darl.learner.parallel import destroy_parallel

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    torch.set_num_threads(1)
    yield
    destroy_parallel()


@pytest.fixture
def sandbox_runs_here() -> None:
    """The code sandbox runs here, else the test skips saying why, or fails where
    DARL_REQUIRE_SANDBOX=1 (`needs_sandbox` in tests/helpers/sandbox.py)."""
    from tests.helpers.sandbox import require_sandbox

    require_sandbox()


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory) -> str:
    """A Hugging Face folder (model + demo tokenizer) after `SFT_STEPS` supervised steps, so that
    rewards vary within groups and losses are not identically zero; each run copies it."""
    from dataclasses import replace

    from megatron_darl.config import load_config
    from megatron_darl.launch import warmstart
    from tests.helpers.e2e import SFT_STEPS, base_config, write_config

    root = str(tmp_path_factory.mktemp("warm"))
    cfg_dict = base_config(root, "builtin:tiny-qwen3")
    cfg_dict["model"] = {"hf_dir": "builtin:tiny-qwen3", "tokenizer": "builtin:demo"}
    cfg = load_config(write_config(os.path.join(root, "warm.yaml"), cfg_dict))
    cfg = replace(cfg, demo=replace(cfg.demo, sft_steps=SFT_STEPS))
    return warmstart.prepare_model(cfg).model.hf_dir


# the tool runs' rollout settings: one call, then the answer ("<tool_call>3 + 4</tool_call>",
# "<tool_response>7\n</tool_response>", "7", EOS: 14 tokens), one tool worker so calls queue
TOOL_ROLLOUT = {"tool": "python", "max_turns": 2, "max_new_tokens": 24, "tool_workers": 1}


@pytest.fixture(scope="session")
def warm_tool_model(tmp_path_factory) -> str:
    """`warm_model` with `builtin:demo-tools` and every warm-start example a tool episode, so the
    policy calls the tool on most samples (tests of runs with tools: test_e2e_tools.py)."""
    from megatron_darl.config import load_config
    from megatron_darl.launch import warmstart
    from tests.helpers.e2e import base_config, write_config

    root = str(tmp_path_factory.mktemp("warm_tools"))
    cfg_dict = base_config(root, "builtin:tiny-qwen3", rollout=TOOL_ROLLOUT,
                           demo={"sft_steps": 60, "sft_tool_fraction": 1.0})
    cfg_dict["model"] = {"hf_dir": "builtin:tiny-qwen3", "tokenizer": "builtin:demo-tools"}
    cfg = load_config(write_config(os.path.join(root, "warm.yaml"), cfg_dict))
    return warmstart.prepare_model(cfg).model.hf_dir


@pytest.fixture(scope="session")
def demo_tok(tmp_path_factory):
    from megatron_darl.data.tokenizers import load_tokenizer

    return load_tokenizer("builtin:demo", cache_dir=tmp_path_factory.mktemp("cache"))
