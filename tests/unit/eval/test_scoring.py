"""Evaluation maths (avg@k, pass@k, intervals) and the generate->grade path with a fake engine."""

import asyncio
import math

import numpy as np
import pytest

from megatron_darl.eval.scoring import ProblemScores, aevaluate, paired_difference
from megatron_darl.rewards.api import RewardResult
from megatron_darl.types import GenerateResponse


def test_avg_and_pass_at_k_against_loops():
    rng = np.random.default_rng(0)
    s = (rng.random((50, 4)) < 0.3).astype(float)
    r = ProblemScores(list(range(50)), s).result("x")
    avg = sum(sum(row) / 4 for row in s) / 50
    passed = sum(1 for row in s if max(row) >= 1) / 50
    means = [sum(row) / 4 for row in s]
    sd = math.sqrt(sum((m - avg) ** 2 for m in means) / 49)
    assert r.avg_at_k == pytest.approx(avg) and r.pass_at_k == pytest.approx(passed)
    assert r.ci95[1] - r.avg_at_k == pytest.approx(1.959964 * sd / math.sqrt(50))


def test_paired_difference_detects_a_real_gain_only():
    rng = np.random.default_rng(1)
    before = (rng.random((500, 1)) < 0.3).astype(float)
    after = np.maximum(before, (rng.random((500, 1)) < 0.2).astype(float))  # strictly better
    mean, lo, hi = paired_difference(ProblemScores(list(range(500)), before), ProblemScores(list(range(500)), after))
    assert mean == pytest.approx(after.mean() - before.mean()) and lo > 0
    mean0, lo0, hi0 = paired_difference(ProblemScores(list(range(500)), before),
                                        ProblemScores(list(range(500)), before))
    assert mean0 == 0 and lo0 == 0 == hi0
    with pytest.raises(ValueError, match="same problems"):
        paired_difference(ProblemScores([1], before[:1]), ProblemScores([2], before[:1]))


class _Prompt:
    def __init__(self, uid):
        self.uid, self.input_ids, self.question, self.task = uid, [1, uid % 7], f"q{uid}", "procedural"
        self.answer, self.metadata = {"gold": str(uid % 3)}, {}


class _EchoEngine:
    """Answers with token (uid % 3) when greedy, records the requests it saw."""

    url = "fake://"

    def __init__(self):
        self.seen = []

    async def agenerate(self, req):
        self.seen.append(req)
        uid = int(req.rid.split("-")[1])
        return GenerateResponse(req.rid, [uid % 3], [0.0], [0], "stop", 0)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Scorer:
    async def ascore(self, items):
        # partial credit (0.75) must not count as a correct answer
        return [RewardResult(1.0 if i.response == i.answer["gold"] else 0.75, "ok") for i in items]


def test_aevaluate_generates_k_per_problem_and_grades():
    prompts = [_Prompt(u) for u in range(10)]
    engines = [_EchoEngine(), _EchoEngine()]
    res = asyncio.run(aevaluate(engines, prompts, _Tok(), _Scorer(), k=3, temperature=0.0, max_new_tokens=4))
    assert res.scores.shape == (10, 3) and res.scores.min() == 1.0
    wrong = [_Prompt(u) for u in range(4)]
    for p in wrong:
        p.answer = {"gold": "nope"}
    res = asyncio.run(aevaluate([_EchoEngine()], wrong, _Tok(), _Scorer(), k=1))
    assert res.scores.max() == 0.0
    assert len(engines[0].seen) == len(engines[1].seen) == 15  # spread over both engines
    assert all(r.sampling.temperature == 0.0 and r.sampling.max_new_tokens == 4 for r in engines[0].seen)
    seeds = {r.sampling.seed for e in engines for r in e.seen}
    assert len(seeds) == 30  # every (problem, sample) has its own seed
