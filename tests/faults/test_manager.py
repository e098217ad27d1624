"""Faults on the rollout manager's side, each reproducing a probe that
did not hold:
- resume: the manager no longer pushes the dead run's weight folder to the engines (HTTP 400,
  counted as an engine failure); it waits for the learner's publication of the restored
  version and runs nothing on the engines' initial weights meanwhile;
- an unwritable state path: the manager's failure to write its state is no longer swallowed
  by the notice loop (training froze, nothing logged, later notices ignored): the manager
  stops with the error, logs it and writes it to its status, and the learner's wait for the
  state fails at once with that error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

import pytest

from megatron_darl.channel.weight_notice import RolloutStatus, WeightNotice, publish_notice, read_status, write_status
from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.rollout.workflow import GroupWorkflow
from megatron_darl.trainer.checkpoints import RunCheckpointer
from megatron_darl.types import GenerateRequest, GenerateResponse, WeightVersion
from tests.helpers.rollout_fakes import ScriptedPrompts


class FolderEngine:
    """An engine that loads weights only from a folder that exists (as darl-engine and SGLang
    do: HTTP 400 'no *.safetensors' otherwise) and tags tokens with its version."""

    def __init__(self, url: str) -> None:
        self.url, self.version, self.paused = url, 0, False
        self.loaded: list[str] = []
        self.versions_generated: set[int] = set()

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        await asyncio.sleep(0.001)
        n = req.sampling.max_new_tokens
        self.versions_generated.add(self.version)
        return GenerateResponse(req.rid, [7] * n, [-0.5] * n, [self.version] * n, "length", self.version)

    async def apause(self, mode: str = "abort") -> None:
        self.paused = True

    async def aresume(self) -> None:
        self.paused = False

    async def aupdate_weights(self, weights: WeightVersion) -> None:
        if not os.path.isdir(weights.location):
            raise RuntimeError(f"HTTP 400: weights at {weights.location} not loaded: no *.safetensors files")
        self.loaded.append(weights.location)
        self.version = weights.version

    async def ahealth(self) -> bool:
        return not self.paused


class Scorer:
    async def ascore(self, episode):
        return [float(i % 2) for i in range(len(episode.samples))]


class Sink:
    def __init__(self):
        self.groups = []

    async def aput_group(self, trajs):
        self.groups.append(trajs)


def make(n_prompts=6):
    cfg = RolloutConfig(group_size=2, max_new_tokens=3, max_concurrent_per_engine=4, request_timeout_s=5.0)
    return cfg, ScriptedPrompts(n_prompts), Sink()


@pytest.mark.timeout(60)
def test_resume_does_not_push_the_dead_runs_weights(tmp_path):
    cfg, prompts, sink = make()
    state = {"format": 1, "version": 4, "loader": {"pos": 0}, "episodes": [], "counters": {}, "gate": None,
             "weights": {"version": 4, "kind": "shm", "location": "/dev/shm/darl-deadrun-weights/v4", "num_bytes": 1}}
    (tmp_path / "v4").mkdir()  # the resumed learner's publication of version 4
    engines = [FolderEngine("fake://0"), FolderEngine("fake://1")]

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, GroupWorkflow(cfg, Scorer(), seed=1), sink)
        mgr.load_state_dict(json.loads(json.dumps(state)))
        run = asyncio.create_task(mgr.arun())
        await asyncio.sleep(0.2)
        assert not any(e.versions_generated for e in engines), "nothing runs on the initial weights meanwhile"
        await mgr.aupdate_weights(WeightVersion(4, "shm", str(tmp_path / "v4")))
        await asyncio.wait_for(run, 30)
        return mgr.metrics()

    m = asyncio.run(main())
    assert m["rollout/engine_failures"] == 0, m
    assert all(e.loaded == [str(tmp_path / "v4")] for e in engines)
    assert all(e.versions_generated == {4} for e in engines)
    assert len(sink.groups) == len(prompts.items)


@pytest.mark.timeout(60)
def test_an_unwritable_state_path_stops_the_manager_with_the_error(tmp_path, caplog):
    cfg, prompts, sink = make(n_prompts=10_000)
    notice, status = tmp_path / "notice.json", tmp_path / "status.json"
    (tmp_path / "checkpoints").write_text("a file where the checkpoint folder should be")
    bad = str(tmp_path / "checkpoints" / "step_00000002.rollout.json.1")

    async def main():
        mgr = RolloutManager(cfg, [FolderEngine("fake://0")], prompts, GroupWorkflow(cfg, Scorer(), seed=1), sink,
                             notice_path=str(notice), status_path=str(status), poll_interval_s=0.02)
        run = asyncio.create_task(mgr.arun())
        await asyncio.sleep(0.1)
        publish_notice(str(notice), WeightNotice(state_request=bad))
        with pytest.raises(OSError, match="rollout state"):
            await asyncio.wait_for(run, 10)  # before: the notice loop died silently, this never returned
        return mgr

    with caplog.at_level(logging.ERROR, logger="megatron_darl.rollout.manager"):
        mgr = asyncio.run(main())
    st = read_status(str(status))
    assert st is not None and st.error is not None and bad in st.error, st
    assert mgr.error == st.error
    assert any(bad in r.getMessage() for r in caplog.records), "the failure is in the log"


@pytest.mark.timeout(60)
def test_the_learner_fails_at_once_with_the_managers_error(tmp_path):
    status = tmp_path / "status.json"
    write_status(str(status), RolloutStatus(version=2, error="notice polling failed: OSError('cannot write')"))

    class Publisher:
        def notify(self, **kw):
            pass

    ckpt = RunCheckpointer(learner=None, feed=None, publisher=Publisher(), ckpt_dir=str(tmp_path),
                           status_path=str(status), group_size=2, keep_last=1, alive=lambda: None)
    with pytest.raises(RuntimeError, match="cannot write"):  # before: waited out the timeout
        ckpt._rollout_state(str(tmp_path / "step_00000002.rollout.json"), timeout_s=5.0)


@pytest.mark.timeout(60)
def test_resume_takes_the_learners_publication_even_below_the_saved_version(tmp_path):
    """Whatever version the resumed learner publishes first is the policy now: waiting for the
    saved (higher) one would wait for ever."""
    cfg, prompts, sink = make()
    state = {"format": 1, "version": 5, "loader": {"pos": 0}, "episodes": [], "counters": {}, "gate": None,
             "weights": {"version": 5, "kind": "disk", "location": str(tmp_path / "gone"), "num_bytes": 1}}
    (tmp_path / "v4").mkdir()
    engines = [FolderEngine("fake://0")]

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, GroupWorkflow(cfg, Scorer(), seed=1), sink)
        mgr.load_state_dict(state)
        run = asyncio.create_task(mgr.arun())
        await asyncio.sleep(0.05)
        await mgr.aupdate_weights(WeightVersion(4, "disk", str(tmp_path / "v4")))
        await asyncio.wait_for(run, 30)
        return mgr.metrics()

    m = asyncio.run(main())
    assert m["rollout/engine_failures"] == 0 and m["rollout/version"] == 4
    assert engines[0].versions_generated == {4} and len(sink.groups) == len(prompts.items)
