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
A save that fails (folder not writable, disk full, the manager's own write failing) raises
`CheckpointError` with that cause at once and removes its partial files (`step_N.tmp`, the
sidecar, the manager's answer); the previous checkpoints stay intact.
What it is not: the learner's own checkpoint format (`learner/checkpoint.py`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any, Callable

from megatron_darl.channel.json_files import read_json, write_json_atomic
from megatron_darl.channel.weight_notice import RolloutStatus

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


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written, with the real cause (folder not writable, no space
    left on the device, the rollout manager's own error) in the message."""


SAVE_TIME = "save_time.json"  # in the checkpoint folder: how long the newest save took


class RunCheckpointer:
    """`save_budget_s`: the time a save must fit in (Slurm's warning before the time limit,
    `launch.signal_before_s`); a save, or a recorded one at resume, that does not fit says so."""

    def __init__(self, learner: Any, feed: Any, publisher: Any, ckpt_dir: str, status_path: str,
                 group_size: int, keep_last: int, alive: Callable[[], None], save_budget_s: float | None = None):
        self.learner, self.feed, self.publisher = learner, feed, publisher
        self.dir, self.status_path, self.group_size = ckpt_dir, status_path, group_size
        self.keep_last, self.alive, self.save_budget_s = keep_last, alive, save_budget_s

    def resume(self, path: str | None) -> int:
        """Load `path` (if any) and return the step to continue from."""
        if self.learner.is_main:
            recorded = read_json(os.path.join(self.dir, SAVE_TIME)) if os.path.isdir(self.dir) else None
            if isinstance(recorded, dict) and isinstance(recorded.get("seconds"), (int, float)):
                self._check_fits(int(recorded.get("step", 0)), float(recorded["seconds"]))
        if path is None:
            return 0
        extra = self.learner.load(path)
        if self.learner.is_main:
            self.feed.load_state_dict(extra["feed"])
        return int(extra["step"])

    def save(self, step: int, timeout_s: float = 600.0) -> str:
        """Checkpoint after `step` steps (collective: every learner rank calls it). A failure on
        the main rank raises `CheckpointError` naming its cause and leaves no partial files."""
        path = os.path.join(self.dir, f"step_{step:08d}")
        extra: dict[str, Any] = {"step": step}
        t0 = time.monotonic()
        try:
            if self.learner.is_main:
                remove_leftovers(self.dir)  # of a save that was killed midway
                problem = writable_problem(self.dir, "checkpoint folder")
                if problem:  # before the manager is asked to write there
                    raise CheckpointError(problem)
                state = self._rollout_state(rollout_sidecar(path), timeout_s)
                self.feed.drain_to(written_groups(state) * self.group_size, step, self.alive, timeout_s)
                extra["feed"] = self.feed.state_dict()
            self.learner.save(path, extra)
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            if not self.learner.is_main:
                raise
            free = _free_bytes(self.dir)  # before the cleanup frees what the failed save wrote
            remove_leftovers(self.dir)
            if isinstance(exc, (CheckpointError, KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(_explain_failure(path, exc, free)) from exc
        if self.learner.is_main:
            self._prune()
            seconds = time.monotonic() - t0
            write_json_atomic(os.path.join(self.dir, SAVE_TIME), {"step": step, "seconds": round(seconds, 3)})
            self._check_fits(step, seconds)
        return path

    def _check_fits(self, step: int, seconds: float) -> None:
        if self.save_budget_s is not None and seconds > self.save_budget_s:
            print(f"darl-train: WARNING: the checkpoint of step {step} took {seconds:.0f} s, more than "
                  f"launch.signal_before_s={self.save_budget_s:.0f} s: a save started at Slurm's warning "
                  f"before the time limit (after the step in progress) would be killed; raise "
                  f"launch.signal_before_s to at least {2 * seconds:.0f} s", flush=True)

    def _rollout_state(self, sidecar: str, timeout_s: float) -> dict:
        """Ask the manager to write its state to `sidecar`; wait for its answer, or its error."""
        request = sidecar + f".{time.time_ns()}"  # a new path is a new request
        self.publisher.notify(state_request=request)
        t0 = time.monotonic()
        while True:
            raw = read_json(self.status_path)
            status = RolloutStatus.from_json(raw, self.status_path) if raw is not None else None
            if status is not None and status.state_path == request and os.path.isfile(request):
                break
            if status is not None and status.error:  # the manager stopped (e.g. its write failed): no answer comes
                raise CheckpointError(f"the rollout manager could not save its state to {request}: {status.error}")
            self.alive()
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the rollout manager did not save its state within {timeout_s} s "
                                   f"(asked for {request}; no error reported in {self.status_path})")
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


LEFTOVER = re.compile(r"^step_(\d{8})(\.tmp|\.old|\.rollout\.json|\.rollout\.json\.\d+)$")
LOW_SPACE = 64 << 20  # bytes: a write that fails with less free than this failed for want of space
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def remove_leftovers(ckpt_dir: str) -> list[str]:
    """Remove what an interrupted save leaves: `step_N.tmp` / `step_N.old` folders, the manager's
    answered requests (`step_N.rollout.json.<ns>`) and sidecars without their checkpoint folder.
    Complete checkpoints (`step_N` with its sidecar) are kept."""
    if not os.path.isdir(ckpt_dir):
        return []
    removed = []
    for name in os.listdir(ckpt_dir):
        m = LEFTOVER.match(name)
        if m is None:
            continue
        if m.group(2) == ".rollout.json" and os.path.isdir(os.path.join(ckpt_dir, f"step_{m.group(1)}")):
            continue  # the sidecar of a complete checkpoint
        path = os.path.join(ckpt_dir, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
        removed.append(path)
    return removed


def writable_problem(folder: str, what: str, create: bool = True) -> str | None:
    """Why `folder` cannot take a file, or None. A probe file is written and removed: permission
    bits do not bind root, a read-only mount or a full disk still do. Without `create`, a folder
    that does not exist yet is judged by its nearest existing parent (nothing is left behind)."""
    target = os.path.abspath(folder)
    try:
        if create:
            os.makedirs(target, exist_ok=True)
        while not os.path.exists(target):
            target = os.path.dirname(target)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=target)
        try:
            os.write(fd, b"0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        via = "" if target == os.path.abspath(folder) else f" (its parent {target})"
        if exc.errno in _NO_SPACE:
            return f"no space left on device for the {what} {folder}{via}: {type(exc).__name__}: {exc}"
        return f"{what} {folder} is not writable{via}: {type(exc).__name__}: {exc}"
    return None


def _free_bytes(folder: str) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _explain_failure(path: str, exc: BaseException, free: int | None) -> str:
    """The cause of a failed save in words: a full disk often surfaces as an error without its
    errno (torch's writer reports `unexpected pos ...`), so the free space decides too."""
    codes = set()
    e: BaseException | None = exc
    while e is not None:
        codes.add(getattr(e, "errno", None))
        e = e.__cause__ or e.__context__
    lines = [line for line in str(exc).splitlines() if line.strip()]
    cause = f"{type(exc).__name__}: {lines[-1].strip() if lines else repr(exc)}"  # a worker's error: its last line
    where = f"{free} bytes free on its filesystem" if free is not None else "free space unknown"
    if codes & set(_NO_SPACE) or (free is not None and free < LOW_SPACE):
        return f"no space left on device writing checkpoint {path} ({where}): {cause}"
    if codes & set(_NOT_WRITABLE):
        return f"checkpoint folder {os.path.dirname(path)} is not writable (writing {os.path.basename(path)}): {cause}"
    return f"checkpoint {path} was not saved: {cause}"


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
