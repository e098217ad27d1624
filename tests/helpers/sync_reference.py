"""A synchronous reference loop built from the real pieces, strictly generate-then-train.

What it is: `reference_losses(cfg, steps)`: one `darl-engine` subprocess driven through
`SGLangClient`, the run's own prompt loader, `GroupWorkflow` + `RewardPoolScorer`, the replay
store, the batching glue and an in-process `MegatronLearner` (world size 1). Each step draws
`train.batch_prompts` prompts, generates all of them with the current weights, trains once,
exports the new weights and loads them into the engine before the next step: no overlap at all.
It returns per-step `train/loss`, `train/grad_norm` and trained prompt ids, to compare with an
asynchronous run at `max_head_offpolicyness=0`.
What it is not: the rollout manager (no gate, no retries, no engine failover) or a test.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import replace

from megatron_darl.channel.ports import free_port


class _DirectClient:
    """The workflow's SampleClient over one engine: each sample is one request (no aborts here)."""

    def __init__(self, engine):
        self.engine, self.seq = engine, 0

    async def agenerate_sample(self, sample, sampling) -> None:
        from megatron_darl.types import GenerateRequest

        while not sample.done:
            self.seq += 1
            req = GenerateRequest(input_ids=sample.next_input_ids(), rid=f"ref-{self.seq}",
                                  sampling=replace(sampling, max_new_tokens=sample.remaining, seed=sample.next_seed()))
            sample.absorb(await self.engine.agenerate(req), keep_partial=True)


def _start_engine(cfg, port: int, log_path: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "megatron_darl.engine", "--model", cfg.model.hf_dir,
            "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
            "--max-batch", str(cfg.rollout.max_concurrent_per_engine), "--seed", str(cfg.train.seed)]
    with open(log_path, "w", encoding="utf-8") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))


async def _agenerate(client, workflow, prompts) -> list:
    episodes = [workflow.new_episode(p) for p in prompts]
    groups = await asyncio.gather(*(workflow.arun_episode(client, e) for e in episodes))
    return [t for g in groups for t in g]


async def _await_healthy(engine, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await engine.ahealth():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"reference engine did not come up (exit {proc.poll()})")
        await asyncio.sleep(0.2)


def reference_losses(cfg, steps: int, work_dir: str) -> list[dict]:
    from megatron_darl.data.sources import build_loader
    from megatron_darl.data.tokenizers import load_tokenizer
    from megatron_darl.learner.megatron_learner import MegatronLearner
    from megatron_darl.model_facts import context_limit
    from megatron_darl.rewards.pool import RewardPool
    from megatron_darl.rollout.sglang_client import SGLangClient
    from megatron_darl.rollout.workflow import GroupWorkflow, RewardPoolScorer
    from megatron_darl.trainer.batching import candidate_batch, choose_groups, take_groups
    from megatron_darl.trainer.replay_store import ReplayStore
    from megatron_darl.types import WeightVersion

    os.makedirs(work_dir, exist_ok=True)
    tok = load_tokenizer(cfg.model.tokenizer_dir)
    loader = build_loader(cfg.data, tok, context=context_limit(cfg))  # as the rollout manager's
    port = free_port()
    proc = _start_engine(cfg, port, os.path.join(work_dir, "ref_engine.log"))
    pool = RewardPool(cfg.reward)
    learner = None
    loop = asyncio.new_event_loop()
    try:
        engine = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=120.0, max_retries=0)
        loop.run_until_complete(_await_healthy(engine, proc, 120.0))
        scorer = RewardPoolScorer(pool, lambda ids: tok.decode(ids, skip_special_tokens=True))
        workflow = GroupWorkflow(cfg.rollout, scorer, seed=cfg.train.seed)
        client = _DirectClient(engine)
        learner = MegatronLearner(cfg.model, cfg.parallel, cfg.optim, cfg.learner, cfg.algo,
                                  temperature=cfg.rollout.temperature, seed=cfg.train.seed)
        store = ReplayStore(cfg.algo, cfg.rollout.group_size)
        out = []
        for step in range(steps):
            trajs = loop.run_until_complete(_agenerate(client, workflow, loader.next_batch(cfg.train.batch_prompts)))
            store.add_many(trajs, step)
            cands = store.candidates(step)
            cands.groups.sort(key=lambda g: (g.version, g.group_id))  # as ReplayFeed orders them
            batch = candidate_batch(cands, cfg.algo)
            batch.prox_logprobs = learner.compute_logprobs(batch)
            chosen, _ = choose_groups(batch, cands, cfg.train.batch_prompts, cfg.algo, step)
            metrics = learner.train_step(take_groups(batch, chosen))
            store.commit(step, cands.group_ids[chosen])
            folder = os.path.join(work_dir, f"ref_v{step + 1}")
            learner.export_hf(folder)
            loop.run_until_complete(engine.aupdate_weights(WeightVersion(version=step + 1, weight_sync="disk",
                                                                         location=folder, num_bytes=0)))
            ids = sorted({t.prompt_id for t in trajs})
            out.append({"step": step, "train/loss": metrics["train/loss"],
                        "train/grad_norm": metrics["train/grad_norm"], "prompt_ids": ids})
        loop.run_until_complete(engine.aclose())
        return out
    finally:
        if learner is not None:
            learner.close()
        loop.close()
        pool.close()
        proc.kill()
        proc.wait(timeout=10)
