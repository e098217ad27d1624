"""The learner memory plan: its exact parts against real Megatron allocations, its formulas
against hand-derived figures, and the refusal of recipes that do not fit."""

import json

import pytest
import torch

from megatron_darl.config import load_config
from megatron_darl.learner import memory_plan as MP
from tests.helpers import learner_worker as W

GIB = float(1 << 30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_distributed_optimizer_bytes_match_real_allocations(tmp_path):
    """bf16 parameters, fp32 main grads, fp32 master + Adam (Megatron refuses bf16 on CPU)."""
    hf = W.tiny_qwen3(str(tmp_path / "hf"), tied=True)
    with open(f"{hf}/config.json") as f:
        config = json.load(f)
    (rank,) = W.launch("allocations", {"hf_dir": hf, "dtype": "bf16"}, 1, str(tmp_path))
    plan = MP.state_bytes(config, tp=1, pp=1, stage=0, bf16=True, dp=1, distributed_optimizer=True)
    for key in ("numel", "parameters", "gradients", "optimizer"):
        assert rank[key] == plan[key], (key, rank, plan)
    # the allocation adds the distributed optimizer's padding: under 64 values per parameter
    # and lcm(dp=1, 128) per bucket (megatron-core 0.16.1, param_and_grad_buffer.py)
    pad = 4 * (64 * rank["grad_tensors"] + 128 * rank["grad_buckets"])
    assert plan["gradients"] <= rank["gradients_allocated"] <= plan["gradients"] + pad, rank


def _cfg(path, *over):
    return load_config(path, list(over))


def test_activation_formula_matches_a_hand_derivation():
    """Qwen3-4B layer, 9216 tokens, TP2 with sequence parallel, bf16, TE (flash attention)."""
    hf = MP_published("qwen3-4b")
    s = MP.setting_of(_cfg("configs/qwen3_4b_math_darl.yaml", "parallel.sequence_parallel=true",
                           "model.recompute=none", "learner.micro_batch_tokens=9216"))
    t, h, f, a, g, d = 9216, 2560, 9728, 32, 8, 128
    outside = 4 * 2 * t * h / 2  # norm inputs/outputs, split by sequence parallel
    inside = (2 * t * (a + g) * d + 2 * t * (a + 2 * g) * d + 2 * t * a * d + 4 * t * a + 2 * t * f * 3) / 2
    kept, rerun = MP._layer_bytes(hf, s, t, "none")
    assert kept == outside + inside and rerun == 0
    kept_full, rerun_full = MP._layer_bytes(hf, s, t, "full")
    assert kept_full == 2 * t * h / 2 and rerun_full == outside + inside
    no_sp = MP.setting_of(_cfg("configs/qwen3_4b_math_darl.yaml", "parallel.sequence_parallel=false"))
    assert MP._layer_bytes(hf, no_sp, t, "none")[0] == 2 * outside + inside


def MP_published(name):
    from megatron_darl.model_facts import PUBLISHED

    return dict(PUBLISHED[name])


@pytest.mark.parametrize("recipe", ["configs/qwen3_1p7b_gsm8k_darl.yaml", "configs/qwen3_4b_math_darl.yaml"])
def test_shipped_gpu_recipes_fit(recipe):
    plan = MP.plan_run(_cfg(recipe), MP_published("qwen3-1.7b" if "1p7b" in recipe else "qwen3-4b"))
    assert plan.setting.on_gpu and plan.fits, plan.format()
    assert plan.total < 0.9 * plan.setting.gpu_gib * GIB  # headroom for what the plan leaves out


def test_the_old_4b_recipe_is_refused_with_changes_that_fit(capsys):
    from megatron_darl.launch.cli import train_main

    old = ["parallel.sequence_parallel=false", "model.recompute=none", "learner.micro_batch_tokens=32768"]
    assert train_main(["--config", "configs/qwen3_4b_math_darl.yaml", "--plan", *old]) == 1
    err = capsys.readouterr().err
    assert "more than learner.gpu_memory_gib=79" in err and "model.recompute=full" in err


def test_preflight_refuses_before_anything_starts(capsys):
    from megatron_darl.learner.checks import learner_checks

    cfg = _cfg("configs/qwen3_4b_math_darl.yaml", "learner.micro_batch_tokens=65536", "model.recompute=none")
    errors = learner_checks(cfg)
    assert len(errors) == 1 and "gpu_memory_gib" in errors[0] and "learner.micro_batch_tokens=" in errors[0]
    # engines sharing the GPU count against it
    shared = _cfg("configs/qwen3_4b_math_darl.yaml", "learner.engine_memory_fraction=0.9")
    assert learner_checks(shared) and not learner_checks(_cfg("configs/qwen3_4b_math_darl.yaml"))


def test_cpu_runs_print_a_plan_without_gpu_check(capsys):
    from megatron_darl.launch.cli import train_main

    assert train_main(["--config", "configs/cpu_demo_darl.yaml", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "built-in model" in out and "not checked against a GPU" in out


def test_the_local_spec_plans_six_bytes_per_attention_score():
    """megatron-core's local DotProductAttention keeps the fp32 softmax output and its bf16 copy."""
    hf = MP_published("qwen3-1.7b")
    cfg = _cfg("configs/qwen3_1p7b_gsm8k_darl.yaml", "model.recompute=none")
    te, local = MP.setting_of(cfg, "te"), MP.setting_of(cfg, "local")
    t, a, f, tp = 4096, hf["num_attention_heads"], hf["intermediate_size"], te.tp
    gap = MP._layer_bytes(hf, local, t, "none")[0] - MP._layer_bytes(hf, te, t, "none")[0]
    assert gap == (6 * a * t * min(t, local.max_seq) - 4 * t * a + 2 * t * f) / tp


def test_a_node_without_te_refuses_the_1p7b_recipe_that_planned_te():
    """The 1.7B recipe plans under 80 GiB with TE; with model.spec=auto on a node without TE it
    runs the local spec, whose attention does not fit: refused on the node, naming both."""
    from megatron_darl.learner.checks import check_resolved_spec

    cfg = _cfg("configs/qwen3_1p7b_gsm8k_darl.yaml")  # shapes: the published Qwen3-1.7B
    hf = MP_published("qwen3-1.7b")
    te, local = MP.plan_run(cfg, hf, "te"), MP.plan_run(cfg, hf, "local")
    assert te.fits and not local.fits and local.total > 1.3 * te.total, (te.total / GIB, local.total / GIB)
    with pytest.raises(RuntimeError, match="fell back to megatron-core's local spec.*megatron-darl\\[gpu\\]"):
        check_resolved_spec(cfg, on_gpu=True, te=False)
    check_resolved_spec(cfg, on_gpu=True, te=True)
    check_resolved_spec(cfg, on_gpu=False, te=False)
