"""GSM8K-style multi-step word problems that the project generates: `reasoning_gym:word_problems`.

What it is: `WordProblemsDataset`, a reasoning-gym procedural dataset registered under the name
`word_problems` (`register()`; `procedural._create` calls it, so `data.source:
reasoning_gym:word_problems` works in every process, the reward workers' too). Entry i is drawn
from `random.Random(seed + i)`: a person starts with some items and 2-3 (min_steps..max_steps)
events change the count (gains, losses, boxes of n, doubling, halving, selling bags of n), then
"How many ... now?". Every intermediate count is a whole number from 0 to `max_value`, so each
problem needs several exact steps, not one sum. The reference solution is written out the GSM8K
way (one equation a line, then `#### N`) in `metadata["solution"]`; the answer is N.
Graded with math-verify as the project's math grading calls it (`rewards/math_grader.py`) on the text
after the response's last `####`, or on the whole response when it has none (its final number),
which must be a number written out, not an expression (data/answers.py).
Train and test are disjoint by construction with `data.partition: hash` (data/partition.py: a
question belongs to one split by a hash of its text); the recipe sets it.
What it is not: GSM8K itself (its problems are human-written and harder), or a source class: the
project's `ProceduralSource` reads it like any reasoning-gym dataset.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

NAME = "word_problems"
NAMES = ("Ana", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Leo",
         "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sam", "Tara", "Yusuf")
ITEMS = ("coins", "marbles", "stickers", "apples", "books", "pencils", "cards", "shells", "stamps", "cookies")
CONTAINERS = ("boxes", "bags", "packs", "jars")
ANSWER_MARK = "####"


@dataclass
class WordProblemsConfig:
    min_steps: int = 2  # events after the starting count
    max_steps: int = 3
    max_start: int = 40  # the starting count is 5..max_start
    max_operand: int = 12  # numbers in an event are 2..max_operand
    max_value: int = 500  # every intermediate count stays in 0..max_value
    seed: int | None = None
    size: int = 500

    def validate(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"word_problems: need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.max_start < 5 or self.max_operand < 2 or self.max_value < self.max_start:
            raise ValueError("word_problems: need max_start >= 5, max_operand >= 2, max_value >= max_start")


def _events(v: int, rng: random.Random, cfg: WordProblemsConfig, item: str, friend: str) -> list[tuple]:
    """The events possible at count `v`: (sentence, new count, equation)."""
    n, m = rng.randint(2, cfg.max_operand), rng.randint(2, min(cfg.max_operand, 6))
    box = rng.choice(CONTAINERS)
    out = [(f"Then {{pron}} gets {n} more {item}.", v + n, f"{v} + {n} = {v + n}"),
           (f"Then {{pron}} buys {m} {box} with {n} {item} in each.", v + m * n,
            f"{m} * {n} = {m * n}\n{v} + {m * n} = {v + m * n}")]
    if n <= v:
        out.append((f"Then {{pron}} gives {n} {item} to {friend}.", v - n, f"{v} - {n} = {v - n}"))
    if m * n <= v:
        out.append((f"Then {{pron}} puts {n} {item} in each of {m} {box} and sells the {box}.", v - m * n,
                    f"{m} * {n} = {m * n}\n{v} - {m * n} = {v - m * n}"))
    if v % 2 == 0 and v >= 4:
        out.append((f"Then {{pron}} gives half of {{poss}} {item} to {friend}.", v // 2, f"{v} / 2 = {v // 2}"))
    if 2 * v <= cfg.max_value:
        out.append((f"Then the number of {item} {{pron}} has doubles.", 2 * v, f"{v} * 2 = {2 * v}"))
    return [e for e in out if 0 <= e[1] <= cfg.max_value]


def generate(rng: random.Random, cfg: WordProblemsConfig) -> dict[str, Any]:
    """One problem: {question, answer, metadata: {steps, solution}}."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    pron, poss = ("she", "her") if name in ("Ana", "Carla", "Emma", "Grace", "Ines", "Kira", "Maya", "Olga",
                                            "Rosa", "Tara") else ("he", "his")
    v = rng.randint(5, cfg.max_start)
    sentences, lines = [f"{name} has {v} {item}."], []
    steps = rng.randint(cfg.min_steps, cfg.max_steps)
    for _ in range(steps):
        sentence, v, equation = rng.choice(_events(v, rng, cfg, item, friend))
        sentences.append(sentence.format(pron=pron, poss=poss))
        lines.append(equation)
    sentences.append(f"How many {item} does {name} have now?")
    solution = "\n".join([*lines, f"{ANSWER_MARK} {v}"])
    return {"question": " ".join(sentences), "answer": str(v), "metadata": {"steps": steps, "solution": solution}}


def final_answer(response: str) -> str:
    """The text after the last `####`, else the whole response."""
    head, mark, tail = response.rpartition(ANSWER_MARK)
    return tail.strip() if mark and tail.strip() else response


def score(response: str | None, gold: str) -> float:
    """1.0 when the response's final answer equals `gold` by the project's math grading."""
    if not response or not response.strip():
        return 0.0
    # math-verify as rewards/math_grader.py calls it (data/ does not import rewards/, which imports
    # data/): gold is a whole number, the response's final answer is read as an expression
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    from megatron_darl.data.answers import is_number_literal

    pred = parse(final_answer(response), (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()),
                 parsing_timeout=None)
    if pred and not is_number_literal(str(pred[-1])):
        return 0.0  # "she has 40 - 7 stickers": an expression, the arithmetic left to the grader
    return 1.0 if pred and verify(parse(gold, (ExprExtractionConfig(),), parsing_timeout=None), pred,
                                  timeout_seconds=None) else 0.0


def _dataset_class():
    from reasoning_gym.dataset import ProceduralDataset

    class WordProblemsDataset(ProceduralDataset):
        """reasoning-gym's interface over `generate`; entry i comes from Random(seed + i)."""

        def __init__(self, config: WordProblemsConfig):
            super().__init__(config=config, seed=config.seed, size=config.size)

        def __getitem__(self, idx: int) -> dict[str, Any]:
            return generate(random.Random(self.seed + idx), self.config)

        def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
            return score(answer, entry["answer"])

    return WordProblemsDataset


def register() -> None:
    """Register `word_problems` with reasoning-gym once per process."""
    from reasoning_gym.factory import DATASETS, register_dataset

    if NAME not in DATASETS:
        register_dataset(NAME, _dataset_class(), WordProblemsConfig)
