"""A learner step's wait for rollouts has a bound (`train.data_wait_timeout_s`): a live rollout
side that produces nothing (every group filtered, an engine that answers nothing) stops the run
naming the step, what the learner holds and the rollout manager's last report, instead of
leaving the learner waiting until someone stops it.

Real parts: the shared-memory ring (created in /dev/shm, nothing written to it), the replay
feed and store, the publisher reading the status file the rollout manager writes
(`write_status`, with the keys the manager reports); the loop's `_wait_rollouts` is what
`train_loop` calls on the main rank."""

from __future__ import annotations

import os
import time
import uuid
from types import SimpleNamespace

import pytest

from megatron_darl.channel.shm_ring import ShmRing
from megatron_darl.channel.weight_notice import RolloutStatus, write_status
from megatron_darl.config import load_config
from megatron_darl.trainer.feed import ReplayFeed
from megatron_darl.trainer.loop import DataStalled, _wait_rollouts
from megatron_darl.trainer.publication import Publisher
from megatron_darl.trainer.replay_store import ReplayStore

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "cpu_demo_darl.yaml")


@pytest.fixture
def trainer(tmp_path):
    cfg = load_config(DEMO, ["train.data_wait_timeout_s=1.5", "train.batch_prompts=4"])
    ring = ShmRing.create(f"darl-test-{uuid.uuid4().hex[:12]}", 1 << 16)
    feed = ReplayFeed(ring, ReplayStore(cfg.algo, cfg.rollout.group_size), 4, cfg.algo.max_head_offpolicyness)
    publisher = Publisher(SimpleNamespace(is_main=False), str(tmp_path / "weights"), str(tmp_path / "notice.json"),
                          str(tmp_path / "status.json"), "disk")
    checks = []
    yield SimpleNamespace(cfg=cfg, feed=feed, publisher=publisher, wait_alive=lambda: checks.append(1), checks=checks)
    ring.unlink()


@pytest.mark.timeout(30)
def test_a_step_that_gets_no_data_stops_naming_the_stall(trainer):
    write_status(trainer.publisher.status_path,
                 RolloutStatus(version=3, groups_written=12, groups_filtered=40, metrics={
                     "rollout/engines_up": 1.0, "rollout/inflight_groups": 2.0, "rollout/groups_written": 12.0,
                     "rollout/filtered_groups": 40.0, "rollout/groups_dropped": 0.0, "rollout/gate_capacity": 0.0}))
    t0 = time.monotonic()
    with pytest.raises(DataStalled) as info:
        _wait_rollouts(trainer, 3)
    waited = time.monotonic() - t0
    assert 1.5 <= waited < 5.0, waited
    msg = str(info.value)
    assert "step 3: no batch of 4 groups (4 never trained) within 1.5 s (pool: 0 groups, 0 incomplete)" in msg, msg
    assert ("the rollout manager's last report (" in msg and "version 3, engines up 1, groups in flight 2, "
            "groups written 12, filtered (equal rewards) 40, dropped 0" in msg and "admission capacity 0" in msg), msg
    assert "train.data_wait_timeout_s (now 1.5 s)" in msg and "set it to 0" in msg, msg
    assert trainer.checks, "the liveness check was not called while waiting"


@pytest.mark.timeout(30)
def test_a_manager_that_never_reported_is_named(trainer):
    with pytest.raises(DataStalled, match=r"the rollout manager never reported \(no status file"):
        _wait_rollouts(trainer, 0)


def test_the_bound_is_a_checked_key():
    assert load_config(DEMO).train.data_wait_timeout_s == 3600.0
    assert load_config(DEMO, ["train.data_wait_timeout_s=0"]).train.data_wait_timeout_s == 0.0  # no bound
    with pytest.raises(Exception, match="train.data_wait_timeout_s"):
        load_config(DEMO, ["train.data_wait_timeout_s=-1"])
