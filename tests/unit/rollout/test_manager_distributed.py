"""The manager's side of `rollout.weight_sync=distributed`, with fake engines and a fake learner
answering the transfer requests beside the notice: pause, transfer, resume keeps partial rollouts
and per-token versions exact; an engine whose broadcast failed loads the fallback folder
(counted); an engine that was down rejoins with a new group and the current version; a learner
that never answers marks the engines down after the bound instead of hanging; an engine that
may hold part of a version is not resumed until it loaded a whole one."""

from __future__ import annotations

import asyncio

import pytest

from megatron_darl.channel.json_files import read_json, write_json_atomic
from megatron_darl.channel.weight_transfer import transfer_paths
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.types import WeightVersion
from tests.helpers.rollout_fakes import check_groups, make


async def fake_learner(notice: str, engines: list, fail: set[int], seen: list[dict]) -> None:
    """Answers every new request: engines not in `fail` now serve the version (as a broadcast
    would leave them), the others fail half-way (they hold a mix) and a fallback folder is named."""
    req_path, res_path = transfer_paths(notice)
    last = None
    while True:
        req = read_json(req_path)
        if req and req["id"] != last:
            last = req["id"]
            seen.append(req)
            ok = [e["index"] for e in req["engines"] if e["index"] not in fail]
            for e in req["engines"]:  # a failed broadcast leaves what SGLang loaded of it: a mix
                i = e["index"]
                engines[i].version, engines[i].mixed = ((req["version"], False) if i in ok
                                                        else (engines[i].version, True))
            write_json_atomic(res_path, {"id": req["id"], "version": req["version"], "ok": ok,
                                         "failed": {str(e["index"]): "broadcast timed out" for e in req["engines"]
                                                    if e["index"] in fail},
                                         "fallback": "/w/fallback/v1" if len(ok) < len(req["engines"]) else None})
        await asyncio.sleep(0.01)


def dist_version(v: int) -> WeightVersion:
    return WeightVersion(v, "distributed", f"127.0.0.1#v{v}")


@pytest.mark.timeout(60)
def test_partials_span_versions_and_a_failed_broadcast_falls_back_to_disk(tmp_path):
    cfg, engines, prompts, sink, wf = make(n_prompts=4, n_engines=2, step_s=0.01, max_new_tokens=20)
    notice, seen = str(tmp_path / "notice.json"), []

    async def main():
        learner = asyncio.create_task(fake_learner(notice, engines, {1}, seen))
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, notice_path=notice)
        await mgr.astart()
        await asyncio.sleep(0.08)
        await mgr.aupdate_weights(dist_version(1))
        await asyncio.wait_for(mgr.arun(), 30)
        learner.cancel()
        return mgr

    mgr = asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    check_groups(sink, cfg)
    mixed = [t for g in sink.groups for t in g if set(t.behav_versions.tolist()) == {0, 1}]
    assert mixed and all(t.behav_versions.tolist() == sorted(t.behav_versions.tolist()) for t in mixed)
    groups = [e["group"] for e in seen[0]["engines"]]
    assert [g.rsplit("-", 2)[1:] for g in groups] == [["w0", "0"], ["w1", "0"]] and groups[0].startswith("darl-")
    assert engines[0].updates == [] and engines[1].updates == [1]  # only the failed one read a folder
    m = mgr.metrics()
    assert m["rollout/weight_sync_fallbacks"] == 1 and m["rollout/engines_up"] == 2 and mgr.version == 1


@pytest.mark.timeout(60)
def test_an_engine_back_from_down_rejoins_with_a_new_group_and_the_current_version(tmp_path):
    cfg, engines, prompts, sink, wf = make(n_prompts=10, n_engines=2, step_s=0.004, request_timeout_s=0.5)
    notice, seen = str(tmp_path / "notice.json"), []

    async def main():
        learner = asyncio.create_task(fake_learner(notice, engines, set(), seen))
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, notice_path=notice, health_interval_s=0.05)
        await mgr.astart()
        await mgr.aupdate_weights(dist_version(1))
        engines[0].dead = True
        await mgr.await_groups(3)
        engines[0].dead, engines[0].version = False, 0  # restarted with its initial weights
        await asyncio.wait_for(mgr.arun(), 30)
        learner.cancel()
        return mgr

    mgr = asyncio.run(main())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    rejoin = [r for r in seen if [e["index"] for e in r["engines"]] == [0]]
    assert rejoin and rejoin[-1]["engines"][0]["group"].endswith("-w0-1") and rejoin[-1]["version"] == 1
    assert engines[0].version == 1 and mgr.metrics()["rollout/engine_recoveries"] >= 1


@pytest.mark.timeout(60)
def test_a_learner_that_never_answers_marks_the_engines_down_within_the_bound(tmp_path):
    cfg, engines, prompts, sink, wf = make(n_prompts=2, n_engines=2, request_timeout_s=0.3)

    async def main():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, notice_path=str(tmp_path / "notice.json"),
                             health_interval_s=3600)
        await mgr.astart()
        await asyncio.wait_for(mgr.aupdate_weights(dist_version(1)), 10)
        m = mgr.metrics()
        await mgr.astop()
        return m

    m = asyncio.run(main())
    assert m["rollout/engines_up"] == 0 and m["rollout/engine_failures"] == 2
    # the learner may have sent them part of the version: paused until a whole one loads
    assert all(e.paused for e in engines)


@pytest.mark.timeout(60)
def test_a_restarted_manager_asks_for_group_names_no_engine_holds(tmp_path):
    """Two starts of the manager of one run over the same engines (a manager restart: its
    engines' incarnations begin again at 0 while the engines still hold the first start's
    groups): every name differs, and each carries the run id. An earlier manager had both starts ask
    for darl-w0-0 and darl-w1-0, which SGLang refuses ("group name has already been created")."""
    notice, seen = str(tmp_path / "notice.json"), []
    names = []
    for start in range(2):
        cfg, engines, prompts, sink, wf = make(n_prompts=1, n_engines=2)

        async def main(cfg, engines, prompts, sink, wf, version):
            learner = asyncio.create_task(fake_learner(notice, engines, set(), seen))
            mgr = RolloutManager(cfg, engines, prompts, wf, sink, notice_path=notice, run_id="run7")
            await mgr.astart()
            await mgr.aupdate_weights(dist_version(version))
            await mgr.astop()
            learner.cancel()

        asyncio.run(main(cfg, engines, prompts, sink, wf, 1 + start))
        names.append([e["group"] for e in seen[-1]["engines"]])
    assert len(set(names[0] + names[1])) == 4, names
    assert all(n.startswith("darl-run7-") and n.endswith(("-w0-0", "-w1-0")) for n in names[0] + names[1]), names


@pytest.mark.timeout(60)
def test_an_engine_left_on_part_of_a_version_runs_again_only_after_a_whole_one(tmp_path):
    """Engine 1's broadcast fails half-way (it holds a mix, as SGLang leaves it) and it cannot
    read the fallback folder either: the manager must neither resume it nor send it requests
    until it has loaded a whole version; the health loop has the learner send it the version
    again, and only then does it run. Measured on the fake engine: resumes and tokens while it
    held the mix. An earlier manager resumed it at once ("nothing stays paused"), and
    again before each health check."""
    cfg, engines, prompts, sink, wf = make(n_prompts=16, n_engines=2, step_s=0.004)
    notice, seen, fail = str(tmp_path / "notice.json"), [], {1}
    engines[1].fail_updates = 10**6

    async def main():
        learner = asyncio.create_task(fake_learner(notice, engines, fail, seen))
        mgr = RolloutManager(cfg, engines, prompts, wf, sink, notice_path=notice, health_interval_s=0.05)
        await mgr.astart()
        await mgr.aupdate_weights(dist_version(1))
        down, at_down = mgr.metrics()["rollout/engines_up"], len(engines[1].requests)
        await asyncio.sleep(0.3)  # health rounds: the learner still fails it, so it stays paused
        held = (engines[1].paused, engines[1].mixed, len(engines[1].requests) - at_down)
        fail.clear()  # the learner's next broadcast to it gets through
        while mgr.metrics()["rollout/engines_up"] < 2:
            await asyncio.sleep(0.01)
        asked = len(engines[1].requests)
        await asyncio.wait_for(mgr.arun(), 30)
        learner.cancel()
        return mgr, down, held + (len(engines[1].requests) - asked,)

    mgr, down, held = asyncio.run(main())
    assert down == 1 and held[:3] == (True, True, 0) and held[3] > 0  # requests only once whole again
    assert engines[1].resumes_while_mixed == 0 and engines[1].mixed_tokens == 0
    assert not engines[1].mixed and engines[1].version == 1 and engines[1].updates == []  # the fallback never read
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    m = mgr.metrics()
    assert m["rollout/engines_up"] == 2 and m["rollout/engine_recoveries"] >= 1
    assert m["rollout/weight_sync_fallbacks"] >= 1
