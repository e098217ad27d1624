"""`MegatronLearner`: the Megatron-Core implementation of the `Learner` protocol.

What it is: the object the train loop holds on every learner rank — it sets up the process
groups, builds and loads the model, and exposes recompute (`compute_logprobs`), the RL
`train_step`, HF weight export and `dist_checkpointing` save/load, and for `pmis="balance"`
the per-version recompute against kept snapshots (`compute_version_logprobs`). All methods
are collective: every rank calls them in the same order; rank 0 (`is_main`) owns the batches
and the results.
What it is not: the async loop (trainer/loop.py) or the loss maths (algo/).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
from megatron_darl.learner import checkpoint, model, weights
from megatron_darl.learner.collectives import broadcast_arrays
from megatron_darl.learner.logprobs import config_multiple, run_schedule
from megatron_darl.learner.packing import dp_lockstep, pad_batch, rank_micro_batches
from megatron_darl.learner.parallel import destroy_parallel, init_parallel
from megatron_darl.learner.snapshots import SNAPSHOT_BUDGET_BYTES, PolicySnapshots, choose_mode
from megatron_darl.learner.train_step import setup_training, train_step
from megatron_darl.types import TrainBatch

_BATCH_FIELDS = ("tokens", "lengths", "loss_mask", "advantages", "behav_logprobs", "token_versions",
                 "versions", "group_index", "rewards", "prompt_ids", "prox_logprobs")
_BY_VERSION = "behav_logprobs_by_version/"  # broadcast name prefix of the per-version arrays


def _check(section: str, cfg) -> None:
    for field, msg in cfg.check() if hasattr(cfg, "check") else []:
        raise ValueError(f"{section}.{field}: {msg}")
    for field, allowed in getattr(cfg, "_choices", {}).items():
        value = getattr(cfg, field)
        if value is not None and value not in allowed:
            raise ValueError(f"{section}.{field}={value!r}; allowed: {', '.join(allowed)}")


class MegatronLearner:
    """Megatron-Core learner ranks for one Qwen3-family model (see `Learner` in api.py)."""

    def __init__(self, model_cfg: ModelConfig, parallel_cfg: ParallelConfig, optim_cfg: OptimConfig,
                 learner_cfg: LearnerConfig, algo_cfg: AlgoConfig, temperature: float = 1.0, seed: int = 0):
        """`temperature`: the rollout's (`rollout.temperature`), under which log-probs are taken."""
        for section, cfg in (("model", model_cfg), ("parallel", parallel_cfg), ("optim", optim_cfg),
                             ("learner", learner_cfg), ("algo", algo_cfg)):
            _check(section, cfg)
        pmis = algo_cfg.effective_pmis_beta
        self.pmis = pmis  # algo.pmis_beta (tokens when algo.pmis is false); used by policy_loss=darl
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model_cfg, self.parallel_cfg, self.optim_cfg = model_cfg, parallel_cfg, optim_cfg
        self.learner_cfg, self.algo_cfg, self.temperature = learner_cfg, algo_cfg, temperature
        self.seed = seed  # with the step, seeds the partition of each batch into minibatches
        self.ctx = init_parallel(parallel_cfg, seed)
        self.hf_config = model.read_hf_config(model_cfg.hf_dir)
        self.spec = model.resolve_spec(model_cfg, self.ctx.on_gpu, parallel_cfg)
        self.vocab_size = int(self.hf_config["vocab_size"])
        chunks = model.build_model(self.hf_config, model_cfg, parallel_cfg, self.ctx.pg, on_gpu=self.ctx.on_gpu)
        if model_cfg.init == "hf":
            model.load_initial_weights(chunks, model_cfg, self.hf_config, self.spec, self.ctx)
        self.chunks = chunks
        # token widths are padded to this (FP8 GEMM alignment, sequence parallel); 1: none
        self.seq_multiple = config_multiple(chunks[0].config)
        # FP8 delayed: amax reduced over TP x DP at each forward, so DP ranks run as many micro-batches
        self.lockstep = dp_lockstep(chunks[0].config)
        self.ddp, self.optimizer, self.scheduler = setup_training(chunks, optim_cfg, self.ctx.pg,
                                                                  on_gpu=self.ctx.on_gpu)
        self.step = 0  # train steps done (each is ppo_n_minibatches optimizer steps)
        self.num_params, param_bytes = self._count_params()
        # balance: "exact" keeps the K previous versions' weights (CPU) and rescores with them;
        # "interpolate" approximates log mu_k from b and p; None for the other beta_k rules
        self.balance_mode = (choose_mode(algo_cfg.balance_snapshots, algo_cfg.k, param_bytes)
                             if pmis == "balance" else None)
        try:
            keep = max(algo_cfg.k if self.balance_mode == "exact" else 0, self._mismatch_versions(param_bytes))
        except ValueError:
            self.close(keep_world=True)  # a caller that catches it may build another learner
            raise
        self.snapshots = PolicySnapshots([p for c in self.chunks for p in c.parameters()], keep) if keep else None

    def _mismatch_versions(self, param_bytes: int) -> int:
        """How many previous versions `learner.mismatch_every` keeps: eta (0 when off)."""
        eta = self.algo_cfg.max_head_offpolicyness
        if not (self.learner_cfg.mismatch_every and eta):
            return 0
        if eta * param_bytes > SNAPSHOT_BUDGET_BYTES:
            raise ValueError(
                f"learner.mismatch_every={self.learner_cfg.mismatch_every} keeps CPU copies of the last "
                f"algo.max_head_offpolicyness={eta} versions: {eta * param_bytes / 2**30:.1f} GiB, above "
                f"the {SNAPSHOT_BUDGET_BYTES / 2**30:g} GiB budget; set learner.mismatch_every=0")
        return eta

    def _keeps(self, version: int) -> bool:
        """Whether the weights published as `version` are kept: always for exact balance, else
        when a step that measures the mismatch (`measures_mismatch`) may train its tokens."""
        if self.balance_mode == "exact":
            return True
        eta = self.algo_cfg.max_head_offpolicyness
        return any(self.measures_mismatch(version + d) for d in range(1, eta + 1))

    def measures_mismatch(self, step: int) -> bool:
        """Whether train step `step` scores its batch with every kept version (`learner.mismatch_every`)."""
        every = self.learner_cfg.mismatch_every
        return bool(every) and step % every == 0

    # ---- protocol ----
    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    def broadcast_batch(self, batch: TrainBatch | None) -> TrainBatch:
        """Rank 0's batch on every rank (the others pass None)."""
        arrays = None
        if self.is_main:
            arrays = {f: getattr(batch, f) for f in _BATCH_FIELDS if getattr(batch, f) is not None}
            for v, lp in (batch.behav_logprobs_by_version or {}).items():
                arrays[f"{_BY_VERSION}{int(v)}"] = lp
        got = broadcast_arrays(arrays, 0, None, self.ctx.device)
        by_version = {int(k[len(_BY_VERSION):]): got.pop(k) for k in list(got) if k.startswith(_BY_VERSION)}
        return TrainBatch(**got, behav_logprobs_by_version=by_version or None)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> np.ndarray:
        """Log-probs [B, L] under the current weights (at the sampling temperature): the value at
        t is log p(tokens[t] | tokens[:t]) for 1 <= t < lengths[i], 0 at t = 0 and on padding."""
        ctx, padded = self.ctx, pad_batch(batch, self.seq_multiple)
        rows = np.arange(batch.batch_size)
        mbs = rank_micro_batches(padded, rows, self.learner_cfg.recompute_tokens, ctx.dp, ctx.dp_rank, ctx.device,
                                 lockstep=self.lockstep)
        outs = run_schedule(self.ddp, mbs, forward_only=True, temperature=self.temperature,
                            vocab_size=self.vocab_size, pg=ctx.pg, multiple=self.seq_multiple,
                            head=lambda mb, lp, ent: (lp.sum() * 0.0, {"logp": lp}))
        full = torch.zeros(padded.tokens.shape, dtype=torch.float32, device=ctx.device)
        for mb, out in zip(mbs, outs):
            if mb["live"]:
                lp = out["logp"]
                full[torch.as_tensor(mb["rows"], device=ctx.device), : lp.shape[1]] = lp
        pos = torch.arange(full.shape[1], device=ctx.device)
        full = torch.where(pos < torch.as_tensor(batch.lengths, device=ctx.device)[:, None], full, 0.0)
        dist.all_reduce(full, group=ctx.pg.dp)  # DP ranks filled disjoint rows
        dist.broadcast(full, src=dist.get_global_rank(ctx.pg.pp, ctx.pp - 1), group=ctx.pg.pp)
        return full[:, : batch.tokens.shape[1]].cpu().numpy()

    @torch.no_grad()
    def compute_version_logprobs(self, batch: TrainBatch, versions: list[int]) -> dict[int, np.ndarray]:
        """`{v: log-probs [B, L]}` under the weights of each policy version v in `versions` that
        is available: the current one (`v == step`) or a kept snapshot (`pmis="balance"` with
        exact snapshots, or `learner.mismatch_every`). Versions without weights (older than K or
        eta, from before a resume, or interpolate mode) are left out: the train step interpolates
        them. The live parameters are restored bit for bit."""
        out = {}
        for v in sorted({int(v) for v in versions}):
            if v == self.step:
                out[v] = self.compute_logprobs(batch)
            elif self.snapshots is not None and v in self.snapshots:
                with self.snapshots.swapped(v):
                    out[v] = self.compute_logprobs(batch)
        return out

    def train_step(self, batch: TrainBatch, beta: dict[int, float] | None = None) -> dict[str, float]:
        """`algorithm.ppo_n_minibatches` optimizer steps on `batch` (which must carry
        `prox_logprobs` when the loss reads them); returns metrics (same on every rank)."""
        if self.snapshots is not None and self._keeps(self.step):
            self.snapshots.keep(self.step)  # the weights published as version `step` (0: initial)
        # widths padded for FP8 / sequence parallel before packing, so the budget counts them
        metrics = train_step(self.ddp, self.optimizer, self.scheduler, pad_batch(batch, self.seq_multiple),
                             self.algo_cfg, self.learner_cfg,
                             pg=self.ctx.pg, device=self.ctx.device, temperature=self.temperature,
                             vocab_size=self.vocab_size, beta=beta, pmis=self.pmis, num_params=self.num_params,
                             prox_version=self.step, minibatch_seed=(self.seed, self.step), lockstep=self.lockstep)
        self.step += 1
        if self.snapshots is not None:
            self.snapshots.prune(self.step)
        metrics["train/step"] = float(self.step)
        return metrics

    def iter_hf_buckets(self, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors (gathered over TP and PP) in buckets of about `bucket_bytes`;
        collective: every rank iterates, every rank receives the same buckets."""
        return weights.iter_hf_buckets(self.chunks, self._adapter(), self.ctx, bucket_bytes)

    def export_hf(self, out_dir: str) -> None:
        """Write a Hugging Face folder (safetensors + config.json) atomically (rank 0 writes)."""
        weights.save_hf_weights(self.chunks, self._adapter(), self.ctx, out_dir, self.hf_folder_info()[1])

    def hf_folder_info(self) -> tuple[dict, list[str]]:
        """(config.json, folders holding the tokenizer files) of an exported HF folder: what
        `weights.write_hf_folder` needs to write one from buckets already gathered."""
        from checkpoint_tools.mcore_format import HF_EXTRA_DIR

        sources = [self.model_cfg.tokenizer_dir, self.model_cfg.hf_dir, f"{self.model_cfg.hf_dir}/{HF_EXTRA_DIR}"]
        return weights.hf_config(self._adapter(), self.chunks), sources

    def save(self, ckpt_dir: str, extra_state: dict[str, Any] | None = None) -> None:
        """dist_checkpointing save of model, optimizer, scheduler, RNG, step and `extra_state`."""
        checkpoint.save(self, ckpt_dir, extra_state or {})

    def load(self, ckpt_dir: str) -> dict[str, Any]:
        """Restore a `save` (any TP/PP layout); returns its `extra_state`. Kept balance
        snapshots are dropped (they are not checkpointed)."""
        if self.snapshots is not None:
            self.snapshots.clear()
        return checkpoint.load(self, ckpt_dir)

    def close(self, keep_world: bool = False) -> None:
        """Release the process groups (`keep_world`: keep torch.distributed for another learner)."""
        destroy_parallel(keep_world)

    # ---- helpers ----
    def _adapter(self):
        from checkpoint_tools.adapters import get_adapter

        return get_adapter(self.hf_config, spec=self.spec,
                           make_vocab_size_divisible_by=self.model_cfg.make_vocab_size_divisible_by)

    def _count_params(self) -> tuple[int, int]:
        """(parameters, their bytes) of the whole model, the same on every rank."""
        params = [p for c in self.chunks for p in c.parameters()]
        n = torch.tensor([sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)],
                         device=self.ctx.device)
        dist.all_reduce(n, group=self.ctx.pg.mp)  # TP shards and PP stages hold disjoint parameters
        return int(n[0].item()), int(n[1].item())
