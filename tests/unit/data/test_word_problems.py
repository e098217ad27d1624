"""`reasoning_gym:word_problems` (data/word_problems.py): every problem's written-out solution is
right (each equation recomputed with Python, each step starting from the last step's result, the
final one the answer), the problems are multi-step and varied, train and test are disjoint with
`data.partition: hash` (and would overlap without it: unpartitioned streams share questions), and
answers grade through the project's math grading after `####`."""

from __future__ import annotations

import random
import re

import pytest

from megatron_darl.config.data import DataConfig
from megatron_darl.data import word_problems as wp
from megatron_darl.data.procedural import ProceduralVerifier
from megatron_darl.data.sources import build_source

EQUATION = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+)$")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}
# the naive reference: the question read sentence by sentence, independently of the generator
EVENTS = [(re.compile(r"gets (\d+) more"), lambda v, n: v + int(n[0])),
          (re.compile(r"buys (\d+) \w+ with (\d+) "), lambda v, n: v + int(n[0]) * int(n[1])),
          (re.compile(r"gives (\d+) "), lambda v, n: v - int(n[0])),
          (re.compile(r"puts (\d+) \w+ in each of (\d+) "), lambda v, n: v - int(n[0]) * int(n[1])),
          (re.compile(r"gives half of"), lambda v, n: v / 2),
          (re.compile(r"doubles\.$"), lambda v, n: v * 2)]


def _read(question: str) -> int:
    sentences = question.split(". ")
    value = int(re.match(r"\w+ has (\d+) \w+$", sentences[0]).group(1))
    for sentence in sentences[1:-1]:
        rule, groups = _event(sentence)
        value = rule(value, groups)
        assert value == int(value) and 0 <= value <= 500, (question, value)  # whole counts only
    assert sentences[-1].startswith("How many ")
    return int(value)


def _event(sentence: str) -> tuple:
    """The one rule a sentence matches, and its numbers."""
    found = [(f, m.groups()) for pattern, f in EVENTS if (m := pattern.search(sentence + "."))]
    assert len(found) == 1, sentence
    return found[0]


def _check_solution(entry: dict) -> None:
    assert entry["answer"] == str(_read(entry["question"]))
    *lines, last = entry["metadata"]["solution"].split("\n")
    for line in lines:
        a, op, b, result = EQUATION.match(line).groups()
        assert OPS[op](int(a), int(b)) == int(result), line
    assert last == f"#### {entry['answer']}" and lines[-1].endswith(f"= {entry['answer']}")


def test_every_solution_recomputes_and_the_problems_are_multi_step():
    cfg = wp.WordProblemsConfig()
    entries = [wp.generate(random.Random(i), cfg) for i in range(2000)]
    for entry in entries:
        _check_solution(entry)
        assert 2 <= entry["metadata"]["steps"] <= 3
        assert entry["question"].count("Then ") == entry["metadata"]["steps"]
    assert len({e["question"] for e in entries}) >= 1990  # a large space: few repeats in 2000 draws
    assert len({e["answer"] for e in entries}) > 100


def test_entries_are_reproducible_and_grade_through_the_verifier():
    source = build_source(DataConfig(source="reasoning_gym:word_problems", size=100, eval_size=10, seed=3))
    again = build_source(DataConfig(source="reasoning_gym:word_problems", size=100, eval_size=10, seed=3))
    verifier = ProceduralVerifier()
    for i in range(20):
        record = source.record(i)
        assert record.question == again.record(i).question
        solution = record.answer["entry"]["metadata"]["solution"]
        assert verifier.score(record.answer, solution) == 1.0
        gold = int(record.answer["entry"]["answer"])
        assert verifier.score(record.answer, f"{solution[:-len(str(gold))]}{gold + 1}") == 0.0


@pytest.mark.parametrize(("response", "score"), [
    ("Ana has 22 + 2 = 24 coins.\n#### 24", 1.0),
    ("#### 24.0", 1.0),
    ("22 + 2 = 24, so she has 24 coins.", 1.0),  # no ####: the final number
    ("#### 24\nwait, #### 25", 0.0),  # the last #### counts
    ("24 coins, minus 3", 0.0),
    ("", 0.0),
    ("Ana has 22 + 2 coins now.", 0.0),  # an expression: the arithmetic left to the grader
    ("#### 22 + 2", 0.0),
    ("#### 12 * 2", 0.0),
    ("#### 24 coins", 1.0),
])
def test_grading_reads_the_answer_after_the_last_mark(response, score):
    assert wp.score(response, "24") == score


def _questions(source, n: int) -> set[str]:
    return {source.record(i).question for i in range(n)}


def test_train_and_test_are_disjoint_with_the_hash_partition():
    kw = {"source": "reasoning_gym:word_problems", "dataset_kwargs": {"max_start": 8, "max_operand": 3,
                                                                     "min_steps": 1, "max_steps": 1},
          "size": 5000, "eval_size": 50}
    # a small task space, where unpartitioned streams overlap: the partition must separate them
    plain = DataConfig(**kw)
    assert _questions(build_source(plain, "train"), 3000) & _questions(build_source(plain, "eval"), 50)
    cfg = DataConfig(**kw, partition="hash", val_size=20)
    test = _questions(build_source(cfg, "eval"), 50)
    assert len(test) == 50 and not _questions(build_source(cfg, "train"), 3000) & test


def test_the_config_knows_the_name_the_dataset_registers():
    from megatron_darl.config.data import PROJECT_DATASETS

    assert wp.NAME in PROJECT_DATASETS


@pytest.mark.parametrize("response", ["#### 24", "so 24 coins", "#### 25", "no number", "she has 22 + 2 coins"])
def test_grading_agrees_with_the_math_grader(response):
    from megatron_darl.rewards.math_grader import grade_math

    assert wp.score(response, "24") == grade_math(wp.final_answer(response), "24")


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="min_steps"):
        build_source(DataConfig(source="reasoning_gym:word_problems", dataset_kwargs={"min_steps": 4,
                                                                                    "max_steps": 2}))
