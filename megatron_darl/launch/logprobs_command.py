"""`darl-logprobs`: per-token log-probs of token sequences under a model, with TP/PP.

    darl-logprobs --model DIR --data IN.jsonl --out OUT.jsonl [--tp N --pp M] [--temperature T] [--dtype D]

DIR is a Hugging Face folder (config.json + safetensors, converted on the fly through the
checkpoint_tools adapter), a `darl-convert` Megatron folder of the same TP/PP, or a learner
checkpoint written by `MegatronLearner.save` (any layout). Each input
line is `{"input_ids": [...]}`; each output line is `{"logprobs": [...]}`, the log-prob of token t
given the tokens before it for t = 1..len-1 (so one value fewer than the input). With
--tp/--pp above 1 the command starts its own tp*pp processes (gloo on CPU, NCCL on GPU).
Users run it to measure trainer/engine log-prob mismatch.
What it is not: a generation or scoring server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="darl-logprobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder or MegatronLearner checkpoint folder")
    p.add_argument("--data", required=True, help='input JSONL, one {"input_ids": [...]} per line')
    p.add_argument("--out", required=True, help='output JSONL, one {"logprobs": [...]} per line')
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--temperature", type=float, default=1.0, help="divide logits by this (as the sampler did)")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="compute dtype (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="token budget per forward micro-batch")
    return p.parse_args(argv)


def read_sequences(path: str) -> list[list[int]]:
    seqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{\"input_ids\": [...]}} ({e})") from e
            if not isinstance(ids, list) or len(ids) < 1 or not all(isinstance(i, int) for i in ids):
                raise ValueError(f"{path}:{lineno}: input_ids must be a non-empty list of ints")
            seqs.append(ids)
    if not seqs:
        raise ValueError(f"{path}: no sequences")
    return seqs


def _batch(seqs: list[list[int]]):
    from megatron_darl.types import TrainBatch

    b, width = len(seqs), max(len(s) for s in seqs)
    tokens = np.zeros((b, width), np.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    z = np.zeros((b, width), np.float32)
    return TrainBatch(tokens=tokens, lengths=np.array([len(s) for s in seqs], np.int64), loss_mask=z,
                      advantages=np.zeros(b, np.float32), behav_logprobs=z, token_versions=z.astype(np.int64) - 1,
                      versions=np.zeros(b, np.int64), group_index=np.arange(b, dtype=np.int64),
                      rewards=np.zeros(b, np.float32), prompt_ids=np.arange(b, dtype=np.int64))


def _worker(args: argparse.Namespace) -> None:
    import torch

    from megatron_darl.algo.config import AlgoConfig
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    is_ckpt = os.path.isfile(os.path.join(args.model, "learner_meta.json"))
    learner = MegatronLearner(
        ModelConfig(hf_dir=args.model, init="random" if is_ckpt else "hf", dtype=args.dtype),
        ParallelConfig(tp=args.tp, pp=args.pp), OptimConfig(),
        LearnerConfig(micro_batch_tokens=args.micro_batch_tokens),
        AlgoConfig(policy_loss="ppo", replay=False, sg=False, pmis=False),
        temperature=args.temperature)
    if is_ckpt:
        learner.load(args.model)
    seqs = read_sequences(args.data)
    vocab = learner.vocab_size
    bad = [i for i, s in enumerate(seqs) if max(s) >= vocab or min(s) < 0]
    if bad:
        raise ValueError(f"{args.data}: line {bad[0] + 1} has token ids outside [0, {vocab})")
    lp = learner.compute_logprobs(_batch(seqs))
    if learner.is_main:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            for i, s in enumerate(seqs):
                f.write(json.dumps({"logprobs": [float(x) for x in lp[i, 1 : len(s)]]}) + "\n")
        os.replace(tmp, args.out)
    learner.close()


def _self_launch(world: int, argv: list[str]) -> int:
    """Start `world` copies of this command with torch.distributed env vars; if one fails the
    others are stopped (they would wait forever in a collective). Returns the first failure's code."""
    from megatron_darl.learner.parallel import RENDEZVOUS_ENV

    # rank 0 binds the port and publishes it here (a port chosen now could be taken before it binds)
    meet = tempfile.mkdtemp(prefix="darl-rendezvous-")
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="0", WORLD_SIZE=str(world),
                **{RENDEZVOUS_ENV: os.path.join(meet, "rendezvous.json")})
    base.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "megatron_darl.launch.logprobs_command", *argv]
    try:
        return _supervise([subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
                           for r in range(world)])
    finally:
        shutil.rmtree(meet, ignore_errors=True)


def _supervise(procs: list[subprocess.Popen]) -> int:
    import time

    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode]
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait()
            return failed[0]
        time.sleep(0.2)
    return next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    world = args.tp * args.pp
    if world > 1 and "RANK" not in os.environ:
        return _self_launch(world, sys.argv[1:] if argv is None else list(argv))
    _worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
