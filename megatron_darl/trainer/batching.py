"""From replay candidates to the batch a step trains on: advantages, D-ARL selection, subsets.

What it is: the glue between the replay store (groups of trajectories) and the learner
(a padded `TrainBatch`). `candidate_batch` pads candidate groups into one batch with their
group-relative advantages (GRPO / Dr.GRPO / RLOO: a group's advantages do not depend on which
other groups are chosen); `choose_groups` applies the variance-guided selection of ALGORITHM.md
to proximal log-probs the learner recomputed (or FIFO, `fifo_order`, for the baselines and in
warmup); `take_groups` cuts the
chosen groups out of the batch; `prepare_batch` runs these with the learner's recompute for one
step: selection recomputes every candidate (it scores them), FIFO only the groups it trains.
What it is not: the maths (`algo/`), the pool and its ageing (`replay_store.py`), or the learner.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from megatron_darl import algo
from megatron_darl.algo.config import AlgoConfig
from megatron_darl.trainer.replay_store import Candidates
from megatron_darl.types import TrainBatch, make_train_batch


def group_advantages(rewards: np.ndarray, group_index: np.ndarray, cfg: AlgoConfig) -> np.ndarray:
    r = torch.as_tensor(rewards, dtype=torch.float64)
    g = torch.as_tensor(group_index, dtype=torch.long)
    if cfg.advantage == "rloo":
        adv = algo.rloo_advantages(r, g)
    else:
        adv = algo.grpo_advantages(r, g, norm_by_std=cfg.advantage == "grpo", eps=cfg.adv_eps)
    return adv.numpy().astype(np.float32)


def candidate_batch(cands: Candidates, cfg: AlgoConfig) -> TrainBatch:
    """All candidate groups, in candidate order; `group_index[i]` is the candidate position."""
    trajs = [t for g in cands.groups for t in g.trajectories]
    batch = make_train_batch(trajs, np.zeros(len(trajs), dtype=np.float32))
    batch.group_index = np.repeat(np.arange(len(cands.groups)), [len(g.trajectories) for g in cands.groups])
    batch.advantages = group_advantages(batch.rewards, batch.group_index, cfg)
    return batch


def fifo_order(cands: Candidates, reuse_order: str = "oldest") -> np.ndarray:
    """Candidate positions, never-trained groups first, then reused ones: the baselines' FIFO. A
    reused group never crowds out a never-trained one (the feed offers the never-trained groups
    the step must take). The reused ones in pool order (`algo.reuse_order=oldest`: oldest version
    first, the order they entered the pool) or newest version first (`freshest`; ties in pool
    order)."""
    reuse = cands.reuse
    old = np.flatnonzero(reuse > 0)
    if reuse_order == "freshest":
        old = old[np.argsort(-np.asarray(cands.versions)[old], kind="stable")]
    return np.concatenate([np.flatnonzero(reuse == 0), old]).astype(np.int64)


def choose_groups(batch: TrainBatch | None, cands: Candidates, batch_groups: int, cfg: AlgoConfig,
                  step: int) -> tuple[np.ndarray, dict[str, float]]:
    """Candidate positions to train on this step, and selection metrics.

    With `algo.sg`, after warmup, groups are scored by the second moment of the log weight
    `mean_t (p - b)^2` against proximal log-probs and gated by `algo.select_groups` (threshold
    `max(quantile, cfg.sg_tau_floor)`; with `algo.sg_new_first` the never-trained candidates are
    taken first and the gate picks reused groups for the room left); otherwise, and in warmup (when
    the store offers only never-trained groups, which the step trains, a full batch), `fifo_order`
    (FIFO reads no batch).
    `algo/select/reused_admitted`: the reused candidates selection admits (score within the
    threshold; FIFO: every one), from which the feed plans how many new groups the next step takes.
    `algo/select/filtered_groups`: candidates the gate kept out of the batch (FIFO: none).
    """
    versions = torch.as_tensor(cands.versions)
    reused = torch.as_tensor(cands.reuse) > 0
    warm = step < cfg.effective_warmup
    if not cfg.sg or warm or batch is None or batch.prox_logprobs is None:
        chosen = torch.as_tensor(fifo_order(cands, cfg.reuse_order)[:batch_groups])
        metrics = algo.selection_metrics(versions, chosen)
        metrics["algo/select/reused_admitted"] = float(reused.sum())
        metrics["algo/select/filtered_groups"] = 0.0
        return chosen.numpy(), metrics
    mask = torch.as_tensor(batch.loss_mask)
    seq_scores = algo.variance_scores(torch.as_tensor(batch.prox_logprobs), torch.as_tensor(batch.behav_logprobs), mask)
    _, g_scores, _ = algo.group_scores(seq_scores, torch.as_tensor(batch.group_index), torch.as_tensor(batch.versions))
    gate = dict(quantile=cfg.sg_quantile, tau_abs=cfg.sg_tau_abs, tau_floor=cfg.sg_tau_floor)
    chosen = algo.select_groups(g_scores, versions, batch_groups=batch_groups, fill=cfg.sg_fill,
                                never_trained=~reused if cfg.sg_new_first else None, **gate)
    tau, admitted = algo.admitted_groups(g_scores, versions, **gate)
    metrics = algo.selection_metrics(versions, chosen, tau)
    left_out = torch.ones(len(g_scores), dtype=torch.bool).index_fill_(0, chosen, False)
    # groups the gate kept out of the batch (fill may take a group the gate did not admit)
    metrics["algo/select/filtered_groups"] = float((left_out & ~admitted).sum())
    # the quantile alone, beside the tau used: where it is below the floor, the floor gates
    metrics["algo/select/tau_quantile"] = algo.selection_threshold(g_scores, versions, quantile=cfg.sg_quantile)
    metrics["algo/select/admitted_frac"] = float(admitted.double().mean()) if len(g_scores) else 0.0
    metrics["algo/select/score_mean"] = float(g_scores.mean()) if len(g_scores) else 0.0
    metrics["algo/select/reused_admitted"] = float((admitted & reused).sum())
    return chosen.numpy(), metrics


def take_groups(batch: TrainBatch, positions: np.ndarray) -> TrainBatch:
    """The rows of the chosen candidate groups, groups renumbered 0..n-1 in chosen order."""
    rows = np.concatenate([np.flatnonzero(batch.group_index == p) for p in positions]) if len(positions) else \
        np.zeros(0, dtype=np.int64)
    width = int(batch.lengths[rows].max()) if len(rows) else 1
    renumber = {int(p): i for i, p in enumerate(positions)}
    pick = lambda a: None if a is None else a[rows][:, :width]  # noqa: E731 - 2-D arrays trimmed to the new width
    return TrainBatch(
        tokens=pick(batch.tokens), lengths=batch.lengths[rows], loss_mask=pick(batch.loss_mask),
        advantages=batch.advantages[rows], behav_logprobs=pick(batch.behav_logprobs),
        token_versions=pick(batch.token_versions), versions=batch.versions[rows],
        group_index=np.array([renumber[int(g)] for g in batch.group_index[rows]], dtype=np.int64),
        rewards=batch.rewards[rows], prompt_ids=batch.prompt_ids[rows], prox_logprobs=pick(batch.prox_logprobs),
        behav_logprobs_by_version=None if batch.behav_logprobs_by_version is None else
        {k: pick(v) for k, v in batch.behav_logprobs_by_version.items()},
    )


def prepare_batch(cfg, learner, cands: Candidates | None, step: int) -> tuple[TrainBatch, np.ndarray | None, dict]:
    """One step's batch, collectively (every learner rank calls it; `cands` on the main rank,
    None elsewhere): `(batch, chosen, metrics)`. `batch` (every rank) is what the step trains on,
    with proximal log-probs where the loss or selection reads them and, for `pmis_beta=balance`,
    `log mu_k` of the kept versions; `chosen` (main rank) the candidate positions trained;
    `metrics` (main rank) selection's plus `perf/recompute_s` and `perf/select_s`.

    Selection (`algo.sg`) scores every candidate, so it recomputes all of them and keeps the
    chosen rows; FIFO (baselines, the no-selection ablation) chooses first and recomputes only
    the groups it trains."""
    main = learner.is_main
    spent = {"perf/recompute_s": 0.0, "perf/select_s": 0.0}

    def timed(key, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        spent[key] += time.perf_counter() - t
        return out

    def choose(batch):
        return choose_groups(batch, cands, cfg.train.batch_prompts, cfg.algo, step) if main else (None, {})

    if cfg.algo.sg:
        batch = learner.broadcast_batch(candidate_batch(cands, cfg.algo) if main else None)
        batch.prox_logprobs = timed("perf/recompute_s", learner.compute_logprobs, batch)
        chosen, metrics = timed("perf/select_s", choose, batch)
        train = learner.broadcast_batch(take_groups(batch, chosen) if main else None)
    else:
        chosen, metrics = timed("perf/select_s", choose, None)
        kept = Candidates(step, [cands.groups[i] for i in chosen]) if main else None
        train = learner.broadcast_batch(candidate_batch(kept, cfg.algo) if main else None)
        if cfg.algo.computes_proximal:  # read by the loss, or (naive async) by the drift diagnostics
            train.prox_logprobs = timed("perf/recompute_s", learner.compute_logprobs, train)
    # log mu_k of every version with kept weights (the current one is p): balance's, or the
    # engine-learner mismatch of every token at its own version (learner.mismatch_every)
    if learner.pmis == "balance" or learner.measures_mismatch(step):
        versions = set(train.token_versions[train.loss_mask > 0].tolist()) | set(train.versions.tolist())
        train.behav_logprobs_by_version = timed("perf/recompute_s", learner.compute_version_logprobs, train,
                                                sorted(versions - {step}))
    metrics.update(spent)
    return train, chosen, metrics
