"""Checks against this machine before a run starts: files, folders, the warm start, the layout.

What it is: `preflight(cfg)`, the list of problems that stop a run before anything starts (each
naming its key): the model folder and data files exist, the data sources read and fit
`data.prompt_template`, the built-in model's warm start has reference answers, the run and
checkpoint folders take files, the learner and the engines load one NCCL for a distributed weight
sync (`launch/nccl_check.py`), the model's context leaves room for a prompt beside
`rollout.max_new_tokens` / `eval.max_new_tokens`, the model's shapes fit the parallel layout and
the learner fits in GPU memory (`learner/checks.py`). `darl-train` and every Slurm trainer task
run it.
What it is not: validation of the config's keys (`config/`, which any recipe passes anywhere,
so that it prints with --print-config on a laptop).
"""

from __future__ import annotations

import os

from megatron_darl.config import RunConfig
from megatron_darl.config.data import DataConfig


def preflight(cfg: RunConfig) -> list[str]:
    """Checks against this machine before a run starts (not part of validation, so that any
    recipe prints with --print-config anywhere): model folder and data files exist, what
    `_machine_checks` checks, max_new_tokens leaves room in the model's context, the model's
    shapes fit the parallel layout and the learner fits in GPU memory."""
    errors = [f"data.{k}: {m}" for k, m in cfg.data.missing_files()]
    hf = cfg.model.hf_dir
    if not hf.startswith("builtin:") and not os.path.isfile(os.path.join(hf, "config.json")):
        errors.append(f"model.hf_dir: no config.json in {hf!r} (a Hugging Face model folder is expected)")
    tok = cfg.model.tokenizer
    if tok and not tok.startswith("builtin:") and not os.path.isdir(tok):
        errors.append(f"model.tokenizer: folder not found: {tok!r}")
    from megatron_darl.learner.checks import learner_checks

    return errors + _machine_checks(cfg) + context_checks(cfg) + learner_checks(cfg)


def context_checks(cfg: RunConfig) -> list[str]:
    """A request asks for its prompt plus max_new_tokens positions, which SGLang and darl-engine
    refuse beyond the model's context (a 400 marks the engine down; the loaders skip prompts
    that do not fit): a max_new_tokens that leaves no position for a prompt fits no prompt."""
    from megatron_darl.model_facts import model_context

    context, source = model_context(cfg)
    if context is None:
        return []  # a missing config.json is named above
    budgets = [("rollout.max_new_tokens", cfg.rollout.max_new_tokens)]
    if cfg.eval.max_new_tokens and cfg.eval.num_problems > 0:
        budgets.append(("eval.max_new_tokens", cfg.eval.max_new_tokens))
    return [_no_room(key, new, context, source, cfg.data.max_prompt_tokens) for key, new in budgets if new >= context]


def _no_room(key: str, new: int, context: int, source: str, most: int) -> str:
    fits_all = f"; every prompt of up to data.max_prompt_tokens={most}: {key} <= {context - most}" \
        if context > most else ""
    return (f"{key}={new} >= the model's context of {context} tokens (max_position_embeddings in {source}): no "
            f"prompt fits beside it, since SGLang and darl-engine refuse a prompt plus max_new_tokens beyond the "
            f"context; a prompt of n tokens needs {key} <= {context} - n{fits_all}")


def _machine_checks(cfg: RunConfig) -> list[str]:
    """Data, warm start and run folders, checked before anything starts: the data sources read
    and their records fit `data.prompt_template`, the built-in model's warm start has reference
    answers, the ring buffer fits in /dev/shm (local runs), one NCCL on both ends of a distributed
    weight sync, and the run and checkpoint folders take files (a probe file, not permission bits)."""
    from megatron_darl.launch import warmstart
    from megatron_darl.launch.nccl_check import nccl_checks
    from megatron_darl.trainer.checkpoints import writable_problem

    errors = data_checks(cfg.data) + warmstart.check_answers(cfg) + nccl_checks(cfg) + tool_checks(cfg)
    if cfg.launch.mode == "local":  # on Slurm the ring lives on the first trainer node: checked there
        from megatron_darl.channel.shm_space import shm_space_problem

        errors += [f"ring.size_bytes: {p}" for p in [shm_space_problem(cfg.ring.size_bytes)] if p]
    for key, folder, what in (("train.run_dir", cfg.train.run_dir, "run folder"),
                              ("checkpoint.dir", cfg.checkpoint_dir, "checkpoint folder")):
        problem = writable_problem(folder, what, create=False)
        if problem:
            errors.append(f"{key}: {problem}")
    return errors


def data_checks(data: DataConfig) -> list[str]:
    """The data sources read, their records fit `data.prompt_template`, and where a split holds
    code tasks, the code sandbox runs on this machine (a machine that cannot run it would score
    every answer 0)."""
    from megatron_darl.data.sources import check_sources

    errors, code_key = check_sources(data)
    if code_key:
        from megatron_darl.rewards.sandbox import sandbox_problem

        problem = sandbox_problem()
        errors += [f"data.{code_key}: code tasks, but {problem}"] if problem else []
    return errors


def tool_checks(cfg: RunConfig) -> list[str]:
    """With `rollout.tool`, the policy's calls run in the code sandbox, which this machine must
    allow, and a call opens and closes on single tokens of the run's tokenizer (the engine stops on
    the closing one). A tokenizer folder that a run prepares (package:..., builtin:...) is checked
    when the rollout manager starts."""
    rc = cfg.rollout
    if rc.tool == "none":
        return []
    from megatron_darl.data.tokenizers import BUILTINS, load_tokenizer
    from megatron_darl.rewards.sandbox import sandbox_problem
    from megatron_darl.rollout.tools import ToolFormat, limits_of

    problem = sandbox_problem(limits_of(rc))
    errors = [f"rollout.tool: {rc.tool!r} runs the policy's code in the sandbox, but {problem}"] if problem else []
    folder = cfg.model.tokenizer_dir
    if folder in BUILTINS or os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        try:
            ToolFormat(rc, load_tokenizer(folder))
        except ValueError as exc:
            errors.append(str(exc))
    return errors
