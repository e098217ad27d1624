"""Learner role: its config dataclasses and the `Learner` protocol the train loop drives.

What it is: the contract between the async train loop and the Megatron-Core learner — model,
parallelism, optimizer, packing and algorithm settings (OmegaConf structured-config types), and
the methods the loop calls (recompute, train step, weight export, checkpoint).
What it is not: any Megatron code; that lives in `model.py`, `parallel.py`, `train_step.py`,
`megatron_learner.py`. Importing this module never imports torch or Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Protocol, runtime_checkable

import numpy as np

from megatron_darl.types import TrainBatch

POLICY_LOSSES = ("ppo", "decoupled", "darl", "sg_weight")


@dataclass
class ModelConfig:
    """Which model the learner trains and in which numeric format."""

    hf_dir: str = ""  # HF folder with config.json (+ safetensors), or a darl-convert Megatron folder
    init: str = "hf"  # "hf": load hf_dir's weights; "random": Megatron init from its config
    tokenizer: str = ""  # tokenizer folder; empty means hf_dir
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    spec: str = "auto"  # layer spec: auto (te when TE and CUDA are present, else local) | local | te
    fp8: str | None = None  # FP8 recipe with the TE spec: delayed | tensorwise | blockwise | mxfp8
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
        "recompute": ("none", "selective", "full"),
    }
    RECOMPUTE_MODULES: ClassVar[tuple[str, ...]] = ("core_attn", "mlp")  # the dense-model ones

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not self.hf_dir:
            errors.append(("hf_dir", "is required: a folder holding the model's config.json"))
        if self.fp8 is not None and self.spec == "local":
            errors.append(("fp8", "FP8 needs the Transformer Engine spec; set spec=te or auto"))
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
        if self.lr < 0 or self.min_lr < 0:
            errors.append(("lr", "lr and min_lr must be >= 0"))
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

    def check(self) -> list[tuple[str, str]]:
        errors = []
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


@dataclass
class AlgorithmConfig:
    """Which policy loss the train step optimises and its knobs (the maths is in algo/)."""

    policy_loss: str = "darl"  # ppo | decoupled (AReaL) | darl (per-version P-MIS) | sg_weight
    old_logprob: str = "proximal"  # ratio denominator: behavior | proximal (ppo+behavior = naive async)
    recompute_proximal: bool = True  # recompute pi_prox log-probs at step start
    rollout_is: str | None = None  # verl-style IS weights on ppo: token | sequence | geometric
    rollout_is_mode: str = "truncate"  # truncate | mask | clip
    rollout_is_threshold: float = 2.0  # upper cap C of the IS weight (also sg_weight's cap on exp(q - b))
    rollout_is_threshold_lower: float | None = None  # mask mode lower bound; None: 1/threshold
    rollout_is_veto_threshold: float = 1e-4  # drop a sequence with any token ratio below this
    behav_weight_cap: float | None = 5.0  # decoupled (AReaL): tokens with w above it are dropped
    behav_clip: float | None = None  # decoupled/darl behavior-side trust region: tokens with exp(p - b) outside [1/C, C] are dropped
    clip_low: float = 0.2  # PPO clip 1 - clip_low
    clip_high: float = 0.2  # PPO clip 1 + clip_high
    ratio_level: str = "token"  # token | sequence (GSPO-style)
    advantage: str = "grpo"  # grpo | drgrpo | rloo
    adv_eps: float = 1e-6  # std floor of GRPO normalisation
    ppo_n_minibatches: int = 4  # optimizer steps per train step
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "policy_loss": POLICY_LOSSES,
        "old_logprob": ("behavior", "proximal"),
        "rollout_is": ("token", "sequence", "geometric"),
        "rollout_is_mode": ("truncate", "mask", "clip"),
        "ratio_level": ("token", "sequence"),
        "advantage": ("grpo", "drgrpo", "rloo"),
    }

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if self.policy_loss in ("decoupled", "darl") and self.old_logprob != "proximal":
            errors.append(("old_logprob", f"policy_loss={self.policy_loss} needs old_logprob=proximal"))
        if self.uses_proximal and not self.recompute_proximal:
            errors.append((
                "recompute_proximal",
                f"policy_loss={self.policy_loss} with old_logprob={self.old_logprob} reads proximal "
                "log-probs, so recompute_proximal must be true",
            ))
        if self.ppo_n_minibatches < 1:
            errors.append(("ppo_n_minibatches", "must be >= 1"))
        if self.rollout_is_threshold <= 0:
            errors.append(("rollout_is_threshold", "must be > 0"))
        if self.behav_clip is not None and self.behav_clip <= 1:
            errors.append(("behav_clip", f"must be > 1 (a ratio bound), got {self.behav_clip}"))
        if self.clip_low < 0 or self.clip_high < 0:
            errors.append(("clip_low", "clip_low and clip_high must be >= 0"))
        return errors

    @property
    def uses_proximal(self) -> bool:
        """Whether the loss reads pi_prox log-probs (sg_weight never does)."""
        if self.policy_loss in ("decoupled", "darl"):
            return True
        return self.policy_loss == "ppo" and (self.old_logprob == "proximal" or self.rollout_is is not None)


@runtime_checkable
class Learner(Protocol):
    """Every call the train loop, the weight publisher and the run checkpointer make (a test
    holds them to it). Every rank of the learner job calls every method in the same order (they
    are collective) and gets the same return values; `is_main` (global rank 0) is the rank that
    owns incoming batches (`broadcast_batch`) and writes files."""

    pmis: str  # D-ARL's beta_k: replay.pmis_beta, or "tokens"
    balance_mode: str | None  # pmis="balance": "exact" (version snapshots) | "interpolate"; else None

    @property
    def is_main(self) -> bool: ...

    def broadcast_batch(self, batch: TrainBatch | None) -> TrainBatch: ...

    def compute_logprobs(self, batch: TrainBatch) -> np.ndarray: ...

    def compute_version_logprobs(self, batch: TrainBatch, versions: list[int]) -> dict[int, np.ndarray]: ...

    def train_step(self, batch: TrainBatch, beta: dict[int, float] | None = None) -> dict[str, float]: ...

    def export_hf(self, out_dir: str) -> None: ...

    def iter_hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]: ...

    def hf_folder_info(self) -> tuple[dict, list[str]]: ...

    def save(self, ckpt_dir: str, extra_state: dict[str, Any]) -> None: ...

    def load(self, ckpt_dir: str) -> dict[str, Any]: ...

    def close(self, keep_world: bool = False) -> None: ...
