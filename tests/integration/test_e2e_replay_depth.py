"""D-ARL's replay window in a real `darl-train` run (embedded engine, one learner rank) at
staleness eta = 2 with K = 4 and a 2-step warmup: every step, warmup included, trains a full
`train.batch_prompts` of groups (`train/batch_groups`), and after warmup some of each run's
batches are groups trained at an earlier step (`replay/reused_frac` > 0). With the earlier
window (K = max(2, eta)) nothing could be replayed at eta = 2: run with `algo.k=2`, this test
fails on its last check. The old warmup (newest version only) is not caught here: at batch 8 each
warmup step's candidates are of one version, so keeping the newest keeps all of them;
tests/unit/train/test_batching.py (`test_choose_groups_warmup_trains_a_full_batch`) pins that
rule with candidates of several versions. The unit simulations of the feed, gate and store are
in tests/unit/replay/test_consumption.py."""

from __future__ import annotations

import pytest

from tests.helpers.e2e import assert_nothing_left, new_run

BATCH = 8
WARMUP = 2
DEPTH = {"algo": {"max_head_offpolicyness": 2, "replay": True, "k": 4, "sg": True, "warmup": WARMUP, "pmis": True,
                  "policy_loss": "darl", "ppo_n_minibatches": 2},
         "train": {"steps": 10, "batch_prompts": BATCH}}


@pytest.mark.timeout(400)
def test_eta2_k4_trains_full_batches_and_replays(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "depth", **DEPTH)
    run.run_to_end(300)
    per_step = {m["step"]: m for m in run.metrics() if "train/batch_groups" in m}
    assert sorted(per_step) == list(range(10)), sorted(per_step)
    assert all(m["train/batch_groups"] == BATCH for m in per_step.values()), \
        {s: m["train/batch_groups"] for s, m in per_step.items()}
    reused = [per_step[s]["replay/reused_frac"] for s in sorted(per_step)]
    assert all(0.0 <= r <= 1.0 for r in reused) and reused[0] == 0.0, reused  # nothing to reuse at step 0
    assert sum(reused[WARMUP:]) > 0.0, reused
    assert_nothing_left(run, run.run_info()["run_id"])
