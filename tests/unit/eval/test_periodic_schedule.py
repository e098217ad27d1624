"""When the in-loop evaluator evaluates: every `eval.every_steps` versions, at the first step
boundary past each multiple of `eval.every_samples` (labelled with the largest multiple passed,
once), and the last version (final) labelled with the sample budget when one stopped the run;
and the config errors of the new keys name them."""

from __future__ import annotations

import pytest

from megatron_darl.config import ConfigError, load_config
from megatron_darl.eval.periodic import PeriodicEvaluator


def _evaluator(every_steps=0, every_samples=0, budget=0) -> PeriodicEvaluator:
    ev = object.__new__(PeriodicEvaluator)  # the schedule only: no model, no problems
    ev.cfg = load_config(None, ["model.hf_dir=unused", f"train.max_generated_samples={budget}"])
    ev.every, ev.every_samples, ev.next_mark = every_steps, every_samples, every_samples
    return ev


def test_sample_marks_are_evaluated_once_each_at_the_first_boundary_past_them():
    ev = _evaluator(every_samples=1000, budget=3000)
    seen = [ev.due(v, g) for v, g in enumerate([0.0, 300.0, 1100.0, 1900.0, 2500.0, 4300.0], start=1)]
    assert seen == [None, None, 1000.0, None, 2000.0, 4000.0]  # 3000 was jumped over: one point, at 4000
    assert _evaluator(every_samples=1000, budget=3000).due(9, 3050.0, final=True) == 3000.0
    assert _evaluator(every_samples=1000).due(9, 3050.0, final=True) == 3050.0  # no budget: the samples


def test_step_schedule_is_unchanged():
    ev = _evaluator(every_steps=5)
    assert [v for v in range(1, 16) if ev.due(v, 10.0 * v) is not None] == [5, 10, 15]
    assert ev.due(7, 70.0, final=True) is None  # a step-scheduled run evaluates the last version only on schedule


@pytest.mark.parametrize("overrides, key", [
    (["eval.every_samples=-5"], "eval.every_samples"),
    (["eval.every_samples=100", "eval.num_problems=0"], "eval.every_samples"),
    (["eval.sampled_k=4"], "eval.sampled_k"),  # needs an in-loop evaluation
    (["eval.every_samples=100", "eval.sampled_k=4", "eval.sampled_temperature=0"], "eval.sampled_temperature"),
])
def test_bad_keys_are_named(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/cpu_demo_darl.yaml", overrides)
