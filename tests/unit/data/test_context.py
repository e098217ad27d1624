"""Prompts that cannot fit the model's context beside the max_new_tokens their requests ask for
(SGLang and darl-engine answer such a /generate with a 400, which marks the engine down) are bad
rows, counted and named as `prompt_exceeds_context`, never sent: in the formatter, the train
loader and the held-out problems."""

import pytest

from megatron_darl.config import load_config
from megatron_darl.data.api import PromptRecord
from megatron_darl.data.formatting import ContextLimit, PromptExceedsContext, PromptFormatter, PromptTooLong
from megatron_darl.data.sources import build_loader
from megatron_darl.eval.heldout import eval_prompts
from megatron_darl.model_facts import context_limit

DEMO = "configs/cpu_demo_darl.yaml"  # built-in tiny Qwen3: max_position_embeddings 256
# chain_sum prompts of 2 to 5 terms of 1 or 2 digits: "1 + 2 =" (7 tokens) to 24 tokens
VARIED = ["data.dataset_kwargs.min_digits=1", "data.dataset_kwargs.max_terms=5"]


def rec(question):
    return PromptRecord(question=question, task="procedural", answer={}, metadata={}, where="test[0]")


def test_formatter_refuses_a_prompt_the_context_cannot_hold(demo_tok):
    tiny = ContextLimit(context=16, max_new_tokens=8, key="rollout.max_new_tokens", source="m/config.json")
    fmt = PromptFormatter(demo_tok, chat_template=False, context=tiny)
    assert len(fmt.encode(rec("1 + 2 ="))) == 7  # 7 + 8 <= 16
    with pytest.raises(PromptExceedsContext, match=r"13 tokens > 8: the model's context of 16 tokens "
                                                   r"\(max_position_embeddings, m/config.json\) less "
                                                   r"rollout.max_new_tokens=8 leaves 8 for the prompt"):
        fmt.encode(rec("12 + 34 + 5 ="))
    with pytest.raises(PromptExceedsContext, match="203 characters: more than 8 tokens"):  # not even encoded
        fmt.encode(rec("1 + " * 50 + "1 ="))
    # past data.max_prompt_tokens the row keeps that reason; no room at all fits nothing
    with pytest.raises(PromptTooLong):
        PromptFormatter(demo_tok, chat_template=False, max_prompt_tokens=6, context=tiny).encode(rec("12 + 34 + 5 ="))
    full = ContextLimit(context=16, max_new_tokens=16, key="eval.max_new_tokens", source="m/config.json")
    with pytest.raises(PromptExceedsContext, match="eval.max_new_tokens=16 leaves 0"):
        PromptFormatter(demo_tok, chat_template=False, context=full).encode(rec("1 ="))


def test_train_loader_skips_prompts_beyond_the_context_and_counts_them(demo_tok):
    cfg = load_config(DEMO, ["rollout.max_new_tokens=244", "data.size=200", *VARIED])
    limit = context_limit(cfg, "train")
    assert (limit.context, limit.room, limit.key) == (256, 12, "rollout.max_new_tokens")
    loader = build_loader(cfg.data, demo_tok, context=limit)
    prompts = loader.next_batch(30)
    assert len(prompts) == 30 and all(len(p.input_ids) + 244 <= 256 for p in prompts)
    metrics = loader.metrics()
    assert metrics["rollout/prompts_rejected/prompt_exceeds_context"] == metrics["rollout/prompts_rejected"] > 0
    assert all("chain_sum" in e and "prompt_exceeds_context" in e and "rollout.max_new_tokens=244" in e
               for e in loader.report.examples)


def test_held_out_problems_fit_the_evaluation_budget_each_once(demo_tok):
    cfg = load_config(DEMO, ["rollout.max_new_tokens=244", "data.eval_size=60", *VARIED])
    problems = eval_prompts(cfg, demo_tok)
    assert 0 < len(problems) < 60  # the long ones are skipped, not sent to be refused
    assert all(len(p.input_ids) + 244 <= 256 for p in problems)
    assert len({p.uid for p in problems}) == len(problems)  # no wrap into a second pass
    roomy = load_config(DEMO, ["rollout.max_new_tokens=244", "eval.max_new_tokens=6", "data.eval_size=60", *VARIED])
    assert context_limit(roomy, "eval").key == "eval.max_new_tokens"
    assert [p.uid for p in eval_prompts(roomy, demo_tok)] == list(range(60))
