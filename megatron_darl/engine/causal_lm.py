"""The embedded engine's forward pass: the Qwen3 decoder block over HF weights, with a KV cache.

What it is: a plain-torch implementation of the Qwen3 decoder block (also Qwen2 and Llama: the
same block without QK-norm, with or without q/k/v biases), with fused QKV and gate/up
projections: `CausalLM.prefill` (whole sequences from position 0, their KV written into cache
rows), `decode` (one token per row, logits for the last position only) and `logprobs_of` (prompt
log-probs). `KVCache`: a preallocated cache with one sequence per row that grows by doubling.
Weights, activations and KV cache are in the engine dtype; RMSNorm statistics are taken in fp32
and logits are returned in fp32, as transformers and SGLang do.
What it is not: the batching of requests, the sampler or weight swaps (`decoder.py`,
`sampling.py`), the reading of an HF folder (`hf_folder.py`), or a trainer: no autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_darl.engine.hf_folder import ModelSpec


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
