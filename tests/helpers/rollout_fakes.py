"""In-process stand-ins for the rollout manager's collaborators, shared by the rollout, engine-load
and fault tests.

What it is: `ScriptedPrompt` / `ScriptedPrompts` (a prompt loader over a fixed list, with the
loader's resumable state), `FakeEngine` (a `RolloutEngine`: one token per step, tokens tagged with
the loaded version, SGLang's abort / in_place pause semantics, switches to die or hang, and what it
resumes or decodes while it holds part of a version),
`ParityScorer`, `ListSink`, and `make` / `check_groups`, which build and check a manager's run.
What it is not: a test, or a stand-in for a real engine process (`engines.py` starts darl-engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.workflow import Episode, GroupWorkflow
from megatron_darl.types import GenerateRequest, GenerateResponse, WeightVersion


@dataclass
class ScriptedPrompt:
    """What the manager reads of a `data.api.Prompt`."""

    uid: int
    input_ids: list[int]
    task: str = "math"
    answer: dict = field(default_factory=dict)


class ScriptedPrompts:
    """A prompt loader over `n` prompts with uids `start`.. and token ids `tokens(i)`, drawn in
    order; `state_dict` / `load_state_dict` as `PromptLoader` has them."""

    def __init__(self, n: int, start: int = 100, tokens: Callable[[int], list[int]] = lambda i: [5, 6, i % 9],
                 task: str = "math") -> None:
        self.items = [ScriptedPrompt(start + i, tokens(i), task) for i in range(n)]
        self.pos = 0

    def next_batch(self, n: int) -> list[ScriptedPrompt]:
        out = self.items[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])


EOS = 0
VOCAB = 97


def fake_token(seed: int | None, pos: int) -> int:
    """Deterministic 'sampling': a hash of (seed, absolute position), never EOS unless pos says."""
    return 1 + ((seed or 0) * 31 + pos * 17 + pos * pos) % (VOCAB - 1)


class FakeEngine:
    """RolloutEngine fake: one token per `step_s`, tokens tagged with the loaded version,
    abort/in_place pause semantics like SGLang, and switches to die or hang."""

    def __init__(self, url: str, step_s: float = 0.002, version: int = 0) -> None:
        self.url, self.step_s, self.version = url, step_s, version
        self.paused, self.mode = False, "abort"
        self.dead = self.hang = False
        self.active = 0
        self.max_active = 0
        self.requests: list[GenerateRequest] = []
        self.updates: list[int] = []
        # part of a version loaded (a distributed update that failed half-way, as SGLang leaves it):
        # what it resumes or decodes on that mix is counted; a whole version loaded clears it
        self.mixed = False
        self.resumes_while_mixed = self.mixed_tokens = 0
        self.fail_updates = 0  # aupdate_weights calls that fail (a fallback folder it cannot read)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def _astep(self) -> None:
        await asyncio.sleep(self.step_s)
        if self.dead:
            raise ConnectionError(f"{self.url}: connection refused")
        if self.hang:
            await asyncio.sleep(3600)

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        if self.dead:
            raise ConnectionError(f"{self.url}: connection refused")
        self.requests.append(req)
        await self._resumed.wait()  # a paused engine parks new requests
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self._idle.clear()
        ids, lps, vers, reason = [], [], [], "length"
        try:
            for _ in range(req.sampling.max_new_tokens):
                await self._astep()
                if self.paused and self.mode == "abort":
                    reason = "abort"
                    break
                await self._resumed.wait()  # in_place: frozen, continues under new weights
                tok = fake_token(req.sampling.seed, len(req.input_ids) + len(ids))
                self.mixed_tokens += self.mixed
                ids.append(tok)
                lps.append(-0.01 * tok)
                vers.append(self.version)
                if tok in req.sampling.stop_token_ids:  # as SGLang: the matched token is kept
                    reason = "stop"
                    break
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()
        return GenerateResponse(req.rid, ids, lps, vers, reason, self.version)

    async def apause(self, mode: str = "abort") -> None:
        if self.dead:
            raise ConnectionError(f"{self.url}: connection refused")
        self.paused, self.mode = True, mode
        self._resumed.clear()
        if mode == "abort":
            await self._idle.wait()  # like SGLang: returns once in-flight requests were aborted

    async def aresume(self) -> None:
        if self.dead:
            raise ConnectionError(f"{self.url}: connection refused")
        self.resumes_while_mixed += self.mixed
        self.paused = False
        self._resumed.set()

    async def aupdate_weights(self, weights: WeightVersion) -> None:
        if self.dead:
            raise ConnectionError(f"{self.url}: connection refused")
        if self.fail_updates:
            self.fail_updates -= 1
            raise RuntimeError(f"{self.url}: cannot read {weights.location}")
        self.version, self.mixed = weights.version, False
        self.updates.append(weights.version)

    async def ahealth(self) -> bool:
        return not self.dead and not self.hang


class ParityScorer:
    """Reward = last token parity; uids divisible by `equal_every` get all-equal rewards."""

    def __init__(self, equal_every: int = 0, fail_once: set[int] | None = None) -> None:
        self.equal_every, self.fail_once = equal_every, set(fail_once or ())

    async def ascore(self, episode: Episode) -> list[float]:
        if episode.uid in self.fail_once:
            self.fail_once.discard(episode.uid)
            raise RuntimeError(f"grader crashed on {episode.uid}")
        if self.equal_every and episode.uid % self.equal_every == 0:
            return [1.0] * len(episode.samples)
        return [float(i % 2) for i in range(len(episode.samples))]


class ListSink:
    def __init__(self) -> None:
        self.groups: list[list] = []

    async def aput_group(self, trajectories: list) -> None:
        self.groups.append(trajectories)

    @property
    def uids(self) -> list[int]:
        return [g[0].group_id for g in self.groups]


def make(n_prompts: int = 12, n_engines: int = 2, step_s: float = 0.002, gate=None, scorer=None, **cfg_kw):
    kw = dict(group_size=4, max_new_tokens=8, max_concurrent_per_engine=4, request_timeout_s=5.0)
    kw.update(cfg_kw)
    cfg = RolloutConfig(**kw)
    engines = [FakeEngine(f"fake://{i}", step_s) for i in range(n_engines)]
    prompts, sink = ScriptedPrompts(n_prompts, tokens=lambda i: [5, 6, 7 + i % 4]), ListSink()
    wf = GroupWorkflow(cfg, scorer or ParityScorer(), seed=7)
    return cfg, engines, prompts, sink, wf


def check_groups(sink: ListSink, cfg: RolloutConfig) -> None:
    for g in sink.groups:
        assert len(g) == cfg.group_size and len({t.group_id for t in g}) == 1
        for t in g:
            assert t.prompt_id == t.group_id
            assert len(t.response_ids) == cfg.max_new_tokens and t.finish_reason == "length"
