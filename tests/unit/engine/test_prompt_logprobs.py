"""darl-engine's prompt log-probs (`return_logprob` with `logprob_start_len`), as SGLang 0.5.23
answers them: `meta_info.input_token_logprobs` holds `[logprob, token_id, null]` for prompt
tokens `[start:]`, the first log-prob null, the others untempered log_softmax over the full
vocabulary (its logprob_processor.py:734) and equal to transformers' teacher-forced ones, under
the weights in effect (after a weight update too), bounded but not equal in bf16; a start beyond
the prompt is refused with the field named, and without `return_logprob` the field is ignored."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from megatron_darl.engine.decoder import Decoder, Sequence
from megatron_darl.engine.server import EngineServer
from megatron_darl.types import SamplingParams
from tests.helpers.engines import save_wide, serving

PROMPTS = [[3, 17, 42, 8, 8, 91, 5, 60, 12], [7, 1, 2], [44]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt_lp")
    return root, save_wide(root / "v0", seed=0), save_wide(root / "v1", seed=1)


def _untempered(model, prompt: list[int]) -> list[float]:
    """transformers' log-probs of prompt tokens 1.. given the tokens before them (no temperature)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()


def _post(server: EngineServer, *bodies: dict) -> list[tuple[int, object]]:
    async def go():
        async with serving(server) as url, aiohttp.ClientSession() as http:
            out = []
            for body in bodies:
                async with http.post(f"{url}/generate", json=body) as r:
                    out.append((r.status, await r.json() if r.status == 200 else await r.text()))
            return out

    return asyncio.run(go())


def _body(prompts, start, temperature: float = 0.7, **extra) -> dict:
    return {"input_ids": prompts, "return_logprob": True, "logprob_start_len": start,
            "sampling_params": {"temperature": temperature, "max_new_tokens": 1, "sampling_seed": 3}, **extra}


def test_prompt_logprobs_equal_transformers_untempered(models):
    root, v0, _ = models
    server = EngineServer(Decoder(root / "v0", max_batch=4), str(root / "v0"))
    [(status, answers)] = _post(server, _body(PROMPTS, 0))
    assert status == 200
    for prompt, ans in zip(PROMPTS, answers):
        entries = ans["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt and all(e[2] is None for e in entries)
        assert entries[0][0] is None
        got, ref = torch.tensor([e[0] for e in entries[1:]]), torch.tensor(_untempered(v0, prompt))
        assert len(got) == len(prompt) - 1 and all((got - ref).abs() < 1e-4), prompt
        if len(prompt) > 2:  # untempered: the tempered log-probs (T = 0.7) are far from them
            with torch.no_grad():
                logits = v0(torch.tensor([prompt])).logits[0, :-1] / 0.7
            tempered = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
            assert (got - tempered).abs().max() > 1e-2


def test_start_positions_batches_and_refusals(models):
    root, v0, _ = models
    server = EngineServer(Decoder(root / "v0", max_batch=4), str(root / "v0"))
    p = PROMPTS[0]
    answers = _post(server, _body(PROMPTS[:2], [4, 3]), _body(p, len(p) + 1), _body(p, 2, return_logprob=False),
                    _body(p, -2), _body(p, True))
    (ok, both), (far, far_text), (off, off_ans), (neg, _), (boolean, _) = answers
    assert ok == 200
    first, second = (a["meta_info"]["input_token_logprobs"] for a in both)
    assert [e[1] for e in first] == p[4:] and first[0][0] is None
    assert [e[0] for e in first[1:]] == pytest.approx(_untempered(v0, p)[4:], abs=1e-4)
    assert second == []  # start == the prompt's length: nothing, as SGLang's default start
    assert far == 400 and "logprob_start_len" in far_text and "is higher than the number of input tokens" in far_text
    assert off == 200 and off_ans["meta_info"]["input_token_logprobs"] == []  # ignored without return_logprob
    assert neg == 400 and boolean == 400


def test_after_a_weight_update_and_in_bf16(models):
    root, _, v1 = models
    decoder = Decoder(root / "v0", max_batch=4, dtype="bfloat16")
    decoder.load_weights(root / "v1")
    decoder.version = 1
    [(status, ans)] = _post(EngineServer(decoder, str(root / "v0")), _body(PROMPTS[0], 0))
    assert status == 200 and ans["meta_info"]["weight_version"] == "1"
    got = torch.tensor([e[0] for e in ans["meta_info"]["input_token_logprobs"][1:]])
    err = (got - torch.tensor(_untempered(v1, PROMPTS[0]))).abs()
    assert 1e-3 < err.max() < 0.3, float(err.max())  # version 1's weights, in bf16: close, not equal


def test_a_non_finite_prompt_logprob_fails_only_its_row(models, monkeypatch):
    root, _, _ = models
    dec = Decoder(root / "v0", max_batch=4)
    monkeypatch.setattr(dec.model, "logprobs_of", lambda hidden, targets: torch.full(targets.shape, float("nan")))
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True, seed=1)
    scored, plain = Sequence("a", list(PROMPTS[0]), 9, sp, logprob_start=0), Sequence("b", [7, 1, 2], 3, sp)
    dec.add(scored)
    dec.add(plain)
    done = []
    while dec.rows:
        done += dec.step()
    assert scored.error and "non-finite prompt log-prob" in scored.error and scored.output_ids == []
    assert plain.error is None and len(plain.output_ids) == 2 and {s.rid for s in done} == {"a", "b"}
