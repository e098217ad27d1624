"""Preemption: SIGTERM to `darl-train` makes the learners checkpoint and stop; a resumed run
continues from that checkpoint and every step is trained exactly once across both runs."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.e2e import DarlRun, base_config, new_run, write_config


@pytest.mark.timeout(300)
def test_sigterm_checkpoints_then_resume_continues(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "preempt", algo={"max_head_offpolicyness": 1}, train={"steps": 60})
    try:
        run.start()
        run.wait_for(lambda: len(run.ledger()) >= 2, 150, "two trained steps")
        os.kill(run.proc.pid, signal.SIGTERM)  # what Slurm sends before preempting a job
        code = run.wait(120)
        out = run.output()
        assert code == 0, out[-3000:]
        assert "preempted" in out, out[-3000:]
        done = len(run.ledger())
        assert 2 <= done < 60
        ckpt_dir = os.path.join(run.run_dir, "checkpoints")
        assert os.path.isdir(ckpt_dir), f"stopped after {done} steps without a checkpoint:\n{out[-3000:]}"
        ckpts = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") and not d.endswith(".json"))
        assert ckpts[-1] == f"step_{done:08d}", (ckpts, done)  # the final checkpoint is the last step done
    finally:
        run.kill()
    cfg = base_config(run.run_dir, os.path.join(run.run_dir, "model"), algo={"max_head_offpolicyness": 1},
                      train={"steps": done + 2}, checkpoint={"every_steps": 0, "resume": "auto"})
    again = DarlRun(write_config(os.path.join(run.run_dir, "resume.yaml"), cfg), run.run_dir,
                    str(tmp_path / "resume.out"))
    try:
        again.start()
        assert again.wait(180) == 0, again.output()[-3000:]
        steps = [row["step"] for row in again.ledger()]
        assert steps == list(range(done + 2))
        ids = [u for row in again.ledger() for u in row["prompt_ids"]]
        assert len(ids) == len(set(ids))
    finally:
        again.kill()
