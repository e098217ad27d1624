"""Run checkpoints that resume losslessly: learner state, replay state and the rollout side's.

What it is: `RunCheckpointer`. A checkpoint of step t is a learner checkpoint folder
`<dir>/step_{t:08d}` (model, optimizer, scheduler, RNG via `dist_checkpointing`, written to a
temporary folder and renamed: the rename is the commit point) whose extra state holds the
replay feed (store + records received), and a sidecar `<dir>/step_{t:08d}.rollout.json` with
the rollout manager's state (prompt loader position, prompts in flight) taken at the same
instant. The instant is made consistent by a handshake: the learner asks the manager to save
its state, the manager answers with the number of groups it has written so far, and the learner
takes exactly that many groups' records from the ring before saving. Every prompt then is
either in the replay state (generated) or in the manager's state (to generate again), never
both and never neither, whatever moment the run is killed at.
What it is not: the learner's own checkpoint format (`learner/checkpoint.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Any, Callable

from megatron_darl.rollout.weight_notice import read_json, read_status

STEP_DIR = re.compile(r"^step_(\d{8})$")


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The newest complete checkpoint folder (a sidecar alone is not a checkpoint)."""
    if not os.path.isdir(ckpt_dir):
        return None
    steps = sorted(int(m.group(1)) for d in os.listdir(ckpt_dir) if (m := STEP_DIR.match(d)))
    return os.path.join(ckpt_dir, f"step_{steps[-1]:08d}") if steps else None


def resolve_resume(resume: str, ckpt_dir: str) -> str | None:
    """`checkpoint.resume` -> a checkpoint folder or None (fresh start)."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(ckpt_dir)
    if not os.path.isdir(resume):
        raise FileNotFoundError(f"checkpoint.resume={resume!r}: no such checkpoint folder")
    return resume


def rollout_sidecar(ckpt: str) -> str:
    return ckpt.rstrip("/") + ".rollout.json"


class RunCheckpointer:
    def __init__(self, learner: Any, feed: Any, publisher: Any, ckpt_dir: str, status_path: str,
                 group_size: int, keep_last: int, alive: Callable[[], None]):
        self.learner, self.feed, self.publisher = learner, feed, publisher
        self.dir, self.status_path, self.group_size = ckpt_dir, status_path, group_size
        self.keep_last, self.alive = keep_last, alive

    def resume(self, path: str | None) -> int:
        """Load `path` (if any) and return the step to continue from."""
        if path is None:
            return 0
        extra = self.learner.load(path)
        if self.learner.is_main:
            self.feed.load_state_dict(extra["feed"])
        return int(extra["step"])

    def save(self, step: int, timeout_s: float = 600.0) -> str:
        """Checkpoint after `step` steps (collective: every learner rank calls it)."""
        path = os.path.join(self.dir, f"step_{step:08d}")
        extra: dict[str, Any] = {"step": step}
        if self.learner.is_main:
            os.makedirs(self.dir, exist_ok=True)
            sidecar = rollout_sidecar(path)
            state = self._rollout_state(sidecar, timeout_s)
            self.feed.drain_to(written_groups(state) * self.group_size, step, self.alive, timeout_s)
            extra["feed"] = self.feed.state_dict()
        self.learner.save(path, extra)
        if self.learner.is_main:
            self._prune()
        return path

    def _rollout_state(self, sidecar: str, timeout_s: float) -> dict:
        """Ask the manager to write its state to `sidecar`; wait for its answer."""
        request = sidecar + f".{time.time_ns()}"  # a new path is a new request
        self.publisher.notify(state_request=request)
        t0 = time.monotonic()
        while True:
            status = read_status(self.status_path)
            if status is not None and status.error:  # it stopped: no answer will come
                raise RuntimeError(f"the rollout manager failed, no rollout state for {sidecar}: {status.error}")
            if status is not None and status.state_path == request and os.path.isfile(request):
                break
            self.alive()
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the rollout manager did not save its state within {timeout_s} s")
            time.sleep(0.05)
        state = read_json(request)
        written_groups(state)  # validates before the sidecar becomes part of a checkpoint
        os.replace(request, sidecar)
        return state

    def _prune(self) -> None:
        steps = sorted(int(m.group(1)) for d in os.listdir(self.dir) if (m := STEP_DIR.match(d)))
        for s in steps[: -self.keep_last]:
            old = os.path.join(self.dir, f"step_{s:08d}")
            shutil.rmtree(old, ignore_errors=True)
            if os.path.exists(rollout_sidecar(old)):
                os.unlink(rollout_sidecar(old))


def written_groups(state: dict) -> int:
    """Groups the manager had written to the ring when it saved `state`."""
    try:
        return int(state["counters"]["groups_written"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("rollout state lacks counters.groups_written") from None


def load_rollout_state(ckpt: str | None) -> dict | None:
    """The manager's saved state of a checkpoint, for the launcher to hand to a new manager."""
    if ckpt is None:
        return None
    side = rollout_sidecar(ckpt)
    if not os.path.isfile(side):
        raise FileNotFoundError(f"{ckpt}: checkpoint has no rollout state {side}")
    with open(side, encoding="utf-8") as fh:
        return json.load(fh)
