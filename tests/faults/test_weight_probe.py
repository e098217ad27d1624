"""The weight probe on real darl-engine processes: every version an engine loads is checked
against the learner's log-probs of the probe before the engine gets a request.

- an engine that loads a corrupted tensor (one projection's rows reversed: finite, of the right
  shape, it passes every file check) fails the probe of that version, is marked down and
  restarted; with the right weights after the restart it comes back at that version;
- an engine that loads the wrong tensor again after its restart stops the run with
  `ProbeFailed` naming the version, the engine and the figures;
- a distributed update (the learner's own `WeightSender` over gloo) with one wrong bucket is
  caught the same way (v_proj rows reversed in the second bucket: max |delta| 8.5);
- the exact case (fp32 engine, the learner's weights) stays silent: its figures sit under 1e-5;
  a bf16 engine with the right weights (max |delta| 0.14, mean 0.028) passes bf16's threshold.
The learner here is transformers on the published folder (fp32), the naive reference; the
engines are real `darl-engine` processes on 127.0.0.1, driven through `EnginePool` and
`SGLangClient` as the manager drives them. What it is not: the learner's side (unit-tested in
tests/unit/channel/test_weight_probe.py) or the manager's wiring (tests/unit/rollout/test_probe_link.py).
"""

from __future__ import annotations

import asyncio
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_darl.channel.weight_probe import WeightProbe, probe_ids
from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.engine_pool import EnginePool, Signal
from megatron_darl.rollout.probe import ProbeFailed
from megatron_darl.rollout.sglang_client import SGLangClient
from megatron_darl.types import WeightVersion
from tests.helpers.engines import running_engines, save_wide


class CorruptLoader(SGLangClient):
    """An engine client whose engine loads `bad` whenever it is told to load `good`: a weight
    sync that delivers a wrong but loadable tensor."""

    def __init__(self, url: str, good: str, bad: str):
        super().__init__(url, timeout_s=60.0, max_retries=0)
        self.good, self.bad = good, bad

    async def aupdate_weights(self, weights: WeightVersion) -> None:
        if weights.location == self.good:
            weights = WeightVersion(version=weights.version, weight_sync=weights.weight_sync, location=self.bad)
        await super().aupdate_weights(weights)


class Restarter:
    """Gives the restarted engine a client that loads right (`heal`) or wrong again."""

    def __init__(self, heal: bool, good: str):
        self.heal, self.good, self.calls = heal, good, 0

    async def arestart(self, index, engine):
        self.calls += 1
        if self.heal:
            return SGLangClient(engine.url, timeout_s=60.0, max_retries=0)
        return CorruptLoader(engine.url, self.good, engine.bad)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-probe")
    save_wide(root / "v0", seed=0)
    model = save_wide(root / "v1", seed=1)
    shutil.copytree(root / "v1", root / "v1bad")
    path = next((root / "v1bad").glob("*.safetensors"))
    tensors = load_file(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    ids = probe_ids(256, model.config.vocab_size)
    with torch.no_grad():  # the learner: fp32, the published weights
        logits = model(torch.tensor([ids])).logits[0, :-1]
    lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    probe = WeightProbe(version=1, ids=ids, logprobs=lps.tolist())
    with running_engines([(root / "v0", None), (root / "v0", None)], root, startup_s=90) as started:
        yield {"root": root, "urls": [u for u, _ in started], "probe": probe}


def _pool(world, heal: bool) -> tuple[EnginePool, Restarter, WeightVersion]:
    good, bad = str(world["root"] / "v1"), str(world["root"] / "v1bad")
    engines = [SGLangClient(world["urls"][0], timeout_s=60.0, max_retries=0),
               CorruptLoader(world["urls"][1], good, bad)]
    restarter = Restarter(heal, good)
    cfg = RolloutConfig(probe_tokens=256, request_timeout_s=60.0)
    pool = EnginePool(cfg, engines, signal=Signal(), restarter=restarter, restart_grace_s=0.0)
    return pool, restarter, WeightVersion(version=1, weight_sync="disk", location=good)


async def _apush(pool: EnginePool, weights: WeightVersion, probe: WeightProbe) -> None:
    async with pool.update_lock:
        async with pool.apaused() as live:
            pool.version, pool.weights, pool.prober.probe = weights.version, weights, probe
            await pool.apush(weights, live)


def test_a_corrupted_tensor_is_caught_within_its_version_and_the_restart_heals_it(world):
    async def go():
        pool, restarter, w1 = _pool(world, heal=True)
        await _apush(pool, w1, world["probe"])
        m = dict(pool.prober.metrics)
        right, wrong = pool.slots
        assert right.up and right.version == 1 and not wrong.up and wrong.restart_wanted
        assert pool.counts["probe_checks"] == 2 and pool.counts["probe_failures"] == 1
        assert m["rollout/probe_max_abs/engine0"] < 1e-5, m  # the exact case: silent
        assert m["rollout/probe_max_abs/engine1"] > 2.0 and m["rollout/probe_kl/engine1"] > 0.1, m
        assert m["rollout/probe_mean_abs/engine1"] > 0.5, m  # a low-precision engine's rule catches it too
        await pool._arevive(wrong)  # the health loop's round: a new process, the current weights
        assert restarter.calls == 1 and wrong.up and wrong.version == 1 and not wrong.restart_wanted
        assert pool.prober.metrics["rollout/probe_max_abs/engine1"] < 1e-5
        assert pool.counts["probe_checks"] == 3 and pool.counts["probe_failures"] == 1
        for s in pool.slots:
            await s.engine.aclose()
    asyncio.run(go())


def test_a_second_failure_of_the_version_stops_the_run_naming_it(world):
    async def go():
        pool, restarter, w1 = _pool(world, heal=False)
        await _apush(pool, w1, world["probe"])
        wrong = pool.slots[1]
        with pytest.raises(ProbeFailed) as err:
            await pool._arevive(wrong)
        msg = str(err.value)
        assert "engine 1" in msg and world["urls"][1] in msg and "version 1 twice" in msg and "max_abs" in msg, msg
        assert restarter.calls == 1 and not wrong.up
        for s in pool.slots:
            await s.engine.aclose()
    asyncio.run(go())


def test_a_distributed_update_with_one_wrong_bucket_is_caught(world):
    """The learner's own broadcast (`WeightSender`, gloo) of a version whose second bucket holds
    a wrong tensor: the engine loads every bucket, the probe fails. Last: it leaves engine 0 on
    wrong weights (and versions only move forward, hence version 3)."""
    import json

    from megatron_darl.trainer.weight_sender import WeightSender

    root = world["root"]
    tensors = load_file(next((root / "v1").glob("*.safetensors")))
    names = sorted(tensors)
    half = len(names) // 2
    wrong = next(n for n in names[half:] if tensors[n].dim() == 2)
    tensors[wrong] = tensors[wrong].flip(0).contiguous()
    buckets = [[(n, tensors[n]) for n in names[:half]], [(n, tensors[n]) for n in names[half:]]]
    config = json.loads((root / "v1" / "config.json").read_text())
    notice = root / "dist-notice.json"
    sender = WeightSender(str(notice), "127.0.0.1", str(root / "fallback"), (config, [str(root / "v1")]),
                          backend="gloo", timeout_s=20.0)
    sender.stage(3, buckets)
    probe = WeightProbe(version=3, ids=world["probe"].ids, logprobs=world["probe"].logprobs)

    async def go():
        cfg = RolloutConfig(probe_tokens=256, request_timeout_s=60.0, weight_sync="distributed")
        pool = EnginePool(cfg, [SGLangClient(world["urls"][0], timeout_s=60.0, max_retries=0)], signal=Signal(),
                          notice_path=str(notice))
        await _apush(pool, WeightVersion(version=3, weight_sync="distributed", location="127.0.0.1#v3"), probe)
        slot = pool.slots[0]
        assert not slot.up and slot.restart_wanted and pool.counts["probe_failures"] == 1, (wrong, pool.counts)
        assert pool.prober.metrics["rollout/probe_max_abs/engine0"] > 2.0, pool.prober.metrics
        assert pool.prober.metrics["rollout/probe_mean_abs/engine0"] > 0.5, pool.prober.metrics
        await slot.engine.aclose()

    try:
        asyncio.run(go())
    finally:
        sender.close()


def test_a_bf16_engine_with_the_right_weights_passes_its_dtype_threshold(world, tmp_path):
    """The low-precision default (mean 0.5, no max) leaves room for bf16's own noise, which the
    fp32 one (max 1e-3) would not: the same weights, served in bfloat16, differ visibly but pass."""
    root = world["root"]
    with running_engines([(root / "v0", None)], tmp_path, startup_s=90, extra_args=("--dtype", "bfloat16")) as s:
        async def go():
            cfg = RolloutConfig(probe_tokens=256, request_timeout_s=60.0, engine_dtype="bfloat16")
            pool = EnginePool(cfg, [SGLangClient(s[0][0], timeout_s=60.0, max_retries=0)], signal=Signal())
            await _apush(pool, WeightVersion(version=1, weight_sync="disk", location=str(root / "v1")),
                         world["probe"])
            await pool.slots[0].engine.aclose()
            return pool
        pool = asyncio.run(go())
    m = pool.prober.metrics
    assert (pool.prober.max_abs, pool.prober.mean_abs) == (math.inf, 0.5), m
    assert pool.slots[0].up and pool.counts["probe_failures"] == 0, m
    assert 1e-3 < m["rollout/probe_max_abs/engine0"] < 1.0, m  # fails fp32's threshold, passes bf16's
    assert m["rollout/probe_mean_abs/engine0"] < 0.1, m
