"""Test helper script (run as `tp` subprocesses): build a Megatron-Core GPTModel on CPU/gloo from a
converted checkpoint, load each rank's file with strict=True, and compare logits with transformers.

What it is: the check that the adapter's names, fused layouts and TP shards match what Megatron
actually computes with. What it is not: the learner's model builder (this builds its own tiny
TransformerConfig for the test). Prints `MAXDIFF <mcore_dir> <float>` on rank 0 for each pair.
Usage: python3 ckpt_megatron_check.py RANK WORLD PORT HF_DIR MCORE_DIR [HF_DIR MCORE_DIR ...]
"""

import contextlib
import functools
import sys

import torch

torch.set_num_threads(1)


def _cpu_shims():
    """Just enough of Megatron's CUDA-only paths redirected to CPU for a forward pass."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    torch.cuda.current_device = lambda: "cpu"

    @functools.lru_cache(maxsize=8)
    def causal_mask(sq):
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    tutils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask

    class Tracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    tracker = Tracker()
    for i, name in enumerate((mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                              mrandom._DATA_PARALLEL_RNG_TRACKER_NAME)):
        tracker.add(name, 1234 + i)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _stage_model(meta, pp_rank, world):
    """The GPTModel of one pipeline stage (its share of the layers; embedding first, head last)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = meta.hf_config
    qwen3, qwen2 = c["model_type"] == "qwen3", c["model_type"] == "qwen2"
    cfg = TransformerConfig(
        num_layers=c["num_hidden_layers"] // meta.pp, hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
        kv_channels=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        ffn_hidden_size=c["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=c["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=qwen2,
        qk_layernorm=qwen3, tensor_model_parallel_size=world, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    return GPTModel(config=cfg,
                    transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=qwen3, normalization="RMSNorm"),
                    vocab_size=meta.padded_vocab_size, max_sequence_length=64, position_embedding_type="rope",
                    rotary_base=int(c.get("rope_theta", 10000)),
                    share_embeddings_and_output_weights=bool(c.get("tie_word_embeddings")),
                    pre_process=pp_rank == 0, post_process=pp_rank == meta.pp - 1, parallel_output=False)


def build_and_compare(hf_dir, mcore_dir, rank, world):
    """Build every pipeline stage in this process (stage p gets file (rank, p), strict), chain them
    by hand with set_input_tensor, and compare the logits with transformers on rank 0."""
    from checkpoint_tools.mcore_format import load_mcore_rank_state, read_meta

    meta = read_meta(mcore_dir)
    ids = torch.arange(3, 3 + 2 * 11).reshape(2, 11) % meta.vocab_size
    pos = torch.arange(11).unsqueeze(0).expand(2, -1)
    hidden = None
    with torch.no_grad():
        for p in range(meta.pp):
            model = _stage_model(meta, p, world)
            model.load_state_dict(load_mcore_rank_state(mcore_dir, rank, p, mmap=False), strict=True)
            model.eval()
            if p > 0:
                model.set_input_tensor(hidden)
            hidden = model(ids if p == 0 else None, pos, attention_mask=None)
    logits = hidden[..., : meta.vocab_size]
    if rank == 0:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(ids).logits
        print("MAXDIFF", mcore_dir, (logits.float() - want).abs().max().item(), flush=True)


def main(rank, world, port, pairs):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    _cpu_shims()
    for hf_dir, mcore_dir in pairs:
        build_and_compare(hf_dir, mcore_dir, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    rest = sys.argv[4:]
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), list(zip(rest[::2], rest[1::2])))
