"""Fixtures for checkpoint_tools tests: tiny random HF checkpoints saved by `transformers`.

Every model has GQA (2 KV heads for 4 query heads), 4 layers (so PP=2 splits them) and a vocab of
300 (not a multiple of 128, so Megatron padding is exercised); Qwen3 also has head_dim=24 while
hidden/heads=16. Norm weights are randomised too, so a norm mapped to the wrong slot shows.
"""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64)


def make_hf_dir(root: str, arch: str = "qwen3", tied: bool = False, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> str:
    """Save a random tiny model (small shards, so the input has an index) plus fake side files."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    extra = {"head_dim": 24} if arch == "qwen3" else {}
    cfg = cls(**TINY, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(dtype)
    out = os.path.join(root, f"hf_{arch}_{'tied' if tied else 'untied'}_{str(dtype)[6:]}")
    model.save_pretrained(out, max_shard_size="100KB")
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 64, "marker": "%s"}' % arch)
    with open(os.path.join(out, "vocab.json"), "w") as f:
        f.write('{"a": 0}')
    return out


@pytest.fixture(scope="session")
def hf_factory(tmp_path_factory):
    """make(arch, tied, dtype) -> folder, cached per session."""
    root = str(tmp_path_factory.mktemp("hf"))
    cache: dict = {}

    def make(arch="qwen3", tied=False, dtype=torch.float32):
        key = (arch, tied, dtype)
        if key not in cache:
            cache[key] = make_hf_dir(root, arch, tied, dtype)
        return cache[key]

    return make
