"""The engine pool's own counters and logger, as the manager reports and saves them: the metric
names of before, each counted once, across a state round trip."""

from __future__ import annotations

import asyncio
import logging

import pytest

from megatron_darl.rollout.engine_pool import POOL_COUNTERS, EnginePool, Signal
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.types import WeightVersion
from tests.helpers.rollout_fakes import FakeEngine, make

# what `metrics()` reported before the pool had counters of its own (TensorBoard and
# metrics.jsonl keep these names): written out, not derived from the code under test
METRICS_BEFORE = {f"rollout/{k}" for k in (
    "prompts_drawn", "groups_written", "samples_written", "filtered_groups", "groups_dropped",
    "episode_retries", "requests", "requeued_requests", "aborted_requests", "restarted_samples",
    "tokens_generated", "reward_sum", "engine_failures", "engine_restarts", "engine_recoveries",
    "weight_updates", "weight_update_s_total", "weight_sync_fallbacks", "requests_refused",
    "probe_checks", "probe_failures", "probe_dropped_samples",
    "version", "engines_up", "inflight_groups", "inflight_requests", "reward_mean")} | {
    f"perf/{k}" for k in ("samples_per_s", "groups_per_s", "gen_tokens_per_s", "engine_idle_frac", "weight_update_s")}


@pytest.mark.timeout(60)
def test_the_pool_counts_and_logs_as_itself_and_the_manager_reports_the_same_names(caplog):
    cfg, engines, prompts, sink, wf = make(n_prompts=6, n_engines=2, step_s=0.004, request_timeout_s=0.5)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, health_interval_s=0.05)
        await mgr.astart()
        await asyncio.sleep(0.02)
        engines[0].dead = True
        await mgr.await_groups(2)
        engines[0].dead = False
        await mgr.aupdate_weights(WeightVersion(1, "disk", "/w/1"))
        while mgr.pool.engines_up() < 2:  # the health loop brings engine 0 back at version 1
            await asyncio.sleep(0.01)
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr

    with caplog.at_level(logging.INFO):
        mgr = asyncio.run(main())
    m = mgr.metrics()
    assert set(m) == METRICS_BEFORE
    pool = mgr.pool.counts
    assert set(pool) == set(POOL_COUNTERS) and pool["engine_failures"] >= 1 and pool["engine_recoveries"] >= 1
    # counted once, by the pool: at least the tokens written (aborted partials count too)
    written = sum(len(t.response_ids) for g in sink.groups for t in g)
    assert written == 6 * cfg.group_size * cfg.max_new_tokens
    assert m["rollout/tokens_generated"] == pool["tokens_generated"] >= written
    assert m["rollout/engine_failures"] == pool["engine_failures"] and m["rollout/weight_updates"] == 1
    down = [r for r in caplog.records if "marked down" in r.getMessage()]
    back = [r for r in caplog.records if "is back at version" in r.getMessage()]
    assert down and back and {r.name for r in down + back} == {"megatron_darl.rollout.engine_pool"}


@pytest.mark.timeout(60)
def test_a_saved_states_counters_go_back_to_whoever_counts_them():
    cfg, engines, prompts, sink, wf = make(n_prompts=2)
    mgr = RolloutManager(cfg, engines, prompts, wf, sink)
    mgr.pool.count("engine_failures", 2)
    state = mgr.state_dict()
    assert state["counters"]["engine_failures"] == 2 and state["counters"]["groups_written"] == 0
    saved = {**state["counters"], "engine_failures": 3, "groups_written": 5, "tokens_generated": 40}
    again = RolloutManager(*make(n_prompts=2))
    again.load_state_dict({**state, "counters": saved})
    assert again.pool.counts["engine_failures"] == 3 and again.pool.counts["tokens_generated"] == 40
    assert again.counters() == saved and "groups_written" not in again.pool.counts
    m = again.metrics()
    assert m["rollout/engine_failures"] == 3 and m["rollout/groups_written"] == 5


def test_an_unknown_counter_is_refused():
    pool = EnginePool(make()[0], [FakeEngine("fake://0")], signal=Signal())
    with pytest.raises(KeyError, match="'engine_failure' is not one of POOL_COUNTERS"):
        pool.count("engine_failure")
