"""A real `darl-train` run with a bfloat16 darl-engine (`rollout.engine_dtype=bfloat16`) beside
the fp32 learner: it finishes, and the engine-learner mismatch it logs (`algo/mismatch_*`,
synchronous, so every token is compared at its own version) is visible where the fp32 engine's
is ~1e-7 (`test_e2e_sync.py`), and bounded; and an async run with `learner.mismatch_every=1`
logs it on every token of every step, where without it the tokens of the previous version are
not compared."""

from __future__ import annotations

import pytest

from tests.helpers.e2e import assert_nothing_left, new_run

SYNC = {"algo": {"max_head_offpolicyness": 0, "replay": False, "sg": False, "pmis": False, "policy_loss": "ppo",
                 "old_logprob": "proximal", "ppo_n_minibatches": 2}}
# naive async PPO, generation one version ahead of a learner paced to >= 0.5 s a step
ASYNC = {"algo": {**SYNC["algo"], "max_head_offpolicyness": 1, "old_logprob": "behavior"}, "demo": {"min_step_s": 0.5}}


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


def _bf16_run(tmp_path, warm_model, name, **sections) -> dict[int, dict]:
    run = new_run(tmp_path, warm_model, name, rollout={"engine_dtype": "bfloat16"}, **sections)
    try:
        run.start()
        assert run.wait(200) == 0, run.output()[-4000:]
    finally:
        run.kill()
    assert_nothing_left(run, run.run_info()["run_id"])
    return {m["step"]: m for m in run.metrics()}


@pytest.mark.timeout(400)
def test_async_run_measures_the_mismatch_of_every_token_with_kept_versions(tmp_path, warm_model):
    measured = _bf16_run(tmp_path, warm_model, "every1", learner={"mismatch_every": 1}, **ASYNC)
    assert sorted(measured) == list(range(4))
    for step, m in measured.items():
        assert m["algo/mismatch_tokens_frac"] == 1.0, (step, m)  # the previous version's tokens too
        assert 1e-4 < m["algo/mismatch_abs_mean"] < 0.5 and m["algo/mismatch_kl"] > 0, (step, m)
    # without it only the tokens of the current version are compared: in this run, not all of them
    plain = _bf16_run(tmp_path, warm_model, "every0", **ASYNC)
    assert min(m["algo/mismatch_tokens_frac"] for m in plain.values()) < 1.0, plain
