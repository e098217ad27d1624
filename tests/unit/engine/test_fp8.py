"""FP8 weights in the embedded engine (`rollout.engine_dtype=fp8_e4m3`): the rounding against a
naive reference (every value the nearest e4m3 number times its row's scale, the row's largest
|value| kept exactly), which tensors it touches, and an fp8 engine that still decodes, reports its
setting and disagrees with the fp32 reference more than a bf16 engine (the mismatch on purpose),
while wrong-but-loadable weights still stand far above it."""

from __future__ import annotations

import pytest
import torch

from megatron_darl.engine.decoder import Decoder, Sequence
from megatron_darl.engine.fp8 import E4M3_MAX, is_quantised, quantise, round_e4m3
from megatron_darl.types import SamplingParams
from tests.helpers.engines import save_wide, teacher_forced


def _e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn number, by its 256 bit patterns."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)].unique()


def test_rounding_is_the_nearest_e4m3_number_times_the_rows_scale():
    scales = torch.tensor([1e-3, 0.1, 1, 10, 300, 7])[:, None]
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * scales
    w[2, 5] = 0.0
    got = round_e4m3(w)
    grid = _e4m3_values()
    for row in range(w.shape[0]):
        scale = w[row].abs().max() / E4M3_MAX
        x = w[row] / scale
        nearest = (grid[None, :] - x[:, None]).abs().min(dim=1).values  # naive: distance to every e4m3 number
        err = (got[row] / scale - x).abs()
        assert torch.allclose(err, nearest, atol=1e-5 * E4M3_MAX), row
        assert got[row].abs().max() == pytest.approx(float(w[row].abs().max()), rel=1e-6)  # amax kept
    assert got[2, 5] == 0.0 and not torch.equal(got, w)
    rel = ((got - w).abs() / w.abs().clamp(min=1e-30))[w.abs() > w.abs().amax(1, keepdim=True) / 64]
    assert rel.max() <= 2 ** -4 + 1e-6  # 3 mantissa bits: half an ulp in the normal range


def test_zero_rows_stay_zero_and_only_projections_are_quantised():
    assert torch.equal(round_e4m3(torch.zeros(3, 4)), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="weight"):
        round_e4m3(torch.ones(4))
    names = {"model.layers.0.self_attn.q_proj.weight": True, "model.layers.3.mlp.down_proj.weight": True,
             "model.layers.0.self_attn.q_proj.bias": False, "model.layers.0.input_layernorm.weight": False,
             "model.embed_tokens.weight": False, "lm_head.weight": False, "model.norm.weight": False}
    assert {n: is_quantised(n) for n in names} == names
    t = {n: torch.randn(8, 8) for n in names}
    q = quantise(t)
    assert all(torch.equal(q[n], t[n]) != names[n] for n in names)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return root, save_wide(root / "v0", seed=0)


def _errors(root, ref, dtype: str) -> torch.Tensor:
    dec = Decoder(root / "v0", max_batch=4, dtype=dtype)
    seqs = [Sequence(f"r{i}", [1 + i, 5, 9, 2 + i], 4, SamplingParams(temperature=1.0, max_new_tokens=24,
                                                                     ignore_eos=True, seed=i)) for i in range(3)]
    for s in seqs:
        dec.add(s)
    while dec.rows:
        dec.step()
    return torch.cat([(teacher_forced(ref, s.tokens[:4], s.output_ids, 1.0) - torch.tensor(s.logprobs)).abs()
                      for s in seqs])


def test_an_fp8_engine_decodes_in_bf16_and_disagrees_more_than_bf16(model):
    root, ref = model
    dec = Decoder(root / "v0", max_batch=4, dtype="fp8_e4m3")
    assert dec.dtype_name == "fp8_e4m3" and dec.model.embed.dtype == torch.bfloat16 and dec.fp8
    bf16, fp8 = _errors(root, ref, "bfloat16"), _errors(root, ref, "fp8_e4m3")
    assert len(fp8) == 72 and torch.isfinite(fp8).all()
    assert fp8.mean() > 2 * bf16.mean(), (float(fp8.mean()), float(bf16.mean()))
    assert fp8.mean() < 1.0, float(fp8.mean())  # a rounded model, not a broken one
    dec.load_weights(root / "v0")  # a weight update is rounded too
    want = round_e4m3(ref.model.layers[0].self_attn.o_proj.weight.detach().float()).to(torch.bfloat16)
    assert torch.equal(dec.model.layers[0].o, want)
