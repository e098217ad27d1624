"""Model build for the learner: HF config.json -> Megatron-Core `TransformerConfig` -> `GPTModel`.

What it is: `transformer_config` is THE one function turning a Hugging Face config.json of a
family the converter maps (Qwen3: q/k RMSNorm; Qwen2: q/k/v biases; Llama: neither; tied or
untied embeddings) plus our model/parallel configs into a `TransformerConfig`; `build_model`
builds this rank's `GPTModel` chunk(s) with the layer spec of that family, local (CPU, or a GPU
without TE; its core attention `attention.FlashCoreAttention` unless `model.attention=dot_product`)
or Transformer Engine (GPU, optional FP8 recipe, sequence parallel), every parameter in
`params_dtype`; `load_hf_weights` fills them
from the HF safetensors through the `checkpoint_tools` adapter (the same name mapping that
weight export uses).
What it is not: parallel setup (`parallel.py`) or the training loop.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from checkpoint_tools.adapters import ArchFamily, family_of, get_adapter, padded_vocab_size
from megatron_darl.config.learner import ModelConfig, ParallelConfig

_FP8_MIN_TE = {"delayed": "1.0.0", "tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0", "mxfp8": "2.1.0"}
_FP8_MIN_SM = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


def read_hf_config(model_dir: str) -> dict:
    """The HF config.json of an HF folder, a learner checkpoint (which stores it) or a
    `darl-convert` Megatron folder (whose darl_meta.json carries it)."""
    if is_converted_mcore(model_dir):
        from checkpoint_tools.mcore_format import read_meta

        return read_meta(model_dir).hf_config
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.hf_dir={model_dir!r}: no config.json there")
    with open(path) as f:
        return json.load(f)


def is_converted_mcore(model_dir: str) -> bool:
    from checkpoint_tools.mcore_format import META_FILE

    return os.path.isfile(os.path.join(model_dir, META_FILE))


def rope_theta(hf: dict) -> int:
    """RoPE base: top-level `rope_theta` (transformers 4) or `rope_parameters` (transformers 5);
    scaled RoPE variants (yarn, llama3, …) are refused rather than silently run unscaled."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type"))
    if kind not in (None, "default"):
        raise ValueError(f"config.json rope type {kind!r}: only plain RoPE is supported")
    return int(hf.get("rope_theta") or params.get("rope_theta") or 10000)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def resolve_spec(model_cfg: ModelConfig, on_gpu: bool, par: ParallelConfig | None = None) -> str:
    """'te' or 'local': auto picks TE only when both TE and CUDA are present. Sequence parallel
    needs TE: megatron-core 0.16's local spec builds `WrappedTorchNorm`, which asserts
    `not config.sequence_parallel`."""
    if model_cfg.spec == "auto":
        spec = "te" if on_gpu and have_te() else "local"
    elif model_cfg.spec == "te" and not (on_gpu and have_te()):
        raise RuntimeError("model.spec=te needs CUDA and transformer_engine; use spec=local or auto")
    else:
        spec = model_cfg.spec
    if par is not None and par.sequence_parallel and spec != "te":
        raise RuntimeError(f"parallel.sequence_parallel=true needs the Transformer Engine spec (model.spec "
                           f"resolved to {spec!r}: CUDA and transformer_engine are required); set "
                           "parallel.sequence_parallel=false")
    return spec


def resolve_attention(model_cfg: ModelConfig, spec: str) -> str | None:
    """The local spec's core attention ("flash" | "dot_product"); None on the TE spec (TE's own)."""
    if spec == "te":
        return None
    return "flash" if model_cfg.attention == "auto" else model_cfg.attention


def resolve_dtype(model_cfg: ModelConfig, on_gpu: bool) -> torch.dtype:
    if model_cfg.dtype == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[model_cfg.dtype]


def fp8_settings(recipe: str | None, spec: str) -> dict:
    """TransformerConfig FP8 fields for a recipe name, after checking that TE and the GPU
    support it (Megatron's `get_fp8_recipe` then builds the TE recipe object from them)."""
    if recipe is None:
        return {}
    if spec != "te":
        raise ValueError(f"model.fp8={recipe} needs the Transformer Engine spec (resolved spec: {spec})")
    from megatron.core.utils import is_te_min_version

    if not is_te_min_version(_FP8_MIN_TE[recipe]):
        raise RuntimeError(f"model.fp8={recipe} needs transformer_engine >= {_FP8_MIN_TE[recipe]}")
    cap = torch.cuda.get_device_capability()
    if cap < _FP8_MIN_SM[recipe]:
        raise RuntimeError(f"model.fp8={recipe} needs compute capability >= {_FP8_MIN_SM[recipe]}, GPU has {cap}")
    # delayed / current scaling: E4M3 forward, E5M2 gradients; block recipes are E4M3 throughout
    fmt = "hybrid" if recipe in ("delayed", "tensorwise") else "e4m3"
    return {"fp8": fmt, "fp8_recipe": recipe}


def architecture(hf: dict) -> ArchFamily:
    """The family of `hf` (what the converter maps), after refusing what neither side supports:
    the adapter's own refusals (e.g. Llama attention/MLP biases), non-SwiGLU activations and
    Qwen2's sliding-window attention."""
    get_adapter(hf)  # raises UnsupportedArchitectureError / CheckpointError with the field named
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf.get('hidden_act')!r}: only silu (SwiGLU) is supported")
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true: sliding-window attention is not supported")
    return family_of(hf)


def recompute_settings(model_cfg: ModelConfig) -> dict:
    """TransformerConfig recompute fields for `model.recompute` (Megatron's own names)."""
    if model_cfg.recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if model_cfg.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(model_cfg.recompute_modules)}
    return {}


def transformer_config(hf: dict, model_cfg: ModelConfig, par: ParallelConfig, *, on_gpu: bool):
    """THE mapping from an HF config.json dict + our configs to Megatron's TransformerConfig."""
    from megatron.core.transformer import TransformerConfig

    family = architecture(hf)
    heads = hf["num_attention_heads"]
    dtype = resolve_dtype(model_cfg, on_gpu)
    spec = resolve_spec(model_cfg, on_gpu, par)
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,  # GQA
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,  # Qwen3 head_dim != hidden/heads
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        qk_layernorm=family.qk_norm,  # Qwen3 only
        gated_linear_unit=True,  # SwiGLU: silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,  # Qwen2 only (its config.json has no attention_bias key)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf.get("initializer_range", 0.02),
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        sequence_parallel=par.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # CPU: master weights built whole then split, so TP=k initialises exactly like TP=1
        use_cpu_initialization=not on_gpu,
        # local-spec CPU run: no fused CUDA kernels
        bias_activation_fusion=on_gpu and spec == "te",
        masked_softmax_fusion=on_gpu and _importable("scaled_masked_softmax_cuda"),  # apex-built kernel
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        variable_seq_lengths=True,  # micro-batches are packed to different padded lengths
        moe_token_dispatcher_type="alltoall",  # dense model; the default allgather refuses variable lengths
        # losses arrive normalised by the whole batch (algo/ loss_denominator): the schedule and
        # DDP must sum them over micro-batches and DP ranks, never average
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=on_gpu,
        **recompute_settings(model_cfg),
        **fp8_settings(model_cfg.fp8, spec),
    )


def layer_spec(spec: str, family: ArchFamily, attention: str | None = "flash"):
    """The decoder-layer ModuleSpec of `family` (q/k norm modules only where the family has
    them; biases follow `TransformerConfig.add_qkv_bias`); the local spec's core attention is
    `attention` (`attention.local_layer_spec`)."""
    if spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=family.qk_norm)
    from megatron_darl.learner.attention import local_layer_spec

    return local_layer_spec(family.qk_norm, attention or "flash")


@torch.no_grad()
def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Every floating-point parameter of `module` in `dtype` (megatron-core's local spec builds
    its RMSNorms with torch's default fp32 whatever `params_dtype` says); returns how many were
    cast. Run before DDP builds its buffers: they are laid out by parameter dtype, and the
    optimizer keeps fp32 master copies of the `dtype` ones."""
    cast = 0
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            cast += 1
    return cast


def build_model(hf: dict, model_cfg: ModelConfig, par: ParallelConfig, pg, *, on_gpu: bool) -> list:
    """This rank's GPTModel chunks (one per virtual pipeline stage), on the learner device."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )

    config = transformer_config(hf, model_cfg, par, on_gpu=on_gpu)
    spec = resolve_spec(model_cfg, on_gpu, par)
    attention = resolve_attention(model_cfg, spec)
    family = architecture(hf)
    vocab = padded_vocab_size(hf["vocab_size"], par.tp, model_cfg.make_vocab_size_divisible_by)
    chunks = []
    for vp in range(par.vpp or 1):
        vp_stage = vp if par.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(spec, family, attention),
            vocab_size=vocab,
            max_sequence_length=hf.get("max_position_embeddings", 4096),
            pre_process=is_pp_first_stage(pg.pp) and is_vp_first_stage(vp, par.vpp),
            post_process=is_pp_last_stage(pg.pp) and is_vp_last_stage(vp, par.vpp),
            parallel_output=True,  # logits stay vocab-parallel; logprobs.py reduces over TP
            share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
            position_embedding_type="rope",
            rotary_base=rope_theta(hf),
            pg_collection=pg,
            vp_stage=vp_stage,
        )
        cast_parameters(model, config.params_dtype)
        chunks.append(model.to(torch.cuda.current_device() if on_gpu else "cpu"))
    return chunks


def chunk_layer_offset(chunk) -> int:
    """Global index of the chunk's first decoder layer (Megatron's own rule, VPP included)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(chunk.config, vp_stage=chunk.vp_stage)


def global_name(local_name: str, offset: int) -> str:
    """`decoder.layers.{j}.…` of a chunk -> `decoder.layers.{j + offset}.…` (mcore global name)."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


@torch.no_grad()
def load_hf_weights(chunks: list, hf: dict, hf_dir: str, spec: str, divisible_by: int, tp_rank: int, tp: int) -> None:
    """Copy HF weights into this rank's chunks: each parameter is built full by the adapter,
    then cut to this TP rank's shard."""
    from checkpoint_tools.hf_format import HFReader

    adapter = get_adapter(hf, spec=spec, make_vocab_size_divisible_by=divisible_by)
    reader = HFReader(hf_dir)
    for chunk in chunks:
        offset = chunk_layer_offset(chunk)
        for name, param in chunk.named_parameters():
            full = adapter.from_hf(global_name(name, offset), reader.get, tp_size=tp)
            piece = adapter.shard(global_name(name, offset), full, tp_rank, tp)
            if piece.shape != param.shape:
                raise ValueError(f"{name}: HF-derived shard {tuple(piece.shape)} != parameter {tuple(param.shape)}")
            param.copy_(piece.to(param.dtype))
    reader.close()


@torch.no_grad()
def load_converted_weights(chunks: list, model_dir: str, spec: str, divisible_by: int, ctx) -> None:
    """Load this rank's shard from a `darl-convert` per-rank Megatron folder of the same layout."""
    from checkpoint_tools.mcore_format import load_mcore_rank_state, read_meta

    meta = read_meta(model_dir)
    layout = (meta.tp, meta.pp, meta.spec, meta.make_vocab_size_divisible_by)
    if layout != (ctx.tp, ctx.pp, spec, divisible_by) or len(chunks) != 1:
        raise ValueError(
            f"{model_dir}: converted for tp={meta.tp} pp={meta.pp} spec={meta.spec} "
            f"divisible_by={meta.make_vocab_size_divisible_by}, the learner runs tp={ctx.tp} pp={ctx.pp} "
            f"spec={spec} divisible_by={divisible_by} vpp={len(chunks) if len(chunks) > 1 else None}; "
            "reshard it with darl-convert or pass the HF folder")
    state = load_mcore_rank_state(model_dir, ctx.tp_rank, ctx.pp_rank)
    chunks[0].load_state_dict(state, strict=False)
    missing = [n for n, _ in chunks[0].named_parameters() if n not in state]
    if missing:
        raise ValueError(f"{model_dir}: rank tp={ctx.tp_rank} pp={ctx.pp_rank} lacks {missing[:5]}")


def load_initial_weights(chunks: list, model_cfg: ModelConfig, hf: dict, spec: str, ctx) -> None:
    """Fill freshly built chunks from `model.hf_dir`: HF safetensors (any layout, through the
    adapter) or a darl-convert Megatron folder (its own layout)."""
    div = model_cfg.make_vocab_size_divisible_by
    if is_converted_mcore(model_cfg.hf_dir):
        load_converted_weights(chunks, model_cfg.hf_dir, spec, div, ctx)
    else:
        load_hf_weights(chunks, hf, model_cfg.hf_dir, spec, div, ctx.tp_rank, ctx.tp)
