"""The one HF config.json -> TransformerConfig mapping, field by field."""

import pytest
import torch

from megatron_darl.learner.api import ModelConfig, ParallelConfig
from megatron_darl.learner.model import resolve_dtype, resolve_spec, rope_theta, transformer_config

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "vocab_size": 300, "tie_word_embeddings": True, "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "initializer_range": 0.01,
}


def test_qwen3_fields_map_to_megatron():
    cfg = transformer_config(QWEN3, ModelConfig(hf_dir="x"), ParallelConfig(tp=2, pp=2), on_gpu=False)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 160)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (8, 2, 16)  # GQA, head_dim
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5
    assert cfg.qk_layernorm and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.activation_func is torch.nn.functional.silu
    assert cfg.params_dtype == torch.float32 and not cfg.bf16  # fp32 on CPU
    assert cfg.use_cpu_initialization  # TP=k initialises exactly like TP=1
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.calculate_per_token_loss and cfg.init_method_std == 0.01
    assert rope_theta(QWEN3) == 1000000


def test_transformers4_rope_theta_and_refusals():
    assert rope_theta({"rope_theta": 5000.0}) == 5000
    with pytest.raises(ValueError, match="yarn"):
        rope_theta({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        transformer_config(dict(QWEN3, hidden_act="gelu"), ModelConfig(hf_dir="x"), ParallelConfig(), on_gpu=False)


def test_spec_and_dtype_resolution_on_cpu():
    assert resolve_spec(ModelConfig(hf_dir="x"), on_gpu=False) == "local"
    with pytest.raises(RuntimeError, match="spec=te"):
        resolve_spec(ModelConfig(hf_dir="x", spec="te"), on_gpu=False)
    assert resolve_dtype(ModelConfig(hf_dir="x"), on_gpu=True) == torch.bfloat16
    assert resolve_dtype(ModelConfig(hf_dir="x", dtype="bf16"), on_gpu=False) == torch.bfloat16
