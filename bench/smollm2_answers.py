"""Benchmark: what RL changed in the answers of a finished real-model run, problem by problem.

What it is: the base model and the run's final policy (`<run_dir>/final_model`) answer the run's
own held-out problems greedily, as the launcher's evaluation does (same problems, same budget,
same grading), with every response kept. Prints, before and after: accuracy by the kind of event
a word problem holds (a gain, a purchase of boxes, a sale of boxes, a gift, halving, doubling;
data/word_problems.py), the paired gain with its 95% interval under the grader as it is now (a
run's summary.json holds the grading of its own time), mean response tokens, the share of answers
that write `#### N`, and three problems' answers side by side; then one JSON line. Every answer
goes to <run_dir>/answers.jsonl. Run it after bench/smollm2_run.py.
What it is not: a learning measurement (the run's summary.json has the accuracies and interval),
nor a test.

    python3 bench/smollm2_answers.py --run-dir runs/smollm2_bench [--examples 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a problem's event kind, from the sentence data/word_problems.py writes for it
KINDS = (("buys", r"buys \d+ \w+ with"), ("sells", r"and sells the"), ("half", r"gives half of"),
         ("doubles", r"doubles\."), ("gives", r"gives \d+ "), ("gets", r"gets \d+ more"))


def kind(question: str) -> str:
    found = [name for name, pattern in KINDS if re.search(pattern, question)]
    return "+".join(found) if found else "other"


class _Recording:
    """The reward pool, keeping what it graded."""

    def __init__(self, pool):
        self.pool, self.items = pool, []

    async def ascore(self, items):
        self.items = list(items)
        return await self.pool.ascore(items)


def answers(run_dir: str, model: str) -> list[dict]:
    """Greedy answers of `model` to the run's held-out problems, graded: question, response, score."""
    from megatron_darl.config import load_config
    from megatron_darl.data.tokenizers import load_tokenizer
    from megatron_darl.eval.heldout import eval_prompts, stop_ids
    from megatron_darl.eval.scoring import aevaluate
    from megatron_darl.launch.local import start_local_engines
    from megatron_darl.launch.supervisor import Supervisor
    from megatron_darl.rewards.pool import RewardPool
    from megatron_darl.rollout.sglang_client import SGLangClient

    cfg = load_config(os.path.join(run_dir, "config.yaml"), [f"model.hf_dir={model}", "rollout.num_engines=1"])
    tokenizer = load_tokenizer(cfg.model.tokenizer_dir)
    prompts = eval_prompts(cfg, tokenizer)

    async def go(urls):
        engines = [SGLangClient(u, timeout_s=cfg.rollout.request_timeout_s) for u in urls]
        try:
            with RewardPool(cfg.reward) as pool:
                rec = _Recording(pool)
                scores = await aevaluate(engines, prompts, tokenizer, rec, k=1, temperature=0.0,
                                         max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                                         stop_token_ids=stop_ids(tokenizer), seed=cfg.train.seed)
        finally:
            for e in engines:
                await e.aclose()
        return rec.items, scores

    with Supervisor(os.path.join(run_dir, "logs"), echo=None) as sup:
        items, scores = asyncio.run(go(start_local_engines(cfg, sup)))
    rows = [{"question": it.prompt, "response": it.response, "tokens": len(tokenizer.encode(it.response)),
             "score": float(s)} for it, s in zip(items, scores.scores[:, 0])]
    return rows, scores


def summarise(rows: list[dict]) -> dict:
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        by_kind.setdefault(kind(r["question"]), []).append(r["score"])
    return {"accuracy": statistics.fmean(r["score"] for r in rows),
            "by_kind": {k: [statistics.fmean(v), len(v)] for k, v in sorted(by_kind.items())},
            "response_tokens": statistics.fmean(r["tokens"] for r in rows),
            "writes_answer_mark": statistics.fmean("####" in r["response"] for r in rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/smollm2_bench")
    p.add_argument("--examples", type=int, default=3)
    args = p.parse_args()
    run_dir = os.path.abspath(args.run_dir)
    from bench.smollm2_run import models
    from megatron_darl.eval.scoring import paired_difference

    (before, scores_before), (after, scores_after) = (answers(run_dir, m) for m in models(run_dir))
    sb, sa = summarise(before), summarise(after)
    with open(os.path.join(run_dir, "answers.jsonl"), "w") as fh:
        for b, a in zip(before, after):
            fh.write(json.dumps({"before": b, "after": a}) + "\n")
    gain = list(paired_difference(scores_before, scores_after))
    print(f"accuracy          {100 * sb['accuracy']:.1f}% -> {100 * sa['accuracy']:.1f}% on {len(before)} problems: "
          f"gain {100 * gain[0]:+.1f} points (95% CI {100 * gain[1]:+.1f} to {100 * gain[2]:+.1f})")
    for k, (acc, n) in sb["by_kind"].items():
        print(f"  {k:<15} {100 * acc:5.1f}% -> {100 * sa['by_kind'][k][0]:5.1f}%  ({n} problems)")
    print(f"response tokens   {sb['response_tokens']:.1f} -> {sa['response_tokens']:.1f}")
    print(f"writes '#### N'   {100 * sb['writes_answer_mark']:.0f}% -> {100 * sa['writes_answer_mark']:.0f}%")
    for b, a in list(zip(before, after))[: args.examples]:
        print(f"\nQ: {b['question']}\n  before ({b['score']:.0f}): {b['response']!r}\n  after  ({a['score']:.0f}): "
              f"{a['response']!r}")
    print(json.dumps({"before": sb, "after": sa, "gain_ci95": gain, "problems": len(before)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
