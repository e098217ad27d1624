"""Learner checkpoints with Megatron's `dist_checkpointing`: resumable at another TP/PP layout.

What it is: `save` writes model, optimizer (Adam moments included), LR scheduler, RNG states,
the train step and the train loop's `extra_state` into a temp folder and renames it into place
(a crash mid-save leaves the previous checkpoint intact); `load` restores all of it into a
learner of any TP/PP layout (dist_checkpointing reshards model and optimizer tensors).
What it is not: the HF export for engines (weights.py) or offline conversion (checkpoint_tools).

Layout of a checkpoint folder: dist_checkpointing's files, plus `learner_meta.json` (step, the
saved layout) and `extra_state.pt` (torch.save of the loop's dict, written by rank 0).
RNG states are per rank and only meaningful for the same layout: they are restored when TP/PP/DP
match and skipped otherwise (the learner uses no dropout, so training does not depend on them).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from megatron_darl.learner.optim_step import use_sync_free_adam
from megatron_darl.learner.weights import replace_folder

_META = "learner_meta.json"
_EXTRA = "extra_state.pt"


def _sharding(kind: str) -> dict:
    return {"distrib_optim_sharding_type": kind, "chained_optim_avoid_prefix": True}


def _save_kind(learner) -> str:
    """Distributed-optimizer checkpoint format (the non-distributed optimizer, on CPU, ignores it
    and is always reshardable). 'dp_reshardable' by default: each rank writes its own shard,
    exact, resumable at another DP size. 'fully_reshardable' (`optim.reshardable_checkpoint`,
    resumable at another TP/PP too) gathers every DP shard on one rank's CPU at each save (~24 GB
    per rank at 4B), and megatron-core 0.16.1 cannot load it with torch's Adam (no apex/TE: it
    drops the per-parameter 'step'). The default 'fully_sharded_model_space' is refused by
    0.16.1's own ShardedTensor checks."""
    from megatron.core.optimizer import distrib_optimizer

    fused = getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    return "fully_reshardable" if learner.optim_cfg.reshardable_checkpoint and fused else "dp_reshardable"


def _saved_kind(meta: dict) -> str:
    """The format a checkpoint was written in (one that does not record it: the rule that wrote it)."""
    from megatron.core.optimizer import distrib_optimizer

    old = "fully_reshardable" if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False) else "dp_reshardable"
    return meta.get("optimizer_format", old)


def _init_empty_adam_state(optimizer) -> None:
    """A fresh process (a Slurm requeue) has taken no step: with torch's Adam (no apex/TE) the
    per-parameter states do not exist yet, and megatron-core 0.16.1's
    `DistributedOptimizer.state_dict()`, which builds the load template, asserts one 'step'
    across them. Give them the zero state Adam starts from; the load overwrites all of it."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    if getattr(dopt, "HAVE_APEX_OR_TE", True):
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, dopt.DistributedOptimizer):
            continue
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(exp_avg=torch.zeros_like(p.data), exp_avg_sq=torch.zeros_like(p.data),
                                          step=torch.tensor(0.0))


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _sharded_state(learner, kind: str, *, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ctx, chunks = learner.ctx, learner.chunks
    sharding = _sharding(kind)
    state = {_model_key(i, len(chunks)): c.sharded_state_dict(metadata=sharding) for i, c in enumerate(chunks)}
    flat_model = {}
    for v in list(state.values()):
        flat_model.update(v)
    state["optimizer"] = learner.optimizer.sharded_state_dict(flat_model, is_loading=is_loading, metadata=sharding)
    rng = {"cpu": torch.get_rng_state(), "tracker": _tracker_states()}
    if ctx.on_gpu:
        rng["cuda"] = torch.cuda.get_rng_state()
    state["rng_state"] = ShardedObject(
        "rng_state", rng, (ctx.pp, ctx.tp, ctx.dp), (ctx.pp_rank, ctx.tp_rank, ctx.dp_rank), replica_id=0)
    return state


def _tracker_states() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}


def _layout(learner) -> list[int]:
    return [learner.ctx.tp, learner.ctx.pp, learner.ctx.dp]


def save(learner, ckpt_dir: str, extra_state: dict[str, Any]) -> None:
    from megatron.core import dist_checkpointing

    ckpt_dir = ckpt_dir.rstrip("/")
    tmp = f"{ckpt_dir}.tmp"
    main = dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    kind = _save_kind(learner)
    state = _sharded_state(learner, kind, is_loading=False)
    state["scheduler"] = learner.scheduler.state_dict()
    dist_checkpointing.save(state, tmp)
    if main:
        torch.save(extra_state, os.path.join(tmp, _EXTRA))
        with open(os.path.join(tmp, "config.json"), "w") as f:  # rebuilds the model (darl-logprobs)
            json.dump(learner.hf_config, f, indent=1)
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump({"step": learner.step, "layout_tp_pp_dp": _layout(learner), "optimizer_format": kind}, f)
        replace_folder(tmp, ckpt_dir)
    dist.barrier()


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, _META)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{ckpt_dir}: not a learner checkpoint (no {_META})")
    with open(path) as f:
        return json.load(f)


def load(learner, ckpt_dir: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    meta = read_meta(ckpt_dir)
    same_layout = meta["layout_tp_pp_dp"] == _layout(learner)
    _init_empty_adam_state(learner.optimizer)
    state = _sharded_state(learner, _saved_kind(meta), is_loading=True)
    state["scheduler"] = learner.scheduler.state_dict()  # non-sharded: comes back from the common state
    if not same_layout:
        del state["rng_state"]
    loaded = dist_checkpointing.load(state, ckpt_dir)
    for i, chunk in enumerate(learner.chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(learner.chunks))], strict=False)
    with torch.no_grad():  # 0.16.1's dp_reshardable loader copies into leaf params without it
        learner.optimizer.load_state_dict(loaded["optimizer"])
    use_sync_free_adam(learner.optimizer)  # the loaded param groups bring back their saved flags
    learner.scheduler.num_steps = 0  # Megatron's load_state_dict steps forward by the saved count
    learner.scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _restore_rng(loaded["rng_state"], learner.ctx.on_gpu)
    learner.step = int(meta["step"])
    return torch.load(os.path.join(ckpt_dir, _EXTRA), weights_only=False)


def _restore_rng(rng: dict, on_gpu: bool) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(rng["cpu"])
    if on_gpu and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
