"""An HF model folder as the embedded engine reads it: config.json into a `ModelSpec`, the
*.safetensors files into checked fp32 tensors.

What it is: `ModelSpec` (the shape of a decoder-only model: Qwen3, Qwen2 or Llama, the
architectures `ARCHITECTURES` lists, with default RoPE and no MLP bias; its eos ids from
config.json and generation_config.json), `expected_shapes()` (every weight the model needs), and
`load_hf_tensors` (every file read and checked by `weight_files.py`, then none missing; nothing
is half-loaded). `IGNORED_SUFFIXES`: HF buffers some checkpoints carry that are not weights.
What it is not: the forward pass (`causal_lm.py`), the batching (`decoder.py`), the per-file
checks (`weight_files.py`) or the engine dtype: tensors are returned as fp32, the model casts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_darl.engine.weight_files import WeightLoadError, read_weight_file

# architecture -> (has per-head QK RMSNorm, default for q/k/v biases when config has no
# `attention_bias`)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "Qwen3ForCausalLM": (True, False),
    "Qwen2ForCausalLM": (False, True),
    "LlamaForCausalLM": (False, False),
}
# HF buffers some checkpoints carry that are not weights
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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

