"""Flash core attention for megatron-core's local layer spec, on torch's `scaled_dot_product_attention`.

What it is: `FlashCoreAttention`, a `core_attention` module for megatron-core 0.16's
`SelfAttentionSubmodules` (built like its `DotProductAttention`: `config, layer_number,
attn_mask_type, attention_type, attention_dropout, softmax_scale, cp_comm_type, pg_collection`;
called with `query, key, value, attention_mask, attn_mask_type=, attention_bias=,
packed_seq_params=`; inputs `[s, b, heads, dim]`, output `[s, b, heads * dim]`). It hands the
heads to `F.scaled_dot_product_attention`, whose flash / memory-efficient kernels (CUDA) and
flash kernel (CPU) keep O(s) memory per head: the output and one fp32 log-sum-exp per row,
where `DotProductAttention` materialises `[b * heads, s, s]` scores and keeps their fp32 softmax
(and a bf16 copy) for backward. Causal masking is `is_causal` (no `[s, s]` mask), grouped-query
attention `enable_gqa` (K/V are not copied per head), the scale the config's `softmax_scale` or
1 / sqrt(head dim). It has no parameters, so checkpoints, adapters and conversion are those of
the local spec. `local_layer_spec` is that spec with this module in it.
What it is not: a fallback. What it cannot do as `DotProductAttention` does, it refuses when it
is built or called, naming the setting: context parallelism, sliding windows, attention dropout,
non-vanilla softmax, packed sequences, attention biases, and masks it cannot express exactly
(an explicit mask together with the causal type, a float mask, a causal mask over queries and
keys of different lengths).

GQA and the kernels (torch 2.13 CPU, 2.5+ CUDA): the CPU flash kernel takes `enable_gqa` and
keeps K/V at their group width; on CUDA the flash kernel takes it in bf16/fp16, while the
memory-efficient kernel (the only one for fp32) does not and torch would fall back to the math
kernel, so fp32 inputs on CUDA get K/V expanded to every head instead (a copy, O(s) still).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

_GQA_KWARG = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa since 2.5


class UnsupportedAttention(NotImplementedError):
    """A setting the flash core attention cannot run exactly (raised instead of falling back)."""


def _refuse(what: str) -> UnsupportedAttention:
    return UnsupportedAttention(f"model.attention=flash (torch scaled_dot_product_attention) does not support "
                                f"{what}; use model.attention=dot_product (megatron-core's DotProductAttention) "
                                "or the Transformer Engine spec")


class FlashCoreAttention(MegatronModule):
    """`softmax(q k^T * scale + mask) v` per head through `F.scaled_dot_product_attention`."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        """Refuses, naming it, a setting it cannot run exactly.

        Args:
            config: the model's TransformerConfig (as given by megatron-core's `Attention`, whose
                copy may raise `num_query_groups` to the TP size).
            layer_number: 1-based layer index (for sliding-window layer patterns).
            attn_mask_type: the layer's mask type (`AttnMaskType.causal` for GPT).
            attention_type: "self" or "cross".
            attention_dropout: dropout probability (None: the config's); only 0 is supported.
            softmax_scale: scale of the scores (None: the config's, else 1 / sqrt(head dim)).
            cp_comm_type: context-parallel communication type (context parallelism is refused).
            pg_collection: the process groups (its `tp` one).
        """
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.utils import is_layer_window_attention

        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise _refuse(f"context parallelism (context_parallel_size={config.context_parallel_size})")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise _refuse(f"sliding-window attention (window_size={config.window_size})")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise _refuse(f"softmax_type={config.softmax_type!r} (only the vanilla softmax)")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise _refuse(f"attention dropout ({dropout})")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        head_dim = config.kv_channels
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None)
        # DotProductAttention divides its scale by the layer number for apply_query_key_layer_scaling
        # and multiplies the scores by it again in the softmax: the net scale is this one
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)

    def _mask(self, mask_type, attention_mask, sq: int, sk: int) -> tuple[bool, torch.Tensor | None]:
        """(is_causal, SDPA boolean mask: True takes part) for Megatron's (type, mask: True masks out)."""
        from megatron.core.transformer.enums import AttnMaskType

        if mask_type == AttnMaskType.causal:
            if attention_mask is not None:
                raise _refuse("an explicit attention mask with attn_mask_type=causal (megatron-core's kernels "
                              "disagree on which applies)")
            if sq != sk:
                raise _refuse(f"a causal mask over {sq} queries and {sk} keys")
            return sq > 1, None
        if mask_type in (AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.arbitrary):
            if attention_mask is None:
                return False, None
            if attention_mask.dtype != torch.bool:
                raise _refuse(f"a {attention_mask.dtype} attention mask (only boolean masks)")
            return False, ~attention_mask
        raise _refuse(f"attn_mask_type={mask_type!r}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """`[sq, b, heads, dim]` queries, `[sk, b, groups, dim]` keys/values -> `[sq, b, heads * dim]`.

        Args:
            query: `[sq, b, heads, dim]`.
            key: `[sk, b, groups, dim]` (groups divides heads).
            value: `[sk, b, groups, dim]`.
            attention_mask: None, or a boolean mask broadcastable to `[b, heads, sq, sk]`, True where
                a key is masked out (Megatron's convention).
            attn_mask_type: this call's mask type (None: the layer's).
            attention_bias: must be None.
            packed_seq_params: must be None (packed sequences need the THD kernels of TE).
        """
        if packed_seq_params is not None:
            raise _refuse("packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise _refuse("an attention bias")
        sq, b, heads, dim = query.shape
        causal, mask = self._mask(attn_mask_type if attn_mask_type is not None else self.attn_mask_type,
                                  attention_mask, sq, key.shape[0])
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, dim] views
        extra = {}
        groups = k.shape[1]
        if groups != heads:
            if heads % groups:
                raise _refuse(f"{heads} query heads over {groups} key/value groups")
            if _GQA_KWARG and (q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)):
                extra["enable_gqa"] = True
            else:
                k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal,
                                             scale=self.softmax_scale, **extra)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)  # a view when the kernel kept the layout


def local_layer_spec(qk_layernorm: bool, attention: str):
    """megatron-core's local GPT layer spec (RMSNorm) with `attention`'s core attention:
    "flash" (`FlashCoreAttention`) or "dot_product" (megatron-core's own `DotProductAttention`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    if attention == "flash":
        spec.submodules.self_attention.submodules.core_attention = FlashCoreAttention
    elif attention != "dot_product":
        raise ValueError(f"model.attention={attention!r}; allowed: flash, dot_product (auto resolves to flash)")
    return spec
