"""The CPU compatibility layer: idempotent, CPU tensors where Megatron asks for CUDA, loud when moved."""

import importlib

import pytest
import torch

from megatron_darl.learner import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CUDA-less runs")


def test_apply_is_idempotent_and_redirects_cuda_allocations():
    cpu_compat.apply_cpu_compat()
    cpu_compat.apply_cpu_compat()
    assert cpu_compat.is_applied()
    from megatron.core.transformer import utils as tu

    mask = tu.get_default_causal_mask(5)  # Megatron builds it with device="cuda"
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    assert torch.equal(mask, torch.triu(torch.ones(5, 5, dtype=torch.bool), 1))
    sched = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    assert sched.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert sched.torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is not sched.torch.cuda.current_device  # torch itself untouched


def test_cpu_rng_tracker_forks_reproducibly():
    cpu_compat.apply_cpu_compat()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    cpu_compat.seed_cpu(7, tp_rank=1)
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is left alone
    cpu_compat.seed_cpu(7, tp_rank=1)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), a)
    cpu_compat.seed_cpu(7, tp_rank=0)
    with get_cuda_rng_tracker().fork():
        assert not torch.equal(torch.rand(3), a)  # TP ranks draw different streams


def test_grad_clip_replacement_clips_like_megatron():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    cpu_compat._clip_grad_by_total_norm_cpu([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6)))


def test_moved_symbol_fails_loudly(monkeypatch):
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    monkeypatch.setattr(random_mod, cpu_compat._MARK, False, raising=False)
    monkeypatch.delattr(importlib.import_module("megatron.core.optimizer.optimizer"), "clip_grad_by_total_norm_fp32")
    with pytest.raises(RuntimeError, match="clip_grad_by_total_norm_fp32"):
        cpu_compat.apply_cpu_compat()


def test_moved_module_fails_loudly(monkeypatch):
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    monkeypatch.setattr(random_mod, cpu_compat._MARK, False, raising=False)
    monkeypatch.setattr(cpu_compat, "_PROXIED_MODULES", cpu_compat._PROXIED_MODULES + ("megatron.core.no_such_module",))
    with pytest.raises(RuntimeError, match="megatron.core.no_such_module"):
        cpu_compat.apply_cpu_compat()
