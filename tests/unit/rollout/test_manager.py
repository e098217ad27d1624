"""Rollout manager against in-process fakes: uid accounting under engine kill and hang, partial
rollouts across versions, the staleness gate, the DAPO filter, the state round trip, notices, and
a request an engine refuses (a 4xx: the group is dropped, the engine stays up)."""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_darl.channel.json_files import read_json
from megatron_darl.channel.weight_notice import WeightNotice, publish_notice, read_status
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.rollout.sglang_client import EngineHTTPError
from megatron_darl.rollout.staleness import StalenessGate
from megatron_darl.types import WeightVersion
from tests.helpers.rollout_fakes import (
    FakeEngine,
    ParityScorer,
    ScriptedPrompt,
    check_groups,
    fake_token,
    make,
)


@pytest.mark.timeout(60)
def test_all_prompts_once_tokens_exact_and_load_spread():
    cfg, engines, prompts, sink, wf = make(n_prompts=12, n_engines=3)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, health_interval_s=0.05)
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    m = asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    check_groups(sink, cfg)
    for g in sink.groups:  # uninterrupted: one request per sample, tokens as the engine sampled them
        for i, t in enumerate(g):
            seed = wf.new_episode(ScriptedPrompt(t.prompt_id, list(t.prompt_ids))).samples[i].seed
            want = [fake_token(seed, len(t.prompt_ids) + k) for k in range(cfg.max_new_tokens)]
            assert t.response_ids.tolist() == want
            assert (t.behav_versions == 0).all()
            assert t.behav_logprobs.tolist() == pytest.approx([-0.01 * x for x in want])
    assert all(e.requests for e in engines), "least-loaded dispatch should use every engine"
    assert max(e.max_active for e in engines) <= cfg.max_concurrent_per_engine
    assert m["rollout/groups_written"] == 12 and m["rollout/samples_written"] == 48
    assert m["rollout/tokens_generated"] == 48 * cfg.max_new_tokens
    assert m["perf/samples_per_s"] > 0 and 0 <= m["perf/engine_idle_frac"] <= 1


@pytest.mark.timeout(60)
def test_partial_rollout_spans_two_versions_and_continues_from_partial():
    cfg, engines, prompts, sink, wf = make(n_prompts=4, n_engines=2, step_s=0.01, max_new_tokens=20)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink)
        await mgr.astart()
        await asyncio.sleep(0.08)  # some tokens under version 0
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr

    mgr = asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    check_groups(sink, cfg)
    trajs = [t for g in sink.groups for t in g]
    mixed = [t for t in trajs if set(t.behav_versions.tolist()) == {0, 1}]
    assert mixed, "a sample interrupted by the update must carry tokens of both versions"
    for t in mixed:  # old tokens first, then the new version; several requests contributed
        v = t.behav_versions.tolist()
        assert v == sorted(v) and t.metadata["segments"] >= 2
    conts = [r for e in engines for r in e.requests if r.sampling.max_new_tokens < cfg.max_new_tokens]
    assert conts
    for r in conts:  # continuation = prompt + partial response, remaining budget
        assert len(r.input_ids) - 3 + r.sampling.max_new_tokens == cfg.max_new_tokens
        assert r.input_ids[:2] == [5, 6]
    assert all(e.updates == [1] for e in engines) and mgr.version == 1
    m = mgr.metrics()
    assert m["rollout/aborted_requests"] >= 1 and m["rollout/weight_updates"] == 1


@pytest.mark.timeout(60)
def test_no_partial_rollout_restarts_under_new_weights():
    cfg, engines, prompts, sink, wf = make(n_prompts=4, step_s=0.01, max_new_tokens=20, partial_rollout=False)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink)
        await mgr.astart()
        await asyncio.sleep(0.08)
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    m = asyncio.run(main())
    check_groups(sink, cfg)
    trajs = [t for g in sink.groups for t in g]
    assert all(len(set(t.behav_versions.tolist())) == 1 for t in trajs)
    restarted = [t for t in trajs if t.metadata["restarts"] > 0]
    assert restarted and all((t.behav_versions == 1).all() for t in restarted)
    assert m["rollout/restarted_samples"] == len(restarted)


@pytest.mark.timeout(60)
def test_in_place_pause_keeps_requests_on_engine():
    cfg, engines, prompts, sink, wf = make(n_prompts=2, step_s=0.01, max_new_tokens=20, pause_mode="in_place")

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink)
        await mgr.astart()
        await asyncio.sleep(0.08)
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    m = asyncio.run(main())
    trajs = [t for g in sink.groups for t in g]
    assert m["rollout/aborted_requests"] == 0
    assert any(set(t.behav_versions.tolist()) == {0, 1} and t.metadata["segments"] == 1 for t in trajs)


def test_partial_rollout_false_needs_abort_mode():
    cfg, engines, prompts, sink, wf = make(partial_rollout=False, pause_mode="retract")
    with pytest.raises(ValueError, match="pause_mode=abort"):
        RolloutManager(cfg, engines, prompts, wf, sink)


class Restarter:
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.new: list[FakeEngine] = []

    async def arestart(self, index, engine):
        self.calls.append(index)
        fresh = FakeEngine(engine.url, engine.step_s)  # a new process: initial weights (version 0)
        self.new.append(fresh)
        return fresh


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["kill", "hang"])
def test_engine_failure_requeues_restarts_and_loses_nothing(failure):
    cfg, engines, prompts, sink, wf = make(n_prompts=40, n_engines=3, step_s=0.004, max_new_tokens=10,
                                            request_timeout_s=0.3)
    restarter = Restarter()

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, restarter=restarter,
                             health_interval_s=0.05, restart_grace_s=0.5)
        await mgr.astart()
        await asyncio.sleep(0.03)
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))
        for _ in range(200):  # the victim must have work in flight when it fails
            await asyncio.sleep(0.002)
            if engines[1].active > 0:
                break
        assert engines[1].active > 0
        setattr(engines[1], "dead" if failure == "kill" else "hang", True)
        for _ in range(400):  # down, restarted, weights pushed, back in service
            await asyncio.sleep(0.01)
            if mgr.metrics()["rollout/engine_recoveries"] >= 1:
                break
        await asyncio.wait_for(mgr.arun(), 40)
        return mgr.metrics()

    m = asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]  # every uid exactly once
    check_groups(sink, cfg)
    assert m["rollout/engine_failures"] >= 1 and m["rollout/requeued_requests"] >= 1
    assert restarter.calls and restarter.calls[0] == 1
    # the replacement came back with the current weights before taking requests
    assert restarter.new[0].updates == [1]
    assert all(r.input_ids for r in restarter.new[0].requests)
    assert all((t.behav_versions <= 1).all() for g in sink.groups for t in g)


@pytest.mark.timeout(60)
def test_engine_without_restarter_comes_back_via_health():
    cfg, engines, prompts, sink, wf = make(n_prompts=10, n_engines=2, step_s=0.004, request_timeout_s=0.5)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, health_interval_s=0.05)
        await mgr.astart()
        await asyncio.sleep(0.02)
        engines[0].dead = True
        await mgr.await_groups(3)
        assert mgr.metrics()["rollout/engines_up"] == 1
        engines[0].dead = False  # e.g. an SGLang server that recovered
        n_before = len(engines[0].requests)
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics(), n_before

    m, n_before = asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    assert m["rollout/engine_recoveries"] >= 1 and m["rollout/engines_up"] == 2
    assert len(engines[0].requests) > n_before, "the recovered engine takes requests again"


@pytest.mark.timeout(60)
def test_staleness_gate_bounds_generation_ahead_of_training():
    eta, batch = 1, 2
    gate = StalenessGate(eta, batch)
    cfg, engines, prompts, sink, wf = make(n_prompts=30)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, gate=gate)
        await mgr.astart()
        peak = 0
        for _ in range(40):  # version 0: at most (eta + 1) * batch groups may ever start
            await asyncio.sleep(0.01)
            peak = max(peak, gate.accepted + gate.running)
        assert peak == (eta + 1) * batch and len(sink.groups) == (eta + 1) * batch
        assert prompts.pos == (eta + 1) * batch, "no prompt is drawn before the gate admits it"
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))
        await mgr.await_groups((eta + 2) * batch)
        await asyncio.sleep(0.1)
        assert len(sink.groups) == (eta + 2) * batch
        await mgr.astop()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_dapo_filter_counts_and_frees_gate():
    gate = StalenessGate(0, 100)
    cfg, engines, prompts, sink, wf = make(n_prompts=12, filter_equal_rewards=True, gate=gate,
                                            scorer=ParityScorer(equal_every=3))

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, gate=gate)
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    m = asyncio.run(main())
    filtered = [p.uid for p in prompts.items if p.uid % 3 == 0]
    assert sorted(sink.uids) == [p.uid for p in prompts.items if p.uid % 3 != 0]
    assert m["rollout/filtered_groups"] == len(filtered) == 4
    assert gate.accepted == 8 and gate.rejected == 4 and gate.running == 0


@pytest.mark.timeout(60)
def test_scorer_failure_reruns_group_once():
    cfg, engines, prompts, sink, wf = make(n_prompts=6, scorer=ParityScorer(fail_once={101, 104}))

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink)
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    m = asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    assert m["rollout/episode_retries"] == 2
    reqs = sum(len(e.requests) for e in engines)
    assert reqs == 6 * cfg.group_size, "a re-scored group does not generate again"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["weight_sync", "kind"])  # kind: a state saved before the rename
def test_a_saved_states_weights_resume_under_either_name_and_nothing_else_loads(key):
    cfg, engines, prompts, sink, wf = make(n_prompts=3)
    weights = {"version": 2, key: "disk", "location": "/dead/run/v2", "num_bytes": 1}
    state = {"format": 1, "version": 2, "loader": {"pos": 0}, "episodes": [], "counters": {"groups_written": 5},
             "gate": None, "weights": weights}

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink)
        mgr.load_state_dict(state)
        run = asyncio.create_task(mgr.arun())
        await asyncio.sleep(0.05)
        assert not any(e.requests for e in engines), "no request before the version is published"
        await mgr.aupdate_weights(WeightVersion(2, "disk", "/w/2"))
        await asyncio.wait_for(run, 30)
        return mgr.metrics()

    assert asyncio.run(main())["rollout/groups_written"] == 5 + 3 and len(sink.groups) == 3
    assert all(e.updates == [2] for e in engines)
    mgr = RolloutManager(cfg, engines, prompts, wf, sink)
    with pytest.raises(ValueError, match=r"rollout state 'weights': bad weight version .*: 'weight_sync'"):
        mgr.load_state_dict({**state, "weights": {"version": 2, "location": "/w/2"}})


@pytest.mark.timeout(60)
def test_state_round_trip_resumes_partials_and_loses_nothing():
    cfg, engines, prompts, sink, wf = make(n_prompts=10, step_s=0.01, max_new_tokens=30)

    async def first():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink)
        await mgr.astart()
        await mgr.await_groups(2)
        await asyncio.sleep(0.05)  # the next groups are part-way
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))  # abort: partials kept
        await asyncio.sleep(0.03)  # continuations under version 1 are running
        await mgr.astop()
        return json.loads(json.dumps(mgr.state_dict()))  # must survive JSON

    state = asyncio.run(first())
    partial = {e["uid"]: [s["output_ids"] for s in e["samples"]] for e in state["episodes"]}
    assert state["episodes"] and any(any(p) for p in partial.values()), "partial tokens are in the state"
    assert state["version"] == 1 and state["loader"]["pos"] == len(sink.groups) + len(state["episodes"])
    assert state["weights"] == {"version": 1, "weight_sync": "disk", "location": "/w/1", "num_bytes": 0}

    cfg2, engines2, prompts2, sink2, wf2 = make(n_prompts=10, step_s=0.002, max_new_tokens=30)

    async def second():
        mgr = RolloutManager(cfg2, engines2, prompts2, wf2, sink2)
        mgr.load_state_dict(state)
        run = asyncio.create_task(mgr.arun())
        await asyncio.sleep(0.1)
        assert not any(e.requests for e in engines2), "nothing runs on the initial weights of a resumed run"
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))  # the resumed learner publishes v1 anew
        await asyncio.wait_for(run, 30)
        return mgr

    mgr2 = asyncio.run(second())
    assert all(e.updates == [1] for e in engines2), "the resumed version is pushed to the engines"
    assert sorted(sink.uids + sink2.uids) == [p.uid for p in prompts.items]
    assert sink2.uids[: len(partial)] == list(partial), "in-flight prompts are re-run first"
    for g in sink2.groups:
        for i, t in enumerate(g):
            prefix = partial.get(t.group_id, [[]] * cfg.group_size)[i]
            assert t.response_ids.tolist()[: len(prefix)] == prefix
            if prefix:
                assert set(t.behav_versions[: len(prefix)].tolist()) <= {0, 1}
    assert mgr2.metrics()["rollout/groups_written"] == 10


@pytest.mark.timeout(60)
def test_notice_file_drives_updates_state_requests_and_stop(tmp_path):
    notice, status, saved = tmp_path / "notice.json", tmp_path / "status.json", tmp_path / "state.json"
    cfg, engines, prompts, sink, wf = make(n_prompts=1000, step_s=0.003)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, notice_path=str(notice),
                             status_path=str(status), poll_interval_s=0.02)
        run = asyncio.create_task(mgr.arun())
        await asyncio.sleep(0.05)
        publish_notice(str(notice), WeightNotice(WeightVersion(3, "disk", "/w/3")))
        for _ in range(200):
            await asyncio.sleep(0.02)
            st = read_status(str(status))
            if st is not None and st.version == 3:
                break
        assert all(e.version == 3 for e in engines)
        publish_notice(str(notice), WeightNotice(WeightVersion(3, "disk", "/w/3"), state_request=str(saved)))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if saved.exists():
                break
        publish_notice(str(notice), WeightNotice(WeightVersion(3, "disk", "/w/3"), stop=True))
        await asyncio.wait_for(run, 10)
        return mgr

    mgr = asyncio.run(main())
    st = read_status(str(status))
    assert st.version == 3 and st.state_path == str(saved) and st.groups_written == len(sink.groups)
    saved_state = read_json(str(saved))
    assert saved_state["version"] == 3 and saved_state["format"] == 1
    final = mgr.state_dict()  # stopped mid-run: every drawn uid is written or in the state
    in_state = [e["uid"] for e in final["episodes"]]
    assert sorted(sink.uids + in_state) == [p.uid for p in prompts.items[: prompts.pos]]


@pytest.mark.timeout(60)
def test_per_engine_cap_holds_with_more_work_than_slots():
    cfg, engines, prompts, sink, wf = make(n_prompts=8, n_engines=2, max_concurrent_per_engine=3)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, max_inflight_groups=8)  # 32 samples, 6 slots
        await asyncio.wait_for(mgr.arun(), 30)

    asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    assert [e.max_active for e in engines] == [3, 3]


class SGLangLikeEngine(FakeEngine):
    """A paused SGLang server answers its health route 503 (its probe waits behind the pause);
    `fail_updates` weight loads fail (e.g. a bad folder) while it is paused."""

    def __init__(self, *a, fail_updates: int = 0, **kw) -> None:
        super().__init__(*a, **kw)
        self.fail_updates = fail_updates

    async def aupdate_weights(self, weights: WeightVersion) -> None:
        if self.fail_updates:
            self.fail_updates -= 1
            raise RuntimeError("HTTP 400: weights not loaded")
        await super().aupdate_weights(weights)

    async def ahealth(self) -> bool:
        return not self.paused and await super().ahealth()


@pytest.mark.timeout(60)
def test_a_failed_update_leaves_no_engine_paused_and_it_comes_back():
    cfg, _, prompts, sink, wf = make(n_prompts=12, n_engines=0)
    engines = [SGLangLikeEngine("fake://0", 0.002, fail_updates=1), SGLangLikeEngine("fake://1", 0.002)]

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, health_interval_s=0.05)  # no restarter
        await mgr.astart()
        await asyncio.sleep(0.02)
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))
        assert not engines[0].paused, "the engine whose update failed is resumed, not left paused"
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    m = asyncio.run(main())
    assert m["rollout/engine_failures"] == 1 and m["rollout/engine_recoveries"] == 1, m
    assert engines[0].updates == [1], "back in service only with the current weights"
    assert sorted(sink.uids) == [p.uid for p in prompts.items]


@pytest.mark.timeout(60)
def test_an_engine_down_while_paused_is_resumed_before_its_health_check():
    cfg, _, prompts, sink, wf = make(n_prompts=8, n_engines=0)
    engines = [SGLangLikeEngine("fake://0", 0.002), SGLangLikeEngine("fake://1", 0.002)]

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, health_interval_s=0.05)
        await mgr.astart()
        await engines[0].apause("in_place")  # e.g. left paused by a manager that died mid-update
        mgr.pool.mark_down(mgr.pool.slots[0], "test: connection reset")
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    m = asyncio.run(main())
    assert m["rollout/engine_recoveries"] == 1 and m["rollout/engines_up"] == 2, m


@pytest.mark.timeout(60)
def test_learner_notice_sets_what_the_gate_credits(tmp_path):
    """The weight notice's `consumed` and `new_groups` (D-ARL's learner trains fewer new groups
    per step than a batch) reach the staleness gate: a new version alone no longer admits a
    batch; the groups the learner used up do."""
    eta, batch = 1, 2
    gate = StalenessGate(eta, batch)
    cfg, engines, prompts, sink, wf = make(n_prompts=40)
    notice = str(tmp_path / "notice.json")

    async def settled():
        for _ in range(30):
            await asyncio.sleep(0.02)
        return len(sink.groups)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, gate=gate, notice_path=notice, poll_interval_s=0.01)
        await mgr.astart()
        assert await settled() == (eta + 1) * batch
        # step 0 trained 1 new group and the next step takes 1: (eta + 1) * 1 + 1 - 4 < 0
        publish_notice(notice, WeightNotice(WeightVersion(1, "disk", "/w/1"), consumed=1, new_groups=1))
        assert await settled() == 4 and (gate.version, gate.consumed, gate.batch_size) == (1, 1, 1)
        publish_notice(notice, WeightNotice(WeightVersion(2, "disk", "/w/2"), consumed=4, new_groups=2))
        assert await settled() == (eta + 1) * 2 + 4  # what was used up is replaced, eta steps ahead
        await mgr.astop()

    asyncio.run(main())


class RefusingEngine(FakeEngine):
    """Answers 400 to every request of a prompt holding token 50, as SGLang and darl-engine answer
    a prompt that does not fit the context beside max_new_tokens."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.refused = 0

    async def agenerate(self, req):
        if 50 in req.input_ids[:3]:
            self.refused += 1
            await asyncio.sleep(0.01)
            raise EngineHTTPError(self.url, "/generate", 400, "input_ids: 3 tokens + max_new_tokens 8 > context 10")
        return await super().agenerate(req)


@pytest.mark.timeout(60)
def test_a_refused_request_drops_its_group_and_keeps_the_engine(caplog):
    """Was: any failed request marked its engine down; a prompt every engine refuses took every
    engine down in turn and generation stopped."""
    gate = StalenessGate(0, 100)
    cfg, _, prompts, sink, wf = make(n_prompts=8, gate=gate)
    prompts.items[5].input_ids = [5, 6, 50]
    engines = [RefusingEngine(f"fake://{i}") for i in range(2)]

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, gate=gate)
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    with caplog.at_level("ERROR", logger="megatron_darl.rollout.episodes"):
        m = asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items if p.uid != 105]
    check_groups(sink, cfg)
    assert m["rollout/engine_failures"] == 0 and m["rollout/engines_up"] == 2
    assert m["rollout/groups_dropped"] == 1 and m["rollout/episode_retries"] == 0
    assert 1 <= m["rollout/requests_refused"] == sum(e.refused for e in engines) <= cfg.group_size
    assert gate.rejected == 1 and gate.running == 0
    assert "prompt 105 dropped: engine fake://" in caplog.text and "HTTP 400" in caplog.text
