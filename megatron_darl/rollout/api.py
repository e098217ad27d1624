"""The rollout side's interfaces: what the manager (and evaluation) asks of what it drives.

What it is: `RolloutEngine`, the generation backend. The SGLang HTTP client implements it
(`sglang_client.py`), and drives the project's embedded `darl-engine` too (it speaks the same
HTTP protocol), so the manager never knows which backend it drives; the request and response
types are in `types.py` (they cross the HTTP boundary). Beside it, what the manager drives:
`TrajectorySink` (the ring buffer), `PromptProvider` (the prompt loader) and `AdmissionGate` (the
staleness gate).
What it is not: transport code (`sglang_client.py`) or decoding code (`engine/`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from megatron_darl.types import GenerateRequest, GenerateResponse, Trajectory, WeightVersion


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


class TrajectorySink(Protocol):
    """Where finished groups go (the ring buffer); a group is written whole or raises."""

    async def aput_group(self, trajectories: list[Trajectory]) -> None: ...


class PromptProvider(Protocol):
    """`data.api.PromptLoader` has this shape: draws in a resumable order."""

    def next_batch(self, n: int) -> list[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AdmissionGate(Protocol):
    """AReaL's staleness bound counted in groups (`rollout/staleness.py`, `StalenessGate`, has this
    shape): `try_acquire` starts one group if allowed, `release` ends it (kept or not)."""

    def capacity(self) -> int: ...

    def try_acquire(self) -> bool: ...

    def release(self, accepted: bool) -> None: ...

    def on_version(self, version: int, consumed: int | None = None, batch_size: int | None = None) -> None: ...
