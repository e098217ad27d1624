"""The tool demo's warm start writes tool episodes exactly as a rollout runs them.

`demo.sft_tool_fraction` turns a share of the warm start's examples into episodes: the call of
the task's expression, the tool's answer (not trained), the answer copied from it. Checked here:
the answer tokens are what the real sandbox prints for the expression, rendered by the run's
template; the labels skip them; the hash picks about the fraction asked; and, end to end on
one-digit sums, the teacher-forced check of the saved model says of each held-out problem what
greedy decoding with real tool calls (the evaluator's turn loop, the real sandbox) scores on it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest
from transformers import AutoModelForCausalLM

from megatron_darl.config import ConfigError, load_config
from megatron_darl.data.tokenizers import load_tokenizer
from megatron_darl.launch import warmstart
from megatron_darl.launch.sft_episodes import ToolPlan, target_parts
from megatron_darl.rollout.tools import ToolFormat, ToolRunner
from tests.helpers.sandbox import needs_sandbox

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "cpu_demo_tools.yaml")
ONE_DIGIT = ["data.dataset_kwargs.min_digits=1", "data.dataset_kwargs.max_digits=1", "data.eval_size=100",
             "eval.num_problems=100"]


class P:
    def __init__(self, uid, expression, answer):
        self.uid, self.metadata = uid, {"expression": expression}
        self.input_ids = [1, 2]
        self.answer = {"entry": {"answer": answer}}


def plan(fraction=1.0):
    cfg = load_config(TOOLS, [])
    tok = load_tokenizer(cfg.model.tokenizer)
    return tok, ToolPlan(ToolFormat(cfg.rollout, tok), fraction), cfg


@needs_sandbox
def test_the_tool_answer_in_an_example_is_what_the_sandbox_prints():
    tok, tool_plan, cfg = plan()
    runner = ToolRunner(cfg.rollout, tool_plan.format)
    try:
        for expr, answer in (("12345 + 67890", "80235"), ("10 - 99", "-89")):
            (call, trained_call), (reply, trained_reply), (final, trained_final) = \
                target_parts(tok, P(7, expr, answer), answer, tool_plan)
            assert (trained_call, trained_reply, trained_final) == (True, False, True)
            assert tok.decode(call) == f"<tool_call>{expr}</tool_call>"
            result = asyncio.run(runner.arun_turn(call))
            assert result.status == "ok" and tool_plan.format.answer_ids(result.output)[0] == reply
            assert tok.decode(final, skip_special_tokens=True) == answer
    finally:
        runner.close()


def test_the_plan_picks_about_the_fraction_and_labels_skip_the_tool_answer():
    tok, tool_plan, _ = plan(0.3)
    picked = sum(tool_plan.calls(uid) for uid in range(10_000))
    assert 2800 < picked < 3200, picked
    prompts = [P(u, "1 + 2", "3") for u in range(40)]
    ids, labels, attn = warmstart.answer_batch(tok, prompts, tool_plan)
    for i, p in enumerate(prompts):
        parts = target_parts(tok, p, "3", tool_plan)
        assert len(parts) == (3 if tool_plan.calls(p.uid) else 1)
        row = ids[i, 2:int(attn[i].sum())].tolist()
        assert row == [t for run, _ in parts for t in run]
        trained = [t for run, keep in parts for t in (run if keep else [-100] * len(run))]
        assert labels[i, 2:2 + len(trained)].tolist() == trained
    with pytest.raises(ValueError, match="needs the task's expression"):
        target_parts(tok, P(3, " ", "1"), "1", ToolPlan(tool_plan.format, 1.0))


def test_a_tool_warm_start_without_the_tool_is_refused():
    with pytest.raises(ConfigError, match="demo.sft_tool_fraction"):
        load_config(TOOLS, ["rollout.tool=none"])


@needs_sandbox
@pytest.mark.timeout(400)
def test_teacher_forced_tool_episodes_score_as_greedy_decoding_with_real_calls(tmp_path):
    from megatron_darl.eval.periodic import PeriodicEvaluator

    cfg = load_config(TOOLS, [f"train.run_dir={tmp_path}", *ONE_DIGIT, "demo.sft_steps=60",
                              "demo.sft_tool_fraction=1.0"])
    cfg = warmstart.prepare_model(cfg)
    evaluator = PeriodicEvaluator(replace(cfg, eval=replace(cfg.eval, every_steps=1)))
    try:
        scored = evaluator.evaluate_folder(cfg.model.hf_dir)
        prompts, tok = evaluator.prompts, evaluator.tokenizer
    finally:
        evaluator.close()
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir)
    tool_plan = ToolPlan(ToolFormat(cfg.rollout, tok), 1.0)
    forced = warmstart.greedy_correct(model, warmstart.answer_batch(tok, prompts, tool_plan)).numpy()
    scores = scored.scores[:, 0]
    assert 0.2 < scores.mean() and scored.tool_call_rate() > 0.5, (scores.mean(), scored.tool_call_rate())
    differ = [(p.question, bool(f), float(s)) for p, f, s in zip(prompts, forced, scores) if float(f) != s]
    # a call that swaps the terms ("3 + 4" for "4 + 3") scores 1 with the tool, 0 teacher-forced
    assert len(differ) <= 2, differ
