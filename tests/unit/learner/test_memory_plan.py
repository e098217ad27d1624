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
    for key in ("numel", "parameters", "optimizer", "gradients_allocated"):
        assert rank[key] == plan[key], (key, rank, plan)
    # the buffer's padding, exactly: each parameter starts on a multiple of 64 values, the bucket
    # ends on one of lcm(dp=1, 128) (megatron-core 0.16.1, param_and_grad_buffer.py)
    assert plan["gradients_allocated"] > plan["gradients"]


LAYOUTS = ((1, 2),)  # (tp, pp) in a world of 6: DP 3, whose lcm(3, 128) pads every bucket


def _layout_worker(rank: int, hf_dir: str, port: int, out: str) -> None:
    """One rank of 6: per layout, a bf16 model on CPU wrapped in DDP laid out for the distributed
    optimizer (the optimizer itself needs CUDA); what it holds, per rank."""
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="6", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_darl.config.learner import ModelConfig, ParallelConfig
    from megatron_darl.learner import model as M
    from megatron_darl.learner.parallel import destroy_parallel, init_parallel

    results = {}
    for tp, pp in LAYOUTS:
        par = ParallelConfig(tp=tp, pp=pp)
        ctx = init_parallel(par, seed=0)
        hf = M.read_hf_config(hf_dir)
        (chunk,) = M.build_model(hf, ModelConfig(hf_dir=hf_dir, dtype="bf16", init="random"), par, ctx.pg,
                                 on_gpu=False)
        dtypes = sorted({str(p.dtype) for p in chunk.parameters()})
        param_bytes = sum(p.numel() * p.element_size() for p in chunk.parameters())
        ddp = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), chunk, pg_collection=ctx.pg)
        (buf,) = ddp.buffers  # one dtype: one buffer
        mine = {"pp_rank": ctx.pp_rank, "dtypes": dtypes, "params_dtype": str(chunk.config.params_dtype),
                "parameters": param_bytes, "param_buffer": buf.param_data.numel() * buf.param_data.element_size(),
                "grad_buffer": buf.grad_data.numel() * buf.grad_data.element_size(),
                "buckets": [list(b) for b in buf.bucket_indices],
                "params": sorted(list(v[:2]) for v in buf.param_index_map.values())}
        ranks = [None] * 6
        dist.all_gather_object(ranks, mine)
        results[f"tp{tp}pp{pp}"] = ranks
        destroy_parallel(keep_world=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="six gloo ranks on CPU (NCCL refuses six ranks on one GPU)")
def test_a_bf16_cpu_build_holds_the_planned_bytes_and_buffer_layout(tmp_path):
    """Every parameter in params_dtype (megatron-core's local RMSNorms are built fp32 otherwise),
    parameter bytes as planned, and DDP's distributed-optimizer buffers padded exactly as the
    plan lays them out (each parameter, each bucket), at PP2xDP3 with tied embeddings (the
    embedding and its output copy in buckets of their own)."""
    import torch.multiprocessing as mp

    from megatron_darl.channel.ports import free_port

    hf = W.tiny_qwen3(str(tmp_path / "hf"), tied=True)
    with open(f"{hf}/config.json") as f:
        config = json.load(f)
    out = str(tmp_path / "layouts.json")
    mp.start_processes(_layout_worker, args=(hf, free_port(), out), nprocs=6, start_method="spawn")
    with open(out) as f:
        results = json.load(f)
    for tp, pp in LAYOUTS:
        for rank in results[f"tp{tp}pp{pp}"]:
            assert rank["dtypes"] == [rank["params_dtype"]] == ["torch.bfloat16"], rank["dtypes"]
            plan = MP.state_bytes(config, tp=tp, pp=pp, stage=rank["pp_rank"], bf16=True, dp=3,
                                  distributed_optimizer=True)
            assert rank["parameters"] == plan["parameters"]
            assert rank["param_buffer"] == plan["parameters_allocated"] > plan["parameters"]
            assert rank["grad_buffer"] == plan["gradients_allocated"]
            (params,) = MP.chunk_parameters(config, tp=tp, pp=pp, stage=rank["pp_rank"])
            layout = MP.buffer_layout(params, 3, True)
            assert rank["buckets"] == [[b["start"], b["end"]] for b in layout]
            assert rank["params"] == sorted(list(r) for b in layout for r in b["params"])
    assert len(results["tp1pp2"][-1]["buckets"]) == 2  # the output copy's own bucket


def test_the_optimizer_row_is_the_largest_shard_of_the_parameters():
    params = [("a", 100, False), ("b", 30, False), ("c", 500, False)]
    (bucket,) = MP.buffer_layout(params, 3, True)
    assert bucket["params"] == [(0, 500), (512, 542), (576, 676)] and bucket["end"] == 768  # lcm(3, 128) = 384
    assert MP._shard_values([bucket], 3) == 256  # [0, 256) of c; then 244 of c; then b and a, 130
    assert MP.buffer_layout(params, 3, False)[0]["end"] == 630  # no padding without it


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


def test_the_local_spec_plans_six_bytes_per_attention_score_only_with_dot_product_attention():
    """megatron-core's local DotProductAttention keeps the fp32 softmax output and its bf16 copy;
    the default flash core attention keeps TE's 4 B per row and head (the local spec's SwiGLU
    keeps one activation more than TE's fused one either way)."""
    hf = MP_published("qwen3-1.7b")
    cfg = _cfg("configs/qwen3_1p7b_gsm8k_darl.yaml", "model.recompute=none")
    dot = _cfg("configs/qwen3_1p7b_gsm8k_darl.yaml", "model.recompute=none", "model.attention=dot_product")
    te, flash, local = MP.setting_of(cfg, "te"), MP.setting_of(cfg, "local"), MP.setting_of(dot, "local")
    assert flash.flash_attention and not local.flash_attention
    t, a, f, tp = 4096, hf["num_attention_heads"], hf["intermediate_size"], te.tp
    gap = MP._layer_bytes(hf, local, t, "none")[0] - MP._layer_bytes(hf, te, t, "none")[0]
    assert gap == (6 * a * t * min(t, local.max_seq) - 4 * t * a + 2 * t * f) / tp
    assert MP._layer_bytes(hf, flash, t, "none")[0] - MP._layer_bytes(hf, te, t, "none")[0] == 2 * t * f / tp


def test_a_node_without_te_refuses_the_1p7b_recipe_with_dot_product_attention():
    """The 1.7B recipe plans under 80 GiB with TE; with model.spec=auto on a node without TE it
    runs the local spec: with its flash core attention (the default) it still fits, with
    model.attention=dot_product its attention does not: refused on the node, naming both."""
    from megatron_darl.learner.checks import check_resolved_spec

    cfg = _cfg("configs/qwen3_1p7b_gsm8k_darl.yaml")  # shapes: the published Qwen3-1.7B
    dot = _cfg("configs/qwen3_1p7b_gsm8k_darl.yaml", "model.attention=dot_product")
    hf = MP_published("qwen3-1.7b")
    te, flash, local = MP.plan_run(cfg, hf, "te"), MP.plan_run(cfg, hf, "local"), MP.plan_run(dot, hf, "local")
    assert te.fits and flash.fits and flash.total < 1.1 * te.total, (te.total / GIB, flash.total / GIB)
    assert not local.fits and local.total > 1.3 * te.total, (te.total / GIB, local.total / GIB)
    with pytest.raises(RuntimeError, match="fell back to megatron-core's local spec.*megatron-darl\\[gpu\\]"):
        check_resolved_spec(dot, on_gpu=True, te=False)
    check_resolved_spec(cfg, on_gpu=True, te=False)
    check_resolved_spec(dot, on_gpu=True, te=True)
    check_resolved_spec(dot, on_gpu=False, te=False)
