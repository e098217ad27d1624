"""Per-token log-probs and entropy from vocab-parallel logits, run through Megatron's pipeline schedule.

What it is: `VocabParallelLogProbs`, an autograd function computing `log softmax(z / T)[target]`
and the entropy of `softmax(z / T)` when each TP rank holds a slice of the vocabulary — only the
row max, the partition sum, the target logit and `sum p z` cross the TP group (never the full
vocabulary), over sequence chunks of at most `HEAD_CHUNK_BYTES` of fp32 values (the logits stay
in the model's dtype; backward recomputes the softmax per chunk) — and `run_schedule`, which
drives `get_forward_backward_func` over packed micro-batches so that pipeline parallel works for
the forward-only recompute and for training; it pads the token dimension where FP8 GEMMs or
sequence parallel need it (`sequence_multiple`).
What it is not: a loss. Training losses come from `algo/` through the `head` callback.

Alignment: the value at position t is the log-prob of token t given tokens < t (position 0 is 0),
as `TrainBatch.behav_logprobs`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_darl.learner.packing import round_up, sequence_multiple

# fp32 working set of the head: at most this many bytes of [positions x vocab/TP] fp32 values
# exist at once (a few temporaries of one chunk); the full logits stay in the model's dtype
HEAD_CHUNK_BYTES = 256 << 20


def chunk_positions(b: int, v_local: int, chunk_bytes: int = HEAD_CHUNK_BYTES) -> int:
    """Sequence positions per chunk so that one fp32 chunk [b, positions, v_local] fits the budget."""
    return max(1, chunk_bytes // (4 * max(1, b) * max(1, v_local)))


def _scaled(x: torch.Tensor, lo: int, hi: int, valid: int, inv_t: float, shift: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 chunk `x[:, lo:hi, :valid] / T - shift` in one kernel (`shift` [b, s])."""
    return torch.add(shift[:, lo:hi, None].neg(), x[:, lo:hi, :valid], alpha=inv_t)


class VocabParallelLogProbs(torch.autograd.Function):
    """(logp, entropy) per position of `softmax(x / T)` over a vocabulary split across the TP group,
    computed over sequence chunks so that no full fp32 copy of the logits is ever made.

    x: [b, s, V_local] logits in the model's dtype (any strides; Megatron's are transposed);
    target: [b, s] global token ids; columns at or past `valid` (Megatron's vocab padding) are
    excluded. Only the row max, the partition sum, the target logit and `sum p z` cross the TP
    group. Backward recomputes log p chunk by chunk from the saved logits; with z = x / T, per
    local column i:
      d logp / d z_i = 1[i = target] - p_i
      d H / d z_i    = -p_i (log p_i + H)
    both local to the rank, so the backward needs no communication. Per chunk the forward makes
    four passes over its values (the shifted chunk, exp, the sum, `sum e z` as one batched dot
    product) and the backward five (log p, exp, the affine weight, the product, the copy into
    the gradient), two fp32 chunks live in each.
    """

    @staticmethod
    def forward(ctx, x, target, temperature: float, vocab_start: int, valid: int, group, chunk: int):
        b, s, _ = x.shape
        inv_t = 1.0 / temperature
        stats = torch.zeros(3, b, s, dtype=torch.float32, device=x.device)  # sum e, s_target, sum e*s
        if valid > 0:
            zmax = x[..., :valid].amax(-1).float() * inv_t  # T > 0 keeps the order
        else:  # a rank holding only padding columns
            zmax = torch.full((b, s), float("-inf"), device=x.device)
        if group is not None:  # None: the whole vocabulary is local (single rank, tests)
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        local_t = target - vocab_start
        owned = (local_t >= 0) & (local_t < valid)
        idx = torch.where(owned, local_t, torch.zeros_like(local_t))
        for lo in range(0, s if valid > 0 else 0, chunk):  # two fp32 chunks live: sh, e
            hi = min(s, lo + chunk)
            sh = _scaled(x, lo, hi, valid, inv_t, zmax)
            e = torch.exp(sh)
            stats[0, :, lo:hi] = e.sum(-1)
            stats[1, :, lo:hi] = sh.gather(-1, idx[:, lo:hi, None])[..., 0]
            stats[2, :, lo:hi] = torch.matmul(e.unsqueeze(-2), sh.unsqueeze(-1))[..., 0, 0]
        stats[1] = torch.where(owned, stats[1], 0.0)
        if group is not None:
            dist.all_reduce(stats, group=group)
        log_z = torch.log(stats[0])
        logp = stats[1] - log_z
        entropy = log_z - stats[2] / stats[0]
        ctx.save_for_backward(x, idx, owned, zmax + log_z, entropy)
        ctx.temperature, ctx.valid, ctx.chunk = temperature, valid, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        x, idx, owned, log_norm, entropy = ctx.saved_tensors
        inv_t, valid, chunk = 1.0 / ctx.temperature, ctx.valid, ctx.chunk
        grad = torch.zeros_like(x)  # padding columns get no gradient
        # dL/dx_i = (1/T) (gl 1[i = target] - p_i (gl + ge (log p_i + H))) = p_i (c + k log p_i) + ...
        c = ((grad_logp + grad_entropy * entropy) * -inv_t)[..., None]
        k = (grad_entropy * -inv_t)[..., None]
        on_target = torch.where(owned, grad_logp * inv_t, 0.0)[..., None]
        for lo in range(0, x.shape[1] if valid > 0 else 0, chunk):
            hi = min(x.shape[1], lo + chunk)
            logp = _scaled(x, lo, hi, valid, inv_t, log_norm)  # two fp32 chunks live: logp, p
            p = torch.exp(logp)
            w = torch.addcmul(c[:, lo:hi], k[:, lo:hi], logp, out=logp)
            g = p.mul_(w)
            del logp, w
            g.scatter_add_(-1, idx[:, lo:hi, None], on_target[:, lo:hi])
            grad[:, lo:hi, :valid] = g
        return grad, None, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, vocab_size: int,
                   tp_group, chunk_bytes: int = HEAD_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned log-probs and entropies [b, s] (fp32) from local logits [b, s, V/tp] (position 0 is 0).

    Logits at t-1 predict token t; the temperature divides the logits as the engine samples.
    The last position predicts nothing: its target is a placeholder and its values are dropped.
    """
    b, s, v_local = logits.shape
    start = dist.get_rank(tp_group) * v_local if tp_group is not None else 0
    valid = max(0, min(v_local, vocab_size - start))
    target = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)  # next token; the wrap-around is dropped
    lp, ent = VocabParallelLogProbs.apply(logits, target, float(temperature), start, valid, tp_group,
                                          chunk_positions(b, v_local, chunk_bytes))
    pad = torch.zeros(b, 1, dtype=lp.dtype, device=lp.device)
    return torch.cat([pad, lp[:, :-1]], 1), torch.cat([pad, ent[:, :-1]], 1)


# head(micro_batch, logp [b,s], entropy [b,s]) -> (loss scalar, {name: tensor}); the loss must
# already be normalised by the whole batch's denominator (it is summed over micro-batches as is).
Head = Callable[[dict, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def _forward_step(temperature: float, vocab_size: int, tp_group, head: Head, multiple: int, data_iterator, model):
    mb = next(data_iterator)
    tokens = mb["tokens"]
    width = tokens.shape[1]
    padded = round_up(width, multiple)
    if padded != width:  # FP8 / sequence-parallel alignment; trailing padding is invisible (causal)
        tokens = torch.nn.functional.pad(tokens, (0, padded - width))
    pos = torch.arange(padded, device=tokens.device).unsqueeze(0).expand_as(tokens)
    out = model(tokens, pos, None)  # local spec: causal mask; right padding never leaks backwards

    def loss_func(output):
        logp, ent = token_logprobs(output[:, :width], mb["tokens"], temperature, vocab_size, tp_group)
        loss, metrics = head(mb, logp, ent)
        # 3-tuple + calculate_per_token_loss: the schedule adds losses as returned, no rescaling
        return loss, torch.tensor(1, dtype=torch.int), metrics

    return out, loss_func


def config_multiple(config) -> int:
    """`sequence_multiple` of a Megatron TransformerConfig (FP8 recipe, TP, sequence parallel)."""
    recipe = getattr(config, "fp8_recipe", None) if getattr(config, "fp8", None) else None
    return sequence_multiple(recipe, config.tensor_model_parallel_size, bool(config.sequence_parallel))


def run_schedule(chunks: list, micro_batches: list[dict], *, forward_only: bool, temperature: float,
                 vocab_size: int, pg, head: Head, multiple: int | None = None) -> list[dict]:
    """Run all micro-batches through the pipeline schedule; returns the heads' metric dicts
    (one per micro-batch) on the last pipeline stage, [] on the others. Heads see the unpadded
    micro-batch.

    Args:
        chunks: this rank's model chunks (DDP-wrapped; several with virtual pipeline stages).
        micro_batches: dicts with at least `tokens` `[b, s]`; what else they hold is for `head`.
        forward_only: True only evaluates (log-probs); False also runs backward, accumulating grads
            into the DDP buffers.
        temperature: divides the logits before the log-softmax, as the engine samples.
        vocab_size: the model's true vocab size (the HF config's); padded vocab rows are left out.
        pg: Megatron's `ProcessGroupCollection` (its `tp`, `pp` groups).
        head: `(micro_batch, logp, entropy) -> (loss, metrics)`, the loss already normalised by the
            whole batch's denominator (see `Head`).
        multiple: pad token widths to a multiple of this; None: what the model's FP8 / sequence-parallel
            settings need (`config_multiple`).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    multiple = multiple or config_multiple(chunks[0].config)
    fb = get_forward_backward_func(pp_size=pg.pp.size(), vp_size=len(chunks) if len(chunks) > 1 else None)
    step = partial(_forward_step, temperature, vocab_size, pg.tp, head, multiple)
    data = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    out = fb(
        forward_step_func=step,
        data_iterator=data,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=max(round_up(mb["tokens"].shape[1], multiple) for mb in micro_batches),
        micro_batch_size=max(mb["tokens"].shape[0] for mb in micro_batches),
        forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=pg.pp, config=chunks[0].config),
        pg_collection=pg,
    )
    return list(out) if out else []
