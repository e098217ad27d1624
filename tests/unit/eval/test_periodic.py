"""The in-loop evaluator's parts on CPU: its config checks, the generated-samples count, and the
in-process engine (`DecoderEngine`), which must answer concurrent requests exactly as the
decoder answers each one alone, respect its batch size, and fail callers instead of hanging."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_darl.config.eval import EvalConfig
from megatron_darl.engine.decoder import Decoder, Sequence
from megatron_darl.eval.periodic import DecoderEngine, samples_generated
from megatron_darl.types import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=60)
    cfg.architectures = ["Qwen3ForCausalLM"]
    out = str(tmp_path_factory.mktemp("tiny"))
    Qwen3ForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)
    return out


def test_every_steps_is_checked():
    assert EvalConfig(every_steps=5, num_problems=100).check() == []
    assert [k for k, _ in EvalConfig(every_steps=-1).check()] == ["every_steps"]
    assert [k for k, _ in EvalConfig(every_steps=5, num_problems=0).check()] == ["every_steps"]


def test_every_steps_errors_name_the_key():
    from megatron_darl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.every_steps"):
        load_config("configs/cpu_demo_darl.yaml", ["eval.every_steps=4", "eval.num_problems=0"])


def test_samples_generated_counts_filtered_groups():
    assert samples_generated({}, 8) is None
    assert samples_generated({"rollout/samples_written": 64.0}, 8) == 64.0
    assert samples_generated({"rollout/samples_written": 64.0, "rollout/filtered_groups": 3.0}, 8) == 64.0 + 24.0


def _requests(n: int) -> list[GenerateRequest]:
    reqs = []
    for i in range(n):
        sampled = i % 3 == 0
        sp = SamplingParams(temperature=1.0 if sampled else 0.0, max_new_tokens=3 + i % 5, seed=100 + i,
                            stop_token_ids=[59])
        reqs.append(GenerateRequest(input_ids=[1 + (7 * i + j) % 50 for j in range(2 + i % 6)], sampling=sp,
                                    rid=f"r{i}"))
    return reqs


def _alone(model_dir: str, req: GenerateRequest) -> list[int]:
    dec = Decoder(model_dir, max_batch=1)
    dec.add(Sequence(rid=req.rid, tokens=list(req.input_ids), prompt_len=len(req.input_ids), sampling=req.sampling))
    while True:
        done = dec.step()
        if done:
            return done[0].output_ids


@pytest.mark.parametrize("max_batch", [4, 64])
def test_concurrent_requests_answer_as_each_alone(model_dir, max_batch):
    engine = DecoderEngine(Decoder(model_dir, max_batch=max_batch))
    reqs = _requests(13)

    async def run():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    outs = asyncio.run(run())
    assert [o.rid for o in outs] == [r.rid for r in reqs]
    for o, r in zip(outs, reqs):
        assert o.output_ids == _alone(model_dir, r), r.rid
        assert len(o.output_logprobs) == len(o.output_ids) and o.finish_reason in ("stop", "length")
    assert engine.decoder.rows == [] and not engine._futures


def test_a_failing_step_fails_every_caller(model_dir):
    engine = DecoderEngine(Decoder(model_dir, max_batch=8))

    def broken():
        raise RuntimeError("boom")

    engine.decoder.step = broken

    async def run():
        return await asyncio.gather(*(engine.agenerate(r) for r in _requests(5)), return_exceptions=True)

    outs = asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert all(isinstance(o, RuntimeError) and "decode failed" in str(o) for o in outs)
