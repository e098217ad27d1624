"""Benchmark: one Megatron-Core RL train step vs a plain `transformers` step of the same model and batch.

What it is: a Qwen3-architecture model with random weights (CPU: a small one, fp32; GPU: the
Qwen3-1.7B shapes, bf16), saved by transformers, then the same batch of token rows trained two
ways, each for `--steps` timed optimizer steps after one warm-up step:
- the learner: `MegatronLearner.train_step` (PPO loss on behavior log-probs, one minibatch, one
  micro-batch, Megatron DDP + optimizer with grad clipping; local spec on CPU, TE where present);
- plain transformers: forward, log-softmax over the full logits, the same PPO surrogate,
  backward, grad-norm clipping, `torch.optim.AdamW`.
Prints a table (tokens/s of each, their ratio; on a GPU also MFU by the 6 N tokens/s estimate
against the device's dense bf16 peak), then, as the last line, one JSON object with every figure.
What it is not: a test; figures depend on the machine and on whatever else runs on it.

    python3 bench/learner_step.py [--rows 8] [--seq 256] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")  # CPU fallbacks are intended

CPU_MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=8192)


def _model_dir(root: str, on_gpu: bool) -> tuple[str, int]:
    """Save a random Qwen3 (CPU: small; GPU: Qwen3-1.7B shapes) and return (folder, parameters)."""
    import transformers

    from megatron_darl.model_facts import PUBLISHED

    shapes = {k: v for k, v in PUBLISHED["qwen3-1.7b"].items() if k not in ("architectures", "model_type")} \
        if on_gpu else dict(CPU_MODEL, tie_word_embeddings=True)
    cfg = transformers.Qwen3Config(**shapes, max_position_embeddings=4096, rope_theta=1e6)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16 if on_gpu else torch.float32)
    model.save_pretrained(f"{root}/hf")
    return f"{root}/hf", sum(p.numel() for p in model.parameters())


def _batch(rows: int, seq: int, vocab: int):
    from megatron_darl.types import TrainBatch

    rng = np.random.RandomState(0)
    tokens = rng.randint(0, vocab, (rows, seq)).astype(np.int64)
    mask = np.ones((rows, seq), np.float32)
    mask[:, :16] = 0  # a 16-token prompt
    return TrainBatch(tokens=tokens, lengths=np.full(rows, seq, np.int64), loss_mask=mask,
                      advantages=rng.randn(rows).astype(np.float32),
                      behav_logprobs=np.full((rows, seq), -9.0, np.float32),
                      token_versions=np.zeros((rows, seq), np.int64), versions=np.zeros(rows, np.int64),
                      group_index=np.arange(rows, dtype=np.int64), rewards=np.zeros(rows, np.float32),
                      prompt_ids=np.arange(rows, dtype=np.int64))


def _timed(step, steps: int, sync) -> float:
    step()  # warm-up: allocations, kernel selection
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def megatron_step_s(hf_dir: str, batch, steps: int, sync) -> float:
    from megatron_darl.algo.config import AlgoConfig
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    tokens = int(batch.lengths.sum())
    learner = MegatronLearner(ModelConfig(hf_dir=hf_dir), ParallelConfig(), OptimConfig(lr=1e-6, grad_clip=1.0),
                              LearnerConfig(micro_batch_tokens=tokens),
                              AlgoConfig(policy_loss="ppo", old_logprob="behavior", recompute_proximal=False,
                                         replay=False, sg=False, pmis=False, ppo_n_minibatches=1))
    try:
        return _timed(lambda: learner.train_step(batch), steps, sync)
    finally:
        learner.close()


def transformers_step_s(hf_dir: str, batch, steps: int, sync, device: str) -> float:
    import transformers

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    ids = torch.as_tensor(batch.tokens, device=device)
    mask = torch.as_tensor(batch.loss_mask[:, 1:], device=device)
    adv = torch.as_tensor(batch.advantages, device=device)[:, None]
    old = torch.as_tensor(batch.behav_logprobs[:, 1:], device=device)

    def step():
        logits = model(ids).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        ratio = torch.exp(lp - old)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        loss = -(surrogate * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return _timed(step, steps, sync)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    with tempfile.TemporaryDirectory() as root:
        hf_dir, n_params = _model_dir(root, on_gpu)
        vocab = 151936 if on_gpu else CPU_MODEL["vocab_size"]
        batch = _batch(args.rows, args.seq, vocab)
        tokens = int(batch.lengths.sum())
        mega = megatron_step_s(hf_dir, batch, args.steps, sync)
        if on_gpu:
            torch.cuda.empty_cache()
        plain = transformers_step_s(hf_dir, batch, args.steps, sync, "cuda" if on_gpu else "cpu")
    out = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "dtype": "bf16" if on_gpu else "fp32",
           "params": n_params, "tokens_per_step": tokens, "megatron_step_s": mega, "transformers_step_s": plain,
           "megatron_tokens_per_s": tokens / mega, "transformers_tokens_per_s": tokens / plain,
           "ratio_megatron_vs_transformers": plain / mega}
    if on_gpu:
        from megatron_darl.learner.train_step import _PEAK_FLOPS

        peak = next((v for k, v in _PEAK_FLOPS.items() if k in out["device"]), None)
        for who in ("megatron", "transformers"):
            out[f"{who}_mfu"] = 6.0 * n_params * out[f"{who}_tokens_per_s"] / peak if peak else None
    print(f"{'':<14}{'step s':>10}{'tokens/s':>12}" + ("{:>8}".format("MFU") if on_gpu else ""))
    for who in ("megatron", "transformers"):
        mfu = f"{out[f'{who}_mfu']:8.3f}" if on_gpu and out[f"{who}_mfu"] is not None else ""
        print(f"{who:<14}{out[f'{who}_step_s']:10.3f}{out[f'{who}_tokens_per_s']:12.0f}{mfu}")
    print(f"{n_params / 1e6:.1f} M parameters, {tokens} tokens per step ({out['dtype']} on {out['device']}); "
          f"Megatron / transformers throughput: {out['ratio_megatron_vs_transformers']:.2f}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
