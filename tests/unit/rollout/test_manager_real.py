"""The manager with the real pieces: two `darl-engine` processes on 127.0.0.1 (a tiny random
Qwen3), the real staleness gate and the real shared-memory ring buffer. A weight update lands
mid-generation (tokens of both versions in one response), one engine process is SIGKILLed
(marked down, restarted through the restarter, given the current weights) and every drawn prompt
arrives in the ring exactly once as a complete group."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import torch  # noqa: F401  (a hard dependency: imported, never skipped)
import transformers  # noqa: F401  (a hard dependency: imported, never skipped)

from megatron_darl.channel.shm_ring import ShmRing
from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.rollout.manager_process import EmbeddedEngineRestarter, RingSink
from megatron_darl.rollout.staleness import StalenessGate
from megatron_darl.rollout.workflow import Episode, GroupWorkflow
from megatron_darl.types import WeightVersion, group_trajectories
from tests.helpers.engines import save_tiny
from tests.helpers.rollout_fakes import ScriptedPrompts


class EvenTokens:
    async def ascore(self, episode: Episode) -> list[float]:
        return [sum(t % 2 == 0 for t in s.output_ids) / max(len(s.output_ids), 1) for s in episode.samples]


@pytest.mark.timeout(280)
def test_real_engines_ring_and_gate_survive_kill_and_update(tmp_path):
    save_tiny(tmp_path / "v0", 0)
    save_tiny(tmp_path / "v1", 1)
    # long responses: some must still be generating when the weights change, however fast the machine
    cfg = RolloutConfig(group_size=4, max_new_tokens=160, max_concurrent_per_engine=8, request_timeout_s=30.0)
    gate = StalenessGate(max_head_offpolicyness=1, batch_size=3)
    prompts = ScriptedPrompts(9, start=1000, tokens=lambda i: [3 + i % 7, 11, 17 + i % 5, 23], task="custom")
    name = f"darl-test-{uuid.uuid4().hex[:8]}"
    ring = ShmRing.create(name, 1 << 20, directory=str(tmp_path))
    producer = ShmRing.attach(name, directory=str(tmp_path))
    restarter = EmbeddedEngineRestarter(str(tmp_path / "v0"), startup_timeout_s=90, request_timeout_s=30,
                                        log_dir=str(tmp_path))
    sink = RingSink(producer)

    async def main():
        engines = list(await asyncio.gather(restarter.astart_engine(0), restarter.astart_engine(1)))
        victim = restarter.procs[0].pid
        mgr = RolloutManager(cfg, engines, prompts, GroupWorkflow(cfg, EvenTokens(), seed=3), sink, gate,
                             restarter=restarter, health_interval_s=0.2, restart_grace_s=60)
        try:
            await mgr.astart()
            for _ in range(300):  # generation under way on both engines
                await asyncio.sleep(0.02)
                if all(len(s.inflight) for s in mgr.pool.slots):
                    break
            await asyncio.sleep(0.05)  # some tokens under v0 first
            assert gate.version == 0
            await mgr.aupdate_weights(WeightVersion(1, "disk", str(tmp_path / "v1")))
            for _ in range(500):  # the victim is busy with continuations when it dies
                await asyncio.sleep(0.01)
                if mgr.pool.slots[0].inflight:
                    break
            at_kill = (len(mgr.pool.slots[0].inflight), mgr.metrics())
            os.kill(victim, 9)
            deadline = time.monotonic() + 120  # a loaded small machine takes tens of seconds to start one
            while time.monotonic() < deadline:  # down, restarted (new process, new port), v1 pushed, back
                await asyncio.sleep(0.1)
                if mgr.metrics()["rollout/engine_recoveries"] >= 1:
                    break
            await asyncio.wait_for(mgr.await_groups(len(prompts.items)), 90)
            await mgr.astop()
            m = mgr.metrics()
            assert m["rollout/engine_recoveries"] >= 1, f"at kill: {at_kill}\nnow: {m}"
            info = await mgr.pool.slots[0].engine.amodel_info()
            return m, info
        finally:
            for s in mgr.pool.slots:
                await s.engine.aclose()
            await restarter.aclose()

    try:
        m, info = asyncio.run(main())
        sink.close()
        trajs = []
        while (t := ring.get_trajectory(timeout=0.0)) is not None:
            trajs.append(t)
    finally:
        producer.close()
        ring.unlink()
    logs = "\n".join(f"{p.name}: {p.read_text()[-800:]}" for p in sorted(tmp_path.glob("engine*.log")))
    why = f"metrics={m}\nengine logs:\n{logs}"
    groups = group_trajectories(trajs)
    assert sorted(groups) == [p.uid for p in prompts.items], why  # every uid exactly once
    assert all(len(g) == cfg.group_size for g in groups.values())
    assert any(set(t.behav_versions.tolist()) == {0, 1} for t in trajs), "a response spans both versions"
    assert all(t.behav_versions.tolist() == sorted(t.behav_versions.tolist()) for t in trajs)
    assert m["rollout/engine_failures"] >= 1 and m["rollout/engine_restarts"] >= 1, why
    assert m["rollout/engine_recoveries"] >= 1 and m["rollout/engines_up"] == 2, why
    assert int(info["weight_version"]) == 1, "the restarted engine serves the current weights"
    assert gate.accepted == 9 and gate.running == 0
