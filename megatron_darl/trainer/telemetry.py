"""Run telemetry: TensorBoard scalars and histograms, a metrics JSONL, and a progress bar.

What it is: `Telemetry`, which the train loop calls once per step with a flat dict of
namespaced metrics (`train/…`, `algo/…`, `replay/…`, `rollout/…`, `perf/…`). Scalars go to
TensorBoard under `<run_dir>/tb` and, with the step and wall time, to `<run_dir>/metrics.jsonl`
(one JSON object per line, appended, so a resumed run continues the same file); values that are
lists or arrays are written as TensorBoard histograms. A tqdm bar shows step, reward and ETA.
What it is not: the computation of any metric (the roles compute their own).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import numpy as np


def _scalar(value: Any) -> float | None:
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return float(value)
    if hasattr(value, "numel") and value.numel() == 1:  # torch scalar tensor
        return float(value.item())
    return None


def _truncate_steps(path: str, start_step: int) -> None:
    """Drop the lines of steps >= start_step (a resumed run redoes them), atomically."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as fh:
        keep = [line for line in fh if line.strip() and json.loads(line).get("step", 0) < start_step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(keep)
    os.replace(tmp, path)


class Telemetry:
    """Write metrics for one process (the main learner rank); others pass `enabled=False`."""

    def __init__(self, run_dir: str, total_steps: int, *, start_step: int = 0, tensorboard: bool = True,
                 jsonl: bool = True, progress: bool = True, enabled: bool = True, histogram_every: int = 1):
        """Open the run's outputs; the prompt ledger `trained_prompts.jsonl` is kept whatever the other flags.

        Args:
            run_dir: the run folder: `tb/`, `metrics.jsonl` and `trained_prompts.jsonl` go under it.
            total_steps: the run's step count, the progress bar's total.
            start_step: the first step this process logs (a resumed run's checkpoint step): the files'
                lines and TensorBoard events of steps >= it are dropped, since they are redone.
            tensorboard: write TensorBoard scalars and histograms under `<run_dir>/tb`.
            jsonl: append each step's scalars to `<run_dir>/metrics.jsonl`.
            progress: show a tqdm bar (on stderr) with step, reward and ETA.
            enabled: False makes every call a no-op and creates nothing (ranks other than the main one).
            histogram_every: write histograms (list/array values) only every this many steps; 1: every step.
        """
        self.enabled = enabled
        self.histogram_every = histogram_every
        self.run_dir = run_dir
        self._writer = None
        self._jsonl = None
        self._ledger = None
        self._bar = None
        self._t0 = time.time()
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=os.path.join(run_dir, "tb"), purge_step=start_step or None)
        if jsonl:
            path = os.path.join(run_dir, "metrics.jsonl")
            _truncate_steps(path, start_step)
            self._jsonl = open(path, "a", encoding="utf-8")
        ledger = os.path.join(run_dir, "trained_prompts.jsonl")
        _truncate_steps(ledger, start_step)  # steps after the checkpoint were rolled back
        self._ledger = open(ledger, "a", encoding="utf-8")
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr, mininterval=1.0)

    @property
    def tensorboard_dir(self) -> str:
        return os.path.join(self.run_dir, "tb")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step: scalars always, histograms every `histogram_every` steps. NaN/inf
        scalars are kept in JSONL as strings, never dropped."""
        if not self.enabled:
            return
        histogram = step % self.histogram_every == 0
        scalars: dict[str, float] = {}
        for key, value in metrics.items():
            s = _scalar(value)
            if s is not None:
                scalars[key] = s
                if self._writer is not None:
                    self._writer.add_scalar(key, s, step)
            elif histogram and self._writer is not None and value is not None:
                arr = np.asarray(value, dtype=np.float64).ravel()
                if arr.size:
                    self._writer.add_histogram(key, arr, step)
        if self._jsonl is not None:
            row = {"step": step, "time": round(time.time() - self._t0, 3)}
            row.update({k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()})
            self._jsonl.write(json.dumps(row, sort_keys=True) + "\n")
            self._jsonl.flush()
        if self._bar is not None:
            shown = {k.split("/")[-1]: f"{scalars[k]:.3g}" for k in ("rollout/reward_mean", "train/loss")
                     if k in scalars}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(0, step + 1 - self._bar.n))

    def record_trained(self, step: int, prompt_ids: list[int]) -> None:
        """Append which prompts step `step` trained on (`trained_prompts.jsonl`): the ledger that
        shows no prompt is lost or trained twice across a kill and resume."""
        if self._ledger is not None:
            self._ledger.write(json.dumps({"step": step, "prompt_ids": [int(u) for u in prompt_ids]}) + "\n")
            self._ledger.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
        for fh in (self._jsonl, self._ledger):
            if fh is not None:
                fh.close()
        self._bar = self._writer = self._jsonl = self._ledger = None
