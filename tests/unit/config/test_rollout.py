"""The `rollout` section: `weight_sync=auto` resolved where the setting is declared, and the
refusal of truncated (top-p / top-k) sampling for training, evaluation left free."""

import pytest

from megatron_darl.config import ConfigError, load_config
from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.engine.requests import parse_sampling

# (backend, weight_sync, engines on rollout nodes) -> (effective_weight_sync, weight_folder_kind)
CASES = [
    (("torch", "auto", False), ("shm", "shm")),  # embedded engines beside the learner: its /dev/shm
    (("torch", "auto", True), ("disk", "disk")),  # embedded engines on a Slurm job's rollout nodes
    (("sglang", "auto", False), ("disk", "disk")),  # SGLang servers, wherever they run
    (("sglang", "auto", True), ("disk", "disk")),
    (("torch", "shm", True), ("shm", "shm")),  # a set value is kept (the preflight refuses what cannot work)
    (("sglang", "disk", False), ("disk", "disk")),
    (("torch", "disk", False), ("disk", "disk")),
    (("torch", "distributed", False), ("distributed", "shm")),  # fallback folders where auto would put them
    (("torch", "distributed", True), ("distributed", "disk")),
    (("sglang", "distributed", False), ("distributed", "disk")),
]


@pytest.mark.parametrize(("given", "expected"), CASES, ids=["-".join(map(str, g)) for g, _ in CASES])
def test_weight_sync_auto_is_resolved_by_backend_and_placement(given, expected):
    backend, weight_sync, on_rollout_nodes = given
    rc = RolloutConfig(backend=backend, weight_sync=weight_sync)
    assert (rc.effective_weight_sync(on_rollout_nodes), rc.weight_folder_kind(on_rollout_nodes)) == expected


def test_every_setting_is_covered():
    assert {g[1] for g, _ in CASES} == set(RolloutConfig._choices["weight_sync"])
    assert {g[0] for g, _ in CASES} == set(RolloutConfig._choices["backend"])


# ---- truncated sampling: refused for training, free for evaluation ---------------------------

MODEL = ["model.hf_dir=/m"]


@pytest.mark.parametrize(("override", "key", "value"), [("rollout.top_p=0.9", "rollout.top_p", "0.9"),
                                                        ("rollout.top_k=20", "rollout.top_k", "20"),
                                                        ("rollout.top_k=1", "rollout.top_k", "1")])
def test_truncated_training_sampling_is_refused_naming_key_value_and_why(override, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(None, MODEL + [override])
    line = next(x for x in str(err.value).splitlines() if key in x)
    assert f"{key}: {value} truncates the sampling distribution" in line
    assert "full vocabulary" in line and "bias every ratio" in line and "evaluation" in line


def test_untruncated_training_sampling_and_bad_values_are_told_apart():
    cfg = load_config(None, MODEL + ["rollout.top_p=1.0", "rollout.top_k=-1", "rollout.temperature=0.7"])
    assert (cfg.rollout.top_p, cfg.rollout.top_k) == (1.0, -1)
    assert [k for k, _ in RolloutConfig(top_p=float("nan")).check()] == ["top_p"]
    assert "must be 1 (no truncation), got 0.0" in dict(RolloutConfig(top_p=0.0).check())["top_p"]


def test_evaluation_still_samples_truncated():
    """Evaluation is not training: the engines keep serving top-p / top-k requests, and an
    evaluation's sampling settings never meet the training refusal."""
    sp = parse_sampling({"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    assert (sp.top_p, sp.top_k) == (0.9, 20)
    cfg = load_config(None, MODEL + ["eval.temperature=0.6", "eval.sampled_k=4", "eval.every_steps=5",
                                     "eval.sampled_temperature=0.8"])
    assert cfg.eval.sampled_temperature == 0.8
