"""CPU compatibility layer for Megatron-Core (0.16.x): keeps its CUDA-only code paths out of a CPU run.

What it is: one place that lists every CUDA-only path a CPU run of the learner hits and replaces
it, applied by `apply_cpu_compat()` only when the learner's device is CPU. Each patch first checks
that the symbol it replaces is where it expects it; if a Megatron upgrade moved it, it raises a
RuntimeError naming the symbol instead of silently doing nothing. Applying twice is a no-op.
What it is not: a general CUDA emulator. It does not make Transformer Engine, apex, sequence
parallel, fused kernels or the distributed optimizer work on CPU; those stay GPU-only.

The patched paths (measured on megatron-core 0.16.1 + torch 2.13 CPU):
- modules that build tensors with `device="cuda"` / `torch.cuda.current_device()` (pipeline
  schedules and p2p, optimizer scale tensors, grad-norm buffers, the default causal mask, RoPE):
  their module-level `torch` name is pointed at a proxy whose factories put tensors on the CPU
  and whose `torch.cuda.current_device()` is "cpu" and `synchronize()` a no-op. torch itself is
  left untouched, so nothing outside those Megatron modules changes.
- the RNG tracker: named CPU generator states instead of CUDA ones (`seed_cpu`).
- `_get_cuda_rng_state` / `_set_cuda_rng_state` (activation recompute): CPU generator state.
- `clip_grad_by_total_norm_fp32` asserts `torch.cuda.FloatTensor` grads: a CPU version.
- `LanguageModule.setup_embeddings_and_output_layer` (tied embeddings with PP > 1) moves the
  output copy with `weight.data.cuda()`: run with `Tensor.cuda` as the identity, for that call only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from typing import Any

import torch

_MARK = "_darl_cpu_compat_applied"
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "zeros_like",
              "ones_like", "empty_like", "full_like")

# (module, attribute that must exist there): modules whose `torch` global becomes the CPU proxy.
_PROXIED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.utils",  # GlobalMemoryBuffer (attention matmul buffer)
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    # dist_checkpointing save: synchronize() before preloading tensors, CUDA flag tensors
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spec (str, torch.device, int index) to "cpu"; keep others."""
    if device is None:
        return None
    if isinstance(device, int):  # a bare int means a CUDA ordinal in Megatron's code
        return "cpu"
    return "cpu" if torch.device(device).type == "cuda" else device


def _on_cpu(factory, *args, **kwargs):
    if "device" in kwargs:
        kwargs["device"] = _cpu_device(kwargs["device"])
    return factory(*args, **kwargs)


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as the proxied modules see it: the device is the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


class _CpuTorch(types.ModuleType):
    """`torch` as the proxied modules see it: factories never allocate on CUDA."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in _FACTORIES:
            return functools.partial(_on_cpu, attr)
        return attr


def _module(path: str) -> types.ModuleType:
    try:
        return importlib.import_module(path)
    except ImportError as e:
        raise RuntimeError(f"cpu_compat: Megatron module {path} not found ({e}); "
                           "megatron-core moved it, update megatron_darl/learner/cpu_compat.py") from e


def _require(module: types.ModuleType, name: str) -> Any:
    if not hasattr(module, name):
        raise RuntimeError(f"cpu_compat: {module.__name__}.{name} not found; megatron-core moved it, "
                           "update megatron_darl/learner/cpu_compat.py")
    return getattr(module, name)


def _cpu_rng_tracker_class(random_mod: types.ModuleType) -> type:
    base = _require(random_mod, "CudaRNGStatesTracker")

    class CpuRNGStatesTracker(base):
        """Megatron's named RNG states, kept as CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Same maths as Megatron's clip_grad_by_total_norm_fp32, without its CUDA type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _on_cpu_method(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _tensor_cuda_is_identity():
            return method(*args, **kwargs)

    return wrapper


def apply_cpu_compat() -> None:
    """Patch Megatron-Core for a CPU run. Idempotent; raises RuntimeError if a target moved."""
    random_mod = _module("megatron.core.tensor_parallel.random")
    if getattr(random_mod, _MARK, False):
        return
    # Check every target before changing anything, so a moved symbol leaves Megatron untouched.
    proxied = [_module(p) for p in _PROXIED_MODULES]
    for mod in proxied:
        _require(mod, "torch")
    opt_mod = _module("megatron.core.optimizer.optimizer")
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state", "_CUDA_RNG_STATE_TRACKER",
                 "_MODEL_PARALLEL_RNG_TRACKER_NAME", "_DATA_PARALLEL_RNG_TRACKER_NAME",
                 "_EXPERT_PARALLEL_RNG_TRACKER_NAME"):
        _require(random_mod, name)
    _require(opt_mod, "clip_grad_by_total_norm_fp32")
    lm_mod = _module("megatron.core.models.common.language_module.language_module")
    language_module = _require(lm_mod, "LanguageModule")
    _require(language_module, "setup_embeddings_and_output_layer")
    tracker_cls = _cpu_rng_tracker_class(random_mod)

    proxy = _CpuTorch()
    for mod in proxied:
        mod.torch = proxy
    random_mod._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random_mod._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    random_mod._darl_cpu_tracker_class = tracker_cls
    opt_mod.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    language_module.setup_embeddings_and_output_layer = _on_cpu_method(
        language_module.setup_embeddings_and_output_layer)
    setattr(random_mod, _MARK, True)


def is_applied() -> bool:
    return bool(getattr(importlib.import_module("megatron.core.tensor_parallel.random"), _MARK, False))


def seed_cpu(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """CPU replacement for `model_parallel_cuda_manual_seed`: same seeds, CPU generator states."""
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    if not getattr(random_mod, _MARK, False):
        raise RuntimeError("seed_cpu: call apply_cpu_compat() first")
    tracker = random_mod._darl_cpu_tracker_class()
    random_mod._CUDA_RNG_STATE_TRACKER = tracker
    random_mod._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    tracker.add(random_mod._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(random_mod._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
