"""Replay role: its configs and the types that cross its boundary (store <-> learner).

What it is: `ReplayConfig` (replay window, reuse, variance-guided selection, P-MIS switches, the
on-node ring buffer), `StalenessConfig` (AReaL's admission bound), `ReplayGroup` (one prompt's
G responses as the store keeps them), `Candidates` (what the store offers the learner for one
step) and `SelectFn` (the shape of a selection function, uniform for baselines or D-ARL's
`algo.select_groups`).
What it is not: the ring buffer (`shm_ring.py`), the store (`store.py`), the gate
(`staleness.py`) or the selection maths (`algo/`).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from megatron_darl.types import Trajectory

PMIS_BETAS = ("ess", "tokens", "balance")
SG_FILLS = ("fresh", "none")
BALANCE_SNAPSHOTS = ("exact", "interpolate", "auto")


@dataclass
class ReplayConfig:
    """Replay over the K newest behavior versions (ALGORITHM.md). Field comments are the docs."""

    enable: bool = True  # false: every group is trained once then dropped (baselines); no age eviction
    # K: window of behavior versions kept; a group of version v leaves when t - v > K. New data is
    # at most eta (staleness.max_head_offpolicyness) old, so a group is replayed from K - eta versions
    k: int = 4
    max_reuse: int | None = None  # times a group may be trained; None: K (see effective_max_reuse)
    sg: bool = True  # variance-guided selection (score = mean of l^2, threshold from the freshest version)
    sg_quantile: float = 0.9  # q: tau = quantile of the freshest version's group scores
    sg_tau_abs: float | None = None  # absolute score cap for stale groups only (0.04 is a good try)
    # floor of tau: a group whose score (mean squared log weight, ~ Var of its weights) is within
    # it still matches the current policy, however small the freshest groups' scores (~1e-13 where
    # engine and learner compute the same log-probs, which would admit no stale group)
    sg_tau_floor: float = 0.01
    sg_fill: str = "fresh"  # batch short after gating: "fresh" fills with the freshest rest, "none" leaves it short
    warmup: int = 5  # with `sg`: the first `warmup` steps train full batches of never-trained groups (no replay)
    pmis: bool = True  # per-version objective with weights beta_k (false: one collapsed token mean)
    pmis_beta: str = "ess"  # beta_k: "ess" (inverse variance) | "tokens" (N_k/N) | "balance" (Veach)
    # balance's log mu_k: "exact" keeps a CPU copy of the weights of the K previous versions and
    # rescores the batch with each; "interpolate" approximates log-linearly between b and p (no
    # copies); "auto": exact when K copies of the parameters fit in 2 GiB, else interpolate
    balance_snapshots: str = "auto"
    ring_bytes: int = 268435456  # size of the on-node shared-memory ring buffer (bytes, 256 MiB)
    ring_name: str | None = None  # segment name under /dev/shm; None: the launcher derives one per run and node
    ring_checksum: bool | None = None  # crc32 per record; None: on unless the CPU is x86-64 (see shm_ring.py)

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "sg_fill": SG_FILLS,
        "pmis_beta": PMIS_BETAS,
        "balance_snapshots": BALANCE_SNAPSHOTS,
    }

    @property
    def effective_max_reuse(self) -> int:
        """How many times a group may be trained: 1 with replay off, else `max_reuse` or K."""
        if not self.enable:
            return 1
        return self.k if self.max_reuse is None else self.max_reuse

    @property
    def effective_warmup(self) -> int:
        """Steps of selection warmup: `warmup` with variance-guided selection, else 0. Warmup is
        part of selection; without it (baselines, the no-selection ablation) every step takes
        the oldest groups, or the skipped ones would be trained late, staler than eta allows."""
        return self.warmup if self.enable and self.sg else 0

    @property
    def effective_ring_checksum(self) -> bool:
        """Checksums are needed where stores may become visible out of order (not x86-64)."""
        if self.ring_checksum is not None:
            return self.ring_checksum
        return platform.machine().lower() not in ("x86_64", "amd64")

    def check(self) -> list[tuple[str, str]]:
        errs: list[tuple[str, str]] = []
        if self.k < 1:
            errs.append(("k", "must be >= 1"))
        if self.max_reuse is not None and self.max_reuse < 1:
            errs.append(("max_reuse", "must be >= 1 or null (null means k)"))
        if not 0.0 < self.sg_quantile <= 1.0:
            errs.append(("sg_quantile", "must be in (0, 1]"))
        if self.sg_tau_abs is not None and self.sg_tau_abs <= 0:
            errs.append(("sg_tau_abs", "must be > 0 or null"))
        if self.sg_tau_floor < 0:
            errs.append(("sg_tau_floor", "must be >= 0 (0: tau is the quantile alone)"))
        if self.warmup < 0:
            errs.append(("warmup", "must be >= 0"))
        if self.ring_bytes < 1 << 16:
            errs.append(("ring_bytes", "must be >= 65536 (a record never spans more than the ring)"))
        if self.ring_name is not None and (not self.ring_name or "/" in self.ring_name):
            errs.append(("ring_name", "must be a non-empty file name without '/'"))
        return errs


@dataclass
class StalenessConfig:
    """AReaL's admission bound on how far generation may run ahead of training."""

    max_head_offpolicyness: int = 4  # eta: batches generation may run ahead; 0 = synchronous

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {}

    def check(self) -> list[tuple[str, str]]:
        if self.max_head_offpolicyness < 0:
            return [("max_head_offpolicyness", "must be >= 0 (0 means synchronous)")]
        return []


@dataclass
class ReplayGroup:
    """One prompt's G responses as the store keeps them.

    `version` is the oldest behavior version among the group's tokens (staleness is measured
    from the oldest policy that contributed); `reuse` counts the steps that trained on it.
    """

    group_id: int
    version: int
    trajectories: list[Trajectory]
    reuse: int = 0
    added_step: int = 0  # learner step at which the group became complete

    @property
    def num_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.trajectories)


@dataclass
class Candidates:
    """The groups a step may train on, in pool order (oldest version first, then group id).

    The learner recomputes proximal log-probs for them, scores each group, calls its
    selection function with (`scores`, `versions`, batch_groups) and passes the chosen indices
    (positions in this list) to `ReplayStore.commit`.
    """

    step: int
    groups: list[ReplayGroup]

    @property
    def versions(self) -> np.ndarray:
        return np.array([g.version for g in self.groups], dtype=np.int64)

    @property
    def reuse(self) -> np.ndarray:
        return np.array([g.reuse for g in self.groups], dtype=np.int64)

    @property
    def group_ids(self) -> np.ndarray:
        return np.array([g.group_id for g in self.groups], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.groups)


class SelectFn(Protocol):
    """Selection hook: `(group_scores float64 [n], group_versions int64 [n], batch_groups)` ->
    indices (any 1-D integer array-like, e.g. a CPU torch tensor) of at most `batch_groups`
    distinct candidates. `algo.select_groups` has this shape once its tensors are adapted."""

    def __call__(self, group_scores: np.ndarray, group_versions: np.ndarray, batch_groups: int): ...
