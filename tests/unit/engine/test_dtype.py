"""The engine dtype (`darl-engine --dtype`, `rollout.engine_dtype`): a bfloat16 or float16
engine serves /generate with behavior log-probs close to transformers' fp32 teacher-forced ones
(bounded) but measurably not equal (the setting takes effect), keeps its dtype across a weight
update, and the run config carries the setting to the engine command."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from megatron_darl.config import ConfigError, load_config
from megatron_darl.engine.command import engine_specs
from megatron_darl.engine.decoder import Decoder, Sequence
from megatron_darl.engine.server import EngineServer
from megatron_darl.rollout.sglang_client import SGLangClient
from megatron_darl.types import GenerateRequest, SamplingParams
from tests.helpers.engines import save_wide, serving, teacher_forced
from tests.unit.engine.test_command import _parse_embedded

TEMPS = [0.7, 1.0, 1.5]
# |engine - fp32 reference| per token on the wide tiny Qwen3 (measured: bf16 max 0.105, mean
# 0.035; fp16 max 0.020, mean 0.005; fp32 max 4e-6): (max bound, mean bound, floor the max must pass)
BOUNDS = {"float32": (1e-4, 1e-4, 0.0), "bfloat16": (0.3, 0.1, 1e-3), "float16": (0.1, 0.03, 1e-4)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype")
    return root, save_wide(root / "v0", seed=0), save_wide(root / "v1", seed=1)


def _requests() -> list[GenerateRequest]:
    return [GenerateRequest(input_ids=[1 + i, 5, 9, 2 + i], rid=f"d{i}",
                            sampling=SamplingParams(temperature=t, max_new_tokens=24, ignore_eos=True, seed=i))
            for i, t in enumerate(TEMPS)]


def _errors(ref_model, prompt, out, logprobs, temperature) -> torch.Tensor:
    return (teacher_forced(ref_model, prompt, out, temperature) - torch.tensor(logprobs)).abs()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_serves_logprobs_bounded_by_dtype(model, dtype):
    root, ref, _ = model
    server = EngineServer(Decoder(root / "v0", max_batch=4, dtype=dtype), str(root / "v0"))

    async def go():
        async with serving(server) as url:
            async with SGLangClient(url) as client:
                reqs = _requests()
                resps = await asyncio.gather(*(client.agenerate(r) for r in reqs))
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/get_server_info") as r:
                    info = await r.json()
        return reqs, resps, info

    reqs, resps, info = asyncio.run(go())
    assert info["dtype"] == dtype
    top, mean, floor = BOUNDS[dtype]
    errs = torch.cat([_errors(ref, q.input_ids, r.output_ids, r.output_logprobs, q.sampling.temperature)
                      for q, r in zip(reqs, resps)])
    assert len(errs) == 24 * len(TEMPS)
    assert errs.max() < top and errs.mean() < mean, (dtype, float(errs.max()), float(errs.mean()))
    assert errs.max() > floor, f"{dtype} engine scores like fp32: the setting did not take effect"


def test_float16_and_a_weight_update_keep_the_dtype(model):
    root, _, new = model
    dec = Decoder(root / "v0", max_batch=4, dtype="float16")
    dec.load_weights(root / "v1")  # weights arrive as fp32 (read or received) and are cast on load
    assert dec.model.embed.dtype == torch.float16 and dec.cache.k.dtype == torch.float16
    seqs = [Sequence(r.rid, list(r.input_ids), len(r.input_ids), r.sampling) for r in _requests()]
    for s in seqs:
        dec.add(s)
    while dec.rows:
        dec.step()
    errs = torch.cat([_errors(new, s.tokens[: s.prompt_len], s.output_ids, s.logprobs, s.sampling.temperature)
                      for s in seqs])
    top, mean, floor = BOUNDS["float16"]
    assert floor < errs.max() < top and errs.mean() < mean, (float(errs.max()), float(errs.mean()))


def test_run_config_carries_the_dtype_to_the_engine_command():
    base = ["model.hf_dir=/m"]
    spec = engine_specs(load_config(None, base + ["rollout.engine_dtype=bfloat16"]), [0])[0]
    assert _parse_embedded(spec.command("127.0.0.1", 1)[3:]).dtype == "bfloat16"
    plain = engine_specs(load_config(None, base), [0])[0].command("127.0.0.1", 1)
    assert "--dtype" not in plain and _parse_embedded(plain[3:]).dtype == "float32"
    with pytest.raises(ConfigError, match=r"rollout\.engine_dtype=.*allowed values"):
        load_config(None, base + ["rollout.engine_dtype=float64"])
    with pytest.raises(ConfigError, match=r"rollout\.engine_dtype: bfloat16 sets darl-engine's dtype"):
        load_config(None, base + ["rollout.backend=sglang", "rollout.engine_dtype=bfloat16"])
    with pytest.raises(ValueError, match="engine dtype 'half'"):
        Decoder("/nonexistent", dtype="half")
