"""CPU copies of the last K policy versions' parameters, for the balance heuristic's `log mu_k`.

What it is: `PolicySnapshots`, which keeps a CPU copy of this rank's local parameters per
policy version (the weights published as version v are those after v train steps; version 0
is the initial weights), drops versions that left the replay window, and swaps a version's
copy into the live parameters for a no-grad recompute (`swapped`), restoring the current
values bit for bit afterwards. `choose_mode` resolves `algo.balance_snapshots=auto`.
What it is not: the recompute itself (`MegatronLearner.compute_version_logprobs`) or the
balance maths (`algo.balance_weights`, `algo.interpolate_version_logp`).

Snapshots live in process memory only: they are not checkpointed, so after a resume the
versions trained before it are scored by interpolation until they leave the window.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

SNAPSHOT_BUDGET_BYTES = 2 << 30  # auto: exact when K copies of all parameters fit in 2 GiB


def choose_mode(requested: str, k: int, param_bytes: int) -> str:
    """"exact" or "interpolate" for `algo.balance_snapshots` (`param_bytes`: all ranks' parameters)."""
    if requested in ("exact", "interpolate"):
        return requested
    if requested != "auto":
        raise ValueError(f"algo.balance_snapshots={requested!r}; allowed: exact, interpolate, auto")
    return "exact" if k * param_bytes <= SNAPSHOT_BUDGET_BYTES else "interpolate"


class PolicySnapshots:
    """Parameters of the last `k` versions before the current one (the current one is live)."""

    def __init__(self, params: list[torch.Tensor], k: int):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.params, self.k = params, k
        self._kept: dict[int, list[torch.Tensor]] = {}

    @property
    def versions(self) -> list[int]:
        return sorted(self._kept)

    def __contains__(self, version: int) -> bool:
        return int(version) in self._kept

    def keep(self, version: int) -> None:
        """Copy the live parameters as `version` (call before the step that leaves it)."""
        self._kept[int(version)] = [p.detach().to("cpu", copy=True) for p in self.params]

    def clear(self) -> None:
        self._kept.clear()

    def prune(self, current: int) -> None:
        """Forget versions older than `current - k` (they have left the replay window)."""
        for v in [v for v in self._kept if v < current - self.k]:
            del self._kept[v]

    @contextmanager
    def swapped(self, version: int):
        """The live parameters hold `version`'s values inside the block, their own after it."""
        saved = [p.detach().to("cpu", copy=True) for p in self.params]
        try:
            with torch.no_grad():
                for p, s in zip(self.params, self._kept[int(version)]):
                    p.copy_(s)
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)
