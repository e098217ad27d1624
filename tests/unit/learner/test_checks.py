"""Layout checks before anything starts: a tensor/pipeline layout the model cannot take, or a
world size it does not divide, stops `darl-train` at once, naming the keys and what would work."""

import json

import pytest

from megatron_darl.config import load_config
from megatron_darl.launch.cli import train_main
from megatron_darl.launch.preflight import preflight
from megatron_darl.learner.checks import layout_errors, learner_world
from megatron_darl.model_facts import model_shapes

DEMO = "configs/cpu_demo_darl.yaml"  # builtin tiny Qwen3: 4 heads, 2 KV heads, FFN 384, 3 layers


@pytest.fixture
def no_run(monkeypatch):
    """Stand-ins for the two ways `train_main` starts a run (`launch.local.run_local`, this
    machine; `launch.slurm.run_slurm`, one Slurm job) that record being started (they must not be);
    `test_no_run_sees_a_start` shows that a start does reach them."""
    started = []
    monkeypatch.setattr("megatron_darl.launch.local.run_local", lambda cfg: started.append(("local", cfg)) or 0)
    monkeypatch.setattr("megatron_darl.launch.slurm.run_slurm", lambda cfg: started.append(("slurm", cfg)) or 0)
    return started


def test_no_run_sees_a_start(no_run):
    """The control for the two tests below: a layout that fits reaches the (stand-in) start."""
    assert train_main(["--config", DEMO]) == 0
    assert [kind for kind, _ in no_run] == ["local"]
    assert train_main(["--config", DEMO, "launch.mode=slurm"]) == 0
    assert [kind for kind, _ in no_run] == ["local", "slurm"]


def test_tp3_on_the_demo_stops_before_anything_starts(no_run, capsys):
    assert train_main(["--config", DEMO, "parallel.tp=3"]) == 1
    err = capsys.readouterr().err
    assert "parallel.tp=3 must divide num_attention_heads=4, num_key_value_heads=2" in err
    assert "allowed tp for this model: 1, 2" in err
    assert no_run == []  # no engine, no evaluation, no learner


def test_world_size_and_pipeline_errors_name_keys_and_fits(no_run, capsys):
    assert train_main(["--config", DEMO, "parallel.pp=2", "launch.learner_procs_per_node=3"]) == 1
    err = capsys.readouterr().err
    assert "parallel.pp=2 must divide num_hidden_layers=3" in err and "allowed pp for this model: 1, 3" in err
    assert "learner world size 3 (launch.learner_procs_per_node=3" in err and "tp=1 pp=3" in err
    assert no_run == []


def test_slurm_world_counts_trainer_nodes():
    cfg = load_config("configs/qwen3_4b_math_darl.yaml", ["launch.trainer_nodes=2"])
    assert learner_world(cfg)[0] == 16
    cfg = load_config(DEMO, ["launch.learner_procs_per_node=2", "parallel.tp=2"])
    assert learner_world(cfg)[0] == 2 and preflight(cfg) == []  # 4 heads / 2 KV heads split in 2


def test_odd_tp_that_divides_the_heads_passes(tmp_path):
    """SmolLM2-135M's shapes (9 heads, 3 KV heads, FFN 1536) from a real config.json folder."""
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
          "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "vocab_size": 49152, "tie_word_embeddings": True, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = load_config(DEMO, [f"model.hf_dir={tmp_path}", "model.tokenizer=builtin:demo", "parallel.tp=3",
                             "launch.learner_procs_per_node=3"])
    assert model_shapes(cfg)[0] == hf
    assert layout_errors(hf, cfg.parallel, 3, "x") == []
    errs = layout_errors(hf, load_config(DEMO, ["parallel.tp=2"]).parallel, 2, "x")
    assert errs and "num_attention_heads=9" in errs[0] and "allowed tp for this model: 1, 3" in errs[0]


def test_published_shapes_check_a_recipe_without_its_weights():
    cfg = load_config("configs/qwen3_4b_math_darl.yaml", ["parallel.tp=3"])
    hf, source = model_shapes(cfg)
    assert "published config of Qwen3-4B" in source
    (err,) = [e for e in preflight(cfg) if "parallel.tp=3" in e]
    assert "num_attention_heads=32" in err and "allowed tp for this model: 1, 2, 4, 8" in err


def test_an_unsupported_architecture_is_named_not_a_traceback(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    cfg = load_config(DEMO, [f"model.hf_dir={tmp_path}", "model.tokenizer=builtin:demo"])
    (err,) = preflight(cfg)
    assert err.startswith("model.hf_dir:") and "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err
