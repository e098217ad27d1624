"""Benchmark: one Megatron-Core RL train step vs a plain `transformers` step of the same model and batch.

What it is: a Qwen3-architecture model with random weights (CPU: a small one, fp32; GPU: the
Qwen3-1.7B shapes, bf16), saved by transformers, then the same batches of token rows trained
two ways, each for `--steps` timed optimizer steps after one warm-up step, at each shape of
`--shapes` (rows x tokens; one micro-batch each):
- the learner: `MegatronLearner.train_step` (PPO loss on behavior log-probs, one minibatch, one
  micro-batch, Megatron DDP + optimizer with grad clipping; the local spec with its flash core
  attention where Transformer Engine is absent, TE's where present; `--attention dot_product`
  runs megatron-core's DotProductAttention instead);
- plain transformers: forward, log-softmax over the full logits, the same PPO surrogate,
  backward, grad-norm clipping, `torch.optim.AdamW`.
Each system runs in a process of its own, so that its memory figures are its own. Per shape it
reports tokens/s of each and their ratio, the peak memory of a step (GPU: the allocator's peak,
weights and optimizer state included; CPU: the process's peak resident size, which never
shrinks: an upper bound) and, on a GPU, the largest number of rows of `--fit-seq` tokens that
one train step fits (rows doubled until the allocator fails, then bisected; `--max-rows` caps
it); on a GPU also MFU by the 6 N tokens/s estimate against the device's dense bf16 peak. The
last line printed is one JSON object with every figure.
What it is not: a test; figures depend on the machine and on whatever else runs on it.

    python3 bench/learner_step.py [--shapes 8x1024,4x2048,1x8192] [--steps 3] [--fit-seq 8192]
    python3 bench/learner_step.py --rows 8 --seq 256   # one shape (the CPU default)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
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
GPU_SHAPES, CPU_SHAPES = "8x1024,4x2048,1x8192", "8x256"
SYSTEMS = ("megatron", "transformers")


def _model_dir(root: str, on_gpu: bool) -> tuple[str, int]:
    """Save a random Qwen3 (CPU: small; GPU: Qwen3-1.7B shapes) and return (folder, parameters)."""
    import transformers

    from megatron_darl.model_facts import PUBLISHED

    shapes = {k: v for k, v in PUBLISHED["qwen3-1.7b"].items() if k not in ("architectures", "model_type")} \
        if on_gpu else dict(CPU_MODEL, tie_word_embeddings=True)
    cfg = transformers.Qwen3Config(**shapes, max_position_embeddings=40960 if on_gpu else 8192, rope_theta=1e6)
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _timed(step, steps: int) -> tuple[float, float]:
    """(seconds per step, peak GiB) of `steps` steps after a warm-up step."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up: allocations, kernel selection, optimizer state
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    return (time.perf_counter() - t0) / steps, _peak_gib()


def _fits(step) -> bool:
    """Whether one step runs without the allocator failing (the memory is given back either way)."""
    try:
        step()
        _sync()
        ok = True
    except torch.cuda.OutOfMemoryError:
        ok = False
    gc.collect()
    torch.cuda.empty_cache()
    return ok


def largest_rows(make_step, max_rows: int) -> int:
    """The largest row count (<= max_rows) whose step fits: doubling, then bisection."""
    lo, hi = 0, 1
    while hi <= max_rows and _fits(make_step(hi)):
        lo, hi = hi, hi * 2
    hi = min(hi, max_rows + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(make_step(mid)) else (lo, mid)
    return lo


def megatron_steps(hf_dir: str, vocab: int, shapes: list, steps: int, fit_seq: int, max_rows: int,
                   attention: str) -> dict:
    """Timed steps of the learner at each shape, then the fit search (GPU).

    Args:
        hf_dir: the saved model.
        vocab: its vocabulary size (the batch's token range).
        shapes: (rows, tokens) pairs.
        steps: timed steps per shape.
        fit_seq: tokens per row of the fit search; 0 skips it.
        max_rows: the fit search's cap.
        attention: `model.attention` (auto, flash or dot_product).
    """
    from megatron_darl.algo.config import AlgoConfig
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    learner = MegatronLearner(ModelConfig(hf_dir=hf_dir, attention=attention), ParallelConfig(),
                              OptimConfig(lr=1e-6, grad_clip=1.0), LearnerConfig(micro_batch_tokens=1),
                              AlgoConfig(policy_loss="ppo", old_logprob="behavior", recompute_proximal=False,
                                         replay=False, sg=False, pmis=False, ppo_n_minibatches=1))

    def make_step(rows: int, seq: int):
        batch = _batch(rows, seq, vocab)

        def step():
            learner.learner_cfg.micro_batch_tokens = rows * seq  # one micro-batch
            learner.train_step(batch)
        return step

    out = {"core_attention": type(learner.chunks[0].decoder.layers[0].self_attention.core_attention).__name__,
           "shapes": {}}
    try:
        for rows, seq in shapes:
            s, peak = _timed(make_step(rows, seq), steps)
            out["shapes"][f"{rows}x{seq}"] = {"step_s": s, "peak_gib": peak}
        if fit_seq and torch.cuda.is_available():
            out["fit_rows"] = largest_rows(lambda rows: make_step(rows, fit_seq), max_rows)
    finally:
        learner.close()
    return out


def transformers_steps(hf_dir: str, vocab: int, shapes: list, steps: int, fit_seq: int, max_rows: int) -> dict:
    """The plain loop's timed steps at each shape, then its fit search (GPU).

    Args:
        hf_dir: the saved model.
        vocab: its vocabulary size (the batch's token range).
        shapes: (rows, tokens) pairs.
        steps: timed steps per shape.
        fit_seq: tokens per row of the fit search; 0 skips it.
        max_rows: the fit search's cap.
    """
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)

    def make_step(rows: int, seq: int):
        batch = _batch(rows, seq, vocab)
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
        return step

    out = {"shapes": {}}
    for rows, seq in shapes:
        s, peak = _timed(make_step(rows, seq), steps)
        out["shapes"][f"{rows}x{seq}"] = {"step_s": s, "peak_gib": peak}
    if fit_seq and device == "cuda":
        out["fit_rows"] = largest_rows(lambda rows: make_step(rows, fit_seq), max_rows)
    return out


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.lower().split("x")) for s in text.split(",") if s]


def _child(args) -> None:
    """One system in this process; its figures as the last line."""
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    shapes = _shapes(args.shapes)
    if args.system == "megatron":
        out = megatron_steps(args.hf_dir, args.vocab, shapes, args.steps, args.fit_seq, args.max_rows, args.attention)
    else:
        out = transformers_steps(args.hf_dir, args.vocab, shapes, args.steps, args.fit_seq, args.max_rows)
    print(json.dumps(out))


def _run_system(system: str, hf_dir: str, vocab: int, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--system", system, "--hf-dir", hf_dir,
           "--vocab", str(vocab), "--shapes", args.shapes, "--steps", str(args.steps), "--fit-seq",
           str(args.fit_seq), "--max-rows", str(args.max_rows), "--attention", args.attention]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"bench/learner_step.py: the {system} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=None,
                   help=f"rows x tokens, comma-separated (default: {GPU_SHAPES} on a GPU, {CPU_SHAPES} on CPU)")
    p.add_argument("--rows", type=int, default=None, help="with --seq: one shape")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fit-seq", type=int, default=None,
                   help="tokens per row of the largest-micro-batch search (GPU; default 8192; 0 skips it)")
    p.add_argument("--max-rows", type=int, default=64)
    p.add_argument("--attention", default="auto", choices=("auto", "flash", "dot_product"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    if args.rows or args.seq:
        args.shapes = f"{args.rows or 8}x{args.seq or 256}"
    args.shapes = args.shapes or (GPU_SHAPES if on_gpu else CPU_SHAPES)
    args.fit_seq = (8192 if on_gpu else 0) if args.fit_seq is None else args.fit_seq
    if args.child:
        return _child(args)
    with tempfile.TemporaryDirectory() as root:
        hf_dir, n_params = _model_dir(root, on_gpu)
        vocab = 151936 if on_gpu else CPU_MODEL["vocab_size"]
        runs = {s: _run_system(s, hf_dir, vocab, args) for s in SYSTEMS}
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    peak_flops = None
    if on_gpu:
        from megatron_darl.learner.train_step import _PEAK_FLOPS

        peak_flops = next((v for k, v in _PEAK_FLOPS.items() if k in device), None)
    out = {"device": device, "dtype": "bf16" if on_gpu else "fp32", "params": n_params,
           "core_attention": runs["megatron"]["core_attention"], "shapes": {},
           "fit_seq": args.fit_seq or None, "fit_rows": {s: runs[s].get("fit_rows") for s in SYSTEMS}}
    for shape, (rows, seq) in zip(runs["megatron"]["shapes"], _shapes(args.shapes)):
        row = {"tokens_per_step": rows * seq}
        for s in SYSTEMS:
            step_s = runs[s]["shapes"][shape]["step_s"]
            row.update({f"{s}_step_s": step_s, f"{s}_tokens_per_s": rows * seq / step_s,
                        f"{s}_peak_gib": runs[s]["shapes"][shape]["peak_gib"]})
            if peak_flops:
                row[f"{s}_mfu"] = 6.0 * n_params * row[f"{s}_tokens_per_s"] / peak_flops
        row["ratio_megatron_vs_transformers"] = row["transformers_step_s"] / row["megatron_step_s"]
        out["shapes"][shape] = row
    peak = "peak GiB" if on_gpu else "peak RSS GiB"
    print(f"{n_params / 1e6:.1f} M parameters, {out['dtype']} on {device}; Megatron core attention: "
          f"{out['core_attention']}")
    mfu_head = "{:>8}".format("MFU") if peak_flops else ""
    print(f"{'shape':<10}{'':<14}{'step s':>9}{'tokens/s':>11}{peak:>14}{mfu_head}")
    for shape, row in out["shapes"].items():
        for s in SYSTEMS:
            mfu = f"{row[f'{s}_mfu']:8.3f}" if peak_flops else ""
            print(f"{shape if s == 'megatron' else '':<10}{s:<14}{row[f'{s}_step_s']:9.3f}"
                  f"{row[f'{s}_tokens_per_s']:11.0f}{row[f'{s}_peak_gib']:14.2f}{mfu}")
        print(f"{'':<10}Megatron / transformers throughput: {row['ratio_megatron_vs_transformers']:.2f}x")
    if args.fit_seq and on_gpu:
        print(f"largest micro-batch at {args.fit_seq} tokens a row (cap {args.max_rows}): "
              + ", ".join(f"{s} {out['fit_rows'][s]} rows" for s in SYSTEMS))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
