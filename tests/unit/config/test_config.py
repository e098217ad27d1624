"""Config loading: YAML + dotted overrides, errors that name the key, file and line."""

import glob
import re
import os
import subprocess
import sys

import pytest

from megatron_darl.cli import train_main
from megatron_darl.config import ConfigError, RunConfig, load_config, save_resolved, to_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODEL = ["model.hf_dir=/models/qwen3"]
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_defaults_need_only_a_model():
    with pytest.raises(ConfigError, match=r"model\.hf_dir"):
        load_config()
    cfg = load_config(None, MODEL)
    assert isinstance(cfg, RunConfig)
    assert cfg.replay.k == 4 and cfg.staleness.max_head_offpolicyness == 4


@pytest.mark.parametrize("path", SHIPPED, ids=[os.path.basename(p) for p in SHIPPED])
def test_every_shipped_recipe_loads(path):
    load_config(path)


def test_shipped_recipes_exist():
    assert SHIPPED, "configs/ must ship recipes"


def test_print_config_applies_overrides(capsys):
    rc = train_main(["--config", SHIPPED[0], "--print-config", "replay.k=8", "+replay.pmis=true"])
    out = capsys.readouterr().out
    assert rc == 0
    replay = re.search(r"\nreplay:\n((?:  .*\n)+)", out).group(1)
    assert "  k: 8\n" in replay and "  pmis: true\n" in replay


def test_unknown_override_names_the_key(capsys):
    rc = train_main(["--config", SHIPPED[0], "replay.kk=3"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "replay.kk" in err and "Did you mean 'k'" in err and "sg_quantile" in err


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"replay\.k"):
        load_config(None, MODEL + ["replay.k=four"])


def test_bad_choice_lists_allowed_values():
    with pytest.raises(ConfigError) as exc:
        load_config(None, MODEL + ["replay.pmis_beta=uniform"])
    assert "replay.pmis_beta='uniform'" in str(exc.value) and "'ess', 'tokens', 'balance'" in str(exc.value)


def test_invalid_combination_is_refused():
    with pytest.raises(ConfigError) as exc:
        load_config(None, MODEL + ["algo.policy_loss=decoupled", "algo.recompute_proximal=false", "replay.pmis=false"])
    msg = str(exc.value)
    assert "recompute_proximal" in msg and "policy_loss" in msg


def test_pmis_needs_darl_loss():
    with pytest.raises(ConfigError, match=r"replay\.pmis"):
        load_config(None, MODEL + ["algo.policy_loss=ppo", "algo.old_logprob=behavior"])


def test_yaml_error_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  steps: 3\nreplay:\n  k: 2\n  warmupp: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(str(p))
    assert f"{p}:5" in str(exc.value) and "replay.warmupp" in str(exc.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, MODEL + ["replay.k"])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/x.yaml")


def test_resolved_config_round_trip(tmp_path):
    cfg = load_config(None, MODEL + ["replay.k=2", "train.steps=7", "rollout.engine_urls=[http://a:1,http://b:2]"])
    path = save_resolved(cfg, str(tmp_path))
    again = load_config(path)
    assert again == cfg and to_yaml(again) == to_yaml(cfg)


def test_console_script_print_config_is_fast_and_exits_zero():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_darl", "train", "--config", SHIPPED[0], "--print-config", "replay.k=8"],
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


def test_the_old_nccl_name_is_refused_with_the_new_one_and_distributed_loads():
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync.*set rollout\.weight_sync=distributed"):
        load_config(None, MODEL + ["rollout.weight_sync=nccl"])
    cfg = load_config(None, MODEL + ["rollout.weight_sync=distributed", "rollout.weight_sync_timeout_s=30"])
    assert cfg.rollout.weight_sync == "distributed" and cfg.rollout.weight_sync_timeout_s == 30
    with pytest.raises(ConfigError, match=r"weight_sync_timeout_s"):
        load_config(None, MODEL + ["rollout.weight_sync_timeout_s=0"])



def test_balance_loads_and_needs_the_per_version_objective():
    cfg = load_config(None, MODEL + ["replay.pmis_beta=balance", "replay.balance_snapshots=exact"])
    assert cfg.replay.pmis_beta == "balance" and cfg.replay.balance_snapshots == "exact"
    assert load_config(None, MODEL + ["replay.pmis_beta=balance"]).replay.balance_snapshots == "auto"
    with pytest.raises(ConfigError, match=r"replay\.pmis_beta.*replay\.pmis=true"):
        load_config(None, MODEL + ["replay.pmis_beta=balance", "replay.pmis=false"])
    with pytest.raises(ConfigError, match=r"replay\.pmis_beta.*rollout_is=token"):
        load_config(None, MODEL + ["replay.pmis_beta=balance", "algo.rollout_is=sequence"])
    with pytest.raises(ConfigError, match=r"replay\.balance_snapshots"):
        load_config(None, MODEL + ["replay.pmis_beta=balance", "replay.balance_snapshots=always"])
