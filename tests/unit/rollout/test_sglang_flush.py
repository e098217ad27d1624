"""A weight update's `flush_cache`, asked for only where SGLang 0.5.23 can grant it.

The release (read from the pinned wheel: `Release.flush_rules`) flushes only when no request
holds KV, and a refused flush fails the update call itself after the weights changed. With
`pause_mode=in_place` the running requests keep their KV through the pause, so an update that
asks for a flush fails on every version while requests run; `abort` ends them and `retract`
moves them back to the waiting queue without KV (ignored while paused), so those flush. Checked
here: the project's rule (`sglang_requests.flushes_cache`) is the release's; the stand-in refuses
as the release does; the manager's client (`from_config`) and the learner's sender ask for no
flush under `in_place`. An earlier client asked for one in every mode: its in_place
updates failed against the stand-in.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout import sglang_requests as rq
from megatron_darl.rollout.sglang_client import EngineHTTPError, SGLangClient
from megatron_darl.trainer import weight_sender as ws
from megatron_darl.types import PAUSE_MODES, GenerateRequest, SamplingParams, WeightVersion
from tests.helpers.sglang_release import require_release


@pytest.fixture(scope="module")
def release():
    return require_release()


def test_the_pause_modes_that_flush_are_the_release_ones(release):
    rules = release.flush_rules
    assert rules.keep_running == {"in_place"} and rules.others_retract and rules.ignores_waiting_when_paused
    assert "cache was not flushed because requests are still running or queued" in rules.refusal
    assert {m: rq.flushes_cache(m) for m in PAUSE_MODES} == {m: m not in rules.keep_running for m in PAUSE_MODES}
    with pytest.raises(ValueError, match="pause mode"):
        rq.flushes_cache("drain")


def _answer(exc: Exception) -> str:
    return json.loads(exc.body)["message"] if isinstance(exc, EngineHTTPError) else str(exc)


async def _update_while_held(url: str, mode: str, folder: str, version: int) -> dict:
    """Start a long request, pause with `mode` while it runs, load `folder` with a client that
    always flushes (the old client) and with the one `from_config` builds; resume, finish."""
    out = {}
    async with SGLangClient(url, max_retries=0) as old, \
            SGLangClient.from_config(url, RolloutConfig(pause_mode=mode)) as ours:
        req = GenerateRequest([3, 4], SamplingParams(temperature=1.0, max_new_tokens=1000), f"long-{mode}")
        gen = asyncio.create_task(old.agenerate(req))
        await asyncio.sleep(0.5)
        await old.apause(mode)
        assert not gen.done(), "the request finished before the pause: nothing was held"
        for name, client in (("always", old), ("ours", ours)):
            try:
                await client.aupdate_weights(WeightVersion(version, "disk", folder))
                out[name] = "ok"
            except (EngineHTTPError, rq.UpdateFailedError) as exc:
                out[name] = _answer(exc)
            version += 1
        await old.aresume()
        out["finished"] = len((await gen).output_ids)
    return out


@pytest.mark.timeout(240)
def test_the_standin_refuses_a_flush_while_in_place_holds_requests_and_the_client_asks_for_none(release, tmp_path):
    from tests.helpers.engines import running_standin, save_wide
    from tests.helpers.sglang_standin import served_calls

    # deep enough that 1000 tokens take seconds: the request must still run when the pause comes
    save_wide(tmp_path / "a", seed=1, num_hidden_layers=12)
    save_wide(tmp_path / "b", seed=2, num_hidden_layers=12)
    with running_standin(tmp_path / "a", tmp_path) as (url, calls):
        in_place = asyncio.run(_update_while_held(url, "in_place", str(tmp_path / "b"), 1))
        retract = asyncio.run(_update_while_held(url, "retract", str(tmp_path / "b"), 3))
        served = served_calls(calls)
    assert in_place == {"always": release.flush_rules.refusal, "ours": "ok", "finished": 1000}
    assert retract == {"always": "ok", "ours": "ok", "finished": 1000}
    loads = [(c["body"]["flush_cache"], c["status"]) for c in served if c["route"] == "/update_weights_from_disk"]
    assert loads == [(True, 400), (False, 200), (True, 200), (True, 200)]


def test_the_sender_flushes_on_the_last_bucket_only_where_the_pause_mode_allows(monkeypatch, tmp_path):
    posted: list[dict] = []

    async def arequest(self, method, route, body=None, **kw):
        if route == "/update_weights_from_distributed":
            posted.append(body)
        return {"tp_size": 1} if route == "/server_info" else {"success": True, "message": "Success"}

    monkeypatch.setattr(SGLangClient, "arequest", arequest)
    monkeypatch.setattr(ws, "init_custom_group", lambda *a, **k: object())  # no rendezvous
    monkeypatch.setattr(ws, "_broadcast", lambda *a, **k: None)
    monkeypatch.setattr(ws.dist, "destroy_process_group", lambda group: None)
    monkeypatch.setattr(ws.dist, "get_backend", lambda *a: "gloo")
    from megatron_darl.config import load_config
    from megatron_darl.trainer.rank import _weight_sender

    info = SimpleNamespace(weight_sync="distributed", notice=str(tmp_path / "notice.json"), master_addr="127.0.0.1",
                           weights_root=str(tmp_path / "fb"))
    learner = SimpleNamespace(is_main=True, hf_folder_info=lambda: ({}, []))
    flags = {}
    for mode in PAUSE_MODES:
        s = _weight_sender(load_config(None, ["model.hf_dir=/m", f"rollout.pause_mode={mode}"]), info, learner)
        s._staged = (3, [[("a", torch.ones(2))], [("b", torch.ones(2))]])
        posted.clear()
        assert s.serve({"id": mode, "engines": [{"index": 0, "url": "http://10.0.0.1:1", "group": mode}]})["ok"] == [0]
        flags[mode] = [b["flush_cache"] for b in posted]
        s.close()
    assert flags == {"abort": [False, True], "retract": [False, True], "in_place": [False, False]}
