"""Config loading: YAML + dotted overrides, errors that name the key, file and line."""

import glob
import os
import re
import subprocess
import sys

import pytest

from megatron_darl.config import ConfigError, RunConfig, load_config, save_resolved, to_yaml
from megatron_darl.launch.cli import train_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODEL = ["model.hf_dir=/models/qwen3"]
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_defaults_need_only_a_model():
    with pytest.raises(ConfigError, match=r"model\.hf_dir"):
        load_config()
    cfg = load_config(None, MODEL)
    assert isinstance(cfg, RunConfig)
    assert cfg.algo.k == 4 and cfg.algo.max_head_offpolicyness == 4


@pytest.mark.parametrize("path", SHIPPED, ids=[os.path.basename(p) for p in SHIPPED])
def test_every_shipped_recipe_loads(path):
    load_config(path)


def test_shipped_recipes_exist():
    assert SHIPPED, "configs/ must ship recipes"


def test_print_config_applies_overrides(capsys):
    rc = train_main(["--config", SHIPPED[0], "--print-config", "algo.k=8", "+algo.pmis=true"])
    out = capsys.readouterr().out
    assert rc == 0
    algo = re.search(r"\nalgo:\n((?:  .*\n)+)", out).group(1)
    assert "  k: 8\n" in algo and "  pmis: true\n" in algo


def test_unknown_override_names_the_key(capsys):
    rc = train_main(["--config", SHIPPED[0], "algo.kk=3"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "algo.kk" in err and "Did you mean 'k'" in err and "sg_quantile" in err


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"algo\.k"):
        load_config(None, MODEL + ["algo.k=four"])


def test_bad_choice_lists_allowed_values():
    with pytest.raises(ConfigError) as exc:
        load_config(None, MODEL + ["algo.pmis_beta=uniform"])
    assert "algo.pmis_beta='uniform'" in str(exc.value) and "'ess', 'tokens', 'balance'" in str(exc.value)


@pytest.mark.parametrize("lr", ["nan", "inf", "-1e-5", "1e39"])
def test_a_learning_rate_the_optimizer_cannot_use_is_refused_before_start(lr):
    """NaN passed `lr < 0` and trained NaN; 1e39 overflowed float32 in the first Adam step."""
    with pytest.raises(ConfigError, match=r"optim\.lr.*must be finite, >= 0 and <= 3\.403e\+38"):
        load_config(None, MODEL + [f"optim.lr={lr}", "optim.min_lr=0"])
    assert load_config(None, MODEL + ["optim.lr=3e38"]).optim.lr == 3e38


def test_invalid_combination_is_refused():
    with pytest.raises(ConfigError) as exc:
        load_config(None, MODEL + ["algo.policy_loss=decoupled", "algo.recompute_proximal=false", "algo.pmis=false"])
    msg = str(exc.value)
    assert "recompute_proximal" in msg and "policy_loss" in msg


def test_pmis_needs_darl_loss():
    with pytest.raises(ConfigError, match=r"algo\.pmis: the per-version objective needs policy_loss=darl"):
        load_config(None, MODEL + ["algo.policy_loss=ppo", "algo.old_logprob=behavior"])


def test_yaml_error_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  steps: 3\nalgo:\n  k: 2\n  warmupp: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(str(p))
    assert f"{p}:5" in str(exc.value) and "algo.warmupp" in str(exc.value)


def test_a_recipe_of_the_older_layout_names_every_moved_key_with_its_line(tmp_path):
    """D-ARL's knobs were split over `algo`, `replay` and `staleness`, the ring's settings sat in
    `replay` and the demo's in `train`: each old key stops the run with its new name and line."""
    p = tmp_path / "old.yaml"
    p.write_text("model: {hf_dir: /models/qwen3}\nreplay: {enable: false, k: 2, ring_bytes: 65536}\n"
                 "staleness:\n  max_head_offpolicyness: 1\ntrain: {steps: 3, sft_steps: 9, min_step_s: 1.0}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(str(p))
    msg = str(exc.value)
    for old, new, line in [("replay.enable", "algo.replay", 2), ("replay.k", "algo.k", 2),
                           ("replay.ring_bytes", "ring.size_bytes", 2),
                           ("staleness.max_head_offpolicyness", "algo.max_head_offpolicyness", 4),
                           ("train.sft_steps", "demo.sft_steps", 5), ("train.min_step_s", "demo.min_step_s", 5)]:
        assert f"{old!r} moved to {new!r} ({p}:{line})" in msg, msg
    assert "train.steps" not in msg


@pytest.mark.parametrize("override, new", [("replay.k=2", "algo.k"), ("+replay.sg=false", "algo.sg"),
                                           ("replay.enable=false", "algo.replay"),
                                           ("staleness.max_head_offpolicyness=2", "algo.max_head_offpolicyness"),
                                           ("replay.ring_bytes=16777216", "ring.size_bytes"),
                                           ("train.sft_target=0.2", "demo.sft_target")])
def test_an_override_of_a_moved_key_names_the_new_one(override, new):
    with pytest.raises(ConfigError, match=re.escape(f"moved to {new!r}")):
        load_config(None, MODEL + [override])


def test_an_unknown_key_of_a_removed_section_says_the_section_is_gone():
    with pytest.raises(ConfigError, match="the 'replay' section is gone: its keys moved to algo and ring"):
        load_config(None, MODEL + ["replay.kk=2"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, MODEL + ["algo.k"])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/x.yaml")


def test_resolved_config_round_trip(tmp_path):
    cfg = load_config(None, MODEL + ["algo.k=2", "train.steps=7", "rollout.engine_urls=[http://a:1,http://b:2]"])
    path = save_resolved(cfg, str(tmp_path))
    again = load_config(path)
    assert again == cfg and to_yaml(again) == to_yaml(cfg)


def test_console_script_print_config_is_fast_and_exits_zero():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_darl", "train", "--config", SHIPPED[0], "--print-config", "algo.k=8"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "k: 8" in proc.stdout


def test_gpu_recipe_prints_but_does_not_start_without_its_files(capsys):
    recipe = os.path.join(ROOT, "configs", "qwen3_4b_math_darl.yaml")
    assert train_main(["--config", recipe, "--print-config"]) == 0
    capsys.readouterr()
    assert train_main(["--config", recipe]) == 1
    err = capsys.readouterr().err
    assert "data.source: file not found: /path/to/math/train.jsonl" in err and "model.hf_dir" in err


def test_rollout_restart_without_abort_is_refused():
    with pytest.raises(ConfigError, match=r"rollout\.partial_rollout"):
        load_config(None, MODEL + ["rollout.partial_rollout=false", "rollout.pause_mode=in_place"])


def test_mismatch_every_needs_the_learners_log_probs():
    naive = ["algo.policy_loss=ppo", "algo.old_logprob=behavior", "algo.replay=false", "algo.sg=false",
             "algo.pmis=false"]
    assert load_config(None, MODEL + naive + ["learner.mismatch_every=5"]).learner.mismatch_every == 5
    with pytest.raises(ConfigError, match=r"learner\.mismatch_every: 5 compares .* algo\.recompute_proximal=true"):
        load_config(None, MODEL + naive + ["algo.recompute_proximal=false", "learner.mismatch_every=5"])
    with pytest.raises(ConfigError, match=r"learner\.mismatch_every: must be >= 0"):
        load_config(None, MODEL + ["learner.mismatch_every=-1"])


def test_distributed_weight_sync_loads_with_a_bounded_timeout():
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync='nccl': allowed values are 'auto', 'shm', 'disk', "
                                          r"'distributed'"):
        load_config(None, MODEL + ["rollout.weight_sync=nccl"])
    cfg = load_config(None, MODEL + ["rollout.weight_sync=distributed", "rollout.weight_sync_timeout_s=30"])
    assert cfg.rollout.weight_sync == "distributed" and cfg.rollout.weight_sync_timeout_s == 30
    with pytest.raises(ConfigError, match=r"weight_sync_timeout_s"):
        load_config(None, MODEL + ["rollout.weight_sync_timeout_s=0"])



def test_balance_loads_and_needs_the_per_version_objective():
    cfg = load_config(None, MODEL + ["algo.pmis_beta=balance", "algo.balance_snapshots=exact"])
    assert cfg.algo.pmis_beta == "balance" and cfg.algo.balance_snapshots == "exact"
    assert load_config(None, MODEL + ["algo.pmis_beta=balance"]).algo.balance_snapshots == "auto"
    with pytest.raises(ConfigError, match=r"algo\.pmis_beta.*pmis=true"):
        load_config(None, MODEL + ["algo.pmis_beta=balance", "algo.pmis=false"])
    with pytest.raises(ConfigError, match=r"algo\.pmis_beta.*rollout_is=token"):
        load_config(None, MODEL + ["algo.pmis_beta=balance", "algo.rollout_is=sequence"])
    with pytest.raises(ConfigError, match=r"algo\.balance_snapshots"):
        load_config(None, MODEL + ["algo.pmis_beta=balance", "algo.balance_snapshots=always"])
