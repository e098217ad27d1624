"""The optimizer step without per-tensor host syncs: AdamW, global grad norm and clipping.

What it is: without apex or Transformer Engine, megatron-core 0.16.1 falls back to torch's AdamW
(foreach off on CPU; on any device its non-fused step reads every parameter's step count with
`.item()`) and to a grad norm that turns each tensor's norm into a Python float, then the total
into another: a host sync per parameter tensor, about 230 a step at 1.7B. Here:
- `use_sync_free_adam(optimizer)` makes each torch AdamW inside Megatron's optimizer step
  without reading the device: `fused=True` on CUDA (one kernel), and on CPU `ForeachAdamW`,
  torch's own foreach AdamW arithmetic (bit for bit the same updates as the single-tensor loop
  it replaces) with the step count kept on the host. Apex/TE's fused Adam is left alone.
- `optimizer_step(optimizer)` replaces Megatron's `optimizer.step()`: `prepare_grads`, the global
  L2 norm as a device tensor (`torch._foreach_norm`, the same fp32 arithmetic as megatron-core's
  fallback, all-reduced over the optimizer's grad-stats group), clipping by a device-side
  coefficient (`_foreach_mul_`), `step_with_ready_grads`; it returns the norm as a tensor, for
  the train step to read with its other metrics in one transfer.
What it is not: an optimizer of its own: the parameter groups, state, checkpoints and the
distributed optimizer's sharding stay Megatron's and torch's.
"""

from __future__ import annotations

import math

import torch


class ForeachAdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay, no amsgrad/maximize) in foreach ops, its step count
    read on the host: the per-parameter `step` tensors are kept and advanced for checkpoints, the
    bias corrections use a Python count (read once from the state after a load). Same updates,
    bit for bit, as torch's single-tensor and foreach AdamW (`capturable=False`)."""

    _darl_host_steps: dict[int, float] | None = None

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._darl_host_steps = None  # re-read from the loaded `step` tensors

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ForeachAdamW.step takes no closure")
        if self._darl_host_steps is None:
            self._darl_host_steps = {}
        for i, group in enumerate(self.param_groups):
            if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
                raise ValueError("ForeachAdamW: amsgrad, maximize and differentiable are not supported")
            params, grads, avgs, sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            if i not in self._darl_host_steps:  # after construction or a load: one read of the count
                self._darl_host_steps[i] = float(steps[0].item())
            self._darl_host_steps[i] += 1.0
            _foreach_adamw(params, grads, avgs, sqs, steps, self._darl_host_steps[i], group)
        return None


def _foreach_adamw(params, grads, avgs, sqs, steps, step: float, group: dict) -> None:
    """torch 2.13's `_multi_tensor_adam` (capturable=False, decoupled weight decay), its
    `_get_value(step)` replaced by the host count `step`."""
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
    if wd != 0:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_lerp_(avgs, grads, 1 - beta1)
    torch._foreach_mul_(sqs, beta2)
    torch._foreach_addcmul_(sqs, grads, grads, 1 - beta2)
    step_size = (lr / (1 - beta1 ** step)) * -1
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = torch._foreach_sqrt(sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, avgs, denom, step_size)


def _torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The torch AdamW instances inside a Megatron optimizer (chained or not)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW):
            out.append(inner)
    return out


def use_sync_free_adam(optimizer) -> str | None:
    """Switch the torch AdamW instances of a Megatron optimizer to a step that reads nothing
    from the device (see the module); call again after loading a checkpoint (a loaded param
    group brings back its saved flags). Returns "fused", "foreach" or None (apex/TE's Adam)."""
    kind = None
    for inner in _torch_adams(optimizer):
        params = [p for g in inner.param_groups for p in g["params"]]
        if params and params[0].device.type == "cuda":
            kind = "fused"
            for group in [inner.defaults, *inner.param_groups]:
                group.update(fused=True, foreach=False, capturable=False)
            for p in params:  # fused keeps the step count on the device
                st = inner.state.get(p)
                if st and "step" in st and st["step"].device != p.device:
                    st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
        else:
            kind = "foreach"
            if type(inner) is torch.optim.AdamW:
                inner.__class__ = ForeachAdamW
            inner._darl_host_steps = None
    return kind


def _stats_group(opts: list):
    group = opts[0].get_grad_stats_parallel_group()
    if any(o.get_grad_stats_parallel_group() is not group for o in opts[1:]):
        raise RuntimeError("optimizer_step: the chained optimizers reduce grad statistics over different groups")
    return group


def grad_norm(opts: list, device: torch.device) -> torch.Tensor:
    """Global L2 norm of the main grads Megatron counts (not shared, not TP duplicates), a
    float64 0-dim tensor on `device`: per-tensor fp32 norms, their norm, squared and
    all-reduced over the grad-stats group (megatron-core's own sequence), then its root."""
    import torch.distributed as dist

    grads = [g for o in opts for g in o.get_main_grads_for_grad_norm()]
    if grads:
        sq = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).reshape(1) ** 2
    else:
        sq = torch.zeros(1, dtype=torch.float32, device=device)
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=_stats_group(opts))
    return sq.double().sqrt()[0]


def _clip_targets(opts: list) -> list[torch.Tensor]:
    out = []
    for o in opts:
        decoupled = o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        for p in o.get_parameters():
            g = getattr(p, "decoupled_grad", None) if decoupled else p.grad
            if g is not None:
                out.append(g.detach())
    return out


@torch.no_grad()
def optimizer_step(optimizer, device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """Megatron's `optimizer.step()` with the grad norm kept on the device: (stepped, norm).
    Clipping multiplies the grads by min(1, clip_grad / (norm + 1e-6)), Megatron's coefficient,
    without reading it; `clip_grad` infinite (clipping off) skips the multiply."""
    opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if not getattr(o, "is_stub_optimizer", False)]
    if optimizer.prepare_grads():  # inf/nan with a loss scaler (fp16), as Megatron's step
        return False, None
    if not opts:
        return bool(optimizer.step_with_ready_grads()), None
    norm = grad_norm(opts, device)
    max_norm = float(opts[0].config.clip_grad)
    if 0.0 < max_norm < math.inf:
        coeff = (max_norm / (norm + 1.0e-6)).clamp(max=1.0).to(torch.float32)
        grads = _clip_targets(opts)
        if grads:
            torch._foreach_mul_(grads, coeff)
    return bool(optimizer.step_with_ready_grads()), norm
