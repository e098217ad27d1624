"""Every console script (`darl-*`) in one place: argument parsing and dispatch, nothing else.

What it is: one small function per console script (`setup.py` points each script here, and
`python -m megatron_darl <command>` calls the same functions). Each imports its command lazily,
so that `darl-train --print-config` answers in a second without importing Megatron or torch:
  darl-train / darl-launch   a run: preflight, then this machine (`local.py`) or Slurm (`slurm.py`)
  darl-engine                the embedded engine (`engine/server.py`)
  darl-eval                  held-out accuracy of a model folder (`eval_command.py`)
  darl-logprobs              per-token log-probs of sequences under a model (`logprobs_command.py`)
  darl-convert               Hugging Face <-> Megatron checkpoints (`checkpoint_tools/commands.py`)
What it is not: the implementation of any command. The processes a run starts have entries of
their own (`python -m megatron_darl.trainer`, `.rollout`, `.engine`, `.launch.engine_host`).
"""

from __future__ import annotations

import argparse
import sys

from megatron_darl.config import ConfigError, load_config, to_yaml
from megatron_darl.launch.preflight import preflight


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="darl-train",
        description="Asynchronous RL post-training (D-ARL and baselines). Overrides are dotted "
        "KEY=VALUE pairs (algo.k=4); a leading '+' is accepted.",
    )
    p.add_argument("--config", help="YAML recipe (configs/*.yaml); defaults apply without one")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--plan", action="store_true", help="print the learner's per-GPU memory plan and exit "
                   "(exit 1 when the recipe does not fit)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p


def train_main(argv: list[str] | None = None) -> int:
    args = train_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"darl-train: {exc}", file=sys.stderr)
        return 1
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from megatron_darl.launch.packaged import resolve

    try:  # `model.hf_dir: package:...` becomes its prepared folder before the checks
        cfg = resolve(cfg)
    except (ImportError, OSError, ValueError) as exc:
        print(f"darl-train: cannot prepare model.hf_dir={cfg.model.hf_dir}: {exc}", file=sys.stderr)
        return 1
    if args.plan:
        from megatron_darl.learner.checks import plan_command

        return plan_command(cfg)
    problems = preflight(cfg)
    if problems:
        print("darl-train: cannot start:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if cfg.launch.mode == "slurm":  # the placement switch: one Slurm job, or this machine
        from megatron_darl.launch.slurm import run_slurm

        return int(run_slurm(cfg) or 0)
    from megatron_darl.launch.local import run_local

    return int(run_local(cfg) or 0)


def engine_main(argv: list[str] | None = None) -> int:
    from megatron_darl.engine.server import main

    return int(main(argv) or 0)


def convert_main(argv: list[str] | None = None) -> int:
    from checkpoint_tools.commands import main

    return int(main(argv) or 0)


def logprobs_main(argv: list[str] | None = None) -> int:
    from megatron_darl.launch.logprobs_command import main

    return int(main(argv) or 0)


def eval_main(argv: list[str] | None = None) -> int:
    from megatron_darl.launch.eval_command import main

    return int(main(argv) or 0)


def launch_main(argv: list[str] | None = None) -> int:
    """`darl-launch`: the same command as `darl-train` (a name Slurm users look for)."""
    return train_main(argv)


COMMANDS = {"train": train_main, "engine": engine_main, "convert": convert_main, "logprobs": logprobs_main,
            "eval": eval_main, "launch": launch_main}


def _entry(fn) -> None:  # pragma: no cover - thin wrapper for console scripts
    from megatron_darl.launch.supervisor import ChildFailed

    try:
        sys.exit(fn())
    except ChildFailed as exc:  # the child's own log says why; a traceback of the launcher adds nothing
        print(f"{sys.argv[0].rsplit('/', 1)[-1]}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


def train() -> None:
    _entry(train_main)


def engine() -> None:
    _entry(engine_main)


def convert() -> None:
    _entry(convert_main)


def logprobs() -> None:
    _entry(logprobs_main)


def evaluate() -> None:
    _entry(eval_main)


def launch() -> None:
    _entry(launch_main)
