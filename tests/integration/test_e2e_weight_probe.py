"""A real `darl-train` run with the weight probe on (`rollout.probe_tokens=256`): the fp32
darl-engine serves exactly the learner's weights, so every version passes silently (max |delta|
under 1e-4, no failure), the figures reach metrics.jsonl as `rollout/probe_*`, and the probe's
time (the learner's forward, `perf/probe_learner_s`, and one engine's check, `rollout/probe_s`)
is printed against the step's (`perf/step_s`), the cost the issue bounds. Wrong weights:
tests/faults/test_weight_probe.py (real engines) and tests/unit/rollout/test_probe_link.py."""

from __future__ import annotations

import statistics

import pytest

from tests.helpers.e2e import assert_nothing_left, new_run


@pytest.mark.timeout(300)
def test_the_exact_fp32_case_stays_silent_and_the_probe_is_cheap(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "probe", rollout={"probe_tokens": 256})
    try:
        run.start()
        assert run.wait(200) == 0, run.output()[-4000:]
    finally:
        run.kill()
    rows = sorted(run.metrics(), key=lambda m: m["step"])
    assert rows, run.output()[-4000:]
    checked = [m for m in rows if "rollout/probe_max_abs" in m]
    assert checked, rows[-1]
    for m in checked:
        assert m["rollout/probe_max_abs"] < 1e-4 and m["rollout/probe_failures"] == 0, m
    assert rows[-1]["rollout/probe_checks"] >= 1
    steady = rows[1:] or rows  # step 0 pays the warm-up of everything
    med = lambda k: statistics.median(m.get(k, 0.0) for m in steady)  # noqa: E731
    step_s, learner_s, engine_s = med("perf/step_s"), med("perf/probe_learner_s"), med("rollout/probe_s")
    print(f"probe cost per version (median of steps 1..): learner forward {learner_s * 1e3:.1f} ms "
          f"({learner_s / step_s:.1%} of a {step_s:.3f} s step), engine check {engine_s * 1e3:.1f} ms "
          f"({engine_s / step_s:.1%}, inside the weight update); a shared 2-core machine")
    assert_nothing_left(run, run.run_info()["run_id"])
