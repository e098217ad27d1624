"""Console-script entry points (`darl-*`): argument parsing and dispatch, nothing else.

What it is: one small function per console script. Each imports its role lazily so that
`darl-train --print-config` answers in a second without importing Megatron or torch.
What it is not: the implementation of any command; a command whose role has not landed yet
exits 2 with a message saying so.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_darl.config import ConfigError, load_config, to_yaml
from megatron_darl.preflight import preflight

EXIT_UNAVAILABLE = 2


def _delegate(prog: str, module: str, attr: str = "main") -> int:
    """Run `module.attr()` if that role has landed, else exit 2 with a clear message."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            print(f"{prog}: not available in this version ({module} is not part of it yet)", file=sys.stderr)
            return EXIT_UNAVAILABLE
        raise
    fn = getattr(mod, attr, None)
    if fn is None:
        print(f"{prog}: not available in this version ({module}.{attr} is missing)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return int(fn() or 0)


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="darl-train",
        description="Asynchronous RL post-training (D-ARL and baselines). Overrides are dotted "
        "KEY=VALUE pairs (replay.k=4); a leading '+' is accepted.",
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
    if args.plan:
        from megatron_darl.learner.preflight import plan_command

        return plan_command(cfg)
    problems = preflight(cfg)
    if problems:
        print("darl-train: cannot start:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if cfg.launch.mode == "slurm":  # the placement switch: one Slurm job, or this machine
        from megatron_darl.launch.slurm import run_slurm

        return int(run_slurm(cfg) or 0)
    from megatron_darl.launch.runner import run_local

    return int(run_local(cfg) or 0)


def engine_main() -> int:
    return _delegate("darl-engine", "megatron_darl.rollout.engine_server")


def convert_main() -> int:
    return _delegate("darl-convert", "checkpoint_tools.cli")


def logprobs_main() -> int:
    return _delegate("darl-logprobs", "megatron_darl.learner.cli")


def eval_main() -> int:
    return _delegate("darl-eval", "megatron_darl.eval.cli")


def launch_main(argv: list[str] | None = None) -> int:
    """`darl-launch`: the same command as `darl-train` (a name Slurm users look for)."""
    return train_main(argv)


def _entry(fn) -> None:  # pragma: no cover - thin wrapper for console scripts
    sys.exit(fn())


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
