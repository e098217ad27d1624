"""PromptLoader: seeded epochs, uids that prove "every prompt exactly once", exact resume, and
bad prompts (too long, unknown characters) counted instead of crashing the run."""

import json
import logging

import pytest

from megatron_darl.config.data import DataConfig
from megatron_darl.data.api import DataReport, PromptError, PromptLoader, PromptRecord, PromptSource
from megatron_darl.data.sources import build_loader, build_source


class ListSource:
    """A test double of PromptSource over literal questions."""

    def __init__(self, questions, name="list"):
        self.questions, self.name = questions, name
        self.report = DataReport(source=name, rows=len(questions))

    def __len__(self):
        return len(self.questions)

    def record(self, index):
        q = self.questions[index]
        where = f"{self.name}[{index}]"
        return PromptRecord(question=q, task="math", answer={"ground_truth": q}, metadata={}, where=where)


def encode_len(record):
    if record.question.startswith("long"):
        raise PromptError("too long")
    return [len(record.question)]


def test_protocol_is_satisfied():
    assert isinstance(ListSource(["a"]), PromptSource)


def test_every_prompt_exactly_once_per_epoch_and_uid_decodes():
    n = 7
    loader = PromptLoader(ListSource([f"q{i}" for i in range(n)]), encode_len, seed=5)
    drawn = loader.next_batch(3) + loader.next_batch(5) + loader.next_batch(6)  # crosses epoch 0 -> 1
    uids = [p.uid for p in drawn]
    assert len(set(uids)) == len(uids)
    located = [loader.locate(u) for u in uids]
    assert sorted(i for e, i in located if e == 0) == list(range(n))
    assert sorted(i for e, i in located if e == 1) == list(range(n))
    assert all(p.question == f"q{i}" for p, (_, i) in zip(drawn, located))
    order0, order1 = [i for e, i in located if e == 0], [i for e, i in located if e == 1]
    assert order0 != order1 and order0 != list(range(n))  # shuffled, differently per epoch
    again = PromptLoader(ListSource([f"q{i}" for i in range(n)]), encode_len, seed=5)
    assert [p.uid for p in again.next_batch(14)] == uids


def test_resume_yields_exactly_the_prompts_not_yet_drawn():
    qs = [f"q{i}" for i in range(11)]
    full = PromptLoader(ListSource(qs), encode_len, seed=3).next_batch(30)
    first = PromptLoader(ListSource(qs), encode_len, seed=3)
    head = first.next_batch(13)
    state = json.loads(json.dumps(first.state_dict()))  # saved in a checkpoint as JSON
    resumed = PromptLoader(ListSource(qs), encode_len, seed=3)
    resumed.load_state_dict(state)
    tail = resumed.next_batch(17)
    assert [p.uid for p in head + tail] == [p.uid for p in full]


def test_state_of_another_source_is_refused():
    loader = PromptLoader(ListSource(["a", "b"]), encode_len, seed=0)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptLoader(ListSource(["a", "b"]), encode_len, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="size"):
        PromptLoader(ListSource(["a", "b", "c"]), encode_len, seed=0).load_state_dict(state)


def test_rejected_prompts_are_skipped_counted_once_and_logged(caplog):
    src = ListSource(["a", "long1", "b", "long2", "c"])
    loader = PromptLoader(src, encode_len, seed=0)
    with caplog.at_level(logging.WARNING):
        drawn = loader.next_batch(6)  # two epochs of the 3 good prompts
    assert sorted(p.question for p in drawn) == ["a", "a", "b", "b", "c", "c"]
    assert src.report.bad == {"invalid_prompt": 2}  # each bad row once, though met in both epochs
    assert sorted(e.split(":")[0] for e in src.report.examples) == ["list[1]", "list[3]"]
    assert "list[" in caplog.text


def test_all_rejected_stops_with_the_report():
    loader = PromptLoader(ListSource(["long1", "long2"]), encode_len, seed=0)
    with pytest.raises(RuntimeError, match="no record of list is usable"):
        loader.next_batch(1)


def test_build_loader_demo_task_with_too_long_prompts(demo_tok):
    kwargs = {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2}
    cfg = DataConfig(size=40, max_prompt_tokens=90, dataset_kwargs=kwargs)
    loader = build_loader(cfg, demo_tok)
    prompts = loader.next_batch(20)
    assert all(len(p.input_ids) <= 90 for p in prompts)
    assert loader.source.report.bad["prompt_too_long"] > 0  # 4 two-digit terms exceed 90 tokens
    assert all("too_long" in e for e in loader.source.report.examples)
    short = build_loader(DataConfig(size=40, chat_template=False, prompt_template="{expression} ="), demo_tok)
    p = short.next_batch(1)[0]
    assert demo_tok.decode(p.input_ids) == p.metadata["expression"] + " ="


def test_eval_split_is_held_out_and_ordered(demo_tok):
    cfg = DataConfig(size=30, eval_size=12, seed=4)
    train, evals = build_source(cfg, "train"), build_source(cfg, "eval")
    assert len(evals) == 12 and evals.name != train.name
    assert [evals.record(i).question for i in range(5)] != [train.record(i).question for i in range(5)]
    loader = build_loader(cfg, demo_tok, "eval")
    assert [p.uid for p in loader.next_batch(12)] == list(range(12))
    assert build_source(DataConfig(source="humaneval"), "eval") is None
    assert build_source(DataConfig(eval_size=0), "eval") is None


def test_chat_kwargs_reach_the_chat_template(qwen_tok):
    cfg = DataConfig(size=3, chat_kwargs={"enable_thinking": False})
    think_off = build_loader(cfg, qwen_tok).next_batch(1)[0]
    assert qwen_tok.decode(think_off.input_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    think_on = build_loader(DataConfig(size=3), qwen_tok).next_batch(1)[0]
    assert qwen_tok.decode(think_on.input_ids).endswith("<|im_start|>assistant\n")
    assert think_on.uid == think_off.uid and len(think_on.input_ids) < len(think_off.input_ids)


def test_template_field_the_source_lacks_fails_at_build(demo_tok):
    with pytest.raises(ValueError, match=r"uses \['nope'\]"):
        build_loader(DataConfig(size=5, prompt_template="{nope}"), demo_tok)
