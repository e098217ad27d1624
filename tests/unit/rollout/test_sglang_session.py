"""SGLang 0.5.23's weight-update session, read from the pinned wheel, and the learner's sender held to it.

The release's scheduler (`srt/managers/scheduler_components/weight_updater.py`, parsed with `ast`
by `tests/helpers/sglang_release.py`) refuses /update_weights_from_distributed and
/update_weights_from_tensor outside a session opened by /begin_weight_update, refuses a begin
while one is open and an end while none is; the HTTP layer answers each refusal 400 with
{"success": false, "message"}. Checked here: the project's constants (`rollout/sglang_requests.py`,
which darl-engine and the client use) are exactly the release's, so a release that moves a route
in or out of the session fails a test; the client's begin/end bodies fit the release's classes;
and the learner's `WeightSender`, run against engines that answer by the release's rules (its
process groups and broadcasts replaced), opens and closes a session around every version on
every engine, also when a join or a bucket fails, and recovers an engine whose session a dead
learner left open. An earlier sender never opened one: every engine refused its first
bucket.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megatron_darl.rollout import sglang_requests as rq
from megatron_darl.rollout.sglang_client import EngineHTTPError, SGLangClient
from megatron_darl.trainer import weight_sender as ws
from tests.helpers.sglang_release import WEIGHT_UPDATER, parse_session_rules, require_release


@pytest.fixture(scope="module")
def release():
    return require_release()


def test_the_routes_that_need_a_session_and_the_refusals_are_the_release_ones(release):
    rules = release.session_rules
    needs = {name: msg for name, msg in rules.refused_without.items() if name not in rules.closes}
    assert needs == {r.strip("/"): rq.session_required(r) for r in rq.SESSION_ROUTES}
    assert rules.refused_while_open == {"begin_weight_update": rq.SESSION_ALREADY_OPEN}
    assert rules.refused_without["end_weight_update"] == rq.NO_SESSION_OPEN
    assert rules.opens == {"begin_weight_update"} and rules.closes == {"end_weight_update"}
    for name in ("update_weights_from_disk", "init_weights_update_group", "destroy_weights_update_group"):
        assert name not in rules.refused_without  # the folder route and the group routes need none


def test_the_parser_sees_a_release_that_drops_or_adds_a_guard(release):
    """The check can fail: the same file with the distributed route's guard gone, or with a new
    one on the disk route, gives other rules."""
    src = release.source(WEIGHT_UPDATER)
    unguarded = src.replace('message="update_weights_from_distributed must run', 'message_="x', 1)
    with pytest.raises(AssertionError, match="without a literal refusal"):
        parse_session_rules(unguarded)
    start = src.index("def update_weights_from_distributed(")
    body = src.index("if self._session is None:", start)
    dropped = src[:body] + "if False:" + src[body + len("if self._session is None:"):]
    assert "update_weights_from_distributed" not in parse_session_rules(dropped).refused_without
    disk = src.index("def update_weights_from_disk(")
    doc_end = (src.index('"""In-place update of the weights from disk."""', disk)
               + len('"""In-place update of the weights from disk."""'))
    guarded = (src[:doc_end] + '\n        if self._session is None:\n            return UpdateWeightFromDiskReqOutput('
               'success=False, message="needs a session")' + src[doc_end:])
    assert parse_session_rules(guarded).refused_without["update_weights_from_disk"] == "needs a session"


def test_begin_and_end_are_post_routes_answering_400_on_refusal_with_the_client_bodies(release):
    src = release.source("sglang/srt/entrypoints/http_server.py")
    for route in ("/begin_weight_update", "/end_weight_update"):
        assert "POST" in release.routes[route]
        handler = src[src.index(f'@app.post("{route}")'):][:800]
        assert '{"success": success, "message": message}' in handler
        assert "status_code=HTTPStatus.OK if success else HTTPStatus.BAD_REQUEST" in handler
    base = set(release.io_fields("BaseReq"))
    assert set(release.io_fields("BeginWeightUpdateReqInput")) - base == {"selector"}
    assert set(release.io_fields("EndWeightUpdateReqInput")) - base == set()
    release.check_io_body("BeginWeightUpdateReqInput", rq.begin_session_body())
    release.check_io_body("EndWeightUpdateReqInput", rq.end_session_body())
    with pytest.raises(AssertionError, match="does not fit"):  # the check can fail
        release.check_io_body("BeginWeightUpdateReqInput", {"selector": "both"})
    for name in ("BeginWeightUpdateReqOutput", "EndWeightUpdateReqOutput"):
        assert set(release.io_fields(name)) - base == {"success", "message"}


# ---- the sender against engines that answer by the release's rules --------------------------

class ReleaseEngines:
    """SGLang servers as the learner's client sees them: each URL holds a session flag and
    answers the weight routes by the release's session rules (400 {"success": false, "message"}
    with its message). `refuse[(url, route)] = n` fails that route's n-th call (1-based) after the
    session check, as a receive that failed; `calls[url]` logs (route, status)."""

    def __init__(self, rules, urls, open_at_start=()):
        self.rules = rules
        self.open = {u: u in open_at_start for u in urls}
        self.calls: dict[str, list[tuple[str, int]]] = {u: [] for u in urls}
        self.refuse: dict[tuple[str, str], int] = {}

    def answer(self, url: str, route: str):
        name, n = route.strip("/"), sum(1 for r, _ in self.calls[url] if r == route) + 1
        msg = None
        if name in self.rules.refused_without and not self.open[url]:
            msg = self.rules.refused_without[name]
        elif name in self.rules.refused_while_open and self.open[url]:
            msg = self.rules.refused_while_open[name]
        elif self.refuse.get((url, route)) == n:
            msg = "Failed to receive weights: peer closed"
        self.calls[url].append((route, 400 if msg else 200))
        if msg:
            raise EngineHTTPError(url, route, 400, json.dumps({"success": False, "message": msg}))
        self.open[url] = (self.open[url] or name in self.rules.opens) and name not in self.rules.closes
        return {"tp_size": 1} if route == "/server_info" else {"success": True, "message": "Success"}


@pytest.fixture
def engines(release, monkeypatch, tmp_path):
    urls = ["http://10.0.0.1:1", "http://10.0.0.2:1"]
    fake = ReleaseEngines(release.session_rules, urls)

    async def arequest(self, method, route, body=None, **kw):
        return fake.answer(self.url, route)

    monkeypatch.setattr(SGLangClient, "arequest", arequest)
    monkeypatch.setattr(ws, "init_custom_group", lambda *a, **k: object())  # no rendezvous
    monkeypatch.setattr(ws, "_broadcast", lambda *a, **k: None)
    monkeypatch.setattr(ws.dist, "destroy_process_group", lambda group: None)
    monkeypatch.setattr(ws.WeightSender, "_fallback_folder", lambda self, v, b: f"/fallback/v{v}")
    s = ws.WeightSender(str(tmp_path / "notice.json"), "127.0.0.1", str(tmp_path / "fb"), ({}, []), timeout_s=5.0)
    s._staged = (3, [[("a", torch.ones(2))], [("b", torch.ones(2))]])
    yield fake, urls, s
    s.close()


def request(urls, group="g") -> dict:
    return {"id": "r", "engines": [{"index": i, "url": u, "group": f"{group}{i}"} for i, u in enumerate(urls)]}


SESSION = ["/begin_weight_update", "/update_weights_from_distributed", "/update_weights_from_distributed",
           "/end_weight_update"]


def routes(fake, url) -> list[str]:
    return [r for r, _ in fake.calls[url] if r not in ("/server_info", "/init_weights_update_group")]


def test_every_version_goes_to_every_engine_inside_a_session(engines):
    fake, urls, s = engines
    for version in (3, 4):
        s._staged = (version, s._staged[1])
        result = s.serve(request(urls))
        assert result["ok"] == [0, 1] and result["failed"] == {}, result
    for u in urls:
        assert routes(fake, u) == SESSION * 2 and not fake.open[u]
        assert all(status == 200 for _, status in fake.calls[u])


def test_a_failed_bucket_or_join_still_closes_the_session(engines):
    fake, urls, s = engines
    fake.refuse[(urls[1], "/update_weights_from_distributed")] = 1
    result = s.serve(request(urls))
    assert result["ok"] == [0] and "Failed to receive" in result["failed"][1] and result["fallback"] == "/fallback/v3"
    assert routes(fake, urls[1])[:3] == ["/begin_weight_update", "/update_weights_from_distributed",
                                         "/end_weight_update"]
    assert not fake.open[urls[0]] and not fake.open[urls[1]]
    fake.refuse[(urls[0], "/init_weights_update_group")] = 2  # a new group for engine 0 cannot be joined
    result = s.serve(request(urls, group="h"))
    assert result["ok"] == [1] and 0 in result["failed"] and not any(fake.open.values())


def test_a_session_left_open_by_a_dead_learner_is_ended_first(engines):
    fake, urls, s = engines
    fake.open[urls[0]] = True  # the previous learner stopped between begin and end
    result = s.serve(request(urls))
    assert result["ok"] == [0, 1], result
    assert [c for c in fake.calls[urls[0]] if c[0] != "/server_info"][1:4] == [
        ("/begin_weight_update", 400), ("/end_weight_update", 200), ("/begin_weight_update", 200)]
    assert not any(fake.open.values())


def test_the_client_ends_a_stale_session_and_takes_the_not_open_refusal_as_none(engines):
    fake, urls, _ = engines

    async def go():
        c = SGLangClient(urls[0])
        first = await c.aend_stale_weight_update()
        fake.open[urls[0]] = True
        second = await c.aend_stale_weight_update()
        fake.refuse[(urls[0], "/end_weight_update")] = 3  # any other refusal is an error
        fake.open[urls[0]] = True
        with pytest.raises(EngineHTTPError, match="Failed to receive"):
            await c.aend_stale_weight_update()
        return first, second

    assert asyncio.run(go()) == (False, True)


# ---- the stand-in holds the same rules, and serves part of a version as the release would --------

@pytest.mark.timeout(180)
def test_the_standin_holds_the_release_session_and_serves_a_half_version_as_sglang_would(release, tmp_path):
    """The stand-in answers the session's calls with the wheel's rules and messages, and, as the
    release, loads each bucket as it arrives: after a version stopped at its first bucket, a
    resumed stand-in decodes on the mix and its log counts those tokens (what the rollout
    manager must never let happen: tests/unit/rollout/test_manager_distributed.py)."""
    from safetensors.torch import load_file

    from megatron_darl.types import GenerateRequest, SamplingParams
    from tests.helpers.engines import asend_first_bucket_only, asession_answers, running_standin, save_wide
    from tests.helpers.sglang_standin import served_calls

    save_wide(tmp_path / "a", seed=1)
    save_wide(tmp_path / "b", seed=2)
    rules = release.session_rules
    first = sorted(load_file(str(tmp_path / "b" / "model.safetensors")).items())[:5]

    async def half_version(url):
        await asend_first_bucket_only(url, first, "half")
        async with SGLangClient(url, max_retries=0) as c:
            await c.aresume()
            return await c.agenerate(GenerateRequest([3, 4], SamplingParams(temperature=0.0, max_new_tokens=4), "m"))

    with running_standin(tmp_path / "a", tmp_path) as (url, calls):
        answers = asyncio.run(asession_answers(url))
        asyncio.run(half_version(url))
        served = served_calls(calls)
    assert answers == [
        ("/update_weights_from_distributed", 400, rules.refused_without["update_weights_from_distributed"]),
        ("/end_weight_update", 400, rules.refused_without["end_weight_update"]),
        ("/begin_weight_update", 200, "Success"),
        ("/begin_weight_update", 400, rules.refused_while_open["begin_weight_update"]),
        ("/end_weight_update", 200, "Success"), ("/end_weight_update", 400, rules.refused_without["end_weight_update"])]
    assert [c["mixed"] for c in served if c["route"] == "/end_weight_update" and c["status"] == 200][-1] is True
    assert [c["mixed_tokens"] for c in served if c["route"] == "/generate"] == [4]
