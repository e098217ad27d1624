"""FP8 weights for the embedded engine: the rounding an FP8 rollout engine applies to its weights.

What it is: `round_e4m3(w)`, a linear layer's weight rounded to float8 e4m3 with one scale per
output row (the row's largest |value| maps to e4m3's largest, 448: per-channel weight
quantisation) and returned dequantised in the caller's dtype; `is_quantised(name)`, which HF
tensors an FP8 engine quantises: the decoder blocks' projections (q, k, v, o, gate, up, down),
not the embeddings, the norms, the biases or the output head. With `rollout.engine_dtype=fp8_e4m3`
the engine computes in bfloat16 with these weights (w8a16, `decoder.py`), so its log-probs differ
from the fp32 learner's by more than a bf16 engine's: the mismatch of an FP8 rollout, on purpose.
What it is not: FP8 arithmetic. Activations and the KV cache stay bf16; an FP8 GEMM on a GPU (w8a8,
activation scales per token) disagrees more. Nothing here is used by the learner.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                "up_proj.weight", "down_proj.weight")


def is_quantised(name: str) -> bool:
    """True for an HF tensor an FP8 engine stores in e4m3: a decoder block's projection weight."""
    return name.startswith("model.layers.") and name.endswith(_PROJECTIONS)


def round_e4m3(w: torch.Tensor) -> torch.Tensor:
    """`w` ([out, in]) through float8 e4m3 with one scale per row, back in `w`'s dtype: every
    value becomes `scale_row * e` with `e` an e4m3 number, the row's largest |value| exactly
    `448 * scale_row`. An all-zero row stays zero."""
    if w.dim() != 2:
        raise ValueError(f"round_e4m3: a [out, in] weight, got shape {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return ((wf / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def quantise(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (HF names) with every `is_quantised` one rounded by `round_e4m3`."""
    return {k: round_e4m3(v) if is_quantised(k) else v for k, v in tensors.items()}
