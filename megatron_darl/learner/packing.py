"""Cutting a TrainBatch into minibatches, data-parallel shares and token-budget micro-batches.

What it is: pure index arithmetic over sequence lengths and group ids, plus `micro_batch`, which
turns a set of rows into the tensors one schedule step consumes.
What it is not: a sequence packer that concatenates several sequences into one row. Rows keep
one sequence each and are right-padded to the longest row of their micro-batch (the causal mask
makes the padding invisible to the real tokens; padded positions carry loss mask 0). Sorting
rows by length before cutting keeps that padding small. The budget counts padded tokens
(rows x padded length), so memory per micro-batch is bounded whatever the length mix.
FP8 GEMMs (Transformer Engine) and sequence parallel need the token dimension to be a multiple
of an alignment (`sequence_multiple`); `pad_batch` rounds every row's length up to it (padding
carries loss mask 0 and comes after the row's tokens, so no real token attends to it), so the
budget counts the padded width too.
FP8 `delayed` with DP > 1: Transformer Engine reduces the amax history over TP x DP (x CP) at
every forward (megatron-core's `get_amax_reduction_group`, unless `tp_only_amax_red`), a
collective every DP rank must enter as often as the others; `dp_lockstep(config)` says so, and
`rank_micro_batches(..., lockstep=True)` then gives every DP rank the same number of
micro-batches (the ranks with fewer get placeholders of their shortest row, loss mask 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megatron_darl.types import TrainBatch

_PADDED_FIELDS = ("tokens", "loss_mask", "behav_logprobs", "token_versions", "prox_logprobs")


def sequence_multiple(fp8_recipe: str | None, tp: int, sequence_parallel: bool) -> int:
    """What the padded width of a micro-batch must be a multiple of: Megatron's FP8 GEMM
    alignment (`fp8_utils.get_fp8_align_size`: 16, 32 for MXFP8) when FP8 is on, times `tp` with
    sequence parallel (the sequence is split over TP ranks, and each rank's share of
    rows x width must stay aligned)."""
    align = 1
    if fp8_recipe is not None:
        from megatron.core.enums import Fp8Recipe
        from megatron.core.fp8_utils import get_fp8_align_size

        align = get_fp8_align_size(Fp8Recipe(fp8_recipe))
    return align * (tp if sequence_parallel else 1)


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def pad_batch(batch: TrainBatch, multiple: int) -> TrainBatch:
    """`batch` with every length rounded up to `multiple` and the per-token arrays widened to
    match (zeros: token 0, loss mask 0, log-probs 0, version -1). The same object when
    `multiple` is 1; the caller's batch is never modified."""
    if multiple <= 1:
        return batch
    lengths = np.array([round_up(n, multiple) for n in batch.lengths], dtype=batch.lengths.dtype)
    width = max(int(lengths.max()), batch.tokens.shape[1])

    def widen(a: np.ndarray | None, fill: float = 0) -> np.ndarray | None:
        if a is None or a.shape[1] == width:
            return a
        return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)

    arrays = {f: widen(getattr(batch, f), -1 if f == "token_versions" else 0) for f in _PADDED_FIELDS}
    by_version = {k: widen(v) for k, v in (batch.behav_logprobs_by_version or {}).items()} or None
    return dataclasses.replace(batch, lengths=lengths, behav_logprobs_by_version=by_version, **arrays)


def split_minibatches(group_index: np.ndarray, n: int, seed=0) -> list[np.ndarray]:
    """Row indices of `n` minibatches: a random partition of the groups (a group is never split),
    balanced by group count; fewer than `n` when there are fewer groups. The groups are shuffled
    with `np.random.default_rng(seed)` (the loop passes `(train.seed, step)`: the same partition
    on every rank and on a rerun), so each minibatch holds a mix of behavior versions; cutting
    the batch in selection or version order would put the stalest groups in the last update and
    turn the per-version objective into a plain token mean per minibatch. Rows keep batch order
    within a minibatch."""
    groups = np.array(list(dict.fromkeys(int(g) for g in group_index)), dtype=np.int64)
    if len(groups) == 0:
        return []
    order = np.random.default_rng(seed).permutation(len(groups))
    owner = dict(zip(groups[order].tolist(), np.arange(len(groups)) * min(n, len(groups)) // len(groups)))
    part = np.array([owner[int(g)] for g in group_index], dtype=np.int64)
    return [np.flatnonzero(part == p) for p in range(min(n, len(groups)))]


def dp_share(rows: np.ndarray, lengths: np.ndarray, dp: int, dp_rank: int) -> np.ndarray:
    """This DP rank's rows: longest first to the least-loaded rank (balanced token counts)."""
    load = [0] * dp
    owner = {}
    for r in sorted(rows.tolist(), key=lambda r: (-int(lengths[r]), r)):
        k = min(range(dp), key=lambda j: (load[j], j))
        owner[r] = k
        load[k] += int(lengths[r])
    return np.array([r for r in rows.tolist() if owner[r] == dp_rank], dtype=np.int64)


def pack_rows(rows: np.ndarray, lengths: np.ndarray, budget_tokens: int) -> list[np.ndarray]:
    """Group rows into micro-batches whose padded size `len(rows) * max_len` stays within
    `budget_tokens` (a single row longer than the budget gets a micro-batch of its own)."""
    order = sorted(rows.tolist(), key=lambda r: (-int(lengths[r]), r))
    out: list[list[int]] = []
    for r in order:
        if out and (len(out[-1]) + 1) * int(lengths[out[-1][0]]) <= budget_tokens:
            out[-1].append(r)  # rows are sorted longest first, so the first row sets the width
        else:
            out.append([r])
    return [np.array(mb, dtype=np.int64) for mb in out]


def to_device(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array on `device`; on CUDA through pinned memory without waiting (a pageable copy
    would wait for the work already queued, e.g. the previous optimizer step)."""
    t = torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def micro_batch(batch: TrainBatch, rows: np.ndarray, device: torch.device, *, live: bool = True) -> dict:
    """Tensors of one micro-batch, trimmed to its longest row. `live=False` zeroes the loss mask
    (a placeholder micro-batch for a DP rank that got no rows, so collectives still line up)."""
    width = int(batch.lengths[rows].max())
    t = lambda a, dt: to_device(a[rows][:, :width], dt, device)  # noqa: E731
    mask = t(batch.loss_mask, torch.float32)
    mb = {
        "rows": rows,
        "live": live,
        "tokens": t(batch.tokens, torch.long),
        "loss_mask": mask if live else torch.zeros_like(mask),
        "behav_logprobs": t(batch.behav_logprobs, torch.float32),
        "advantages": to_device(batch.advantages[rows], torch.float32, device),
        "versions": to_device(batch.versions[rows], torch.long, device),
    }
    if batch.token_versions is not None:  # each token's own version (-1 off the response: the row's)
        tv = t(batch.token_versions, torch.long)
        mb["token_versions"] = torch.where(tv >= 0, tv, mb["versions"].unsqueeze(-1))
    if batch.prox_logprobs is not None:
        mb["prox_logprobs"] = t(batch.prox_logprobs, torch.float32)
    if batch.behav_logprobs_by_version:
        mb["behav_logprobs_by_version"] = {k: t(v, torch.float32) for k, v in batch.behav_logprobs_by_version.items()}
    return mb


def dp_lockstep(config) -> bool:
    """Whether every DP rank must run as many forwards as the others (a Megatron
    TransformerConfig): FP8 `delayed` reduces amax over TP x DP at each forward unless
    `tp_only_amax_red`; a rank with fewer micro-batches would leave the others waiting in it."""
    return bool(getattr(config, "fp8", None)) and getattr(config, "fp8_recipe", None) == "delayed" \
        and not getattr(config, "tp_only_amax_red", False)


def micro_batch_counts(rows: np.ndarray, lengths: np.ndarray, budget_tokens: int, dp: int) -> list[int]:
    """Each DP rank's number of micro-batches of `rows` (1 for a rank without rows: its placeholder)."""
    return [max(1, len(pack_rows(dp_share(rows, lengths, dp, r), lengths, budget_tokens))) for r in range(dp)]


def rank_micro_batches(batch: TrainBatch, rows: np.ndarray, budget_tokens: int, dp: int, dp_rank: int,
                       device: torch.device, *, lockstep: bool = False) -> list[dict]:
    """This DP rank's micro-batches of the given rows (at least one, possibly a placeholder).
    `lockstep` (see `dp_lockstep`): as many as the DP rank with the most, padded with
    placeholders of this rank's shortest row (every rank computes every rank's count: the
    arithmetic is the same on all of them)."""
    mine = dp_share(rows, batch.lengths, dp, dp_rank)
    if len(mine) == 0:
        mbs = [micro_batch(batch, rows[:1], device, live=False)]
        spare = rows[np.argmin(batch.lengths[rows])]
    else:
        mbs = [micro_batch(batch, mb, device) for mb in pack_rows(mine, batch.lengths, budget_tokens)]
        spare = mine[np.argmin(batch.lengths[mine])]
    if lockstep and dp > 1:
        want = max(micro_batch_counts(rows, batch.lengths, budget_tokens, dp))
        mbs += [micro_batch(batch, np.array([spare]), device, live=False) for _ in range(want - len(mbs))]
    return mbs
