"""Checks against this machine before a run starts: files, folders, the warm start, the layout.

What it is: `preflight(cfg)`, the list of problems that stop a run before anything starts (each
naming its key): the model folder and data files exist, the data sources read and fit
`data.prompt_template`, the built-in model's warm start has reference answers, the run and
checkpoint folders take files, the model's shapes fit the parallel layout and the learner fits
in GPU memory (`learner/preflight.py`). `darl-train` and every Slurm trainer task run it.
What it is not: validation of the config's keys (`config.py`, which any recipe passes anywhere,
so that it prints with --print-config on a laptop).
"""

from __future__ import annotations

import os

from megatron_darl.config import RunConfig


def preflight(cfg: RunConfig) -> list[str]:
    """Checks against this machine before a run starts (not part of validation, so that any
    recipe prints with --print-config anywhere): model folder and data files exist, what
    `_run_preflight` checks, the model's shapes fit the parallel layout and the learner fits in
    GPU memory."""
    errors = [f"data.{k}: {m}" for k, m in cfg.data.missing_files()]
    hf = cfg.model.hf_dir
    if not hf.startswith("builtin:") and not os.path.isfile(os.path.join(hf, "config.json")):
        errors.append(f"model.hf_dir: no config.json in {hf!r} (a Hugging Face model folder is expected)")
    tok = cfg.model.tokenizer
    if tok and not tok.startswith("builtin:") and not os.path.isdir(tok):
        errors.append(f"model.tokenizer: folder not found: {tok!r}")
    from megatron_darl.learner.preflight import learner_preflight  # layout and memory plan (imports torch)

    return errors + _run_preflight(cfg) + learner_preflight(cfg)


def _run_preflight(cfg: RunConfig) -> list[str]:
    """Data, warm start and run folders, checked before anything starts: the data sources read
    and their records fit `data.prompt_template`, the built-in model's warm start has reference
    answers, the ring buffer fits in /dev/shm (local runs), and the run and checkpoint folders
    take files (a probe file, not permission bits)."""
    from megatron_darl import warmstart
    from megatron_darl.data.sources import preflight as data_preflight
    from megatron_darl.resume import writable_problem

    errors = data_preflight(cfg.data) + warmstart.preflight(cfg)
    if cfg.launch.mode == "local":  # on Slurm the ring lives on the first trainer node: checked there
        from megatron_darl.replay.shm_space import shm_space_problem

        errors += [f"replay.ring_bytes: {p}" for p in [shm_space_problem(cfg.replay.ring_bytes)] if p]
    for key, folder, what in (("train.run_dir", cfg.train.run_dir, "run folder"),
                              ("checkpoint.dir", cfg.checkpoint_dir, "checkpoint folder")):
        problem = writable_problem(folder, what, create=False)
        if problem:
            errors.append(f"{key}: {problem}")
    return errors
