"""The learner's config sections: `model`, `parallel`, `optim` and `learner`.

What it is: the dataclasses of those sections, each field documented where it is declared, with
the checks of single keys (`check()`), and the built-in demo model's shapes (`TINY_QWEN3`,
`model.hf_dir: builtin:tiny-qwen3`). What it is not: Megatron code (`learner/`), or the model's
conversion to Megatron's `TransformerConfig` (`learner/model.py`, the one function that does it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ModelConfig:
    """Which model the learner trains and in which numeric format."""

    hf_dir: str = ""  # HF folder with config.json (+ safetensors), or a darl-convert Megatron folder
    init: str = "hf"  # "hf": load hf_dir's weights; "random": Megatron init from its config
    tokenizer: str = ""  # tokenizer folder; empty means hf_dir
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    spec: str = "auto"  # layer spec: auto (te when TE and CUDA are present, else local) | local | te
    fp8: str | None = None  # FP8 recipe with the TE spec: delayed | tensorwise | blockwise | mxfp8
    # the local spec's core attention (the TE spec runs TE's fused attention): auto (flash) | flash
    # (torch scaled_dot_product_attention: flash kernels, O(s) memory, refuses what it cannot run
    # exactly) | dot_product (megatron-core's DotProductAttention: [s, s] scores kept for backward)
    attention: str = "auto"
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of this times TP
    # activation recompute (Megatron's recompute_granularity): none | selective (only the
    # `recompute_modules` below) | full (every layer, uniform, one layer per checkpoint: only each
    # layer's input is kept, the layer is re-run in backward; ~1/3 more compute)
    recompute: str = "none"
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])  # selective: core_attn | mlp

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "init": ("hf", "random"),
        "dtype": ("auto", "fp32", "bf16"),
        "spec": ("auto", "local", "te"),
        "fp8": ("delayed", "tensorwise", "blockwise", "mxfp8"),
        "attention": ("auto", "flash", "dot_product"),
        "recompute": ("none", "selective", "full"),
    }
    RECOMPUTE_MODULES: ClassVar[tuple[str, ...]] = ("core_attn", "mlp")  # the dense-model ones

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not self.hf_dir:
            errors.append(("hf_dir", "is required: a folder holding the model's config.json"))
        if self.fp8 is not None and self.spec == "local":
            errors.append(("fp8", "FP8 needs the Transformer Engine spec; set spec=te or auto"))
        if self.attention != "auto" and self.spec == "te":
            errors.append(("attention", f"{self.attention} selects the local spec's core attention; the "
                                        "Transformer Engine spec (spec=te) runs TE's own: leave attention=auto"))
        if self.make_vocab_size_divisible_by < 1:
            errors.append(("make_vocab_size_divisible_by", "must be >= 1"))
        bad = [m for m in self.recompute_modules if m not in self.RECOMPUTE_MODULES]
        if bad:
            errors.append(("recompute_modules", f"{bad} not allowed; allowed: {', '.join(self.RECOMPUTE_MODULES)}"))
        if self.recompute == "selective" and not self.recompute_modules:
            errors.append(("recompute_modules", "recompute=selective needs at least one module"))
        return errors

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.hf_dir


@dataclass
class ParallelConfig:
    """Model parallel layout; data parallel size is whatever the world size leaves."""

    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: int | None = None  # virtual pipeline stages per rank (GPU; needs pp > 1)
    # Megatron sequence parallel: the norm/residual activations outside the TP region are split
    # along the sequence over TP ranks (activation memory / tp). Needs tp > 1 and the Transformer
    # Engine spec (megatron-core's local spec builds torch norms that refuse it), so GPU-only.
    sequence_parallel: bool = False
    backend: str = "auto"  # torch.distributed backend: auto (nccl with CUDA, else gloo) | gloo | nccl

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {"backend": ("auto", "gloo", "nccl")}

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if self.tp < 1:
            errors.append(("tp", "must be >= 1"))
        if self.pp < 1:
            errors.append(("pp", "must be >= 1"))
        if self.vpp is not None and (self.vpp < 1 or self.pp < 2):
            errors.append(("vpp", "virtual pipeline stages need vpp >= 1 and pp >= 2"))
        if self.sequence_parallel and self.tp < 2:
            errors.append(("sequence_parallel", f"needs tensor parallelism (tp >= 2), got tp={self.tp}"))
        return errors

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def dp(self, world_size: int) -> int:
        """Data parallel size for a world of `world_size` ranks (derived, never configured)."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not a multiple of parallel.tp*parallel.pp="
                f"{self.model_parallel_size}"
            )
        return world_size // self.model_parallel_size


FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: a larger step size overflows


@dataclass
class OptimConfig:
    """Adam optimizer, gradient clipping and learning-rate schedule."""

    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # floor of the decay
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup from 0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_decay_steps: int | None = None  # optimizer steps of decay after warmup (required unless constant)
    distributed_optimizer: bool | None = None  # shard optimizer state over DP; None: on with CUDA
    # distributed optimizer's checkpoints: false: 'dp_reshardable' (each rank writes its own shard;
    # resumable at another DP size); true: 'fully_reshardable' (also at another TP/PP, but every
    # save gathers each DP group's optimizer state on one rank's CPU: ~24 GB per rank at 4B)
    reshardable_checkpoint: bool = False

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "lr_decay_style": ("constant", "linear", "cosine"),
    }

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not (0 <= self.lr <= FP32_MAX and 0 <= self.min_lr <= FP32_MAX):  # NaN fails both
            errors.append(("lr", f"lr and min_lr must be finite, >= 0 and <= {FP32_MAX:.4g} (the optimizer's float32)"))
        if self.min_lr > self.lr:
            errors.append(("min_lr", f"min_lr={self.min_lr} exceeds lr={self.lr}"))
        if self.lr_decay_style != "constant" and not self.lr_decay_steps:
            errors.append(("lr_decay_steps", f"required with lr_decay_style={self.lr_decay_style}"))
        if self.grad_clip < 0:
            errors.append(("grad_clip", "must be >= 0 (0 disables clipping)"))
        return errors


@dataclass
class LearnerConfig:
    """How batches are cut into micro-batches, and what the memory plan checks them against."""

    micro_batch_tokens: int = 8192  # token budget of one micro-batch (padded length x rows)
    logprob_chunk_tokens: int = 0  # token budget for forward-only recompute; 0: micro_batch_tokens
    # memory plan (`darl-train --plan`, checked before a GPU run starts): per-GPU memory in GiB
    # (an 80 GB H100/A100 shows about 79.2 GiB to torch)
    gpu_memory_gib: float = 79.0
    # fraction of each learner GPU held by rollout engines placed on the same GPUs (SGLang's
    # --mem-fraction-static); 0 when the engines run on GPUs of their own (launch.rollout_nodes)
    engine_memory_fraction: float = 0.0
    # every N train steps (0: never), score the batch again with the weights of each behavior
    # version its tokens came from, so `algo/mismatch_*` (the engine's log-probs against the
    # learner's at the token's own version) covers every token of the last eta versions, not only
    # those of the current one. Costs one forward pass per version on those steps, and CPU copies
    # of the parameters of up to eta versions (at most 2 GiB in all, else the learner refuses)
    mismatch_every: int = 0

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if self.mismatch_every < 0:
            errors.append(("mismatch_every", f"must be >= 0 (0: never), got {self.mismatch_every}"))
        if self.micro_batch_tokens < 1:
            errors.append(("micro_batch_tokens", "must be >= 1"))
        if self.logprob_chunk_tokens < 0:
            errors.append(("logprob_chunk_tokens", "must be >= 0"))
        if self.gpu_memory_gib <= 0:
            errors.append(("gpu_memory_gib", "must be > 0"))
        if not 0 <= self.engine_memory_fraction < 1:
            errors.append(("engine_memory_fraction", f"must be in [0, 1), got {self.engine_memory_fraction}"))
        return errors

    @property
    def recompute_tokens(self) -> int:
        return self.logprob_chunk_tokens or self.micro_batch_tokens


# `model.hf_dir: builtin:tiny-qwen3`: the CPU demo's model, which the warm start makes
# (launch/warmstart.py) before any process needs it; its shapes are known before it exists.
BUILTIN_MODEL = "builtin:tiny-qwen3"
# 3 layers, d=128: small enough that the demo's warm start and RL run in minutes on a small CPU machine
# (docs/measurements.md, "The CPU demo on fresh clones")
TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "torch_dtype": "float32",
}
