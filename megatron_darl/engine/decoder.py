"""The embedded engine's decoding core: continuous batching over a forward with a KV cache.

What it is: `Decoder`, continuous batching over one `CausalLM` (the Qwen3 decoder block, also
Qwen2 and Llama, with fused projections and a preallocated KV cache: `causal_lm.py`) loaded from
an HF folder (config.json + *.safetensors: `hf_folder.py`): sequences join between steps (their
KV is prefilled), decode together in one batched step, and leave when finished; a weight swap
marks every row for re-prefill, so in-flight sequences continue under the new weights with their
KV recomputed. The sampler is `sampling.py`; a row whose logits or sampled log-prob is not
finite fails (`Sequence.error`) instead of reaching an answer. The engine dtype (`ENGINE_DTYPES`:
float32, the default, bfloat16, float16, or fp8_e4m3: bf16 over e4m3-rounded projection weights,
`fp8.py`; `rollout.engine_dtype`) is that of the weights,
activations and KV cache, on CPU and GPU alike: weights are read (and received) as fp32 and cast
when the model is built; RMSNorm statistics are taken in fp32 and logits are returned in fp32
for the sampler, as transformers and SGLang do; the learner keeps its own dtype, so a bf16
engine disagrees with it on purpose.
What it is not: an HTTP server (that is `server.py`), a tokenizer (ids in, ids out), or
a trainer: no autograd, no dropout. Measured faster than `transformers.generate()` on CPU with
log-probs equal to transformers' within 1e-4 (tests/unit/engine/test_decoder.py;
`python bench/engine.py` prints the speed ratio).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_darl.engine.causal_lm import CausalLM, KVCache
from megatron_darl.engine.fp8 import quantise

# re-exported: weight_group.py, server.py and tests import IGNORED_SUFFIXES, load_hf_tensors, WeightLoadError here
from megatron_darl.engine.hf_folder import IGNORED_SUFFIXES, ModelSpec, load_hf_tensors  # noqa: F401
from megatron_darl.engine.sampling import sample
from megatron_darl.engine.weight_files import WeightLoadError  # noqa: F401
from megatron_darl.types import SamplingParams

# the engine dtypes `--dtype` / `rollout.engine_dtype` accept, and what each computes in;
# fp8_e4m3: bf16 arithmetic over projection weights rounded to e4m3 (`fp8.py`)
ENGINE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                         "float16": torch.float16, "fp8_e4m3": torch.bfloat16}
FP8_WEIGHTS = ("fp8_e4m3",)


@dataclass
class Sequence:
    """One request inside the decoder. `tokens` is prompt + generated; the cache holds the KV
    of tokens[:-1] and the next step feeds tokens[-1] (so joining and re-prefilling after a
    weight swap are the same operation: prefill tokens[:-1])."""

    rid: str
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    generator: torch.Generator | None = None
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: dict | None = None
    needs_prefill: bool = True
    error: str | None = None  # set when decoding failed for this sequence (it leaves the batch)
    logprob_start: int = -1  # first prompt position whose log-prob is answered (-1: none; SGLang's logprob_start_len)
    prompt_logprobs: list[float | None] | None = None  # of tokens[logprob_start:prompt_len], set at the first prefill

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Decoder:
    """Continuous batching over one CausalLM. Not thread-safe: one caller at a time (the engine
    server runs every call on one worker thread, which also serialises weight swaps with steps).

    Rows 0..B-1 of the KV cache are the B running sequences; a finished sequence leaves by
    moving the last row into its slot, so every step is one dense batched forward.
    """

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu", max_batch: int = 64, seed: int = 0,
                 dtype: str = "float32"):
        """Load `model_dir` and set up the batch.

        Args:
            device: where the model, the KV cache and the sampler run.
            max_batch: the most sequences decoded together (rows of the KV cache).
            seed: the sampler's generator, for requests without a seed of their own.
            dtype: the engine dtype (`ENGINE_DTYPES`) of weights, activations and KV cache.
        """
        if dtype not in ENGINE_DTYPES:
            raise ValueError(f"engine dtype {dtype!r}: allowed are {', '.join(ENGINE_DTYPES)}")
        self.device, self.dtype = torch.device(device), ENGINE_DTYPES[dtype]
        self.dtype_name = dtype  # the setting (fp8_e4m3 computes in bf16)
        self.spec = ModelSpec.from_dir(model_dir)
        self.model = self._build(load_hf_tensors(model_dir, self.spec))
        self.max_batch = max_batch
        self.cache = KVCache(self.spec, max_batch, self.device, dtype=self.dtype)
        self.rows: list[Sequence] = []
        self.version = 0
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.tokens_generated = 0

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.rows)

    def add(self, seq: Sequence) -> None:
        """Join a sequence; its KV is prefilled at the start of the next step."""
        if self.free_slots <= 0:
            raise RuntimeError(f"Decoder.add({seq.rid!r}): all {self.max_batch} rows are busy")
        if not seq.tokens or len(seq.tokens) >= self.spec.max_positions:
            raise ValueError(f"request {seq.rid!r}: {len(seq.tokens)} input tokens; "
                             f"need 1..{self.spec.max_positions - 1}")
        if seq.sampling.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed(seq.sampling.seed)
        seq.needs_prefill = True
        self.rows.append(seq)

    def step(self) -> list[Sequence]:
        """Prefill rows that need it, decode one token for every row, return the finished rows
        (removed from the batch)."""
        if not self.rows:
            return []
        self._prefill()
        failed = self._evict(lambda s: s.error is not None)  # a non-finite prompt log-prob
        if not self.rows:
            return failed
        seqs = self.rows
        tokens = torch.tensor([s.tokens[-1] for s in seqs], device=self.device)
        positions = torch.tensor([len(s.tokens) - 1 for s in seqs], device=self.device)
        logits = self.model.decode(self.cache, tokens, positions)
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        for s, ok in zip(seqs, finite):
            if not ok:  # a broken model (or an overflow): fail the row, never sample from NaN
                s.error = (f"the model produced non-finite logits at position {len(s.tokens) - 1} "
                           f"(weight version {self.version})")
                s.finish = {"type": "abort", "message": s.error}
        good = [i for i, ok in enumerate(finite) if ok]
        if good:
            rows = logits if len(good) == len(seqs) else logits[good]  # no copy in the usual case
            new, lps = sample(rows, [seqs[i] for i in good], self.generator)
            for i, tok, lp in zip(good, new, lps):
                s = seqs[i]
                if not math.isfinite(lp):  # finite logits that overflowed once divided by T: no NaN leaves
                    s.error = (f"non-finite log-prob {lp} at position {len(s.tokens) - 1} (temperature "
                               f"{s.sampling.temperature}, weight version {self.version})")
                    s.finish = {"type": "abort", "message": s.error}
                    continue
                s.tokens.append(tok)
                s.logprobs.append(lp)
                s.versions.append(self.version)
                s.finish = self._finish_reason(s, tok)
        self.tokens_generated += len(good)
        return failed + self._evict(lambda s: s.finish is not None)

    def remove(self, rids: str | Collection[str] | None = None) -> list[Sequence]:
        """Take sequences out of the batch (all when rids is None; one id or a set of ids), e.g.
        to abort them."""
        if isinstance(rids, str):
            rids = (rids,)
        return self._evict(lambda s: rids is None or s.rid in rids)

    def load_weights(self, model_dir: str | Path) -> None:
        """Swap in the weights of `model_dir` (validated first: on error the old ones stay) and
        mark every running sequence for re-prefill under them."""
        self.use_tensors(load_hf_tensors(model_dir, self.spec))

    def use_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Swap in checked HF-named fp32 tensors (cast to the engine dtype); running sequences
        re-prefill under them."""
        self.model = self._build(tensors)
        for s in self.rows:
            s.needs_prefill = True

    @property
    def fp8(self) -> bool:
        """Whether projection weights are rounded to e4m3 on every load (`fp8.py`)."""
        return self.dtype_name in FP8_WEIGHTS

    def _build(self, tensors: dict[str, torch.Tensor]) -> CausalLM:
        """The forward over fp32 `tensors`, FP8-rounded first for an fp8 engine, cast to the dtype."""
        return CausalLM(self.spec, quantise(tensors) if self.fp8 else tensors, self.device, self.dtype)

    def _prefill(self) -> None:
        todo = [i for i, s in enumerate(self.rows) if s.needs_prefill and len(s.tokens) > 1]
        if todo:
            width = max(len(self.rows[i].tokens) - 1 for i in todo)
            batch = torch.zeros(len(todo), width, dtype=torch.long)
            for j, i in enumerate(todo):
                ctx = self.rows[i].tokens[:-1]
                batch[j, : len(ctx)] = torch.tensor(ctx)
            hidden = self.model.prefill(self.cache, todo, batch.to(self.device))
            for j, i in enumerate(todo):
                self._score_prompt(self.rows[i], hidden[j])
        for s in self.rows:
            if s.prompt_logprobs is None and s.logprob_start >= 0:  # a one-token prompt: nothing to score
                s.prompt_logprobs = [None] * (s.prompt_len - s.logprob_start)
            s.needs_prefill = False

    def _score_prompt(self, s: Sequence, hidden: torch.Tensor) -> None:
        """The prompt log-probs of `s` asked for (`logprob_start`), once, from its first prefill:
        the weights its first token is sampled with. A non-finite one fails the row."""
        if s.prompt_logprobs is not None or s.logprob_start < 0 or s.logprob_start >= s.prompt_len:
            return
        # position t-1 predicts prompt token t; the first answered token's log-prob is null (SGLang)
        first = s.logprob_start + 1
        targets = torch.tensor(s.tokens[first : s.prompt_len], device=self.device)
        lps = self.model.logprobs_of(hidden[first - 1 : s.prompt_len - 1], targets).tolist()
        if not all(math.isfinite(v) for v in lps):
            s.error = f"non-finite prompt log-prob (weight version {self.version})"
            s.finish = {"type": "abort", "message": s.error}
        s.prompt_logprobs = [None, *lps]

    def _finish_reason(self, s: Sequence, tok: int) -> dict | None:
        sp = s.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.spec.eos_token_ids):
            return {"type": "stop", "matched": tok}
        n = len(s.tokens) - s.prompt_len
        if n >= sp.max_new_tokens or len(s.tokens) >= self.spec.max_positions:
            return {"type": "length", "length": n}
        return None

    def _evict(self, leaving) -> list[Sequence]:
        out = []
        for i in reversed(range(len(self.rows))):
            if not leaving(self.rows[i]):
                continue
            out.append(self.rows[i])
            last = len(self.rows) - 1
            if i != last:  # keep rows dense: the last row moves into the freed slot
                self.cache.move_row(last, i, len(self.rows[last].tokens) - 1)
                self.rows[i] = self.rows[last]
            self.rows.pop()
        out.reverse()
        return out
