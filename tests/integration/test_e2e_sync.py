"""`algo.max_head_offpolicyness=0` with selection off is a synchronous run, exactly.

Two real `darl-train` runs (embedded engine, rollout manager, one learner rank) with the same
seed: every step trains only on tokens sampled by the weights of that very step (staleness 0),
and the two runs give bit-identical `train/loss` and `train/grad_norm` at every step, which are
not all zero (rewards vary within groups after the warm start, so the comparison can fail).
A synchronous reference loop made of the same pieces in-process (`sync_reference.py`: engine,
workflow, scorer, store, learner; generate, then train, then load the weights) trains the same
prompts with the same losses and gradient norms.
"""

from __future__ import annotations

import pytest

from megatron_darl.channel.ports import free_port
from megatron_darl.config import load_config
from tests.helpers.e2e import assert_nothing_left, new_run
from tests.helpers.sync_reference import reference_losses

SYNC = {"algo": {"max_head_offpolicyness": 0, "replay": False, "sg": False, "pmis": False, "policy_loss": "ppo",
                 "old_logprob": "proximal", "ppo_n_minibatches": 2}}


@pytest.mark.timeout(300)
def test_eta0_is_synchronous_and_reproducible(tmp_path, warm_model, monkeypatch):
    runs = [new_run(tmp_path, warm_model, f"sync{i}", **SYNC) for i in range(2)]
    try:
        for r in runs:  # concurrently: the result must not depend on timing
            r.start()
        for r in runs:
            assert r.wait(200) == 0, r.output()[-4000:]
    finally:
        for r in runs:
            r.kill()
    steps = 4
    rows = [{m["step"]: m for m in r.metrics()} for r in runs]
    for per_step in rows:
        assert sorted(per_step) == list(range(steps))
        for step, m in per_step.items():
            # trajectory version = the oldest token's version; no version above `step` exists yet
            # when step `step` trains, so staleness 0 means every token was sampled by v=step
            assert m["algo/staleness/batch/max"] == 0.0, (step, m["algo/staleness/batch/max"])
            assert m["algo/staleness/batch/0"] == 1.0
            assert m["train/version"] == step + 1
            # fp32 engine and learner at the same version: every token compared, agreeing to numerics
            assert m["algo/mismatch_tokens_frac"] == 1.0
            assert m["algo/mismatch_abs_max"] < 1e-5 and m["algo/mismatch_kl"] < 1e-10, (step, m)
            assert m["algo/mismatch_clip_frac"] == 0.0
    for step in range(steps):
        a, b = rows[0][step], rows[1][step]
        assert a["train/loss"] == b["train/loss"], (step, a["train/loss"], b["train/loss"])
        assert a["train/grad_norm"] == b["train/grad_norm"], (step, a["train/grad_norm"], b["train/grad_norm"])
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
    assert any(rows[0][s]["train/grad_norm"] > 0 for s in range(steps)), "all-zero gradients prove nothing"
    assert runs[0].ledger() == runs[1].ledger()
    for r in runs:
        assert_nothing_left(r, r.run_info()["run_id"])

    # (c) the same losses as a loop that generates, then trains, with nothing overlapping
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)  # the in-process learner's world of one, undone after the test
    ref = reference_losses(load_config(runs[0].config), steps, str(tmp_path))
    assert [r["prompt_ids"] for r in ref] == [r["prompt_ids"] for r in runs[0].ledger()]
    for r in ref:
        m = rows[0][r["step"]]
        assert r["train/loss"] == m["train/loss"], (r, m["train/loss"])
        assert r["train/grad_norm"] == m["train/grad_norm"], (r, m["train/grad_norm"])
