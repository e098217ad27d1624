"""The embedded engine's sampler: one token and its behavior log-prob per row of logits.

What it is: `sample` (temperature, top-p and top-k, one uniform per row, seeded rows on their own
generator) and `SAMPLING_EPS`, the temperature below which sampling is greedy, as SGLang 0.5.23
decides it (its `sglang/srt/sampling/sampling_params.py`: `_SAMPLING_EPS = 1e-6`, and
`0 <= temperature < _SAMPLING_EPS` becomes `temperature = 1.0, top_k = 1`); dividing float32
logits by a smaller temperature overflows and gives NaN log-probs.
The returned log-prob follows SGLang 0.5.23's convention (its `srt/layers/sampler.py`, read from
the wheel): log_softmax(logits / T) of the FULL vocabulary at the sampled token, before top-p /
top-k truncation (sampler.py:275 divides by T, :294-299 takes the softmax into `probs`, which
`_sample_from_probs` truncates only in copies, and :308-315 returns `log(probs)`); untempered
when greedy (:208-223); `SGLANG_RETURN_ORIGINAL_LOGPROB=1` (:82, :231-237, :322-323) would
make SGLang return untempered ones, which the learner does not compute. Training therefore
refuses truncation (`config/rollout.py`); the engine still serves it (evaluation, other clients).
What it is not: the forward pass or the batch (`decoder.py`), or request validation
(`requests.py`, which maps such temperatures to 0 at the door).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from megatron_darl.types import SamplingParams

SAMPLING_EPS = 1e-6  # sglang/srt/sampling/sampling_params.py `_SAMPLING_EPS`: below it, greedy


class Row(Protocol):
    """What the sampler reads of a sequence (decoder.Sequence has it)."""

    sampling: SamplingParams
    generator: torch.Generator | None


def _truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p nucleus (unnormalised; the
    sampler does not need a normalised distribution). The first token is always kept."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    keep = (rank < top_k[:, None]) & ((sorted_p.cumsum(-1) - sorted_p) < top_p[:, None])
    return torch.zeros_like(probs).scatter(1, order, sorted_p * keep)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one index per row of unnormalised `probs` from uniforms `u` [B]: one random
    number per row (torch.multinomial draws one exponential per vocabulary entry, which was
    12% of a decode step). The cumulative sum is taken in float64 so that rounding over a
    150k vocabulary cannot shift mass between tokens."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u.to(torch.float64) * cdf[:, -1])[:, None], right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, seqs: Sequence[Row], generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Sample one token per row; return the tokens and their behavior log-probs.

    The behavior log-prob is log_softmax(logits / T) at the sampled token over the full
    vocabulary, i.e. before top-p/top-k truncation: that is exactly what the learner recomputes
    (log_softmax(logits / T) over the full vocab), so the importance ratio is 1 on-policy.
    A temperature below SAMPLING_EPS means greedy, and then the log-prob is that of the
    untempered distribution (what SGLang computes: it samples top_k=1 at temperature 1).
    Seeded requests draw from their own generator, so their samples do not depend on which
    other requests share the batch. A log-prob can still be non-finite when finite logits
    overflow float32 once divided by T; the caller checks every one (`Decoder.step`).
    """
    temps = torch.tensor([s.sampling.temperature for s in seqs], device=logits.device)
    greedy = temps < SAMPLING_EPS
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    probs = logp.exp()
    vocab = logits.shape[-1]
    top_k = [s.sampling.top_k if 0 < s.sampling.top_k < vocab else vocab for s in seqs]
    top_p = [s.sampling.top_p for s in seqs]
    if min(top_k) < vocab or min(top_p) < 1.0:
        probs = _truncate(probs, torch.tensor(top_k, device=logits.device), torch.tensor(top_p, device=logits.device))
    tokens = logits.argmax(dim=-1)
    is_greedy = greedy.tolist()
    shared = [i for i, s in enumerate(seqs) if not is_greedy[i] and s.generator is None]
    if shared:
        u = torch.rand(len(shared), generator=generator, device=logits.device)
        tokens[shared] = _inverse_cdf(probs[shared], u)
    for i, s in enumerate(seqs):
        if not is_greedy[i] and s.generator is not None:
            tokens[i] = _inverse_cdf(probs[i : i + 1], torch.rand(1, generator=s.generator, device=logits.device))[0]
    lps = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), lps.tolist()
