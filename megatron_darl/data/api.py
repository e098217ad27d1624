"""Data role: the `Prompt` that leaves this role, the source protocol, the bad-row report and the
`PromptLoader` that draws prompts epoch by epoch with a resumable state (the `data` config
section is `config/data.py`).

What it is: the contract between prompt sources (reasoning-gym tasks, JSONL/parquet files,
HumanEval) and the rollout manager, which only ever calls `PromptLoader.next_batch(n)`.
What it is not: file parsing, tokenizer loading or chat formatting; those live in `files.py`,
`procedural.py`, `humaneval.py`, `tokenizers.py` and `formatting.py`. Grading lives with the
rewards (`procedural.ProceduralVerifier` is the one verifier this role owns, because only the
procedural source knows how to re-create its entries).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

TASKS = ("math", "procedural", "code")
PROGRESS_ROWS = 5000  # validating a source this large shows a progress bar
MAX_DETAIL = 300  # characters of a rejection's detail kept in the report (a 1 MB row is not copied)


def json_safe(value: Any, *, lossy: bool = False) -> Any:
    """The JSON image of `value` (tuples become lists). Other types raise TypeError naming them,
    or with `lossy` become their `str()` (e.g. Fraction in reasoning-gym metadata)."""
    return json.loads(json.dumps(value, default=str if lossy else None))


@dataclass
class Prompt:
    """One prompt draw, ready for the rollout manager. `uid` is unique per draw: it encodes the
    epoch and the source index (`PromptLoader.locate`), so "every prompt trained exactly once"
    can be checked. `answer` is the JSON payload the reward grader of `task` needs."""

    uid: int
    question: str
    input_ids: list[int]
    task: str  # one of TASKS
    answer: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptRecord:
    """What a source yields for one index, before tokenization. `where` locates it for reports
    (file:line, or dataset[index])."""

    question: str
    task: str
    answer: dict[str, Any]
    metadata: dict[str, Any]
    where: str


class PromptError(ValueError):
    """A record that cannot become a prompt (too long, characters the tokenizer cannot encode).
    The loader counts it as a bad row under `reason` instead of stopping a long run."""

    reason = "invalid_prompt"


@dataclass
class DataReport:
    """Counts of rows read and rows rejected by reason, with every rejection located (file:line
    or dataset[index]), so nothing is dropped silently: `log` names each rejected row once,
    `metrics` counts them for TensorBoard, `summary` (for error messages) shows the first
    `max_examples`."""

    source: str
    rows: int = 0  # rows read (good and bad)
    bad: Counter = field(default_factory=Counter)  # reason -> count
    rejections: list[str] = field(default_factory=list)  # "where: reason: detail", in the order found
    max_examples: int = 20
    _logged: int = 0  # rejections already written to a log

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    @property
    def examples(self) -> list[str]:
        return self.rejections[: self.max_examples]

    def add_bad(self, reason: str, where: str, detail: str) -> None:
        self.bad[reason] += 1
        detail = detail if len(detail) <= MAX_DETAIL else detail[:MAX_DETAIL] + "..."
        self.rejections.append(f"{where}: {reason}: {detail}")

    def headline(self) -> str:
        head = f"data source {self.source}: {self.rows} rows read, {self.num_bad} rejected"
        if not self.bad:
            return head
        return f"{head} ({', '.join(f'{r}={c}' for r, c in sorted(self.bad.items()))})"

    def summary(self) -> str:
        if not self.bad:
            return self.headline()
        more = self.num_bad - len(self.examples)
        tail = [f"... and {more} more (each named in the log)"] if more > 0 else []
        return "\n  ".join([f"{self.headline()}; first rejections:", *self.examples, *tail])

    def log(self, logger: logging.Logger) -> None:
        """The counts, then every rejection not logged before, one line each."""
        logger.log(logging.WARNING if self.bad else logging.INFO, "%s", self.headline())
        for line in self.rejections[self._logged:]:
            logger.warning("rejected row %s", line)
        self._logged = len(self.rejections)

    def metrics(self) -> dict[str, float]:
        """`rollout/prompts_rejected` (all reasons) and `rollout/prompts_rejected/<reason>`."""
        out = {"rollout/prompts_rejected": float(self.num_bad)}
        out.update({f"rollout/prompts_rejected/{r}": float(c) for r, c in sorted(self.bad.items())})
        return out


@runtime_checkable
class PromptSource(Protocol):
    """A finite, indexable set of prompt records. `name` identifies the set (kind, target, seed)
    so a loader state is never applied to another source; `report` holds its bad rows. A source
    whose records are generated on demand sets a class attribute `lazy = True`: its loader then
    checks records as drawn instead of all at start."""

    name: str
    report: DataReport

    def __len__(self) -> int: ...

    def record(self, index: int) -> PromptRecord: ...


class PromptLoader:
    """Draws prompts from a source in a seeded permutation per epoch, skipping (and reporting)
    records `encode` rejects. The state is (epoch, position): the permutation of an epoch is a
    pure function of (seed, epoch), so a loader restored from `state_dict()` yields exactly the
    prompts not yet drawn, in the same order.

    Records are checked up front (`validate`) or as they are drawn; a rejection while drawing is
    counted and logged with its location at once. Either way `metrics()` counts every dropped
    row by reason."""

    def __init__(
        self,
        source: PromptSource,
        encode: Callable[[PromptRecord], list[int]],
        *,
        seed: int = 0,
        shuffle: bool = True,
        logger: logging.Logger | None = None,
        validate: bool = False,
        progress: bool = False,
    ) -> None:
        """A loader at epoch 0, position 0.

        Args:
            source: the prompt records; it must hold at least one row.
            encode: a record to its prompt token ids; raises `PromptError` to reject the record.
            seed: the permutation seed; epoch e draws in the order `default_rng([seed, e])` gives.
            shuffle: draw each epoch in a seeded random order; False draws in source order.
            logger: where rejections are logged; None uses this module's logger.
            validate: encode every record once here, so every row the run will skip is counted and named
                before the first draw (sources that hold their rows: files, HumanEval); False checks on draw.
            progress: with `validate`, show a tqdm bar for sources of `PROGRESS_ROWS` rows or more.
        """
        if len(source) == 0:
            raise ValueError(f"data source {source.name} has no usable rows\n{source.report.summary()}")
        self.source, self.encode, self.seed, self.shuffle = source, encode, seed, shuffle
        self.logger = logger or logging.getLogger(__name__)
        self.epoch, self.position = 0, 0
        self._rejected: set[int] = set()  # indices counted as bad in this process (each row once, every epoch skips it)
        self._order = self._permutation(0)
        if validate:
            self._validate_all(progress)

    def _validate_all(self, progress: bool) -> None:
        indices: Any = range(len(self.source))
        if progress and len(self.source) >= PROGRESS_ROWS:
            from tqdm import tqdm

            indices = tqdm(indices, desc=f"checking {self.source.name}", unit="row", mininterval=1.0)
        for index in indices:
            record = self.source.record(index)
            try:
                self.encode(record)
            except PromptError as e:
                self._reject(index, record, e)
        if len(self._rejected) == len(self.source):
            raise ValueError(f"data source {self.source.name} has no usable rows\n{self.source.report.summary()}")

    def _reject(self, index: int, record: PromptRecord, error: PromptError) -> None:
        self._rejected.add(index)
        self.source.report.add_bad(error.reason, record.where, str(error))

    def metrics(self) -> dict[str, float]:
        """Rows dropped so far (read and encoding rejections), by reason: `rollout/prompts_rejected...`."""
        return self.source.report.metrics()

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.source)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def report(self) -> DataReport:
        """The source's bad-row report, including prompts this loader rejected so far."""
        return self.source.report

    def locate(self, uid: int) -> tuple[int, int]:
        """(epoch, source index) of a prompt uid."""
        return divmod(uid, len(self.source))

    def next_batch(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        skipped_in_a_row = 0
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            index = int(self._order[self.position])
            self.position += 1
            prompt = self._make(index)
            if prompt is not None:
                out.append(prompt)
                skipped_in_a_row = 0
                continue
            skipped_in_a_row += 1
            if skipped_in_a_row >= len(self.source):  # a whole epoch without one usable prompt
                raise RuntimeError(f"no record of {self.source.name} is usable\n{self.source.report.summary()}")
        return out

    def one_pass(self, n: int) -> list[Prompt]:
        """Up to `n` prompts from the rest of this epoch, never wrapping into the next one (so
        none repeats; fewer than `n` when rejected rows leave fewer): the held-out evaluation's
        draw, whose problems must be distinct."""
        out: list[Prompt] = []
        while len(out) < n and self.position < len(self._order):
            index = int(self._order[self.position])
            self.position += 1
            prompt = self._make(index)
            if prompt is not None:
                out.append(prompt)
        return out

    def _make(self, index: int) -> Prompt | None:
        if index in self._rejected:
            return None
        record = self.source.record(index)
        try:
            ids = self.encode(record)
        except PromptError as e:
            self._reject(index, record, e)
            self.source.report.log(self.logger)  # named in the log now, not only counted
            return None
        return Prompt(
            uid=self.epoch * len(self.source) + index,
            question=record.question,
            input_ids=ids,
            task=record.task,
            answer=record.answer,
            metadata=record.metadata,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "source": self.source.name,
            "size": len(self.source),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("source", "size", "seed", "shuffle"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"PromptLoader state was saved for {key}={state.get(key)!r}, this loader has "
                    f"{key}={mine[key]!r}; resuming would not continue the same prompt order"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
