#!/usr/bin/env python3
"""The demo's warm start alone: `prepare_model` on a config (dotted overrides allowed), then the
stop it made (SFT steps, final loss, held-out greedy accuracy, seconds, and what the stop selected
from: `warmstart.checks_summary` of its held-out checks), as one JSON line.

What it is: the command behind the warm-start table of docs/measurements.md (thread counts and float kernels
are set in the environment, e.g. `OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=avx2`). What it is not:
RL or an evaluation by the engine (the warm start's own check is teacher-forced greedy, which
`tests/unit/warmstart` holds equal to the engine's greedy score).

    python scripts/warm_start.py --run-dir /tmp/ws configs/cpu_demo_darl.yaml [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/warm_start.py", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a recipe whose model.hf_dir is builtin:tiny-qwen3")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as darl-train takes them")
    p.add_argument("--run-dir", required=True, help="folder for the warm start (reused when its settings match)")
    args = p.parse_args(argv)
    from megatron_darl.config import ConfigError, load_config
    from megatron_darl.launch import warmstart

    try:
        cfg = load_config(args.config, [*args.overrides, f"train.run_dir={args.run_dir}"])
    except ConfigError as e:
        print(f"scripts/warm_start.py: {e}", file=sys.stderr)
        return 2
    if cfg.model.hf_dir != warmstart.BUILTIN_MODEL:
        print(f"scripts/warm_start.py: model.hf_dir={cfg.model.hf_dir!r} is not {warmstart.BUILTIN_MODEL}: "
              "nothing to warm-start", file=sys.stderr)
        return 2
    t0 = time.time()
    stats = warmstart.read_stats(warmstart.prepare_model(cfg).model.hf_dir)
    keep = ("sft_steps", "sft_final_loss", "sft_heldout_accuracy", "sft_reached_target", "sft_seconds")
    print(json.dumps({**{k: stats.get(k) for k in keep}, "held_out_checks": stats.get("checks_summary"),
                      "wall_s": round(time.time() - t0, 1),
                      "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                      "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
