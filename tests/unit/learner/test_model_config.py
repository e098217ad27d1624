"""The one HF config.json -> TransformerConfig mapping, field by field."""

import pytest
import torch

from megatron_darl.config.learner import ModelConfig, ParallelConfig
from megatron_darl.learner.model import layer_spec, resolve_dtype, resolve_spec, rope_theta, transformer_config

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


QWEN2 = dict(QWEN3, architectures=["Qwen2ForCausalLM"], model_type="qwen2", head_dim=None, tie_word_embeddings=False)
LLAMA = dict(QWEN3, architectures=["LlamaForCausalLM"], model_type="llama", head_dim=None, attention_bias=False,
             mlp_bias=False)


def _submodule_names(spec) -> set:
    attn = spec.submodules.self_attention.submodules
    from megatron.core.transformer.identity_op import IdentityOp

    return {n for n in ("q_layernorm", "k_layernorm") if getattr(attn, n) is not IdentityOp}


@pytest.mark.parametrize("hf,qk_norm,qkv_bias", [(QWEN3, True, False), (QWEN2, False, True), (LLAMA, False, False)])
def test_each_family_gets_its_own_attention(hf, qk_norm, qkv_bias):
    from megatron_darl.learner.model import architecture

    cfg = transformer_config(hf, ModelConfig(hf_dir="x"), ParallelConfig(), on_gpu=False)
    assert cfg.qk_layernorm == qk_norm and cfg.add_qkv_bias == qkv_bias and not cfg.add_bias_linear
    assert (_submodule_names(layer_spec("local", architecture(hf)))
            == ({"q_layernorm", "k_layernorm"} if qk_norm else set()))


def test_unsupported_variants_are_refused_with_the_field_named():
    for bad, field in ((dict(LLAMA, attention_bias=True), "attention_bias"), (dict(LLAMA, mlp_bias=True), "mlp_bias"),
                       (dict(QWEN2, use_sliding_window=True), "use_sliding_window"),
                       (dict(QWEN3, architectures=["GPT2LMHeadModel"], model_type="gpt2"), "GPT2LMHeadModel")):
        with pytest.raises(ValueError, match=field):
            transformer_config(bad, ModelConfig(hf_dir="x"), ParallelConfig(), on_gpu=False)


def test_recompute_and_sequence_parallel_settings():
    full = transformer_config(QWEN3, ModelConfig(hf_dir="x", recompute="full"), ParallelConfig(), on_gpu=False)
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    sel = transformer_config(QWEN3, ModelConfig(hf_dir="x", recompute="selective", recompute_modules=["mlp"]),
                             ParallelConfig(), on_gpu=False)
    assert sel.recompute_granularity == "selective" and sel.recompute_modules == ["mlp"]
    assert transformer_config(QWEN3, ModelConfig(hf_dir="x"), ParallelConfig(),
                              on_gpu=False).recompute_granularity is None
    # megatron-core's local spec refuses sequence parallel (torch norms): named before any model is built
    with pytest.raises(RuntimeError, match="parallel.sequence_parallel"):
        resolve_spec(ModelConfig(hf_dir="x"), on_gpu=False, par=ParallelConfig(tp=2, sequence_parallel=True))


def test_megatron_local_spec_really_refuses_sequence_parallel():
    """The fact the check above relies on, read from the installed megatron-core."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                            sequence_parallel=True, normalization="RMSNorm", use_cpu_initialization=True)
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(cfg, 8)
