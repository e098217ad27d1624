"""SIGTERM (Slurm's preemption) to `darl-train` in each state that is not a train step: during
the warm start, while the engines start, during the evaluation before training and the one
after it, and while a checkpoint is being saved. Each ends cleanly with exit 0 and leaves
nothing half-written (no `*.tmp*` model or checkpoint folder), nothing running (no process, no
shared memory) and no traceback but Python's KeyboardInterrupt of a child the launcher stopped
while it was still importing its modules. What each state adds:
- before any train step (warm start, engine start, evaluation before RL): the launcher stops at
  once and says that nothing was checkpointed; a warm start keeps the model it had;
- the evaluation after training is skipped, the exported policy named;
- a save that the signal lands in completes, and the run stops at the next step boundary with
  a checkpoint of its last step.
Mid-training and waiting for data are tests/integration/test_e2e_preempt.py and
tests/faults/test_launch.py."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import time

import pytest

from tests.helpers.e2e import DarlRun, assert_nothing_left, new_run

EVAL = {"data": {"eval_size": 400}, "eval": {"num_problems": 400}}
STATES = {
    # state: (config sections, the launcher line that marks the state, what the output then says)
    "warm_start": ({"model": {"hf_dir": "builtin:tiny-qwen3", "tokenizer": "builtin:demo"},
                    "demo": {"sft_steps": 20000}}, "warm start of the built-in model",
                   "stopped: SIGTERM before training started"),
    "engine_start": ({}, "[launcher] starting engines", "stopped: SIGTERM before training started"),
    "evaluation_before": (EVAL, "evaluating held-out accuracy before RL", "stopped: SIGTERM before training started"),
    # the engines are held (SIGSTOP) once the learners are done, so the evaluation after RL cannot
    # finish before the SIGTERM lands: timing alone lost that race twice in CI
    "evaluation_after": ({**EVAL, "train": {"steps": 2}}, "evaluating held-out accuracy after RL",
                         "evaluation after RL skipped (SIGTERM during the evaluation after training)"),
}


def _half_written(run_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "model.tmp*"))
                  + glob.glob(os.path.join(run_dir, "checkpoints", "*.tmp"))
                  + glob.glob(os.path.join(run_dir, "checkpoints", "*.old")))


def _unexpected_tracebacks(out: str) -> list[str]:
    """Tracebacks other than a child's KeyboardInterrupt: the launcher stops its children with
    SIGINT, and one stopped while Python is still importing its modules prints that traceback
    (its `[role]` prefix on every line); anything else, or any traceback of the launcher, is bad."""
    parts = out.split("Traceback (most recent call last):")
    bad = []
    for before, block in zip(parts[:-1], parts[1:]):
        prefix = before.rsplit("\n", 1)[-1].strip()
        if not prefix.startswith("[") or f"{prefix} KeyboardInterrupt" not in block:
            bad.append(f"{prefix or '(launcher)'}: {block[:1500]}")
    return bad


def _term_and_wait(run: DarlRun) -> tuple[int, str]:
    os.kill(run.proc.pid, signal.SIGTERM)
    code = run.wait(180)
    return code, run.output()


def _engine_pids(out: str) -> list[int]:
    """The engines the host started ("engine 0 (generation 0) starting at URL, pid N, log ...")."""
    return [int(p) for p in re.findall(r"engine \d+ \(generation \d+\) starting at \S+, pid (\d+),", out)]


def _hold_engines_after_training(run: DarlRun) -> list[int]:
    """SIGSTOP the engines once the learners wrote their summary (nothing on the learner side
    talks to an engine after that), so the evaluation after RL waits on them until released."""
    run.wait_for(lambda: os.path.isfile(os.path.join(run.run_dir, "learner_summary.json")), 300,
                 "the learners' summary")
    pids = _engine_pids(run.output())
    assert pids, run.output()[-3000:]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def _term_held_and_wait(run: DarlRun, held: list[int], says: str) -> tuple[int, str]:
    """SIGTERM while the engines are held; release them once the launcher said what it skipped."""
    os.kill(run.proc.pid, signal.SIGTERM)
    try:
        run.wait_for(lambda: says in run.output(), 120, repr(says))
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):  # an engine the launcher already stopped
                os.kill(pid, signal.SIGCONT)
    code = run.wait(180)
    return code, run.output()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("state", sorted(STATES))
def test_sigterm_outside_a_train_step_ends_cleanly(tmp_path, warm_model, state):
    sections, marker, says = STATES[state]
    run = new_run(tmp_path, warm_model, state, **sections)
    model_before = os.path.getmtime(os.path.join(run.run_dir, "model", "model.safetensors"))
    try:
        run.start()
        held = _hold_engines_after_training(run) if state == "evaluation_after" else []
        run.wait_for(lambda: marker in run.output(), 300, f"the launcher's line {marker!r}")
        if state == "warm_start":
            time.sleep(2.0)  # into the supervised steps
        run_id = run.run_info()["run_id"] if os.path.isfile(os.path.join(run.run_dir, "run_info.json")) else None
        code, out = _term_held_and_wait(run, held, says) if held else _term_and_wait(run)
        assert code == 0, out[-4000:]
        assert says in out, out[-4000:]
        assert _unexpected_tracebacks(out) == [], out[-4000:]
        assert _half_written(run.run_dir) == []
        if state == "warm_start":  # the cached model is the one it had, whole
            assert os.path.getmtime(os.path.join(run.run_dir, "model", "model.safetensors")) == model_before
        if state == "evaluation_after":  # the exported policy is whole
            assert glob.glob(os.path.join(run.run_dir, "final_model", "*.safetensors")), out[-3000:]
        assert_nothing_left(run, run_id or "no-run-id")  # the warm start runs before the run has an id
    finally:
        run.kill()


@pytest.mark.timeout(420)
def test_sigterm_during_a_checkpoint_save_completes_it_and_stops_at_the_next_step(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "save", algo={"max_head_offpolicyness": 1}, train={"steps": 400},
                  checkpoint={"every_steps": 1})
    ckpts = os.path.join(run.run_dir, "checkpoints")
    try:
        run.start()
        # the first save in progress: its folder is step_N.tmp until it is complete
        run.wait_for(lambda: glob.glob(os.path.join(ckpts, "step_*.tmp")), 300, "a checkpoint being saved")
        run_id = run.run_info()["run_id"]
        code, out = _term_and_wait(run)
        assert code == 0 and "preempted" in out, out[-4000:]
        assert _half_written(run.run_dir) == []
        done = len(run.ledger())
        saved = sorted(d for d in os.listdir(ckpts) if d.startswith("step_") and not d.endswith(".json"))
        assert 1 <= done < 400 and saved[-1] == f"step_{done:08d}", (saved, done)  # the last step done is saved
        assert_nothing_left(run, run_id)
    finally:
        run.kill()
