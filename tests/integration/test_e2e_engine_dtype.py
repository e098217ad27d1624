"""A real `darl-train` run with a bfloat16 darl-engine (`rollout.engine_dtype=bfloat16`) beside
the fp32 learner: it finishes, and the engine-learner mismatch it logs (`algo/mismatch_*`,
synchronous, so every token is compared at its own version) is visible where the fp32 engine's
is ~1e-7 (`test_e2e_sync.py`), and bounded."""

from __future__ import annotations

import pytest

from tests.helpers.e2e import assert_nothing_left, new_run

SYNC = {"algo": {"max_head_offpolicyness": 0, "replay": False, "sg": False, "pmis": False, "policy_loss": "ppo",
                 "old_logprob": "proximal", "ppo_n_minibatches": 2}}


@pytest.mark.timeout(300)
def test_bf16_engine_runs_and_its_mismatch_is_logged(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "bf16", rollout={"engine_dtype": "bfloat16"}, **SYNC)
    try:
        run.start()
        assert run.wait(200) == 0, run.output()[-4000:]
    finally:
        run.kill()
    rows = {m["step"]: m for m in run.metrics()}
    assert sorted(rows) == list(range(4))
    for step, m in rows.items():
        assert m["algo/mismatch_tokens_frac"] == 1.0, (step, m)
        assert 1e-4 < m["algo/mismatch_abs_mean"] < 0.5, (step, m["algo/mismatch_abs_mean"])
        assert m["algo/mismatch_kl"] > 0
    assert_nothing_left(run, run.run_info()["run_id"])
