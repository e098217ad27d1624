"""Unit tests for the HF <-> Megatron-Core name/layout table (checkpoint_tools.adapters)."""

import pytest
import torch

from checkpoint_tools.adapters import get_adapter, layer_range, padded_vocab_size, stage_from_hf, stage_to_hf
from checkpoint_tools.api import CheckpointError, MissingTensorsError, ShapeMismatchError, UnsupportedArchitectureError

CFG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=300, hidden_size=64,
           intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
           tie_word_embeddings=False)
# Published Hugging Face config.json values (Qwen/Qwen3-1.7B, Qwen/Qwen3-4B).
QWEN3_1_7B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                  vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
QWEN3_4B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2560, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


def random_hf_state(adapter, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in adapter.hf_shapes().items()}


def naive_qkv(q, k, v, heads, kv_heads, d):
    """Megatron's fused layout built head by head: per KV group, its query heads, then k, then v."""
    rows = []
    per = heads // kv_heads
    for g in range(kv_heads):
        for h in range(g * per, (g + 1) * per):
            rows.append(q[h * d:(h + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    return torch.cat(rows)


def test_local_spec_names_match_megatron_core_0_16_1():
    # Names and shapes printed by GPTModel(get_gpt_layer_local_spec(qk_layernorm=True)).state_dict() for
    # this config (untied, 1 layer shown); the subprocess logits test loads them with strict=True as well.
    shapes = get_adapter({**CFG, "num_hidden_layers": 1}).mcore_shapes()
    assert shapes == {
        "embedding.word_embeddings.weight": (384, 64),
        "decoder.layers.0.input_layernorm.weight": (64,),
        "decoder.layers.0.self_attention.linear_qkv.weight": (192, 64),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 96),
        "decoder.layers.0.pre_mlp_layernorm.weight": (64,),
        "decoder.layers.0.mlp.linear_fc1.weight": (192, 64),
        "decoder.layers.0.mlp.linear_fc2.weight": (64, 96),
        "decoder.layers.0.self_attention.q_layernorm.weight": (24,),
        "decoder.layers.0.self_attention.k_layernorm.weight": (24,),
        "decoder.final_layernorm.weight": (64,),
        "output_layer.weight": (384, 64),
    }


def test_te_spec_fuses_norms_into_linears():
    names = set(get_adapter(CFG, spec="te").mcore_shapes())
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    a = get_adapter(CFG, spec="te")
    hf = random_hf_state(a)
    got = a.from_hf("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", hf.__getitem__)
    assert torch.equal(got, hf["model.layers.1.post_attention_layernorm.weight"])
    assert a.extra_state_keys(0, 1) == []


def test_qkv_fusion_matches_head_by_head_reference():
    a = get_adapter(CFG)
    hf = random_hf_state(a)
    p = "model.layers.2.self_attn."
    fused = a.from_hf("decoder.layers.2.self_attention.linear_qkv.weight", hf.__getitem__)
    assert torch.equal(fused, naive_qkv(hf[p + "q_proj.weight"], hf[p + "k_proj.weight"], hf[p + "v_proj.weight"],
                                        4, 2, 24))
    back = dict(a.to_hf("decoder.layers.2.self_attention.linear_qkv.weight", fused))
    assert all(torch.equal(back[p + x], hf[p + x]) for x in ("q_proj.weight", "k_proj.weight", "v_proj.weight"))


def test_qwen2_qkv_bias_uses_the_same_group_layout():
    cfg = {**CFG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    del cfg["head_dim"]
    a = get_adapter(cfg)
    hf = random_hf_state(a)
    p = "model.layers.0.self_attn."
    fused = a.from_hf("decoder.layers.0.self_attention.linear_qkv.bias", hf.__getitem__)
    assert torch.equal(fused, naive_qkv(hf[p + "q_proj.bias"], hf[p + "k_proj.bias"], hf[p + "v_proj.bias"], 4, 2, 16))
    assert "decoder.layers.0.self_attention.q_layernorm.weight" not in a.mcore_shapes()


def test_tp_shards_match_naive_reference():
    a, tp = get_adapter(CFG), 2
    hf = random_hf_state(a)
    L = "decoder.layers.1."
    p = "model.layers.1."
    for r in range(tp):
        qkv = a.shard(L + "self_attention.linear_qkv.weight",
                      a.from_hf(L + "self_attention.linear_qkv.weight", hf.__getitem__), r, tp)
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        # rank r holds query group r: heads 2r, 2r+1 (24 rows each), then k and v of group r
        assert torch.equal(qkv, naive_qkv(q[r * 48:(r + 1) * 48], k[r * 24:(r + 1) * 24], v[r * 24:(r + 1) * 24],
                                          2, 1, 24))
        fc1 = a.shard(L + "mlp.linear_fc1.weight", a.from_hf(L + "mlp.linear_fc1.weight", hf.__getitem__), r, tp)
        gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
        assert torch.equal(fc1, torch.cat([gate[r * 48:(r + 1) * 48], up[r * 48:(r + 1) * 48]]))
        fc2 = a.shard(L + "mlp.linear_fc2.weight", hf[p + "mlp.down_proj.weight"], r, tp)
        assert torch.equal(fc2, hf[p + "mlp.down_proj.weight"][:, r * 48:(r + 1) * 48])
        proj = a.shard(L + "self_attention.linear_proj.weight", hf[p + "self_attn.o_proj.weight"], r, tp)
        assert torch.equal(proj, hf[p + "self_attn.o_proj.weight"][:, r * 48:(r + 1) * 48])
        emb = a.shard("embedding.word_embeddings.weight",
                      a.from_hf("embedding.word_embeddings.weight", hf.__getitem__, tp), r, tp)
        padded = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(512 - 300, 64)])
        assert torch.equal(emb, padded[r * 256:(r + 1) * 256])
        norm = a.shard(L + "input_layernorm.weight", hf[p + "input_layernorm.weight"], r, tp)
        assert torch.equal(norm, hf[p + "input_layernorm.weight"])


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_every_tensor_round_trips_through_fuse_shard_unshard_split(arch, tied):
    cfg = {**CFG, "architectures": [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "llama": "LlamaForCausalLM"}[arch]],
           "model_type": arch, "tie_word_embeddings": tied}
    a = get_adapter(cfg)
    hf = random_hf_state(a)
    seen = {}
    for tp in (1, 2):
        for pp in (1, 2):
            for pp_rank in range(pp):
                for name in a.stage_names(pp_rank, pp):
                    full = a.from_hf(name, hf.__getitem__, tp)
                    assert tuple(full.shape) == a.shape(name, tp)
                    shards = [a.shard(name, full, r, tp) for r in range(tp)]
                    assert torch.equal(a.unshard(name, shards), full)
                    for hn, t in a.to_hf(name, a.unshard(name, shards)):
                        assert torch.equal(t, hf[hn]), hn
                        seen[hn] = True
    assert set(seen) == set(hf)


def test_tied_output_layer_lives_on_last_stage_only_when_pipelined():
    a = get_adapter({**CFG, "tie_word_embeddings": True})
    assert "output_layer.weight" not in a.stage_names(0, 1)
    assert "output_layer.weight" in a.stage_names(1, 2)
    assert "lm_head.weight" not in a.hf_shapes()
    hf = random_hf_state(a)
    out = a.from_hf("output_layer.weight", hf.__getitem__, 2)
    assert torch.equal(out[:300], hf["model.embed_tokens.weight"])
    assert a.to_hf("output_layer.weight", out) == []
    assert a.extra_state_keys(1, 2)[-1] == "output_layer._extra_state"


def test_padded_vocab_size_and_layer_range():
    assert padded_vocab_size(300, 1) == 384
    assert padded_vocab_size(300, 2) == 512
    assert padded_vocab_size(151936, 1) == 151936
    assert padded_vocab_size(151936, 2) == 152064
    assert padded_vocab_size(100, 3, divisible_by=8) == 120
    assert list(layer_range(1, 2, 4)) == [2, 3]
    assert list(layer_range(0, 1, 4)) == [0, 1, 2, 3]
    with pytest.raises(CheckpointError, match="not divisible by pp_size=3"):
        layer_range(0, 3, 4)
    with pytest.raises(CheckpointError, match="outside"):
        layer_range(2, 2, 4)


def test_local_and_global_layer_names():
    a = get_adapter(CFG)
    assert a.to_local_name("decoder.layers.3.mlp.linear_fc1.weight", 1, 2) == "decoder.layers.1.mlp.linear_fc1.weight"
    assert a.to_global_name("decoder.layers.1.mlp.linear_fc1.weight", 1, 2) == "decoder.layers.3.mlp.linear_fc1.weight"
    assert a.to_local_name("output_layer.weight", 1, 2) == "output_layer.weight"
    with pytest.raises(CheckpointError, match="not on pipeline stage 0"):
        a.to_local_name("decoder.layers.3.mlp.linear_fc1.weight", 0, 2)
    with pytest.raises(CheckpointError, match="local layer 2"):
        a.to_global_name("decoder.layers.2.mlp.linear_fc1.weight", 0, 2)
    for pp_rank in range(2):
        for n in a.stage_names(pp_rank, 2):
            assert a.to_global_name(a.to_local_name(n, pp_rank, 2), pp_rank, 2) == n


def test_errors_are_clear():
    with pytest.raises(UnsupportedArchitectureError, match="Qwen3ForCausalLM.*Qwen2ForCausalLM.*LlamaForCausalLM"):
        get_adapter({**CFG, "architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    with pytest.raises(CheckpointError, match="'intermediate_size'"):
        get_adapter({k: v for k, v in CFG.items() if k != "intermediate_size"})
    with pytest.raises(CheckpointError, match="mlp_bias"):
        get_adapter({**CFG, "mlp_bias": True})
    with pytest.raises(CheckpointError, match="spec="):
        get_adapter(CFG, spec="fancy")
    a = get_adapter(CFG)
    with pytest.raises(CheckpointError, match="num_key_value_heads=2"):
        a.shard("decoder.layers.0.self_attention.linear_qkv.weight", torch.zeros(192, 64), 0, 4)
    with pytest.raises(CheckpointError, match="not a Qwen3ForCausalLM mcore name"):
        a.shard("decoder.layers.9.mlp.linear_fc1.weight", torch.zeros(1), 0, 1)
    hf = random_hf_state(a)
    hf["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    with pytest.raises(ShapeMismatchError, match=r"model.layers.0.mlp.up_proj.weight.*\(95, 64\).*\(96, 64\)"):
        a.from_hf("decoder.layers.0.mlp.linear_fc1.weight", hf.__getitem__)


@pytest.mark.parametrize("cfg", [QWEN3_1_7B, QWEN3_4B], ids=["qwen3-1.7b", "qwen3-4b"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_real_qwen3_configs_shapes_on_meta_device(cfg, tp):
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    hf = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied: lm_head is the embedding
    a = get_adapter(cfg)
    assert {n: tuple(t.shape) for n, t in hf.items()} == a.hf_shapes()
    shapes = a.mcore_shapes(tp)
    assert len(shapes) == 2 + 8 * cfg["num_hidden_layers"]
    for name, shape in shapes.items():
        full = a.from_hf(name, hf.__getitem__, tp)  # fusion runs on meta tensors: shapes only
        assert tuple(full.shape) == shape
        pieces = [a.shard(name, full, r, tp) for r in range(tp)]
        assert tuple(a.unshard(name, pieces).shape) == shape
    assert shapes["embedding.word_embeddings.weight"][0] == padded_vocab_size(151936, tp)
    d, h = 128, cfg["num_attention_heads"]
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == ((h + 2 * 8) * d, cfg["hidden_size"])


@pytest.mark.parametrize("tied", [False, True])
def test_stage_helpers_rebuild_every_hf_tensor_once(tied):
    a = get_adapter({**CFG, "tie_word_embeddings": tied})
    hf = random_hf_state(a)
    got = {}
    for pp_rank in range(2):
        states = [stage_from_hf(a, hf.__getitem__, r, 2, pp_rank, 2) for r in range(2)]
        assert "decoder.layers.1.self_attention.linear_qkv._extra_state" in states[0]
        assert not any(k.startswith("decoder.layers.2.") for k in states[0])  # local numbering
        for name, t in stage_to_hf(a, states, pp_rank, 2):
            assert name not in got
            got[name] = t
    assert set(got) == set(hf) and all(torch.equal(got[n], hf[n]) for n in hf)
    del states[1]["decoder.final_layernorm.weight"]
    with pytest.raises(MissingTensorsError, match="tp_rank 1: decoder.final_layernorm.weight"):
        list(stage_to_hf(a, states, 1, 2))
