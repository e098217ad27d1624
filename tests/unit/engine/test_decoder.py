"""The embedded engine's decoding core, in process, against transformers as the reference:
log-probs of every sampled token equal transformers' teacher-forced log-probs (Qwen3, Qwen2,
Llama; tied and untied embeddings) while sequences join and leave the batch at different
steps and weights are swapped mid-generation."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (a hard dependency: imported, never skipped)

from megatron_darl.engine.decoder import Decoder, Sequence, WeightLoadError
from megatron_darl.engine.sampling import _truncate
from megatron_darl.types import SamplingParams
from tests.helpers import engines

TINY = dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=256, initializer_range=0.3)


def save_tiny(path, arch: str = "qwen3", seed: int = 0, **overrides):
    """A random tiny model of `TINY` saved as an HF folder; norms and biases randomised too so
    that a wrong norm or a dropped bias shows in the log-probs."""
    return engines.save_tiny(path, seed, config=TINY, arch=arch, random_norms=True, **overrides)


def teacher_forced(model, seq: Sequence) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([seq.tokens])).logits[0]
    t = seq.sampling.temperature
    logp = torch.log_softmax(logits[seq.prompt_len - 1 : -1] / t, dim=-1)
    return logp.gather(1, torch.tensor(seq.output_ids)[:, None]).squeeze(1)


def run_to_end(dec: Decoder, joins: dict[int, Sequence] | None = None) -> list[Sequence]:
    done, step = [], 0
    while dec.rows or (joins and any(k >= step for k in joins)):
        if joins and step in joins:
            dec.add(joins[step])
        done += dec.step()
        step += 1
    return done


@pytest.mark.parametrize("arch,extra", [("qwen3", {"head_dim": 16, "tie_word_embeddings": False}),
                                        ("qwen3", {"head_dim": 8, "tie_word_embeddings": True}),
                                        ("qwen2", {}), ("llama", {})])
def test_logprobs_equal_transformers_with_joins_and_leaves(tmp_path, arch, extra):
    model = save_tiny(tmp_path, arch, **extra)
    dec = Decoder(tmp_path, max_batch=4)
    temps = [0.6, 1.0, 1.4]
    for i, t in enumerate(temps):  # different lengths: rows leave at different steps
        dec.add(Sequence(str(i), list(range(1 + i, 7 + 3 * i)), 6 + 2 * i,
                         SamplingParams(temperature=t, max_new_tokens=8 + 5 * i, ignore_eos=True, seed=i)))
    late = {3: Sequence("late", [5, 9, 2], 3,
                        SamplingParams(temperature=0.9, top_k=7, top_p=0.8, max_new_tokens=12, ignore_eos=True)),
            10: Sequence("later", [7], 1, SamplingParams(temperature=1.2, max_new_tokens=9, ignore_eos=True))}
    done = run_to_end(dec, late)
    assert sorted(s.rid for s in done) == ["0", "1", "2", "late", "later"]
    for s in done:
        assert len(s.output_ids) == s.sampling.max_new_tokens and s.finish["type"] == "length"
        err = (teacher_forced(model, s) - torch.tensor(s.logprobs)).abs().max().item()
        assert err < 1e-4, (s.rid, err)


def test_weight_swap_reprefills_and_versions_tokens(tmp_path):
    old = save_tiny(tmp_path / "v0", seed=0)
    new = save_tiny(tmp_path / "v1", seed=1)
    dec = Decoder(tmp_path / "v0", max_batch=2)
    seq = Sequence("a", [3, 1, 4, 1, 5], 5, SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=7))
    dec.add(seq)
    for _ in range(8):
        dec.step()
    dec.load_weights(tmp_path / "v1")
    dec.version = 1
    run_to_end(dec)
    assert seq.versions == [0] * 8 + [1] * 12
    lp = torch.tensor(seq.logprobs)
    assert (teacher_forced(old, seq)[:8] - lp[:8]).abs().max() < 1e-4
    assert (teacher_forced(new, seq)[8:] - lp[8:]).abs().max() < 1e-4
    assert (teacher_forced(old, seq)[8:] - lp[8:]).abs().max() > 1e-2  # the swap really changed the scores


def test_bad_weights_are_rejected_and_old_ones_kept(tmp_path):
    model = save_tiny(tmp_path / "ok")
    save_tiny(tmp_path / "wide", intermediate_size=128)
    dec = Decoder(tmp_path / "ok", max_batch=1)
    with pytest.raises(WeightLoadError, match=r"mlp\.(down|gate|up)_proj\.weight"):
        dec.load_weights(tmp_path / "wide")
    seq = Sequence("a", [1, 2, 3], 3, SamplingParams(max_new_tokens=5, ignore_eos=True))
    dec.add(seq)
    run_to_end(dec)
    assert (teacher_forced(model, seq) - torch.tensor(seq.logprobs)).abs().max() < 1e-4
    with pytest.raises(WeightLoadError, match="no config.json"):
        Decoder(tmp_path / "missing")


def test_stop_tokens_and_greedy(tmp_path):
    model = save_tiny(tmp_path)
    dec = Decoder(tmp_path, max_batch=2)
    stop = Sequence("s", [1, 2], 2, SamplingParams(stop_token_ids=list(range(TINY["vocab_size"])), max_new_tokens=9))
    greedy = Sequence("g", [1, 2], 2, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    dec.add(stop)
    dec.add(greedy)
    run_to_end(dec)
    assert stop.finish == {"type": "stop", "matched": stop.output_ids[0]} and len(stop.output_ids) == 1
    with torch.no_grad():
        ref = model.generate(torch.tensor([[1, 2]]), max_new_tokens=6, do_sample=False)[0, 2:].tolist()
    assert greedy.output_ids == ref


def test_truncation_matches_naive_top_k_top_p():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(3, 20), -1)
    top_k, top_p = torch.tensor([3, 20, 20]), torch.tensor([1.0, 0.5, 0.9])
    got = _truncate(probs, top_k, top_p)
    for r in range(3):
        order = probs[r].argsort(descending=True).tolist()
        keep, mass = [], 0.0
        for rank, tok in enumerate(order):  # naive: walk tokens by probability
            if rank >= int(top_k[r]) or mass >= float(top_p[r]):
                break
            keep.append(tok)
            mass += float(probs[r, tok])
        assert sorted(torch.nonzero(got[r]).flatten().tolist()) == sorted(keep)


@pytest.mark.gpu
def test_cuda_decoder_logprobs_equal_transformers_on_cpu(tmp_path):
    model = save_tiny(tmp_path, head_dim=16)
    dec = Decoder(tmp_path, device="cuda", max_batch=4)
    for i, t in enumerate([0.7, 1.0, 1.3]):
        dec.add(Sequence(str(i), [2 + i, 4, 6][: 1 + i], 1 + i,
                         SamplingParams(temperature=t, top_p=0.95, max_new_tokens=10 + 4 * i, ignore_eos=True, seed=i)))
    done = run_to_end(dec, {2: Sequence("late", [9, 9], 2, SamplingParams(max_new_tokens=6, ignore_eos=True))})
    assert len(done) == 4
    for s in done:
        assert (teacher_forced(model, s) - torch.tensor(s.logprobs)).abs().max().item() < 1e-4, s.rid


def test_eos_from_config_and_generation_config_stops_unless_ignored(tmp_path):
    save_tiny(tmp_path, eos_token_id=5)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 5]}')
    dec = Decoder(tmp_path, max_batch=2)
    assert dec.spec.eos_token_ids == (5, 7)
    everything = list(range(TINY["vocab_size"]))
    stops = Sequence("s", [1], 1, SamplingParams(temperature=0.0, max_new_tokens=4))
    dec.add(stops)
    dec.spec = type(dec.spec)(**{**dec.spec.__dict__, "eos_token_ids": tuple(everything)})  # every token is an end
    ignores = Sequence("i", [1], 1, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    dec.add(ignores)
    run_to_end(dec)
    assert stops.finish["type"] == "stop" and len(stops.output_ids) == 1
    assert ignores.finish["type"] == "length" and len(ignores.output_ids) == 4


def test_long_sequences_grow_the_cache_and_leave_the_batch(tmp_path):
    """Past the initial KV capacity (128) the cache grows inside decode; rows that finish later
    must still move within it (a regression: the grown cache used to refuse in-place moves)."""
    model = save_tiny(tmp_path / "m")
    dec = Decoder(tmp_path / "m", max_batch=3)
    seqs = [Sequence(r, [3, 1, 4], 3, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=i))
            for i, (r, n) in enumerate([("short", 140), ("long", 200), ("mid", 170)])]
    for s in seqs:
        dec.add(s)
    done = run_to_end(dec)
    assert sorted(s.rid for s in done) == ["long", "mid", "short"]
    assert dec.cache.capacity >= 203
    for s in seqs:
        assert len(s.output_ids) == s.sampling.max_new_tokens
        assert (teacher_forced(model, s) - torch.tensor(s.logprobs)).abs().max() < 1e-4
