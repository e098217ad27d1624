"""Rollout role: the engine protocol, its request/response types, and the rollout config.

What it is: the contract between the rollout manager and any generation backend. One protocol
(`RolloutEngine`) is implemented by the SGLang HTTP client, which also drives the project's
embedded `darl-engine` server (it speaks the same HTTP protocol), so the manager never knows
which backend it drives.
What it is not: transport code or decoding code; those live in `sglang_client.py` and
`engine_server.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from megatron_darl.types import WeightVersion

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class SamplingParams:
    """The subset of SGLang `sampling_params` an RL rollout uses. `to_json` gives SGLang's
    field names: `seed` travels as `sampling_seed` (SGLang's SamplingParams is a strict struct:
    an unknown key fails the whole request)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation (SGLang's convention)
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None  # per-request sampler seed (SGLang: `sampling_seed`, an int64)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "max_new_tokens": int(self.max_new_tokens),
            "stop_token_ids": [int(t) for t in self.stop_token_ids],
            "ignore_eos": bool(self.ignore_eos),
        }
        if self.seed is not None:
            d["sampling_seed"] = int(self.seed)
        return d


@dataclass
class GenerateRequest:
    """One sequence to continue: `input_ids` is the prompt plus any partial response so far."""

    input_ids: list[int]
    sampling: SamplingParams
    rid: str  # request id, used by /abort_request


@dataclass
class GenerateResponse:
    """What came back for one request. `output_versions[t]` is the weight version that sampled
    token t, read from the answer's `meta_info.weight_versions` spans (`[{version, start,
    end}]`, one per version that produced tokens; SGLang and the embedded engine both send
    them), or from its single `weight_version` when a server sends no spans."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation backend as the rollout manager sees it (one per engine URL).

    `apause(mode)` stops generation between decode steps: `abort` ends in-flight requests
    with finish_reason "abort" and returns their partial output (the manager resubmits the
    continuation later, tagging the partial tokens with their version), `retract`/`in_place`
    keep them on the engine to continue after `aresume()` under whatever weights are loaded.
    """

    url: str

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse: ...

    async def apause(self, mode: str = "abort") -> None: ...

    async def aresume(self) -> None: ...

    async def aupdate_weights(self, weights: WeightVersion) -> None: ...

    async def ahealth(self) -> bool: ...


@dataclass
class RolloutConfig:
    """How trajectories are generated. Field comments are the documentation."""

    backend: str = "torch"  # "torch": embedded darl-engine processes; "sglang": SGLang servers
    engine_urls: list[str] = field(default_factory=list)  # sglang: servers to use (empty: launcher starts them)
    num_engines: int = 1  # engines the launcher starts (embedded: processes on this node)
    engine_threads: int = 1  # torch threads per embedded engine (1 beats 2 on a shared 2-core box)
    api_key: str | None = None  # sent as Bearer token; the embedded engine requires it when set
    group_size: int = 8  # G: responses sampled per prompt (a group is never split)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    pause_mode: str = "abort"  # how engines pause for a weight update: abort | retract | in_place
    partial_rollout: bool = True  # keep interrupted responses and continue them under new weights
    max_concurrent_per_engine: int = 64  # in-flight requests per engine (least-loaded dispatch)
    request_timeout_s: float = 600.0  # one /generate call; a hung engine is marked down after it
    max_retries: int = 3  # transport retries with exponential backoff before an engine is marked down
    filter_equal_rewards: bool = False  # DAPO-style: drop groups whose rewards are all equal
    # how versions reach engines: "shm" (HF folder in /dev/shm, embedded engines on this node), "disk"
    # (folder on a shared file system), "distributed" (broadcast over a process group through SGLang's
    # /update_weights_from_distributed: NCCL on GPUs, gloo on CPU; no file), "auto" (shm embedded, disk sglang)
    weight_sync: str = "auto"
    weight_sync_timeout_s: float = 120.0  # distributed: bound of every join and broadcast of the weight groups

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "backend": ("torch", "sglang"),
        "pause_mode": PAUSE_MODES,
        "weight_sync": ("auto", "shm", "disk", "distributed", "nccl"),  # nccl: the old name, refused
    }

    def check(self) -> list[tuple[str, str]]:
        errs: list[tuple[str, str]] = []
        if self.group_size < 1:
            errs.append(("group_size", "must be >= 1"))
        if self.max_new_tokens < 1:
            errs.append(("max_new_tokens", "must be >= 1"))
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            errs.append(("temperature", "must be finite and > 0 (behavior log-probs are taken under it)"))
        if not 0 < self.top_p <= 1:  # NaN fails this too
            errs.append(("top_p", "must be in (0, 1]"))
        if self.top_k != -1 and self.top_k < 1:
            errs.append(("top_k", "must be -1 (no truncation) or >= 1"))
        if self.max_concurrent_per_engine < 1:
            errs.append(("max_concurrent_per_engine", "must be >= 1"))
        if not self.partial_rollout and self.pause_mode != "abort":
            errs.append(("partial_rollout", "false (restart interrupted samples) needs pause_mode=abort: "
                         "retract/in_place keep requests on the engine, which continue them"))
        if not self.weight_sync_timeout_s > 0:
            errs.append(("weight_sync_timeout_s", "must be > 0 (every collective of a weight group is bounded)"))
        if self.num_engines < 1 and not self.engine_urls:
            errs.append(("num_engines", "must be >= 1 when no engine_urls are given"))
        return errs
