"""The `data` config section: where prompts come from and how they become token ids.

What it is: `DataConfig` (each field documented where it is declared) and `SourceSpec`, the
parsed form of a source string (`reasoning_gym:chain_sum`, `jsonl:PATH`, `parquet:PATH`,
`humaneval`), with the checks that need no file: the spec's syntax, the reasoning-gym dataset
name and the prompt template's fields. What it is not: reading sources or tokenizing (`data/`);
whether a file exists is checked before a run starts (`DataConfig.missing_files`, by
`launch/preflight.py`), so that a recipe prints with --print-config on any machine.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

PARTITIONS = ("none", "hash")
FORMATS = ("auto", "gsm8k", "math500", "aime24", "livecodebench", "custom")
SOURCE_KINDS = ("reasoning_gym", "jsonl", "parquet", "humaneval")
PROJECT_DATASETS = ("word_problems",)  # reasoning-gym datasets the project registers (data/word_problems.py)


@dataclass(frozen=True)
class SourceSpec:
    """A parsed `DataConfig.source` string: `kind` is one of SOURCE_KINDS, `target` the dataset
    name (reasoning_gym) or file path (jsonl, parquet), empty for humaneval."""

    kind: str
    target: str

    @classmethod
    def parse(cls, spec: str) -> SourceSpec:
        kind, sep, target = spec.partition(":")
        kind, target = kind.strip(), target.strip()
        if kind not in SOURCE_KINDS:
            raise ValueError(
                f"source spec {spec!r}: unknown kind {kind!r}; allowed: "
                "reasoning_gym:<dataset>, jsonl:<path>, parquet:<path>, humaneval"
            )
        if kind == "humaneval":
            if target:
                raise ValueError(f"source spec {spec!r}: 'humaneval' takes no argument")
            return cls(kind, "")
        if not sep or not target:
            raise ValueError(f"source spec {spec!r}: {kind} needs a target, e.g. {kind}:<name or path>")
        return cls(kind, target)


@dataclass
class DataConfig:
    """Where prompts come from and how they become token ids. Field comments are the documentation."""

    source: str = "reasoning_gym:chain_sum"  # reasoning_gym:<dataset> | jsonl:<path> | parquet:<path> | humaneval
    eval_source: str | None = None  # same syntax; None: procedural -> held-out seed of `source`, files -> no eval set
    format: str = "auto"  # field mapping of file sources (auto detects gsm8k/math500/aime24/livecodebench per file)
    prompt_field: str | None = None  # format=custom: the row key holding the question
    answer_field: str | None = None  # format=custom: the row key holding the ground truth (None: no ground truth)
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)  # reasoning-gym config args, e.g. {min_terms: 3}
    size: int = 10000  # procedural: prompts per epoch
    eval_size: int = 500  # procedural held-out set size (0: no eval set)
    seed: int = 0  # procedural generation seed and shuffling seed of the loader
    system_prompt: str | None = None  # chat template only: a system message before the question
    chat_template: bool = True  # format through the tokenizer's chat template; false: the raw prompt_template
    prompt_template: str = "{question}"  # user message; fields: {question} and any scalar metadata key
    chat_kwargs: dict[str, Any] = field(default_factory=dict)  # apply_chat_template extras: {enable_thinking: false}
    # longer prompts are counted as bad rows and skipped (prompt_too_long), as are those longer than
    # the model's context (max_position_embeddings) less rollout.max_new_tokens, or for the held-out
    # split eval.max_new_tokens (prompt_exceeds_context): the engines would refuse them
    max_prompt_tokens: int = 1024
    # procedural sources: "hash" splits the task's questions into disjoint train / validation /
    # test sets by a hash of the question (data/partition.py): training never draws a test or
    # validation question, the eval split is `eval_size` distinct test questions, the validation
    # split (the warm start's stop) `val_size` distinct validation questions. "none": the eval
    # split is another seed's stream of the same task, whose questions may coincide with training's
    partition: str = "none"
    test_frac: float = 0.1  # partition=hash: share of the question hash space that is the test split
    val_frac: float = 0.1  # partition=hash: share that is the validation split
    val_size: int = 500  # partition=hash: distinct validation questions (the warm start's stop reads them)

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {"format": FORMATS, "partition": PARTITIONS}

    def check(self) -> list[tuple[str, str]]:
        errs: list[tuple[str, str]] = []
        for name in ("source", "eval_source"):
            spec = getattr(self, name)
            if spec is None:
                continue
            try:
                parsed = SourceSpec.parse(spec)
            except ValueError as e:
                errs.append((name, str(e)))
                continue
            errs.extend((name, msg) for msg in _check_spec_target(parsed))
        if self.format == "custom" and not self.prompt_field:
            errs.append(("prompt_field", "format=custom needs prompt_field (the row key holding the question)"))
        if self.format != "custom" and (self.prompt_field or self.answer_field):
            errs.append(("format", "prompt_field/answer_field are used only with format=custom"))
        if self.size < 1:
            errs.append(("size", "must be >= 1"))
        if self.eval_size < 0:
            errs.append(("eval_size", "must be >= 0 (0: no eval set)"))
        if self.max_prompt_tokens < 1:
            errs.append(("max_prompt_tokens", "must be >= 1"))
        if self.system_prompt is not None and not self.chat_template:
            errs.append(("system_prompt", "needs chat_template=true (a raw template has no system role)"))
        if self.chat_kwargs and not self.chat_template:
            errs.append(("chat_kwargs", "needs chat_template=true"))
        errs.extend(self._check_partition())
        try:
            template_fields(self.prompt_template)
        except ValueError as e:
            errs.append(("prompt_template", str(e)))
        return errs

    def _check_partition(self) -> list[tuple[str, str]]:
        if self.partition != "hash":
            return []
        errs = []
        try:
            kind = SourceSpec.parse(self.source).kind
        except ValueError:
            kind = None  # a malformed data.source is reported under its own key
        if kind not in (None, "reasoning_gym"):
            errs.append(("partition", "hash partitions a procedural task (data.source: reasoning_gym:<name>); "
                         "a file source is split by its files (data.eval_source)"))
        if self.eval_source is not None:
            errs.append(("eval_source", "must be unset with partition=hash (the test split is part of data.source)"))
        if not 0.0 < self.test_frac < 1.0:
            errs.append(("test_frac", "must be in (0, 1) with partition=hash"))
        if not 0.0 <= self.val_frac < 1.0 or self.test_frac + self.val_frac > 0.9:
            errs.append(("val_frac", "must be >= 0 with data.test_frac + data.val_frac <= 0.9 "
                                     "(training keeps the rest)"))
        if self.val_size < 0:
            errs.append(("val_size", "must be >= 0 (0: no validation split)"))
        return errs

    def missing_files(self) -> list[tuple[str, str]]:
        """(field, message) for each file source that does not exist on this machine."""
        out = []
        for name in ("source", "eval_source"):
            spec = getattr(self, name)
            if spec is None:
                continue
            parsed = SourceSpec.parse(spec)
            if parsed.kind in ("jsonl", "parquet") and not Path(parsed.target).expanduser().is_file():
                out.append((name, f"file not found: {parsed.target}"))
        return out


def _check_spec_target(spec: SourceSpec) -> list[str]:
    # file existence is not checked here: a recipe must print (--print-config) on any machine;
    # `DataConfig.missing_files()` is the pre-flight check before a run starts
    if spec.kind == "reasoning_gym":
        from reasoning_gym.factory import DATASETS  # heavy import, only when a procedural source is named

        if spec.target not in DATASETS and spec.target not in PROJECT_DATASETS:
            return [f"unknown reasoning-gym dataset {spec.target!r}; e.g. chain_sum, basic_arithmetic, gsm_symbolic"]
    return []


def template_fields(template: str) -> list[str]:
    """Names used by a `str.format` template; ValueError on malformed braces or positional fields."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    for name in names:
        if name == "" or name.isdigit():
            raise ValueError(f"template {template!r}: positional field {{{name}}}; use named fields like {{question}}")
    return names
