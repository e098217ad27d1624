"""Benchmark: generated tokens/s of the embedded engine's decoder vs `transformers` generate().

What it is: on one random Qwen3-architecture model (about 3.7M parameters by default, saved
as an HF folder in a temp dir; or `--model DIR`), the same random prompts (16 tokens) and the
same length (64 new tokens, no early stop), sampling at temperature 1 with the log-prob of
every sampled token (the engine's behavior log-probs; for transformers, log_softmax of the
scores it returns), batches 8, 32 and 64: tokens/s of `Decoder` (continuous batching core of
darl-engine, in process, all requests joining at once) and of `model.generate()`, best of
`--reps` runs each (alternating), and their ratio. Also the largest difference between the engine's
log-probs and transformers' teacher-forced log-probs of the same tokens. One line per batch
size, then the last line: one JSON object of every figure.
What it is not: a test, or an HTTP benchmark (the server adds a few ms per request, not per
token); numbers depend on the machine and on what else runs on it.

    python3 bench/engine.py [--threads 1] [--new-tokens 64] [--reps 5] [--device cpu] [--model HF_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_darl.engine.decoder import Decoder, Sequence
from megatron_darl.types import SamplingParams

BATCHES = (8, 32, 64)
PROMPT_LEN = 16


def _save_model(path: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=768, max_position_embeddings=2048,
                      tie_word_embeddings=True, initializer_range=0.1)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def _engine_run(dec: Decoder, prompts: torch.Tensor, new: int) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", p.tolist(), len(p), SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for s in seqs:
        dec.add(s)
    while dec.rows:
        dec.step()
    return seqs


@torch.inference_mode()
def _hf_run(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0,
                         top_p=1.0, max_new_tokens=new, min_new_tokens=new, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    logp = torch.log_softmax(torch.stack(out.scores, dim=1), dim=-1)  # the same log-probs the engine returns
    return logp.gather(2, out.sequences[:, prompts.shape[1]:, None]).squeeze(2)


def _best_pair(fn_a, fn_b, reps: int) -> tuple[float, float]:
    """Best-of-`reps` wall time of two functions, run alternately so that load from other
    processes on a shared machine hits both alike."""
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for j, fn in enumerate((fn_a, fn_b)):
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # generate() may return before its last kernels ran
            best[j] = min(best[j], time.perf_counter() - t0)
    return best[0], best[1]


@torch.inference_mode()
def _logprob_error(model, seqs: list[Sequence]) -> float:
    err = 0.0
    for s in seqs:
        logits = model(torch.tensor([s.tokens], device=model.device)).logits[0, s.prompt_len - 1 : -1].cpu()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
        err = max(err, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (both engines on it)")
    ap.add_argument("--model", default=None, help="HF folder (default: a random ~3.7M-param Qwen3)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tmp
        if args.model is None:
            _save_model(tmp)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(args.device)
        dec = Decoder(path, device=args.device, max_batch=max(BATCHES))
        vocab = dec.spec.vocab_size
        params = sum(p.numel() for p in model.parameters())
        result: dict[str, float | int | str] = {"params": params, "threads": args.threads,
                                                "new_tokens": args.new_tokens, "prompt_len": PROMPT_LEN,
                                                "device": args.device}
        gen = torch.Generator().manual_seed(1)
        _engine_run(dec, torch.randint(0, vocab, (2, PROMPT_LEN)), 4)  # warm-up both
        _hf_run(model, torch.randint(0, vocab, (2, PROMPT_LEN), device=args.device), 4)
        for b in BATCHES:
            prompts = torch.randint(0, vocab, (b, PROMPT_LEN), generator=gen).to(args.device)
            tokens = b * args.new_tokens
            t_eng, t_hf = _best_pair(lambda p=prompts: _engine_run(dec, p, args.new_tokens),
                                     lambda p=prompts: _hf_run(model, p, args.new_tokens), args.reps)
            result[f"engine_tok_s_b{b}"] = round(tokens / t_eng, 1)
            result[f"hf_generate_tok_s_b{b}"] = round(tokens / t_hf, 1)
            result[f"ratio_b{b}"] = round(t_hf / t_eng, 2)
            print(f"batch {b:3d}: engine {tokens / t_eng:9.1f} tok/s, "
                  f"transformers generate() {tokens / t_hf:9.1f} tok/s, "
                  f"ratio {t_hf / t_eng:5.2f}", flush=True)
        seqs = _engine_run(dec, torch.randint(0, vocab, (8, PROMPT_LEN), generator=gen), args.new_tokens)
        result["engine_logprob_max_abs_err"] = float(f"{_logprob_error(model, seqs):.3g}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
