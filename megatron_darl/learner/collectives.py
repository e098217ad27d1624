"""Small collectives the learner needs beyond Megatron's: JSON values and numpy arrays over groups.

What it is: broadcast / all-gather of JSON-serialisable values and of named numpy arrays, as
plain tensors (uint8 bytes, fixed-dtype arrays) on the learner device, so they work over gloo
and NCCL alike and nothing is pickled.
What it is not: the gradient or parameter communication (Megatron's DDP and optimizer do that).
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist


def _bytes_tensor(obj, device) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def broadcast_json(obj, src: int, group, device: torch.device):
    """`obj` from global rank `src` to every rank of `group` (the others pass anything)."""
    mine = dist.get_rank() == src
    payload = _bytes_tensor(obj, device) if mine else None
    size = torch.tensor([payload.numel() if mine else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if not mine:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return json.loads(payload.cpu().numpy().tobytes().decode("utf-8"))


def all_gather_json(obj, group, device: torch.device) -> list:
    """Every rank's `obj`, in group-rank order."""
    payload = _bytes_tensor(obj, device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    width = max(int(s.item()) for s in sizes)
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    bufs = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(bufs, padded, group=group)
    return [json.loads(b[: int(s.item())].cpu().numpy().tobytes().decode("utf-8")) for b, s in zip(bufs, sizes)]


def broadcast_arrays(arrays: dict[str, np.ndarray] | None, src: int, group, device: torch.device) -> dict[str, np.ndarray]:
    """Named numpy arrays from global rank `src` to every rank of `group` (header as JSON)."""
    mine = dist.get_rank() == src
    header = {k: [str(v.dtype), list(v.shape)] for k, v in arrays.items()} if mine else None
    header = broadcast_json(header, src, group, device)
    out = {}
    for name, (dtype, shape) in header.items():
        if mine:
            t = torch.from_numpy(np.ascontiguousarray(arrays[name])).to(device)
        else:
            t = torch.empty(shape, dtype=torch.from_numpy(np.zeros(0, dtype=dtype)).dtype, device=device)
        dist.broadcast(t, src=src, group=group)
        out[name] = t.cpu().numpy().astype(dtype, copy=False)
    return out
