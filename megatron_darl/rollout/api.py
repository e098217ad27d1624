"""The engine protocol: what the rollout manager (and evaluation) asks of any generation backend.

What it is: `RolloutEngine`. The SGLang HTTP client implements it (`sglang_client.py`), and drives
the project's embedded `darl-engine` too (it speaks the same HTTP protocol), so the manager never
knows which backend it drives; the request and response types are in `types.py` (they cross the
HTTP boundary).
What it is not: transport code (`sglang_client.py`) or decoding code (`engine/`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from megatron_darl.types import GenerateRequest, GenerateResponse, WeightVersion


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
