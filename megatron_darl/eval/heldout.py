"""Held-out evaluation of the policy that engines serve now (or of a model folder).

What it is: `evaluate_with_engines(cfg, urls, label, final_model)`, used by the launcher before
and after training: it draws `eval.num_problems` problems of `data.eval_source` (a held-out seed
for procedural tasks), optionally loads `final_model` into the engines first, samples
`eval.samples_per_problem` responses each (greedy at temperature 0) and grades them in the
reward pool. Returns per-problem scores and a printable line.
What it is not: the maths of the scores (`scoring.py`) or a benchmark-file loader (`data/`).
"""

from __future__ import annotations

import asyncio

from megatron_darl.config import RunConfig
from megatron_darl.eval.scoring import ProblemScores, aevaluate, format_result
from megatron_darl.types import WeightVersion


def eval_prompts(cfg: RunConfig, tokenizer) -> list | None:
    """The held-out problems, or None when the data has no eval split (files without
    data.eval_source): the first `eval.num_problems` usable ones, each once. A problem too long
    for the model's context with the evaluation's max_new_tokens (`context_limit`) is skipped,
    counted and logged as a bad row, not sent to be refused by the engines."""
    from megatron_darl.data.sources import build_loader
    from megatron_darl.model_facts import context_limit

    loader = build_loader(cfg.data, tokenizer, "eval", context=context_limit(cfg, "eval"))
    if loader is None:
        return None
    return loader.one_pass(cfg.eval.num_problems)


def stop_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(ids)


async def _arun(cfg: RunConfig, urls: list[str], prompts: list, tokenizer, final_model: str | None) -> ProblemScores:
    from megatron_darl.rewards.pool import RewardPool
    from megatron_darl.rollout.sglang_client import SGLangClient
    from megatron_darl.rollout.turns import tool_turns

    engines = [SGLangClient(u, api_key=cfg.rollout.api_key, timeout_s=cfg.rollout.request_timeout_s) for u in urls]
    turns = tool_turns(cfg.rollout, tokenizer)  # rollout.tool: samples call tools as in training
    try:
        if final_model is not None:
            final = WeightVersion(version=cfg.train.steps, weight_sync="disk", location=final_model)
            for e in engines:
                await e.aupdate_weights(final)
        with RewardPool(cfg.reward) as pool:
            return await aevaluate(engines, prompts, tokenizer, pool, k=cfg.eval.samples_per_problem,
                                   temperature=cfg.eval.temperature,
                                   max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                                   stop_token_ids=stop_ids(tokenizer), seed=cfg.train.seed, turns=turns)
    finally:
        if turns is not None:
            turns.close()
        for e in engines:
            await e.aclose()


def evaluate_with_engines(cfg: RunConfig, urls: list[str], label: str,
                          final_model: str | None = None) -> tuple[ProblemScores | None, str]:
    """Scores and a printable line; (None, why) when the data has no held-out split."""
    from megatron_darl.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.tokenizer_dir)
    prompts = eval_prompts(cfg, tokenizer)
    if prompts is None:
        return None, f"no held-out accuracy {label}: set data.eval_source (file sources have no eval split)"
    scores = asyncio.run(_arun(cfg, urls, prompts, tokenizer, final_model))
    line = format_result(scores.result(f"held-out accuracy {label}"))
    rate = scores.tool_call_rate()
    return scores, line if rate is None else f"{line}; {100 * rate:.1f}% of samples called a tool"
