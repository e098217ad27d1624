"""The signal a weight-version probe reads (the probe's wiring into the trainer
is not built yet): the prompt log-probs of a fixed 256-token sequence, served by darl-engine
(`logprob_start_len=0`), against the fp32 reference's (transformers here, the learner in a run).
Weights that are finite, of the right shape and pass every file check today but are wrong (one
projection's rows reversed, two layers' tensors swapped) load without error, and their figures
sit far above those of a correct bf16 engine, which sit far above the fp32 engine's: a
threshold per engine dtype separates them. Measured on the wide tiny Qwen3 (mean / max |delta|):
fp32 5e-7 / 6e-6, bf16 0.042 / 0.29, rows reversed 2.4 / 11.6, layers swapped 2.9 / 12.4."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_darl.algo import mismatch_metrics
from megatron_darl.engine.decoder import Decoder, Sequence
from megatron_darl.types import SamplingParams
from tests.helpers.engines import save_wide

PROBE = torch.randint(0, 96, (256,), generator=torch.Generator().manual_seed(0)).tolist()


def _reverse_rows(t: dict) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    t[name] = t[name].flip(0).contiguous()


def _swap_layers(t: dict) -> None:
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"
    t[a], t[b] = t[b].clone(), t[a].clone()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    model = save_wide(root / "v0", seed=0)
    for name, corrupt in (("reversed", _reverse_rows), ("swapped", _swap_layers)):
        shutil.copytree(root / "v0", root / name)
        path = next((root / name).glob("*.safetensors"))
        tensors = load_file(path)
        corrupt(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    with torch.no_grad():
        logits = model(torch.tensor([PROBE])).logits[0, :-1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(PROBE[1:])[:, None]).squeeze(1)
    return root, ref


def _figures(decoder: Decoder, ref: torch.Tensor) -> dict[str, float]:
    seq = Sequence("probe", list(PROBE), len(PROBE), SamplingParams(temperature=0.0, max_new_tokens=1),
                   logprob_start=0)
    decoder.add(seq)
    while decoder.rows:
        decoder.step()
    got = torch.tensor(seq.prompt_logprobs[1:])
    out = mismatch_metrics(ref[None], got[None], torch.ones(1, len(got), dtype=torch.bool), prefix="probe")
    return {k.removeprefix("probe/mismatch_"): v for k, v in out.items()}


def test_wrong_but_loadable_weights_stand_out_of_the_dtype_noise(world):
    root, ref = world
    fp32 = _figures(Decoder(root / "v0", max_batch=1), ref)
    bf16 = _figures(Decoder(root / "v0", max_batch=1, dtype="bfloat16"), ref)
    assert fp32["abs_max"] < 1e-4 and fp32["abs_mean"] < 1e-5
    assert 1e-3 < bf16["abs_mean"] < 0.1 and bf16["abs_max"] < 1.0
    for name in ("reversed", "swapped"):
        dec = Decoder(root / "v0", max_batch=1)
        dec.load_weights(root / name)  # every file check passes: finite, right names and shapes
        bad = _figures(dec, ref)
        assert bad["abs_mean"] > 10 * bf16["abs_mean"] and bad["abs_max"] > 2 * bf16["abs_max"], (name, bad, bf16)
        bad16 = _figures(Decoder(root / name, max_batch=1, dtype="bfloat16"), ref)
        assert bad16["abs_mean"] > 10 * bf16["abs_mean"], (name, bad16)  # caught on a bf16 engine too
