"""The weight probe through the manager: the notice's probe reaches every engine after the
version loads, the figures reach the status file (the learner's TensorBoard and metrics.jsonl
read it) as `rollout/probe_*`, and an engine that answers wrong twice for the same version stops
the run with the version, the engine and the figures in the status error. Fake engines whose
probe answers are the learner's (exact) or shifted (wrong weights); real engines:
tests/faults/test_weight_probe.py."""

from __future__ import annotations

import asyncio

import pytest

from megatron_darl.channel.weight_notice import WeightNotice, publish_notice, read_status
from megatron_darl.channel.weight_probe import WeightProbe
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.rollout.probe import ProbeFailed
from megatron_darl.types import WeightVersion
from tests.helpers.rollout_fakes import make

PROBE = WeightProbe(version=2, ids=[3, 1, 4, 1, 5], logprobs=[-1.0, -2.0, -0.5, -3.0])


def _answer(engine, shift: float):
    async def aprompt_logprobs(ids, timeout_s=None):
        assert ids == PROBE.ids
        engine.probed.append(engine.version)
        return [x + (shift if engine.version == PROBE.version else 0.0) for x in PROBE.logprobs]
    engine.probed = []
    engine.aprompt_logprobs = aprompt_logprobs


async def _await_status(path, pred):
    for _ in range(400):
        await asyncio.sleep(0.02)
        st = read_status(str(path))
        if st is not None and pred(st):
            return st
    raise AssertionError(f"status never matched: {read_status(str(path))}")


@pytest.mark.timeout(60)
def test_figures_reach_the_status_and_a_wrong_engine_stops_the_run_at_its_second_failure(tmp_path):
    notice, status = tmp_path / "notice.json", tmp_path / "status.json"
    cfg, engines, prompts, sink, wf = make(n_prompts=1000, step_s=0.003, probe_tokens=5)
    _answer(engines[0], 0.0)
    _answer(engines[1], 0.75)  # under bf16's default, far over fp32's 1e-3

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, notice_path=str(notice), status_path=str(status),
                             poll_interval_s=0.02, health_interval_s=0.05, restart_grace_s=0.0)
        run = asyncio.create_task(mgr.arun())
        await asyncio.sleep(0.05)
        publish_notice(str(notice), WeightNotice(WeightVersion(2, "disk", "/w/2"), probe=PROBE))
        st = await _await_status(status, lambda s: s.error is not None)
        with pytest.raises(ProbeFailed):
            await asyncio.wait_for(run, 10)
        return st

    st = asyncio.run(main())
    m = st.metrics
    assert m["rollout/probe_max_abs/engine0"] == 0.0 and m["rollout/probe_kl/engine0"] == 0.0
    assert m["rollout/probe_max_abs/engine1"] == pytest.approx(0.75)
    assert m["rollout/probe_max_abs"] == pytest.approx(0.75)  # the worst engine
    assert m["rollout/probe_failures"] == 2 and m["rollout/probe_checks"] >= 3
    assert "engine 1" in st.error and "version 2 twice" in st.error and "max_abs 0.75" in st.error, st.error
    assert engines[0].probed == [2] and engines[1].probed == [2, 2]  # at the push, then after its reload


@pytest.mark.timeout(60)
def test_no_probe_in_the_notice_checks_nothing(tmp_path):
    notice, status = tmp_path / "notice.json", tmp_path / "status.json"
    cfg, engines, prompts, sink, wf = make(n_prompts=1000, step_s=0.003, probe_tokens=5)
    for e in engines:
        _answer(e, 5.0)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, notice_path=str(notice), status_path=str(status),
                             poll_interval_s=0.02)
        run = asyncio.create_task(mgr.arun())
        publish_notice(str(notice), WeightNotice(WeightVersion(2, "disk", "/w/2")))  # an older learner's notice
        st = await _await_status(status, lambda s: s.version == 2)
        publish_notice(str(notice), WeightNotice(WeightVersion(2, "disk", "/w/2"), stop=True))
        await asyncio.wait_for(run, 10)
        return st

    st = asyncio.run(main())
    assert st.error is None and st.metrics["rollout/probe_checks"] == 0 and all(not e.probed for e in engines)
