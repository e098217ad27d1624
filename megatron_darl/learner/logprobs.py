"""Per-token log-probs and entropy from vocab-parallel logits, run through Megatron's pipeline schedule.

What it is: `VocabParallelLogProbs`, an autograd function computing `log softmax(z / T)[target]`
and the entropy of `softmax(z / T)` when each TP rank holds a slice of the vocabulary — only the
row max, the partition sum, the target logit and `sum p z` cross the TP group (never the full
vocabulary) — and `run_schedule`, which drives `get_forward_backward_func` over packed
micro-batches so that pipeline parallel works for the forward-only recompute and for training.
What it is not: a loss. Training losses come from `algo/` through the `head` callback.

Alignment: the value at position t is the log-prob of token t given tokens < t (position 0 is 0),
as `TrainBatch.behav_logprobs`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist


class VocabParallelLogProbs(torch.autograd.Function):
    """(logp, entropy) of `softmax(z)` over a vocabulary split across the TP group.

    z: [N, V_local] float32 (already divided by the temperature); columns past the true vocab
    (Megatron's padding) are excluded. Backward, per local column i, with p = softmax(z):
      d logp / d z_i = 1[i = target] - p_i
      d H / d z_i    = -p_i (log p_i + H)
    both local to the rank, so the backward needs no communication.
    """

    @staticmethod
    def forward(ctx, z, target, vocab_start: int, valid: int, group):
        n_local = z.shape[-1]
        col_ok = torch.arange(n_local, device=z.device) < valid
        z = torch.where(col_ok, z, torch.full((), float("-inf"), dtype=z.dtype, device=z.device))
        zmax = z.max(dim=-1).values
        if group is not None:  # None: the whole vocabulary is local (single rank, tests)
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        s = z - zmax.unsqueeze(-1)
        e = torch.exp(s)  # exp(-inf) = 0 on padding columns
        sum_e = e.sum(-1)
        local_t = target - vocab_start
        owned = (local_t >= 0) & (local_t < valid)
        idx = torch.where(owned, local_t, torch.zeros_like(local_t)).unsqueeze(-1)
        s_t = torch.where(owned, s.gather(-1, idx).squeeze(-1), torch.zeros_like(zmax))
        p_s = torch.where(col_ok, e * s, torch.zeros((), dtype=z.dtype, device=z.device)).sum(-1)
        stats = torch.stack([sum_e, s_t, p_s])
        if group is not None:
            dist.all_reduce(stats, group=group)
        sum_e, s_t, p_s = stats
        log_z = torch.log(sum_e)
        logp = s_t - log_z
        entropy = log_z - p_s / sum_e
        p = e / sum_e.unsqueeze(-1)
        ctx.save_for_backward(p, idx, owned, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        p, idx, owned, entropy = ctx.saved_tensors
        grad = -p * grad_logp.unsqueeze(-1)
        onehot = torch.zeros_like(p).scatter_(-1, idx, owned.to(p.dtype).unsqueeze(-1))
        grad = grad + onehot * grad_logp.unsqueeze(-1)
        grad = grad - (torch.xlogy(p, p) + p * entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, vocab_size: int,
                   tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned log-probs and entropies [b, s] from local logits [b, s, V/tp] (position 0 is 0).

    Logits at t-1 predict token t; the temperature divides the logits as the engine samples.
    """
    b, s, v_local = logits.shape
    start = dist.get_rank(tp_group) * v_local if tp_group is not None else 0
    valid = max(0, min(v_local, vocab_size - start))
    z = logits[:, :-1].float().reshape(-1, v_local) / temperature
    lp, ent = VocabParallelLogProbs.apply(z, tokens[:, 1:].reshape(-1), start, valid, tp_group)
    pad = torch.zeros(b, 1, dtype=lp.dtype, device=lp.device)
    return torch.cat([pad, lp.view(b, s - 1)], 1), torch.cat([pad, ent.view(b, s - 1)], 1)


# head(micro_batch, logp [b,s], entropy [b,s]) -> (loss scalar, {name: tensor}); the loss must
# already be normalised by the whole batch's denominator (it is summed over micro-batches as is).
Head = Callable[[dict, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def _forward_step(temperature: float, vocab_size: int, tp_group, head: Head, data_iterator, model):
    mb = next(data_iterator)
    tokens = mb["tokens"]
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    out = model(tokens, pos, None)  # local spec: causal mask; right padding never leaks backwards

    def loss_func(output):
        logp, ent = token_logprobs(output, tokens, temperature, vocab_size, tp_group)
        loss, metrics = head(mb, logp, ent)
        # 3-tuple + calculate_per_token_loss: the schedule adds losses as returned, no rescaling
        return loss, torch.tensor(1, dtype=torch.int), metrics

    return out, loss_func


def run_schedule(chunks: list, micro_batches: list[dict], *, forward_only: bool, temperature: float,
                 vocab_size: int, pg, head: Head) -> list[dict]:
    """Run all micro-batches through the pipeline schedule; returns the heads' metric dicts
    (one per micro-batch) on the last pipeline stage, [] on the others. Backward accumulates
    grads into the DDP buffers when `forward_only` is False."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    fb = get_forward_backward_func(pp_size=pg.pp.size(), vp_size=len(chunks) if len(chunks) > 1 else None)
    step = partial(_forward_step, temperature, vocab_size, pg.tp, head)
    data = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    out = fb(
        forward_step_func=step,
        data_iterator=data,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=max(mb["tokens"].shape[1] for mb in micro_batches),
        micro_batch_size=max(mb["tokens"].shape[0] for mb in micro_batches),
        forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=pg.pp, config=chunks[0].config),
        pg_collection=pg,
    )
    return list(out) if out else []
