"""Disjoint train / validation / test splits of a procedural task, by a hash of the question.

What it is: `data.partition: hash`. Every question of a reasoning-gym task belongs to exactly one
split, decided by the question text alone: `bucket(question)` = the first 8 hex digits of its
SHA-256 modulo 1000; buckets [0, 1000 * test_frac) are the test split, the next
1000 * val_frac the validation split, the rest training. Membership does not depend on seeds,
streams or indices, so a question drawn by any stream lands in one split only: the splits are
disjoint by construction, including for small task spaces that a training epoch covers whole.
- `PartitionedTrain`: the training stream, lazily: record i is the first of the underlying
  entries i * STRIDE .. i * STRIDE + STRIDE - 1 whose question is a training one (about 1.25
  tries at test_frac = val_frac = 0.1).
- `HeldOutSplit`: the test split (`eval`, seed + EVAL_SEED_OFFSET) or the validation split
  (seed + 2 * EVAL_SEED_OFFSET): the first `size` DISTINCT questions of that split met in the
  underlying stream, found at construction (a ValueError naming the key when the task has fewer).
The answer payload of each record names the underlying entry (dataset, config, index), so the
graders (`ProceduralVerifier`) re-create it unchanged.
What it is not: a partition of file sources (their rows are split by the files themselves).
"""

from __future__ import annotations

import hashlib
from typing import Any

from megatron_darl.data.api import DataReport, PromptRecord
from megatron_darl.data.procedural import EVAL_SEED_OFFSET, ProceduralSource

BUCKETS = 1000
STRIDE = 32  # underlying entries per training record (a miss on all: p ~ 0.2^32)
SCAN = 400  # a held-out split scans at most SCAN * size underlying entries for its distinct questions
# ... and stops sooner once this many draws in a row brought no question it had not seen (a task
# of Q questions with D < Q seen does that with chance (D / Q)^EXHAUSTED: only when all but a few
# are seen)
EXHAUSTED = 10_000
SPLIT_SEED = {"eval": EVAL_SEED_OFFSET, "validation": 2 * EVAL_SEED_OFFSET}
HELD_OUT_KEY = {"eval": "data.eval_size", "validation": "data.val_size"}


def bucket(question: str) -> int:
    return int(hashlib.sha256(question.encode("utf-8")).hexdigest()[:8], 16) % BUCKETS


def split_of(question: str, test_frac: float, val_frac: float) -> str:
    """"test", "validation" or "train": the one split a question belongs to."""
    b, test_end = bucket(question), round(BUCKETS * test_frac)
    if b < test_end:
        return "test"
    return "validation" if b < test_end + round(BUCKETS * val_frac) else "train"


class PartitionedTrain:
    """The training split: `size` records, none of whose questions is a test or validation one."""

    task = "procedural"
    lazy = True

    def __init__(self, dataset: str, *, size: int, seed: int, dataset_kwargs: dict[str, Any] | None,
                 test_frac: float, val_frac: float):
        """The training stream over `size * STRIDE` underlying entries; records are found as drawn.

        Args:
            dataset: the reasoning-gym dataset name.
            size: the number of training records (`data.size`).
            seed: the underlying stream's seed (`data.seed`).
            dataset_kwargs: the reasoning-gym dataset's options (`data.dataset_kwargs`); None: its defaults.
            test_frac: the share of hash buckets that are the test split, in [0, 1].
            val_frac: the share of hash buckets, after the test ones, that are the validation split.
        """
        self.inner = ProceduralSource(dataset, size=size * STRIDE, seed=seed, dataset_kwargs=dataset_kwargs)
        self.size, self.fracs = size, (test_frac, val_frac)
        self.name = f"reasoning_gym:{dataset}[seed={seed},size={size},partition=train]"
        self.report = DataReport(source=self.name, rows=size)

    def __len__(self) -> int:
        return self.size

    def record(self, index: int) -> PromptRecord:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name}: index {index} out of range")
        for j in range(index * STRIDE, (index + 1) * STRIDE):
            rec = self.inner.record(j)
            if split_of(rec.question, *self.fracs) == "train":
                return _renamed(rec, self.name, index)
        raise ValueError(f"{self.name}[{index}]: none of {STRIDE} draws is a training question "
                         f"(data.test_frac + data.val_frac too close to 1)")


class HeldOutSplit:
    """The test (`split="eval"`) or validation split: `size` distinct questions of that split."""

    task = "procedural"
    lazy = False

    def __init__(self, dataset: str, *, split: str, size: int, seed: int, dataset_kwargs: dict[str, Any] | None,
                 test_frac: float, val_frac: float):
        """Scan the split's own stream now for its `size` distinct questions; ValueError if too few.

        Args:
            dataset: the reasoning-gym dataset name.
            split: `eval` (the test split, seed + EVAL_SEED_OFFSET) or `validation` (seed + 2 * EVAL_SEED_OFFSET).
            size: how many distinct questions of the split to hold (`data.eval_size` or `data.val_size`).
            seed: the run's data seed (`data.seed`); the split's stream offsets it as above.
            dataset_kwargs: the reasoning-gym dataset's options (`data.dataset_kwargs`); None: its defaults.
            test_frac: the share of hash buckets that are the test split, in [0, 1].
            val_frac: the share of hash buckets, after the test ones, that are the validation split.
        """
        want = "test" if split == "eval" else "validation"
        self.inner = ProceduralSource(dataset, size=size * SCAN, seed=seed + SPLIT_SEED[split],
                                      dataset_kwargs=dataset_kwargs)
        self.name = f"reasoning_gym:{dataset}[seed={seed},partition={want},size={size}]"
        seen: set[str] = set()  # distinct questions of every split
        self.indices: list[int] = []
        draws, last_new = 0, 0
        for draws in range(1, size * SCAN + 1):
            q = self.inner.record(draws - 1).question
            if q in seen:
                if draws - last_new >= EXHAUSTED:  # the task has no more questions to give
                    break
                continue
            seen.add(q)
            last_new = draws
            if split_of(q, test_frac, val_frac) == want:
                self.indices.append(draws - 1)
                if len(self.indices) == size:
                    break
        if len(self.indices) < size:
            raise ValueError(f"{HELD_OUT_KEY[split]}={size}: the {want} split of reasoning_gym:{dataset} holds "
                             f"only {len(self.indices)} distinct questions in {draws} draws ({len(seen)} distinct "
                             f"in all splits, none new in the last {draws - last_new}); lower "
                             f"{HELD_OUT_KEY[split]} or raise data.{'test' if want == 'test' else 'val'}_frac")
        self.report = DataReport(source=self.name, rows=size)

    def __len__(self) -> int:
        return len(self.indices)

    def record(self, index: int) -> PromptRecord:
        return _renamed(self.inner.record(self.indices[index]), self.name, index)


def _renamed(rec: PromptRecord, name: str, index: int) -> PromptRecord:
    """`rec` under the split's name (its answer payload still names the underlying entry)."""
    meta = dict(rec.metadata, source=name)
    return PromptRecord(question=rec.question, task=rec.task, answer=rec.answer, metadata=meta,
                        where=f"{name}[{index}]")


def partitioned_source(dataset: str, split: str, *, size: int, eval_size: int, val_size: int, seed: int,
                       dataset_kwargs: dict[str, Any] | None, test_frac: float, val_frac: float):
    """The source of `split` under `data.partition: hash`; None for a held-out split of size 0.

    Args:
        dataset: the reasoning-gym dataset name (`data.source`'s target).
        split: `train`, `eval` (the test split) or `validation`.
        size: the training records (`data.size`); read for `train` only.
        eval_size: the test split's distinct questions (`data.eval_size`); 0 gives None for `eval`.
        val_size: the validation split's distinct questions (`data.val_size`); 0 gives None for `validation`.
        seed: the run's data seed (`data.seed`); the held-out splits offset it.
        dataset_kwargs: the reasoning-gym dataset's options (`data.dataset_kwargs`); None: its defaults.
        test_frac: the share of hash buckets that are the test split (`data.test_frac`), in [0, 1].
        val_frac: the share of hash buckets, after the test ones, that are the validation split (`data.val_frac`).
    """
    fracs = {"test_frac": test_frac, "val_frac": val_frac}
    if split == "train":
        return PartitionedTrain(dataset, size=size, seed=seed, dataset_kwargs=dataset_kwargs, **fracs)
    n = eval_size if split == "eval" else val_size
    if n == 0:
        return None
    return HeldOutSplit(dataset, split=split, size=n, seed=seed, dataset_kwargs=dataset_kwargs, **fracs)
