#!/usr/bin/env bash
# The README's first command as a newcomer runs it, timed: a fresh `git clone` of REPO, a fresh
# venv, then exactly `pip install -e . && darl-train --config configs/cpu_demo_darl.yaml`.
# Prints one line: threads, wall time (install included), warm-start steps, held-out accuracy
# before -> after and the gain with its paired 95% interval (from the run's summary.json).
# It is the command behind the fresh-clone table of docs/measurements.md; it is not a test.
#   scripts/fresh_clone_demo.sh REPO WORKDIR [THREADS]   (THREADS: OMP_NUM_THREADS; empty: unset)
set -uo pipefail
repo=${1:?usage: scripts/fresh_clone_demo.sh REPO WORKDIR [THREADS]}
work=${2:?usage: scripts/fresh_clone_demo.sh REPO WORKDIR [THREADS]}
threads=${3:-}
if [ -e "$work" ]; then echo "fresh_clone_demo: $work exists; give a new folder" >&2; exit 2; fi
start=$(date +%s.%N)
git clone -q "$repo" "$work" || exit 1
cd "$work" && python3 -m venv venv && . venv/bin/activate || exit 1
if [ -n "$threads" ]; then export OMP_NUM_THREADS=$threads; else unset OMP_NUM_THREADS; fi
( pip install -e . && darl-train --config configs/cpu_demo_darl.yaml ) > "$work/fresh_clone_demo.log" 2>&1
rc=$?
end=$(date +%s.%N)
python3 - "$work/runs/cpu_demo" "$rc" "$start" "$end" "${threads:-unset}" "$work/fresh_clone_demo.log" <<'PY'
import json, sys
run, rc, start, end, threads, log = sys.argv[1:]
wall = float(end) - float(start)
try:
    s = json.load(open(f"{run}/summary.json"))
    w = json.load(open(f"{run}/model/warmstart.json"))
except OSError as e:
    sys.exit(f"fresh_clone_demo: rc={rc}, no result ({e}); see {log}")
lo, hi = s["gain_ci95"]
print(f"OMP_NUM_THREADS={threads} rc={rc} wall={int(wall) // 60} min {int(wall) % 60:02d} s "
      f"sft_steps={w['sft_steps']} before={s['accuracy_before']:.1%} after={s['accuracy_after']:.1%} "
      f"gain={100 * s['gain']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]")
PY
