"""The RL train step: DDP wrapping, Megatron optimizer and LR schedule, policy-loss heads, minibatch loop.

What it is: `setup_training` wraps the model chunks in Megatron DDP and builds the Megatron
optimizer (`get_megatron_optimizer`; distributed optimizer on GPU) and `OptimizerParamScheduler`;
`train_step` runs `ppo_n_minibatches` optimizer steps over a TrainBatch. Each minibatch is cut
into token-budget micro-batches (`packing.py`) whose losses are normalised by the minibatch's
whole-token count (or per-version counts for D-ARL), so gradient accumulation gives exactly the
gradient of one big batch, whatever the packing, DP size or pipeline schedule.
What it is not: the loss maths (in `megatron_darl.algo`) or the recompute of proximal log-probs
(in `megatron_learner.py`).
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from megatron_darl import algo
from megatron_darl.algo.config import AlgoConfig
from megatron_darl.config.learner import LearnerConfig, OptimConfig
from megatron_darl.learner.collectives import all_gather_json, broadcast_json
from megatron_darl.learner.logprobs import run_schedule
from megatron_darl.learner.optim_step import optimizer_step, use_sync_free_adam
from megatron_darl.learner.packing import rank_micro_batches, split_minibatches
from megatron_darl.types import TrainBatch

# dense bf16 peak FLOP/s per GPU for MFU (by substring of torch.cuda.get_device_name)
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12}


def setup_training(chunks: list, optim: OptimConfig, pg, *, on_gpu: bool):
    """(ddp_chunks, optimizer, scheduler) for this rank's chunks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    use_dist = on_gpu if optim.distributed_optimizer is None else optim.distributed_optimizer
    if use_dist and not on_gpu:
        raise ValueError("optim.distributed_optimizer=true needs CUDA (Megatron's distributed optimizer)")
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=use_dist)
    ddp = [DistributedDataParallel(c.config, ddp_cfg, c, pg_collection=pg) for c in chunks]
    config = chunks[0].config
    # losses are already normalised by the whole batch: finalize must not divide by token counts
    config.finalize_model_grads_func = lambda model, num_tokens=None, **kw: finalize_model_grads(model, None, **kw)
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        # 0 disables clipping; an infinite bound still computes (and reports) the grad norm
        clip_grad=optim.grad_clip if optim.grad_clip > 0 else float("inf"),
        bf16=config.bf16, params_dtype=config.params_dtype, use_distributed_optimizer=use_dist,
    )
    optimizer = get_megatron_optimizer(opt_cfg, ddp, use_gloo_process_groups=False, pg_collection=pg)
    use_sync_free_adam(optimizer)  # torch's AdamW (no apex/TE): fused on CUDA, foreach on CPU
    warmup = optim.lr_warmup_steps
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=warmup + (optim.lr_decay_steps or 1),
        lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler


def minibatch_constants(algo_cfg: AlgoConfig, batch: TrainBatch, rows: np.ndarray,
                        beta: dict[int, float] | None, pmis: str = "ess",
                        prox_version: int | None = None) -> tuple[dict, dict]:
    """Quantities every micro-batch loss of `rows` needs, and their metrics (computed once).
    `train_step` calls it once per step on the WHOLE selected batch (beta_k, N_k and ESS are
    whole-batch constants, ALGORITHM.md) and shares the result out with `minibatch_share`.
    `pmis` (ess | tokens | balance) computes D-ARL's beta_k when the caller passes no `beta`;
    balance also needs `log mu_k` per version (see `balance_logp`; `prox_version` is the
    version of the proximal policy, the learner's step) and mixes versions per token: `alpha_k`
    counts each token for the version that generated it (`token_versions`)."""
    t = lambda a: torch.as_tensor(np.asarray(a)[rows], dtype=torch.float32)  # noqa: E731
    mask = t(batch.loss_mask) > 0
    consts = {"den": max(float(mask.sum()), 1.0)}
    metrics: dict[str, float] = {}
    if algo_cfg.policy_loss == "darl":
        versions = torch.as_tensor(batch.versions[rows])
        counts = algo.version_token_counts(versions, mask)
        by_version, mix = None, None
        if pmis == "balance":
            token_versions = _token_versions(batch, rows, versions)
            mix = algo.version_token_counts(token_versions, mask)
            consts.update(needed=sorted(k for k, n in mix.items() if float(n) > 0), prox_version=prox_version, mix=mix)
            given = {k: t(v) for k, v in (batch.behav_logprobs_by_version or {}).items()}
            by_version, interpolated = balance_logp(consts, given, t(batch.prox_logprobs), t(batch.behav_logprobs),
                                                    token_versions)
            metrics.update({"algo/balance_exact": float(interpolated == 0),
                            "algo/balance_interpolated": float(interpolated)})
        if beta is None:
            beta, counts, m = algo.pmis_batch_constants(
                t(batch.prox_logprobs), t(batch.behav_logprobs), mask, versions,
                **_is_kwargs(algo_cfg), pmis=pmis, behav_logp_by_version=by_version, mixture_counts=mix)
            metrics.update({k: float(v) for k, v in m.items()})
        consts.update(beta={int(k): float(v) for k, v in beta.items()}, counts=counts, pmis=pmis)
    elif algo_cfg.policy_loss == "ppo" and algo_cfg.rollout_is is not None:
        _, m = algo.rollout_is_weights(t(batch.prox_logprobs), t(batch.behav_logprobs), mask,
                                       level=algo_cfg.rollout_is, **_weight_kwargs(algo_cfg))
        metrics.update({k: float(v) for k, v in m.items()})
    return consts, metrics


def minibatch_share(whole: dict, batch: TrainBatch, rows: np.ndarray) -> dict:
    """The constants of one minibatch (`rows`) of a batch whose `minibatch_constants` are
    `whole`: beta_k (and balance's alpha_k) of the whole batch; the token-mean denominator is
    the minibatch's own token count `N_mb`, and N_k becomes `N_k * N_mb / N`, so the
    minibatch's loss `-sum_k beta_k (N / (N_k N_mb)) sum_{mb, k} ...` estimates the whole-batch
    objective from its own tokens (with beta_k = N_k / N: exactly the minibatch token mean,
    the collapsed baseline's update)."""
    den = max(float((np.asarray(batch.loss_mask)[rows] > 0).sum()), 1.0)
    consts = {**whole, "den": den}
    if "counts" in whole:
        scale = den / whole["den"]
        consts["counts"] = {k: float(n) * scale for k, n in whole["counts"].items()}
    return consts


def _token_versions(batch: TrainBatch, rows: np.ndarray, versions: torch.Tensor) -> torch.Tensor:
    """Each token's behavior version `[B, T]` (a sequence's version where none was recorded)."""
    per_row = versions.unsqueeze(-1).expand(len(rows), batch.loss_mask.shape[1])
    if batch.token_versions is None:
        return per_row
    tv = torch.as_tensor(np.asarray(batch.token_versions)[rows], dtype=torch.long)
    tv = torch.where(tv >= 0, tv, per_row)
    mask = torch.as_tensor(np.asarray(batch.loss_mask)[rows]) > 0
    oldest = torch.where(mask, tv, torch.iinfo(torch.long).max).amin(-1)
    bad = mask.any(-1) & (oldest != versions)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"TrainBatch: row {int(rows[i])} has versions={int(versions[i])} but its oldest token "
                         f"version is {int(oldest[i])} (a sequence's version is its oldest token's)")
    return tv


def balance_logp(consts: dict, given: dict, prox: torch.Tensor, behav: torch.Tensor,
                 versions: torch.Tensor) -> tuple[dict[int, torch.Tensor], int]:
    """`log mu_k` of these rows for every version k of the batch (`consts["needed"]`), and
    how many versions were interpolated (and read by tokens of another version). Exact from
    `given` (the batch's kept-snapshot recompute), or the proximal log-probs for the proximal
    version itself; the rest by the log-linear APPROXIMATION `algo.interpolate_version_logp`
    between b and p. `versions`: each token's version `[B, T]` (or each row's `[B]`); a token's
    own version uses its behavior log-prob b (what the engine sampled it with), so one version
    is plain IS and the later tokens of an interrupted rollout are exact for their own version."""
    needed, prox_version = consts["needed"], consts["prox_version"]
    out = {k: given[k] for k in needed if k in given}
    if prox_version in needed and prox_version not in out:
        out[prox_version] = prox
    missing = [k for k in needed if k not in out]
    if missing:
        if prox_version is None:
            raise ValueError(f"pmis='balance': no log-probs for versions {missing} and no prox_version to "
                             "interpolate them")
        out.update(algo.interpolate_version_logp(prox, behav, versions, prox_version, missing))
    own = (lambda k: versions == k) if versions.dim() == 2 else (lambda k: (versions == k).unsqueeze(-1))
    # with one version every token reads its own b: nothing interpolated is used
    return {k: torch.where(own(k), behav, lp) for k, lp in out.items()}, (len(missing) if len(needed) > 1 else 0)


def _weight_kwargs(a: AlgoConfig) -> dict:
    return dict(mode=a.rollout_is_mode, threshold=a.rollout_is_threshold,
                threshold_lower=a.rollout_is_threshold_lower, veto_threshold=a.rollout_is_veto_threshold)


def _is_kwargs(a: AlgoConfig) -> dict:
    return dict(is_level=a.rollout_is or "token", is_mode=a.rollout_is_mode, is_threshold=a.rollout_is_threshold,
                is_threshold_lower=a.rollout_is_threshold_lower, is_veto_threshold=a.rollout_is_veto_threshold)


def _behav_clip(a: AlgoConfig) -> dict:
    return {"behav_clip": "mask", "behav_mask_threshold": a.behav_clip} if a.behav_clip else {}


def policy_loss(a: AlgoConfig, consts: dict, mb: dict, logp: torch.Tensor, entropy: torch.Tensor):
    """The configured algo/ loss of one micro-batch, normalised over the whole minibatch."""
    mask = mb["loss_mask"] > 0
    behav, prox, adv = mb["behav_logprobs"], mb.get("prox_logprobs"), mb["advantages"]
    den = consts["den"]
    common = dict(clip_low=a.clip_low, clip_high=a.clip_high, ratio_level=a.ratio_level)
    if a.policy_loss == "ppo":
        old = prox if a.old_logprob == "proximal" else behav
        w = None
        if a.rollout_is is not None:
            w, _ = algo.rollout_is_weights(prox, behav, mask, level=a.rollout_is, **_weight_kwargs(a))
        loss, m = algo.ppo_loss(logp, old, adv, mask, token_weights=w, loss_denominator=den, **common)
    elif a.policy_loss == "decoupled":
        loss, m = algo.decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=a.behav_weight_cap,
                                          loss_denominator=den, **common, **_behav_clip(a))
    elif a.policy_loss == "darl":
        by_version = None
        if consts["pmis"] == "balance":
            tv = mb.get("token_versions", mb["versions"])  # each token's version (balance is per token)
            by_version, _ = balance_logp(consts, mb.get("behav_logprobs_by_version", {}), prox, behav, tv)
        loss, m = algo.darl_policy_loss(logp, prox, behav, adv, mask, mb["versions"], **_is_kwargs(a),
                                        pmis=consts["pmis"], beta=consts["beta"], version_token_counts=consts["counts"],
                                        behav_logp_by_version=by_version, mixture_counts=consts.get("mix"),
                                        anchor=a.anchor, **common, **_behav_clip(a))
    elif a.policy_loss == "sg_weight":
        loss, m = algo.sg_policy_loss(logp, behav, adv, mask, threshold=a.rollout_is_threshold, loss_denominator=den)
    else:
        raise ValueError(f"algorithm.policy_loss={a.policy_loss!r}; allowed: ppo, decoupled, darl, sg_weight")
    # the clip of naive async, whatever this loss's own anchor: one figure comparable across cells
    m["algo/clip_frac_behavior"] = algo.behavior_clip_fraction(logp, behav, adv, mask, den=den, **common)
    ent = torch.where(mask, entropy, torch.zeros_like(entropy)).sum() / den
    if a.entropy_coef:
        loss = loss - a.entropy_coef * ent
    metrics = {k: v.detach() for k, v in m.items()}
    metrics.update({"train/loss": loss.detach(), "train/entropy": ent.detach()})
    return loss, metrics


def _sum_metrics(dicts: list[dict]) -> dict[str, torch.Tensor]:
    """Per-key sums over micro-batches, float64 0-dim tensors left on their device (no read)."""
    out: dict[str, torch.Tensor] = {}
    for d in dicts:
        for k, v in d.items():
            v = torch.as_tensor(v).detach().to(torch.float64)
            out[k] = out[k] + v if k in out else v
    return out


def reduce_head_metrics(steps: list[dict], pg, device) -> list[dict[str, float]]:
    """The metrics of each optimizer step of a train step, read in one device-to-host
    transfer. `steps`: per optimizer step, the micro-batch metric sums (`_sum_metrics`, normalised
    by the whole minibatch: they add up over micro-batches and DP ranks) and `grad_norm` (a
    device scalar, the same on every rank). The sums are added over DP ranks and handed from
    the last pipeline stage to every stage; the key names cross ranks as JSON (a few small
    reads, whatever the model's size) only when DP or PP is larger than 1."""
    keys = [sorted(st["sums"]) for st in steps]
    multi = pg.dp.size() > 1 or pg.pp.size() > 1
    if multi:  # ranks may hold different keys (e.g. per-version metrics): take the union
        gathered = all_gather_json(keys, pg.dp, device)
        keys = [sorted({k for rank in gathered for k in rank[i]}) for i in range(len(steps))]
        last = dist.get_global_rank(pg.pp, pg.pp.size() - 1)
        keys = broadcast_json(keys, last, pg.pp, device)
    zero, empty = (torch.zeros(n, dtype=torch.float64, device=device) for n in ((), (0,)))
    rows = [torch.stack([st["sums"].get(k, zero).to(device) for k in ks]) if ks else empty
            for st, ks in zip(steps, keys)]
    sums = torch.cat(rows) if rows else empty
    if multi:
        dist.all_reduce(sums, group=pg.dp)
        dist.broadcast(sums, src=last, group=pg.pp)
    norms = torch.stack([zero if st["grad_norm"] is None else st["grad_norm"].to(device, torch.float64)
                         for st in steps])
    values = torch.cat([sums, norms]).tolist()  # the one transfer
    out, at = [], 0
    for ks in keys:
        out.append(dict(zip(ks, values[at:at + len(ks)])))
        at += len(ks)
    for i, m in enumerate(out):
        m["train/grad_norm"] = values[at + i]
    return out


def train_step(ddp: list, optimizer, scheduler, batch: TrainBatch, a: AlgoConfig, lc: LearnerConfig, *,
               pg, device, temperature: float, vocab_size: int, beta: dict[int, float] | None = None,
               pmis: str = "ess", num_params: int = 0, prox_version: int | None = None,
               minibatch_seed=0, lockstep: bool = False) -> dict[str, float]:
    """`ppo_n_minibatches` optimizer steps over `batch`; metrics averaged over the steps, except
    the behavior-weight statistics, which describe the whole batch (computed once). The
    per-version constants (beta_k, N_k, ESS) are computed once on the whole batch.

    Args:
        ddp: this rank's DDP-wrapped model chunks.
        optimizer: Megatron's optimizer; its `step()` returns `(ok, grad_norm, ...)`.
        scheduler: the learning-rate schedule, stepped once per optimizer step.
        batch: the selected batch, widths already padded (`pad_batch`); needs `prox_logprobs` when the loss
            reads them.
        a: the `algorithm` section (which loss, its options, `ppo_n_minibatches`).
        lc: the `learner` section (`micro_batch_tokens`).
        pg: Megatron's `ProcessGroupCollection` (its `dp`, `tp`, `pp` groups).
        device: where the micro-batches go; MFU is reported on `cuda` only.
        temperature: the sampling temperature the log-probs are taken at.
        vocab_size: the model's true vocab size; padded vocab rows are left out.
        beta: `{k: beta_k}` given by the caller; None: D-ARL computes it from the batch by `pmis`.
        pmis: D-ARL's `beta_k` mode: `ess`, `tokens` or `balance` (see `algo.pmis_batch_constants`).
        num_params: the model's parameter count, for `perf/mfu`; 0 leaves MFU out.
        prox_version: the proximal policy's version (the learner's step), for `balance`'s interpolation
            of versions without kept log-probs; None: none may be missing.
        minibatch_seed: seeds the random partition of the batch's groups into minibatches (the learner
            passes `(train.seed, step)`: the same partition on every rank).
        lockstep: every DP rank runs as many micro-batches (`packing.dp_lockstep`: FP8 delayed scaling
            reduces amax over TP x DP); False: each rank runs as many as its own rows need.
    """
    if a.uses_proximal and batch.prox_logprobs is None:
        raise ValueError(f"policy_loss={a.policy_loss} old_logprob={a.old_logprob} needs batch.prox_logprobs")
    start = time.perf_counter()
    steps: list[dict] = []
    dp, dp_rank = pg.dp.size(), pg.dp.rank()
    whole, batch_metrics = minibatch_constants(a, batch, np.arange(batch.batch_size), beta, pmis, prox_version)
    batch_metrics = {**weight_diagnostics(a, batch, whole, prox_version), **batch_metrics}
    for rows in split_minibatches(batch.group_index, a.ppo_n_minibatches, minibatch_seed):
        consts = minibatch_share(whole, batch, rows)
        mbs = rank_micro_batches(batch, rows, lc.micro_batch_tokens, dp, dp_rank, device, lockstep=lockstep)
        for chunk in ddp:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        outs = run_schedule(ddp, mbs, forward_only=False, temperature=temperature, vocab_size=vocab_size,
                            pg=pg, head=partial(policy_loss, a, consts))
        scheduler.step(increment=1)  # optimizer step i (1-based) runs at the schedule's lr(i)
        lr = float(optimizer.param_groups[0]["lr"])
        ok, grad_norm = optimizer_step(optimizer, device)  # nothing read from the device
        steps.append({"sums": _sum_metrics(outs), "grad_norm": grad_norm,
                      "host": {"train/update_skipped": float(not ok), "train/lr": lr}})
    per_step = [{**m, **st["host"]} for m, st in zip(reduce_head_metrics(steps, pg, device), steps)]
    elapsed = time.perf_counter() - start
    out = {k: float(np.mean([m[k] for m in per_step if k in m])) for k in dict.fromkeys(k for m in per_step for k in m)}
    out.update(batch_metrics)  # one source: the whole batch's weights, not a mean over minibatches
    out["train/clip_frac"] = out.get("algo/clip_frac", 0.0)
    out["train/lr"] = per_step[-1]["train/lr"]
    out["train/optimizer_steps"] = float(len(per_step))
    tokens = float(batch.lengths.sum())
    out["perf/tokens_per_s"] = tokens * len(per_step) / elapsed
    out["perf/train_step_s"] = elapsed
    if device.type == "cuda" and num_params:
        out.update(_mfu(num_params, tokens * len(per_step), elapsed, dist.get_world_size()))
    return out


def weight_diagnostics(a: AlgoConfig, batch: TrainBatch, whole: dict,
                       prox_version: int | None = None) -> dict[str, float]:
    """ALGORITHM.md's drift diagnostics of the whole batch, from the behavior weights the
    configured loss multiplies its surrogate by (`whole`: the batch's `minibatch_constants`):
    ESS fraction, rho mean/max/p99 and token share, global and per version, KL(mu || pi_prox)
    k1/k2/k3; plus the weight function's own fractions (capped, truncated, masked, vetoed).
    Losses without behavior weights (naive and synchronous PPO, sg_weight) get KL and the ESS of
    the weights they do not apply (`algo.drift_diagnostics`), when proximal log-probs exist.
    Every loss also gets the engine-learner mismatch (`algo/mismatch_*`) on the tokens whose
    behavior version the learner has at hand (`prox_version`, kept snapshots)."""
    if batch.prox_logprobs is None:
        return {}
    prox, behav = (torch.as_tensor(x, dtype=torch.float32) for x in (batch.prox_logprobs, batch.behav_logprobs))
    mask, versions = torch.as_tensor(batch.loss_mask) > 0, torch.as_tensor(batch.versions)
    out: dict = {}
    if a.policy_loss == "decoupled":
        rho, out = algo.decoupled_weights(prox, behav, mask, behav_weight_cap=a.behav_weight_cap)
    elif a.policy_loss == "ppo" and a.rollout_is is not None:
        rho, out = algo.rollout_is_weights(prox, behav, mask, level=a.rollout_is, **_weight_kwargs(a))
    elif a.policy_loss == "darl":
        by_version = None
        if whole["pmis"] == "balance":
            given = {k: torch.as_tensor(v, dtype=torch.float32)
                     for k, v in (batch.behav_logprobs_by_version or {}).items()}
            by_version, _ = balance_logp(whole, given, prox, behav,
                                         _token_versions(batch, np.arange(batch.batch_size), versions))
        is_options = algo.RolloutISOptions(level=a.rollout_is or "token", **_weight_kwargs(a))
        rho, out = algo.pmis_behavior_weights(prox, behav, mask, versions, is_options=is_options, pmis=whole["pmis"],
                                              behav_logp_by_version=by_version, version_token_counts=whole["counts"],
                                              mixture_counts=whole.get("mix"))
    else:
        rho = None
    if rho is None:  # no weight in the loss: the drift itself, and the ESS of the uncorrected exp(p - b)
        out = algo.drift_diagnostics(prox, behav, mask, versions)
    else:
        out = {**algo.diagnostics(prox, behav, mask, versions, weights=rho), **out}
    return {**{k: float(v) for k, v in out.items()}, **mismatch_diagnostics(a, batch, prox, behav, prox_version)}


def mismatch_diagnostics(a: AlgoConfig, batch: TrainBatch, prox: torch.Tensor, behav: torch.Tensor,
                         prox_version: int | None) -> dict[str, float]:
    """`algo/mismatch_*` (`algo.mismatch_metrics`): behavior log-probs against the learner's at the
    token's own version, the proximal one (`prox_version`) or a kept snapshot's; the PPO ratio's
    clip range is the loss's own (`algo.clip_low`, `algo.clip_high`)."""
    tv = torch.as_tensor(batch.versions, dtype=torch.long).unsqueeze(-1).expand(prox.shape)
    if batch.token_versions is not None:  # a token's own version where recorded (not checked here: a diagnostic)
        given_tv = torch.as_tensor(np.asarray(batch.token_versions), dtype=torch.long)
        tv = torch.where(given_tv >= 0, given_tv, tv)
    given = {int(k): torch.as_tensor(v, dtype=torch.float32)
             for k, v in (batch.behav_logprobs_by_version or {}).items()}
    logp, at_hand = algo.learner_logp_at_behavior_version(prox, tv, prox_version, given)
    return algo.mismatch_metrics(logp, behav, torch.as_tensor(batch.loss_mask) > 0, at_hand,
                                 clip_low=a.clip_low, clip_high=a.clip_high)


def _mfu(num_params: int, tokens: float, seconds: float, gpus: int) -> dict[str, float]:
    """Model FLOPs utilisation with the 6 N FLOPs-per-token estimate (attention FLOPs left out)."""
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in _PEAK_FLOPS.items() if k in name), None)
    if peak is None:
        return {}
    return {"perf/mfu": 6.0 * num_params * tokens / seconds / (peak * gpus)}
