"""The embedded engine's decoding core: a forward over Hugging Face weights with a KV cache.

What it is: a plain-torch implementation of the Qwen3 decoder block (also Qwen2 and Llama: the
same block without QK-norm, with or without q/k/v biases), loaded from an HF folder
(config.json + *.safetensors), with fused QKV and gate/up projections, a preallocated KV cache
with one position per row, and logits for the last position only. `Decoder` adds continuous
batching on top: sequences join between steps (their KV is prefilled), decode together in one
batched step, and leave when finished; a weight swap marks every row for re-prefill, so
in-flight sequences continue under the new weights with their KV recomputed. The sampler is
`sampling.py`; a row whose logits or sampled log-prob is not finite fails (`Sequence.error`)
instead of reaching an answer. The engine dtype (`ENGINE_DTYPES`: float32, the default, bfloat16
or float16; `rollout.engine_dtype`) is that of the weights, activations and KV cache, on CPU and
GPU alike: weights are read (and received) as fp32 and cast when the model is built; RMSNorm
statistics are taken in fp32 and logits are returned in fp32 for the sampler, as transformers
and SGLang do; the learner keeps its own dtype, so a bf16 engine disagrees with it on purpose.
What it is not: an HTTP server (that is `server.py`), a tokenizer (ids in, ids out), or
a trainer: no autograd, no dropout. Measured faster than `transformers.generate()` on CPU with
log-probs equal to transformers' within 1e-4 (tests/unit/engine/test_decoder.py;
`python bench/engine.py` prints the speed ratio).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_darl.engine.sampling import sample
from megatron_darl.engine.weight_files import WeightLoadError, read_weight_file
from megatron_darl.types import SamplingParams

# architecture -> (has per-head QK RMSNorm, default for q/k/v biases when config has no
# `attention_bias`)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "Qwen3ForCausalLM": (True, False),
    "Qwen2ForCausalLM": (False, True),
    "LlamaForCausalLM": (False, False),
}
# HF buffers some checkpoints carry that are not weights
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# the engine dtypes `--dtype` / `rollout.engine_dtype` accept
ENGINE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                         "float16": torch.float16}


def _ignored(name: str, spec: ModelSpec) -> bool:
    # tied models may still carry a copy of the embedding as lm_head
    return name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and spec.tie_word_embeddings)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only model, read from an HF config.json."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    max_positions: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelSpec":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise WeightLoadError(f"{path}: no config.json (expected an HF model folder)")
        cfg = json.loads(path.read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise WeightLoadError(f"{path}: architectures={archs}; supported: {sorted(ARCHITECTURES)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise WeightLoadError(f"{path}: rope type {rope.get('rope_type')!r}; only 'default' RoPE is supported")
        qk_norm, bias_default = ARCHITECTURES[arch]
        if cfg.get("mlp_bias"):
            raise WeightLoadError(f"{path}: mlp_bias=true is not supported")
        heads = int(cfg["num_attention_heads"])
        eos_ids: set[int] = set()
        gen_path = Path(model_dir) / "generation_config.json"  # instruct models list more ends there
        for source in (cfg, json.loads(gen_path.read_text()) if gen_path.is_file() else {}):
            eos = source.get("eos_token_id")
            eos_ids.update(eos if isinstance(eos, list) else ([] if eos is None else [int(eos)]))
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_positions=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            qkv_bias=bool(cfg.get("attention_bias", bias_default)),
            eos_token_ids=tuple(sorted(eos_ids)),
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, for every weight the model needs."""
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        qd, kvd = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h),
                                              "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (qd, h),
                p + "self_attn.k_proj.weight": (kvd, h),
                p + "self_attn.v_proj.weight": (kvd, h),
                p + "self_attn.o_proj.weight": (h, qd),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            })
            if self.qkv_bias:
                for n, size in (("q", qd), ("k", kvd), ("v", kvd)):
                    shapes[f"{p}self_attn.{n}_proj.bias"] = (size,)
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        return shapes


def load_hf_tensors(model_dir: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Read every *.safetensors file of `model_dir` as fp32 and check it (`weight_files`: readable,
    names, floating dtypes, shapes, finite values: a well-formed file of NaNs is refused, not
    served) against `spec`, then that none is missing; raises WeightLoadError naming the first
    offending file or tensor (nothing is half-loaded)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir}: no *.safetensors files")
    expected = spec.expected_shapes()
    arch = f"{spec.arch} ({spec.num_layers} layers)"
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(read_weight_file(path, expected, lambda name: _ignored(name, spec), arch))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise WeightLoadError(f"{model_dir}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    return tensors


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # the statistics in fp32 whatever the engine dtype (as transformers' RMSNorm): the casts are
    # no-ops for an fp32 engine, whose results stay bit for bit those of before
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class KVCache:
    """K and V for `rows` sequences: [layers, rows, kv_heads, capacity, head_dim]. Row r holds
    the KV of positions 0..len-1 of the sequence in slot r; capacity grows by doubling."""

    def __init__(self, spec: ModelSpec, rows: int, device: torch.device, capacity: int = 128,
                 dtype: torch.dtype = torch.float32):
        self.shape = (spec.num_layers, rows, spec.num_kv_heads, capacity, spec.head_dim)
        self.k = torch.zeros(self.shape, device=device, dtype=dtype)
        self.v = torch.zeros(self.shape, device=device, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def ensure(self, length: int) -> None:
        if length <= self.capacity:
            return
        cap = self.capacity
        while cap < length:
            cap *= 2
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (cap,) + old.shape[4:])
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)

    @torch.inference_mode()  # after `ensure` grew them inside decode, k/v are inference tensors
    def move_row(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class CausalLM:
    """The forward pass. `prefill` writes the KV of whole sequences into cache rows; `decode`
    feeds one token per row (rows 0..B-1, each at its own position) and returns last-position
    logits (fp32, whatever the engine `dtype` the weights and activations are in)."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype = torch.float32):
        self.spec, self.device, self.dtype = spec, device, dtype
        t = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        self.lm_head = self.embed if spec.tie_word_embeddings else t["lm_head.weight"]
        self.layers = [self._fuse(t, f"model.layers.{i}.") for i in range(spec.num_layers)]
        d = spec.head_dim
        self.inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))

    def _fuse(self, t: dict[str, torch.Tensor], p: str) -> _Layer:
        a = p + "self_attn."
        bias = torch.cat([t[a + n + "_proj.bias"] for n in "qkv"]) if self.spec.qkv_bias else None
        return _Layer(
            ln1=t[p + "input_layernorm.weight"],
            qkv=torch.cat([t[a + n + "_proj.weight"] for n in "qkv"]),  # one GEMM instead of three
            qkv_b=bias,
            q_norm=t.get(a + "q_norm.weight"),
            k_norm=t.get(a + "k_norm.weight"),
            o=t[a + "o_proj.weight"],
            ln2=t[p + "post_attention_layernorm.weight"],
            gate_up=torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]),
            down=t[p + "mlp.down_proj.weight"],
        )

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2], as transformers does
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)  # angles in fp32, as transformers

    def _block(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        s = self.spec
        b, t, _ = x.shape
        qkv = F.linear(_rms(x, layer.ln1, s.rms_eps), layer.qkv, layer.qkv_b)
        qd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = qkv[..., :qd].view(b, t, s.num_heads, s.head_dim)
        k = qkv[..., qd : qd + kvd].view(b, t, s.num_kv_heads, s.head_dim)
        v = qkv[..., qd + kvd :].view(b, t, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q, k = _rms(q, layer.q_norm, s.rms_eps), _rms(k, layer.k_norm, s.rms_eps)
        q, k = _rope(q, cos, sin).transpose(1, 2), _rope(k, cos, sin).transpose(1, 2)
        a = attend(q, k, v.transpose(1, 2))  # [B, H, T, D]
        x = x + F.linear(a.transpose(1, 2).reshape(b, t, qd), layer.o)
        gate, up = F.linear(_rms(x, layer.ln2, s.rms_eps), layer.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Causal pass over right-padded `tokens` [N, T] from position 0; writes K/V of every
        position into cache `rows` (padding K/V lands beyond each row's length, where the
        causal mask of later steps never looks before it is overwritten). Returns the last
        layer's hidden states [N, T, H] (for prompt log-probs, `logprobs_of`)."""
        n, t = tokens.shape
        cache.ensure(t)
        idx = torch.tensor(rows, device=self.device)
        cos, sin = self._cos_sin(torch.arange(t, device=self.device).expand(n, t))
        x = F.embedding(tokens, self.embed)
        for li, layer in enumerate(self.layers):
            def attend(q, k, v, li=li):
                cache.k[li, idx, :, :t] = k
                cache.v[li, idx, :, :t] = v
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            x = self._block(layer, x, cos, sin, attend)
        return x

    @torch.inference_mode()
    def logprobs_of(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Log-probs [T] of `targets` [T] from the hidden states [T, H] of the positions before
        them, untempered and over the full vocabulary (SGLang's prompt log-probs)."""
        logits = F.linear(_rms(hidden, self.norm, self.spec.rms_eps), self.lm_head).float()
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)

    @torch.inference_mode()
    def decode(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row for cache rows 0..B-1 at `positions` [B]; returns logits [B, V]."""
        b = tokens.shape[0]
        span = int(positions.max()) + 1
        cache.ensure(span)
        ar = torch.arange(b, device=self.device)
        kvh = self.spec.num_kv_heads
        mask = (torch.arange(span, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        cos, sin = self._cos_sin(positions[:, None])
        x = F.embedding(tokens[:, None], self.embed)
        for li, layer in enumerate(self.layers):
            def attend(q, k, v, li=li):
                cache.k[li, ar, :, positions] = k[:, :, 0]
                cache.v[li, ar, :, positions] = v[:, :, 0]
                keys, vals = cache.k[li, :b, :, :span], cache.v[li, :b, :, :span]
                # the G query heads sharing a KV head act as G query rows: no K/V expansion
                # (20% faster than enable_gqa here); head h reads KV head h // G, as in HF
                grouped = q.reshape(b, kvh, -1, q.shape[-1])
                return F.scaled_dot_product_attention(grouped, keys, vals, attn_mask=mask).reshape(q.shape)

            x = self._block(layer, x, cos, sin, attend)
        return F.linear(_rms(x[:, -1], self.norm, self.spec.rms_eps), self.lm_head).float()


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
        self.spec = ModelSpec.from_dir(model_dir)
        self.model = CausalLM(self.spec, load_hf_tensors(model_dir, self.spec), self.device, self.dtype)
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
        self.model = CausalLM(self.spec, tensors, self.device, self.dtype)
        for s in self.rows:
            s.needs_prefill = True

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
