"""Multi-process scenarios for the learner tests: one process-group launch runs several checks.

Each scenario runs on every rank of a torch.distributed job started by `launch()` (subprocesses
with RANK/WORLD_SIZE env vars, gloo) and rank 0 writes its figures to a JSON file that the
tests compare across layouts. Not a test module itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from megatron_darl.channel.ports import free_port
from tests.helpers import repo_env


def tiny_qwen3(path: str, tied: bool = False, seed: int = 0) -> str:
    """A random tiny Qwen3 saved by transformers (norm weights perturbed so they matter)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=tied, rms_norm_eps=1e-6)
    model = transformers.Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def make_batch(seed: int = 0):
    """8 sequences in 4 groups of 2, mixed lengths, two behavior versions, random advantages."""
    from megatron_darl.types import TrainBatch

    rng = np.random.RandomState(seed)
    b, width = 8, 24
    lengths = rng.randint(9, width + 1, size=b)
    lengths[0] = width
    tokens = np.zeros((b, width), np.int64)
    mask = np.zeros((b, width), np.float32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.randint(0, 256, size=n)
        mask[i, 4:n] = 1.0  # 4 prompt tokens
    behav = np.where(mask > 0, -5.5 + 0.3 * rng.randn(b, width), 0.0).astype(np.float32)
    return TrainBatch(
        tokens=tokens, lengths=lengths.astype(np.int64), loss_mask=mask,
        advantages=rng.randn(b).astype(np.float32), behav_logprobs=behav,
        token_versions=np.where(mask > 0, np.array([3, 3, 2, 2, 3, 3, 2, 2])[:, None], -1).astype(np.int64),
        versions=np.array([3, 3, 2, 2, 3, 3, 2, 2], np.int64),
        group_index=np.repeat(np.arange(4), 2).astype(np.int64),
        rewards=rng.rand(b).astype(np.float32), prompt_ids=np.arange(b, dtype=np.int64))


def learner_algo(policy_loss: str = "darl", **kw):
    """An `algo` section for a learner on its own: the loss knobs given, and replay and the
    per-version objective only with D-ARL's loss, selection off, so that the section is valid
    (`AlgoConfig.check`) whatever the loss."""
    from megatron_darl.algo.config import AlgoConfig

    darl = policy_loss == "darl"
    return AlgoConfig(policy_loss=policy_loss, **{"replay": darl, "sg": False, "pmis": darl, **kw})


def make_learner(hf_dir: str, tp: int, pp: int, *, policy_loss: str = "darl", micro_batch_tokens: int = 48,
                 n_minibatches: int = 2, lr: float = 1e-3, recompute: str = "none",
                 recompute_modules: tuple = ("core_attn",), **algo_kw):
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    return MegatronLearner(
        ModelConfig(hf_dir=hf_dir, recompute=recompute, recompute_modules=list(recompute_modules)),
        ParallelConfig(tp=tp, pp=pp),
        OptimConfig(lr=lr, grad_clip=1.0, lr_warmup_steps=1, lr_decay_style="linear", lr_decay_steps=8),
        LearnerConfig(micro_batch_tokens=micro_batch_tokens),
        learner_algo(policy_loss, ppo_n_minibatches=n_minibatches, **algo_kw),
        temperature=0.9, seed=1)


def _step(learner, batch) -> tuple[dict, list]:
    batch.prox_logprobs = learner.compute_logprobs(batch)
    metrics = learner.train_step(batch)
    return metrics, batch.prox_logprobs.tolist()


def run_layout(hf_dir: str, tp: int, pp: int, *, save: str = "", export: str = "", resume: str = "",
               mbt: int = 48) -> dict:
    """Two train steps from the HF weights; optionally save after step 1, export after step 2,
    then load `resume` (a step-1 checkpoint, any layout) and redo step 2."""
    learner = make_learner(hf_dir, tp, pp, micro_batch_tokens=mbt)
    batch = learner.broadcast_batch(make_batch() if learner.is_main else None)
    out = {}
    m1, lp0 = _step(learner, batch)
    out.update(step1=m1, logprobs0=lp0, allocations=gather_allocations(learner))
    if save:
        learner.save(save, {"note": "step1", "ids": [1, 2, 3]})
    m2, lp1 = _step(learner, batch)
    out.update(step2=m2, logprobs1=lp1, logprobs2=learner.compute_logprobs(batch).tolist())
    if export:
        learner.export_hf(export)
    if resume:
        out["extra"] = learner.load(resume)
        out["resumed_step"] = learner.step
        out["step2_resumed"], _ = _step(learner, batch)
        out["logprobs2_resumed"] = learner.compute_logprobs(batch).tolist()
    learner.close(keep_world=True)
    return out


def scenario_layouts(args: dict) -> dict:
    """World of 4 gloo ranks, four layouts in turn (DP fills the rest): TP2xPP2 saves and
    exports, TP1 (DP4) saves, TP2 (DP2) resumes from the TP1 checkpoint, PP2 (DP2) from TP2xPP2."""
    w, hf = args["workdir"], args["hf_dir"]
    return {
        "tp2pp2": run_layout(hf, 2, 2, save=f"{w}/ckpt_tp2pp2", export=f"{w}/export_tp2pp2"),
        "tp1dp4": run_layout(hf, 1, 1, save=f"{w}/ckpt_tp1"),
        "tp2dp2": run_layout(hf, 2, 1, resume=f"{w}/ckpt_tp1"),
        "pp2dp2": run_layout(hf, 1, 2, resume=f"{w}/ckpt_tp2pp2"),
    }


def transformers_logprobs(hf_dir: str, tokens: np.ndarray, lengths: np.ndarray, temperature: float) -> list:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens)).logits[:, :-1] / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(tokens)[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(len(tokens), 1), lp], 1)
    pos = torch.arange(tokens.shape[1])
    return torch.where(pos < torch.as_tensor(lengths)[:, None], lp, 0.0).tolist()


def _load_folder(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            out.update(load_file(f"{path}/{name}"))
    return out


def _export_checks(w: str, hf: str) -> dict:
    """HF export at init equals the source; TP2xPP2 and TP1 exports after training agree."""
    learner = make_learner(hf, 1, 1)
    learner.export_hf(f"{w}/export_init")
    learner.close(keep_world=True)
    src, got = _load_folder(hf), _load_folder(f"{w}/export_init")
    other, mine = _load_folder(f"{w}/export_tp2pp2"), _load_folder(f"{w}/export_tp1")
    return {
        "export_init_names_equal": sorted(src) == sorted(got),
        "export_init_max_diff": max(float((src[k] - got[k]).abs().max()) for k in src if k in got),
        "export_tp2pp2_names_equal": sorted(other) == sorted(mine) == sorted(src),
        "export_tp2pp2_max_diff": max(float((other[k] - mine[k]).abs().max()) for k in mine if k in other),
    }


def scenario_reference(args: dict) -> dict:
    """One process: the TP1/PP1/DP1 reference run (resuming from the TP2xPP2 checkpoint),
    transformers log-probs, HF export at init, packing budgets, and a few learning steps."""
    w, hf = args["workdir"], args["hf_dir"]
    out = {"ref": run_layout(hf, 1, 1, resume=f"{w}/ckpt_tp2pp2", export=f"{w}/export_tp1")}
    batch = make_batch()
    out["transformers_logprobs0"] = transformers_logprobs(hf, batch.tokens, batch.lengths, 0.9)
    out["transformers_export_tp1"] = transformers_logprobs(f"{w}/export_tp1", batch.tokens, batch.lengths, 0.9)
    out.update(_export_checks(w, hf))
    out["packing"] = {}
    for mbt in (24, 64, 10_000):
        learner = make_learner(hf, 1, 1, micro_batch_tokens=mbt, n_minibatches=1)
        batch = learner.broadcast_batch(make_batch())
        m, _ = _step(learner, batch)
        out["packing"][str(mbt)] = {"metrics": m, "logprobs": learner.compute_logprobs(batch).tolist()}
        learner.close(keep_world=True)
    for mode, modules in (("full", ()), ("selective", ("core_attn", "mlp"))):
        learner = make_learner(hf, 1, 1, micro_batch_tokens=10_000, n_minibatches=1, recompute=mode,
                               recompute_modules=modules or ("core_attn",))
        batch = learner.broadcast_batch(make_batch())
        out[f"recompute_{mode}"] = _step(learner, batch)[0]
        learner.close(keep_world=True)
    # naive-async PPO on fixed data: old = behavior = the initial policy, so the surrogate moves
    learner = make_learner(hf, 1, 1, policy_loss="ppo", old_logprob="behavior", n_minibatches=1, lr=3e-3,
                           micro_batch_tokens=256)
    batch = learner.broadcast_batch(make_batch())
    batch.behav_logprobs = learner.compute_logprobs(batch) * batch.loss_mask
    out["losses"] = [learner.train_step(batch)["train/loss"] for _ in range(5)]
    learner.close(keep_world=True)
    # a darl-convert Megatron folder loads to the same model as its HF source
    from checkpoint_tools.convert import hf_to_mcore

    hf_to_mcore(hf, f"{w}/converted", tp=1, pp=1, progress=False)
    learner = make_learner(f"{w}/converted", 1, 1)
    out["converted_logprobs0"] = learner.compute_logprobs(make_batch()).tolist()
    learner.close(keep_world=True)
    # darl-logprobs on a learner checkpoint saved at TP2xPP2 after one step (last: it ends the world)
    from megatron_darl.launch import logprobs_command as cli

    batch = make_batch()
    with open(f"{w}/seqs.jsonl", "w") as f:
        for row, n in zip(batch.tokens, batch.lengths):
            f.write(json.dumps({"input_ids": row[:n].tolist()}) + "\n")
    cli.main(["--model", f"{w}/ckpt_tp2pp2", "--data", f"{w}/seqs.jsonl", "--out", f"{w}/cli_out.jsonl",
              "--temperature", "0.9"])
    with open(f"{w}/cli_out.jsonl") as f:
        out["cli_ckpt_logprobs"] = [json.loads(line)["logprobs"] for line in f]
    return out


def _padding_run(hf_dir: str, multiple: int) -> dict:
    """One recompute + one train step with token widths padded to `multiple` (1: unpadded)."""
    import torch

    learner = make_learner(hf_dir, 1, 1, n_minibatches=1, micro_batch_tokens=64)
    learner.seq_multiple = multiple  # as FP8 (16/32) or sequence parallel would set it
    widths = []
    learner.chunks[0].register_forward_pre_hook(lambda mod, args: widths.append(int(args[0].shape[1])))
    batch = learner.broadcast_batch(make_batch())
    m, lp0 = _step(learner, batch)
    grads = torch.cat([b.grad_data.flatten() for c in learner.ddp for b in c.buffers]).tolist()
    out = {"metrics": m, "logprobs0": lp0, "logprobs1": learner.compute_logprobs(batch).tolist(),
           "grads": grads, "widths": widths}
    learner.close(keep_world=True)
    return out


def scenario_padding(args: dict) -> dict:
    """The same step unpadded and with widths padded to 16 (FP8 alignment): shapes and numbers."""
    return {str(m): _padding_run(args["hf_dir"], m) for m in (1, 16)}


def rank_allocations(learner) -> dict:
    """What this rank really allocated: parameter count and bytes, DDP gradient-buffer bytes,
    optimizer-state bytes (fp32 master copies and Adam moments) after a step."""
    import torch

    params = [p for c in learner.chunks for p in c.parameters()]
    buffers = [b for c in learner.ddp for b in c.buffers]
    # megatron-core 0.16.1's distributed optimizer pads its grad buffer (each parameter's start to
    # 64 values, each bucket's end to lcm(dp, 128)): the plan counts the unpadded values
    grads = sum(b.numel_unpadded * b.grad_data.element_size() for b in buffers)
    opts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    state = 0
    for opt in opts:
        for st in opt.optimizer.state.values():
            state += sum(t.numel() * t.element_size() for k, t in st.items()
                         if torch.is_tensor(t) and k != "step")
        # bf16 fp32 master weights: Float16OptimizerWithFloat16Params keeps them in
        # fp32_from_float16_groups, the DistributedOptimizer (its shard) in shard_fp32_from_float16_groups
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(opt, name, None) or []:
                state += sum(p.numel() * p.element_size() for p in group if p is not None)
    return {"tp_rank": learner.ctx.tp_rank, "pp_rank": learner.ctx.pp_rank, "numel": sum(p.numel() for p in params),
            "parameters": sum(p.numel() * p.element_size() for p in params), "gradients": grads, "optimizer": state,
            "gradients_allocated": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            "grad_tensors": sum(len(b.params) for b in buffers),
            "grad_buckets": sum(len(b.buckets) for b in buffers)}


def gather_allocations(learner) -> list:
    import torch.distributed as dist

    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rank_allocations(learner))
    return ranks


def scenario_allocations(args: dict) -> dict:
    """Real allocations after one step with `args["dtype"]` and the distributed optimizer
    (GPU: Megatron's bf16 optimizer refuses CPU tensors), for the memory plan."""
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    learner = MegatronLearner(
        ModelConfig(hf_dir=args["hf_dir"], dtype=args["dtype"]), ParallelConfig(),
        OptimConfig(lr=1e-4, distributed_optimizer=True), LearnerConfig(micro_batch_tokens=256),
        learner_algo("ppo", old_logprob="behavior", ppo_n_minibatches=1))
    learner.train_step(learner.broadcast_batch(make_batch()))
    out = gather_allocations(learner)
    learner.close()
    return out


def token_batch(rows: list[list[int]]):
    """A TrainBatch holding `rows` (right-padded with 0), every token after the first scored."""
    from megatron_darl.types import TrainBatch

    b, width = len(rows), max(len(r) for r in rows)
    tokens = np.zeros((b, width), np.int64)
    lengths = np.array([len(r) for r in rows], np.int64)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
    mask[:, 0] = 0
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=np.zeros(b, np.float32),
                      behav_logprobs=np.zeros((b, width), np.float32),
                      token_versions=np.where(mask > 0, 0, -1).astype(np.int64), versions=np.zeros(b, np.int64),
                      group_index=np.arange(b, dtype=np.int64), rewards=np.zeros(b, np.float32),
                      prompt_ids=np.arange(b, dtype=np.int64))


def scenario_architectures(args: dict) -> dict:
    """Learner log-probs (fp32, temperature 1) of each model at TP = world size, in turn."""
    import torch.distributed as dist

    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    out = {}
    for name, spec in args["models"].items():
        world = int(os.environ["WORLD_SIZE"])
        learner = MegatronLearner(ModelConfig(hf_dir=spec["hf_dir"], dtype="fp32"), ParallelConfig(tp=world),
                                  OptimConfig(), LearnerConfig(micro_batch_tokens=4096),
                                  learner_algo("ppo", old_logprob="behavior", recompute_proximal=False))
        batch = learner.broadcast_batch(token_batch(spec["tokens"]) if learner.is_main else None)
        out[name] = {"logprobs": learner.compute_logprobs(batch).tolist(),
                     "heads_per_rank": learner.chunks[0].config.num_attention_heads // world}
        learner.close(keep_world=name != list(args["models"])[-1])
        if name != list(args["models"])[-1]:
            dist.barrier()
    return out


def scenario_gpu(args: dict) -> dict:
    """One CUDA rank: the given spec/dtype/FP8 recipe, distributed optimizer, a few PPO steps."""
    import torch

    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    learner = MegatronLearner(
        ModelConfig(hf_dir=args["hf_dir"], spec=args["spec"], fp8=args["fp8"], dtype=args["dtype"],
                    make_vocab_size_divisible_by=128),
        ParallelConfig(), OptimConfig(lr=3e-3, distributed_optimizer=True), LearnerConfig(micro_batch_tokens=256),
        learner_algo("ppo", old_logprob="behavior", ppo_n_minibatches=1), temperature=0.9)
    batch = learner.broadcast_batch(make_batch())
    lp = learner.compute_logprobs(batch)
    ref = np.array(transformers_logprobs(args["hf_dir"], batch.tokens, batch.lengths, 0.9))
    batch.behav_logprobs = lp * batch.loss_mask
    losses = [learner.train_step(batch)["train/loss"] for _ in range(4)]
    learner.save(args["ckpt"], {"k": 1})  # sharded distributed-optimizer state included
    after = learner.train_step(batch)
    learner.load(args["ckpt"])
    again = learner.train_step(batch)
    out = {"resume_diff": max(abs(after[m] - again[m]) for m in ("train/loss", "train/grad_norm", "train/lr")),
           "mfu": after.get("perf/mfu", -1.0), "tokens_per_s": after["perf/tokens_per_s"]}
    out.update({"losses": losses, "max_logprob_diff_vs_fp32_reference": float(np.abs(lp - ref).max()),
           "distributed_optimizer": type(learner.optimizer).__name__ != "FP32Optimizer"
           and "Distributed" in repr(type(getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])[0])),
           "fp8_recipe": learner.chunks[0].config.fp8_recipe if args["fp8"] else None,
           "seq_multiple": learner.seq_multiple})
    learner.close()
    torch.cuda.synchronize()
    return out


def scenario_gpu_resume(args: dict) -> dict:
    """One CUDA rank, bf16 local spec, distributed optimizer: `args["save"]` trains and saves;
    otherwise this fresh process (no step taken: a Slurm requeue) loads and trains one step."""
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    learner = MegatronLearner(
        ModelConfig(hf_dir=args["hf_dir"], spec="local", dtype="bf16", make_vocab_size_divisible_by=128),
        ParallelConfig(), OptimConfig(lr=3e-3, distributed_optimizer=True), LearnerConfig(micro_batch_tokens=256),
        learner_algo("ppo", old_logprob="behavior", ppo_n_minibatches=1), temperature=0.9)
    batch = learner.broadcast_batch(make_batch())
    batch.behav_logprobs = learner.compute_logprobs(batch) * batch.loss_mask
    if args["save"]:
        learner.train_step(batch)
        learner.save(args["ckpt"], {"k": 1})
        out = {"next": learner.train_step(batch)}
    else:
        extra = learner.load(args["ckpt"])
        out = {"next": learner.train_step(batch), "extra": extra, "step": learner.step}
    learner.close()
    return out


def scenario_sequence_parallel(args: dict) -> dict:
    """TP2 with sequence parallel on the TE spec (one rank per GPU): log-probs, a few steps."""
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    learner = MegatronLearner(
        ModelConfig(hf_dir=args["hf_dir"], spec="te", dtype="fp32", recompute="full"),
        ParallelConfig(tp=2, sequence_parallel=True), OptimConfig(lr=3e-3), LearnerConfig(micro_batch_tokens=256),
        learner_algo("ppo", old_logprob="behavior", ppo_n_minibatches=1), temperature=0.9)
    batch = learner.broadcast_batch(make_batch() if learner.is_main else None)
    lp = learner.compute_logprobs(batch)
    batch.behav_logprobs = lp * batch.loss_mask
    losses = [learner.train_step(batch)["train/loss"] for _ in range(3)]
    out = {"logprobs": lp.tolist(), "losses": losses, "seq_multiple": learner.seq_multiple}
    learner.close()
    return out


def main() -> None:
    import torch

    torch.set_num_threads(1)
    name, args_path, out_path = sys.argv[1:4]
    with open(args_path) as f:
        args = json.load(f)
    result = globals()[f"scenario_{name}"](args)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def launch(name: str, args: dict, world: int, workdir: str, timeout: float = 240.0) -> dict:
    """Run scenario `name` on `world` gloo processes; rank 0's result."""
    port = free_port()
    args_path, out_path = os.path.join(workdir, f"{name}_args.json"), os.path.join(workdir, f"{name}_{world}_out.json")
    with open(args_path, "w") as f:
        json.dump(args, f)
    env = repo_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.learner_worker", name, args_path, out_path],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"scenario {name} (world {world}) failed:\n" + "\n".join(log[-3000:] for log in logs))
    with open(out_path) as f:
        return json.load(f)


if __name__ == "__main__":
    main()
