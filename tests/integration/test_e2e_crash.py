"""A crash of any child stops the whole run, names it, and leaves nothing behind.

A real `darl-train` run whose rollout manager is killed with SIGKILL mid-run: the launcher must
exit non-zero with an error naming the process (`rollout`) and its signal, and afterwards no
process names the run folder or remains in a process group the run had (reward workers, engines
the manager restarted), and no `/dev/shm/darl-<run_id>-*` segment remains. (An engine that
exits is tolerated by design: the rollout manager restarts it; its own tests cover that.)
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.e2e import assert_nothing_left, group_members, new_run, role_pid, run_groups


@pytest.mark.slow  # a whole darl-train run
@pytest.mark.timeout(180)
def test_rollout_manager_crash_stops_everything(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "crash", algo={"max_head_offpolicyness": 1},
                  train={"steps": 50})
    try:
        run.start()
        run.wait_for(lambda: len(run.ledger()) >= 1, 120, "a trained step")
        run_id = run.run_info()["run_id"]
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"darl-{run_id}-")], "no shared memory in use?"
        groups = run_groups(run)
        assert len(group_members(groups)) >= 4  # launcher, engine, rollout manager, learner
        os.kill(role_pid(run.run_dir, "megatron_darl.rollout"), signal.SIGKILL)
        code = run.wait(60)
        out = run.output()
        assert code != 0, out[-3000:]
        assert "process 'rollout' stopped with signal SIGKILL" in out, out[-3000:]
        assert len(run.ledger()) < 50
        assert_nothing_left(run, run_id, groups)
    finally:
        run.kill()
