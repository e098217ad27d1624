"""From a `DataConfig` to a source and a loader: parses the source spec, picks the held-out
eval split, and wires the tokenizer's prompt formatting into a `PromptLoader`.

What it is: `build_source(cfg, split)` and `build_loader(cfg, tokenizer, split)`, the two calls the
trainer and the evaluator make (their `context`, the room a prompt must leave for its answer, is
`model_facts.context_limit`: the model's context); and
`check_sources(cfg)`, the data checks made before a run starts.
What it is not: the sources themselves (`procedural.py`, `files.py`, `humaneval.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_darl.config.data import DataConfig, SourceSpec
from megatron_darl.data.api import PromptLoader, PromptSource
from megatron_darl.data.formatting import ContextLimit, PromptFormatter, check_template
from megatron_darl.data.procedural import EVAL_SEED_OFFSET

SPLITS = ("train", "eval")  # the splits a run reads; "validation" (data.partition=hash) is the warm start's


def build_source(cfg: DataConfig, split: str = "train") -> PromptSource | None:
    """The source of `split`. Eval without `eval_source`: a procedural source gets a held-out
    stream of `eval_size` entries (seed + EVAL_SEED_OFFSET; for tiny task spaces some questions
    can coincide with training ones), other sources have no eval set (None). With
    `data.partition: hash` the three splits are disjoint sets of questions (`data/partition.py`):
    "eval" is the test split, "validation" the warm start's; without it "validation" is None."""
    if split not in (*SPLITS, "validation"):
        raise ValueError(f"split {split!r}; allowed: {(*SPLITS, 'validation')}")
    if cfg.partition == "hash":
        from megatron_darl.data.partition import partitioned_source

        return partitioned_source(SourceSpec.parse(cfg.source).target, split, size=cfg.size,
                                  eval_size=cfg.eval_size, val_size=cfg.val_size, seed=cfg.seed,
                                  dataset_kwargs=cfg.dataset_kwargs, test_frac=cfg.test_frac, val_frac=cfg.val_frac)
    if split == "validation":
        return None
    spec_text = cfg.source if split == "train" else cfg.eval_source
    seed, size = cfg.seed, cfg.size
    if split == "eval":
        if cfg.eval_size == 0:
            return None
        seed, size = cfg.seed + EVAL_SEED_OFFSET, cfg.eval_size
        if spec_text is None:
            if SourceSpec.parse(cfg.source).kind != "reasoning_gym":
                return None
            spec_text = cfg.source
    spec = SourceSpec.parse(spec_text)
    if spec.kind == "reasoning_gym":
        from megatron_darl.data.procedural import ProceduralSource

        return ProceduralSource(spec.target, size=size, seed=seed, dataset_kwargs=cfg.dataset_kwargs)
    if spec.kind == "humaneval":
        from megatron_darl.data.humaneval import HumanEvalSource

        return HumanEvalSource()
    from megatron_darl.data.files import FileSource

    return FileSource(
        spec.target, spec.kind, fmt=cfg.format, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field
    )


def build_loader(
    cfg: DataConfig,
    tokenizer: Any,
    split: str = "train",
    *,
    logger: logging.Logger | None = None,
    progress: bool = True,
    context: ContextLimit | None = None,
    **chat_kwargs: Any,
) -> PromptLoader | None:
    """A loader over `build_source(cfg, split)` that formats through `tokenizer`; None when the
    split has no source. Train draws are shuffled per epoch; other splits keep the source order.
    Sources that hold their rows are checked whole now (every rejected row counted and named in
    the log before the first draw); generated ones as drawn. `chat_kwargs` add to (and override)
    `cfg.chat_kwargs`.

    Args:
        cfg: the run's data section.
        tokenizer: the model's Hugging Face tokenizer.
        split: `train`, `eval` or `validation` (the last only with `data.partition: hash`).
        logger: where the data report and rejections are logged; None uses this module's logger.
        progress: show a progress bar while checking a source of 5000 rows or more (`api.PROGRESS_ROWS`).
        context: `model_facts.context_limit`: prompts that leave too little of the model's context for their
            answers are bad rows too (`prompt_exceeds_context`); None: only `data.max_prompt_tokens` limits.
    """
    source = build_source(cfg, split)
    if source is None:
        return None
    logger = logger or logging.getLogger(__name__)
    formatter = PromptFormatter.from_config(tokenizer, cfg, context, **chat_kwargs)
    formatter.user_message(source.record(0))  # a template field the source lacks fails now, not mid-run
    loader = PromptLoader(source, formatter.encode, seed=cfg.seed, shuffle=split == "train", logger=logger,
                          validate=not getattr(source, "lazy", False), progress=progress)
    source.report.log(logger)
    return loader


def check_sources(cfg: DataConfig) -> tuple[list[str], str | None]:
    """Before a run starts: every split's source can be built (files read, bad rows counted) and
    `prompt_template` names only fields its records have. Returns one message per problem, and
    the key (`source` or `eval_source`) of a split whose records are code tasks, or None: the
    run's preflight checks that the code sandbox works on this machine."""
    if cfg.missing_files():
        return [], None  # reported by `DataConfig.missing_files`
    errors, code_key = [], None
    for split in SPLITS:
        key = "eval_source" if split == "eval" and cfg.eval_source else "source"
        try:
            source = build_source(cfg, split)
            if source is not None:
                check_template(cfg.prompt_template, source.record(0))
                code_key = code_key or (key if source.record(0).task == "code" else None)
        except (ValueError, OSError) as e:
            errors.append(f"data.{key} ({split} split): {e}")
    return errors, code_key
