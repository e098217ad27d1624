"""The chunked vocab-parallel log-prob/entropy head against a naive float64 log_softmax.

Values and gradients, chunked (1 and 3 positions per chunk) and unchunked, at TP=1 and at TP=2
on gloo (each rank holds half of a padded vocabulary, the last columns being Megatron padding)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_darl.channel.ports import free_port
from megatron_darl.learner.logprobs import VocabParallelLogProbs, chunk_positions, token_logprobs

B, S, VOCAB, PADDED, T = 3, 7, 13, 16, 0.7  # 13 real columns padded to 16 (8 per rank at TP=2)
CHUNKS = (1, 3, S)  # S: one chunk, the unchunked computation


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, B, PADDED, generator=g) * 3  # Megatron's [s, b, v] ...
    logits = logits.transpose(0, 1)  # ... handed over transposed (non-contiguous), as GPTModel does
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    g_lp, g_ent = (torch.randn(B, S, generator=g, dtype=torch.float64),
                   torch.randn(B, S, generator=g, dtype=torch.float64))
    return logits, tokens, g_lp, g_ent


def _naive(logits, tokens):
    """float64 log_softmax over the real columns; aligned like token_logprobs (position 0 is 0)."""
    x = logits.detach().double()[..., :VOCAB].clone().requires_grad_()
    logp_all = torch.log_softmax(x[:, :-1] / T, -1)
    lp = logp_all.gather(-1, tokens[:, 1:, None])[..., 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros(B, 1, dtype=torch.float64)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1), x


def _grads_of_naive(logits, tokens, g_lp, g_ent):
    lp, ent, x = _naive(logits, tokens)
    (lp * g_lp + ent * g_ent).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def _chunk_bytes(chunk: int, v_local: int) -> int:
    return 4 * B * v_local * chunk  # exactly `chunk` positions per chunk


@pytest.mark.parametrize("chunk", CHUNKS)
def test_single_rank_matches_naive_values_and_gradients(chunk):
    logits, tokens, g_lp, g_ent = _inputs()
    x = logits.clone().requires_grad_()
    assert chunk_positions(B, PADDED, _chunk_bytes(chunk, PADDED)) == chunk
    lp, ent = token_logprobs(x, tokens, T, VOCAB, None, chunk_bytes=_chunk_bytes(chunk, PADDED))
    (lp.double() * g_lp + ent.double() * g_ent).sum().backward()
    ref_lp, ref_ent, ref_grad = _grads_of_naive(logits, tokens, g_lp, g_ent)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    assert torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    assert torch.allclose(x.grad[..., :VOCAB].double(), ref_grad, atol=1e-5)
    assert torch.all(x.grad[..., VOCAB:] == 0)  # padding logits get no gradient
    assert torch.all(x.grad[:, -1] == 0)  # the last position predicts nothing
    assert ref_grad.abs().max() > 0.1  # the comparison is not between zeros


def test_bf16_logits_keep_their_dtype_and_stay_close():
    logits, tokens, g_lp, g_ent = _inputs(1)
    x = logits.to(torch.bfloat16).requires_grad_()
    lp, ent = token_logprobs(x, tokens, T, VOCAB, None, chunk_bytes=_chunk_bytes(2, PADDED))
    (lp.double() * g_lp + ent.double() * g_ent).sum().backward()
    assert lp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16  # no fp32 copy handed back
    ref_lp, _, ref_grad = _grads_of_naive(x.detach().float(), tokens, g_lp, g_ent)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-4)
    assert torch.allclose(x.grad[..., :VOCAB].double(), ref_grad, atol=2e-2)


def test_direct_function_on_a_rank_with_only_padding_columns():
    x = torch.randn(1, 2, 4, requires_grad=True)
    lp, ent = VocabParallelLogProbs.apply(x, torch.zeros(1, 2, dtype=torch.long), 1.0, 100, 0, None, 1)
    # alone (no TP group) this rank's partition sum is 0: -inf/nan values, but a zero gradient
    (torch.nan_to_num(lp) + torch.nan_to_num(ent)).sum().backward()
    assert torch.all(x.grad == 0)


def _tp_worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    logits, tokens, g_lp, g_ent = _inputs()
    v_local = PADDED // 2
    results = {}
    for chunk in CHUNKS:
        x = logits[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        lp, ent = token_logprobs(x, tokens, T, VOCAB, dist.group.WORLD, chunk_bytes=_chunk_bytes(chunk, v_local))
        (lp.double() * g_lp + ent.double() * g_ent).sum().backward()
        grads = [torch.zeros_like(x.grad) for _ in range(2)]
        dist.all_gather(grads, x.grad.contiguous())
        results[chunk] = (lp.detach(), ent.detach(), torch.cat(grads, -1))
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def test_tp2_on_gloo_matches_naive_for_every_chunking(tmp_path):
    port = free_port()
    out = str(tmp_path / "tp2.pt")
    mp.start_processes(_tp_worker, args=(port, out), nprocs=2, start_method="spawn")
    results = torch.load(out)
    logits, tokens, g_lp, g_ent = _inputs()
    ref_lp, ref_ent, ref_grad = _grads_of_naive(logits, tokens, g_lp, g_ent)
    for chunk, (lp, ent, grad) in results.items():
        assert torch.allclose(lp.double(), ref_lp, atol=1e-5), chunk
        assert torch.allclose(ent.double(), ref_ent, atol=1e-5), chunk
        assert torch.allclose(grad[..., :VOCAB].double(), ref_grad, atol=1e-5), chunk
        assert torch.all(grad[..., VOCAB:] == 0), chunk
    unchunked = results[S]
    for chunk in CHUNKS[:-1]:  # chunked == unchunked to float32 round-off
        for a, b in zip(results[chunk], unchunked):
            assert torch.allclose(a, b, atol=1e-6), chunk
