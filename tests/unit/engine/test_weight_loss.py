"""An engine lost mid-broadcast costs the learner that engine's version, never its life.

Over gloo on 127.0.0.1 with real `darl-engine` processes: engine 0 is killed with SIGKILL while it
waits inside /update_weights_from_distributed for the second bucket's broadcast. The learner's
`WeightSender` (this process) answers the transfer within its bound, engine 1 of the same
transfer gets the whole version, engine 0 gets the fallback folder, which a restarted engine 0
loads, and the next version reaches the restarted engine over a new group. A peer that joined
but stopped receiving (SIGSTOP, or a receiver that never receives) ends the broadcast at the
sender's deadline, not the group's timeout. On NCCL, the same groups are built without the
watchdog's teardown (checked here on CPU; the broadcast itself in
tests/unit/learner/test_gpu.py, marked gpu).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import torch

from megatron_darl.channel import process_group as pgm
from megatron_darl.channel.ports import free_port
from megatron_darl.rollout.sglang_client import SGLangClient
from megatron_darl.trainer import weight_sender as ws
from megatron_darl.types import WeightVersion
from tests.helpers.engines import running_engines, save_wide
from tests.unit.engine.test_weight_group import hf_buckets


async def _version(url: str) -> str:
    async with SGLangClient(url, max_retries=0) as c:
        return (await c.amodel_info())["weight_version"]


async def _load(url: str, version: int, folder: str) -> str:
    async with SGLangClient(url, max_retries=0) as c:
        await c.aupdate_weights(WeightVersion(version, "disk", folder))
    return await _version(url)


def _sender(root) -> ws.WeightSender:
    config = json.loads((root / "b" / "config.json").read_text())
    return ws.WeightSender(str(root / "notice.json"), "127.0.0.1", str(root / "fallback"), (config, [str(root / "b")]),
                           backend="gloo", timeout_s=20.0)


@pytest.mark.timeout(240)
def test_an_engine_killed_mid_broadcast_gets_the_fallback_and_the_learner_goes_on(tmp_path, monkeypatch):
    save_wide(tmp_path / "a", seed=1)
    save_wide(tmp_path / "b", seed=2)
    real, calls = ws._broadcast, []

    def killing(group, bucket, device, *rest):  # engine 0's second bucket: it is inside its receive
        calls.append(group)
        if group is s._groups.get("w0-0", (None, None))[1] and sum(g is group for g in calls) == 2:
            time.sleep(0.3)  # the post has reached the engine, which now waits in dist.broadcast
            os.kill(pid0, signal.SIGKILL)
        return real(group, bucket, device, *rest)

    monkeypatch.setattr(ws, "_broadcast", killing)
    with running_engines([(tmp_path / "a", None), (tmp_path / "a", None)], tmp_path) as started:
        (url0, p0), (url1, _) = started
        pid0, s = p0.pid, _sender(tmp_path)
        try:
            s._staged = (5, hf_buckets(tmp_path / "b"))
            t0 = time.monotonic()
            result = s.serve({"id": "1", "engines": [{"index": 0, "url": url0, "group": "w0-0"},
                                                     {"index": 1, "url": url1, "group": "w1-0"}]})
            took = time.monotonic() - t0
            assert p0.wait(timeout=10) == -signal.SIGKILL
            assert result["ok"] == [1] and list(result["failed"]) == [0], result
            assert result["fallback"] == str(tmp_path / "fallback" / "v5") and took < 20.0, (took, result)
            assert asyncio.run(_version(url1)) == "5" and "w0-0" not in s._groups
            # engine 0 comes back: it loads the fallback folder, then the next version over a new group
            (tmp_path / "back").mkdir()
            with running_engines([(tmp_path / "a", None)], tmp_path / "back") as [(url0b, _)]:
                assert asyncio.run(_load(url0b, 5, result["fallback"])) == "5"
                s._staged = (6, hf_buckets(tmp_path / "b"))
                again = s.serve({"id": "2", "engines": [{"index": 0, "url": url0b, "group": "w0-1"},
                                                        {"index": 1, "url": url1, "group": "w1-0"}]})
                assert again["ok"] == [0, 1] and again["failed"] == {}, again
                assert asyncio.run(_version(url0b)) == asyncio.run(_version(url1)) == "6"
        finally:
            s.close()


@pytest.mark.timeout(120)
def test_a_peer_that_stops_receiving_ends_the_broadcast_at_the_senders_deadline():
    """A receiver that joined the group but never receives: a 64 MB broadcast cannot finish. The
    group's own timeout is 60 s; the sender's deadline (here 2 s) ends it, and the group is
    destroyed cleanly afterwards."""
    import subprocess
    import sys

    import torch.distributed as dist

    from tests.helpers import repo_env

    port = free_port("127.0.0.1")
    peer = subprocess.Popen([sys.executable, "-c", f"""
import time
from megatron_darl.channel.process_group import init_custom_group
init_custom_group("127.0.0.1", {port}, 2, "stuck", 1, "gloo", 60.0)
time.sleep(60)
"""], env=repo_env(OMP_NUM_THREADS="1"))
    try:
        group = pgm.init_custom_group("127.0.0.1", port, 2, "stuck", 0, "gloo", 60.0)
        _expect_deadline(group)
        dist.destroy_process_group(group)
    finally:
        peer.kill()
        peer.wait()


def _expect_deadline(group) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not done after 2s \(rollout.weight_sync_timeout_s\)"):
        ws._broadcast(group, [("x", torch.zeros(16 << 20))], "cpu", 2.0)
    assert time.monotonic() - t0 < 10.0


def test_nccl_weight_groups_are_built_without_the_watchdogs_teardown(monkeypatch):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=0 while ProcessGroupNCCL reads it (its constructor), for
    nccl groups only, and the environment restored after; aborting never reaches the default group."""
    from torch.distributed import distributed_c10d as c10d

    seen = []

    def helper(world, rank, ranks, backend, store, **kw):
        seen.append((str(backend), os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))
        return object(), None

    monkeypatch.setattr(c10d, "_new_process_group_helper", helper)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    for backend in ("nccl", "gloo"):
        pgm.init_custom_group("127.0.0.1", free_port("127.0.0.1"), 1, f"g-{backend}", 0, backend, 10.0)
    assert seen == [("nccl", "0"), ("gloo", "3")] and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    with pytest.raises(ValueError, match="not the default group"):
        pgm.abort_group(None)
