"""`algo.pmis_beta=balance` end to end: a real `darl-train` run (embedded engine, replay window
K=2, staleness 1, selection admitting stale groups) trains batches that mix behavior versions
with exact kept snapshots, says so at start, and flags every step's weights as exact."""

from __future__ import annotations

import pytest

from tests.helpers.e2e import assert_nothing_left, new_run

BALANCE = {"algo": {"max_head_offpolicyness": 1, "replay": True, "k": 2, "sg": True, "sg_quantile": 1.0, "warmup": 0,
                    "pmis": True, "pmis_beta": "balance", "balance_snapshots": "exact", "policy_loss": "darl",
                    "ppo_n_minibatches": 2}}


@pytest.mark.timeout(300)
def test_balance_run_finishes_with_exact_snapshots(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "balance", **BALANCE)
    run.run_to_end(200)
    assert "algo.balance_snapshots=exact -> exact" in run.output()
    per_step = {m["step"]: m for m in run.metrics()}
    assert sorted(per_step) == [0, 1, 2, 3]
    for step, m in per_step.items():
        assert m["algo/balance_exact"] == 1.0 and m["algo/balance_interpolated"] == 0.0, (step, m)
        assert m["train/loss"] == m["train/loss"]  # not NaN
    assert any(m["train/grad_norm"] > 0 for m in per_step.values())
    # selection admits stale groups (quantile 1, no warmup): some step mixes two kept versions
    assert any(sum(k.startswith("algo/beta/v") for k in m) >= 2 for m in per_step.values()), per_step
    assert_nothing_left(run, run.run_info()["run_id"])
