"""Run the comparison suite of ALGORITHM.md on the CPU demo and print one table.

What it is: a driver over `darl-train`: the same warm-started model (the demo's cached SFT
folder is made once and copied into every run), the same data, seeds and replay window, and
one run per method -- sync (eta = 0), naive async, decoupled (AReaL cap and verl IS), D-ARL --
optionally crossed with learning rates and `algo.ppo_n_minibatches`. Each run's held-out gain
(paired, 95% interval) comes from its `summary.json`; the last printed line is one JSON object.
What it is not: a benchmark of speed, or a claim: it prints what it measures, whichever wins.

    python scripts/compare_async.py --steps 120 --lr 5e-5 1e-4 --minibatches 1 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time

METHODS = {
    "sync": ["staleness.max_head_offpolicyness=0", "replay.enable=false", "replay.sg=false", "replay.pmis=false",
             "algo.policy_loss=ppo", "algo.old_logprob=proximal"],
    "naive": ["replay.enable=false", "replay.sg=false", "replay.pmis=false", "algo.policy_loss=ppo",
              "algo.old_logprob=behavior", "algo.recompute_proximal=false"],
    "decoupled_areal": ["replay.enable=false", "replay.sg=false", "replay.pmis=false",
                        "algo.policy_loss=decoupled", "algo.behav_weight_cap=5.0"],
    "decoupled_verl": ["replay.enable=false", "replay.sg=false", "replay.pmis=false", "algo.policy_loss=ppo",
                       "algo.old_logprob=proximal", "algo.rollout_is=token", "algo.rollout_is_threshold=2.0"],
    "darl": ["algo.policy_loss=darl", "replay.enable=true", "replay.sg=true", "replay.pmis=true"],
}


def run_one(out_root: str, name: str, overrides: list[str], model_dir: str, config: str) -> dict:
    run_dir = os.path.join(out_root, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    shutil.copytree(model_dir, os.path.join(run_dir, "model"))  # same warm start, cache hit
    cmd = [sys.executable, "-m", "megatron_darl", "train", "--config", config, f"train.run_dir={run_dir}",
           "checkpoint.every_steps=0", "logging.progress=false", *overrides]
    t0 = time.time()
    with open(os.path.join(out_root, f"{name}.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    row = {"run": name, "rc": rc, "wall_s": round(time.time() - t0, 1)}
    summary = os.path.join(run_dir, "summary.json")
    if rc == 0 and os.path.isfile(summary):
        with open(summary) as fh:
            s = json.load(fh)
        row.update({k: s[k] for k in ("accuracy_before", "accuracy_after", "gain", "gain_ci95") if k in s})
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/cpu_demo_darl.yaml")
    p.add_argument("--out", default="runs/compare")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", nargs="+", type=float, default=[5e-5])
    p.add_argument("--minibatches", nargs="+", type=int, default=[2])
    p.add_argument("--extra", nargs="*", default=[], help="overrides applied to every run")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    warm = os.path.join(args.out, "_warm")
    if not os.path.isfile(os.path.join(warm, "model", "warmstart.json")):  # make the SFT model once
        subprocess.run([sys.executable, "-c", "import sys; from megatron_darl.config import load_config;"
                        "from megatron_darl.warmstart import prepare_model;"
                        f"prepare_model(load_config({args.config!r}, ['train.run_dir={warm}']))"], check=True)
    rows = []
    for method, lr, mb in itertools.product(args.methods, args.lr, args.minibatches):
        name = f"{method}_lr{lr:g}_mb{mb}"
        over = METHODS[method] + [f"train.steps={args.steps}", f"optim.lr={lr}", f"algo.ppo_n_minibatches={mb}",
                                  *args.extra]
        row = run_one(args.out, name, over, os.path.join(warm, "model"), args.config)
        rows.append(row)
        gain = f"{100 * row['gain']:+.1f} [{100 * row['gain_ci95'][0]:+.1f}, {100 * row['gain_ci95'][1]:+.1f}]" \
            if "gain" in row else f"failed (rc={row['rc']}, see {args.out}/{name}.log)"
        print(f"{name:32s} {gain}  ({row['wall_s']} s)", flush=True)
    print(json.dumps({"steps": args.steps, "runs": rows}))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
