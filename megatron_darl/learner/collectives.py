"""Small collectives the learner needs beyond Megatron's: JSON values and numpy arrays over groups.

What it is: broadcast / all-gather of JSON-serialisable values and of named numpy arrays, as
plain tensors (uint8 bytes, fixed-dtype arrays) on the learner device, so they work over gloo
and NCCL alike and nothing is pickled; and `StoreSync`, the agreements ranks reach while one of
them may be busy for long (waiting for rollouts, evaluating), through the rendezvous store
instead of a collective.
What it is not: the gradient or parameter communication (Megatron's DDP and optimizer do that).
"""

from __future__ import annotations

import json
import time
from typing import Callable

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


def broadcast_arrays(arrays: dict[str, np.ndarray] | None, src: int, group,
                     device: torch.device) -> dict[str, np.ndarray]:
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


class StoreSync:
    """Waits of the other learner ranks for the main rank, outside any collective.

    While the main rank waits for rollouts (a first batch of long responses can take longer
    than the process group's 600 s) or evaluates, the others must not wait inside a broadcast or
    an all-reduce: NCCL's watchdog would kill the job at the group's timeout. Here they poll keys
    of the default group's store (the TCPStore learner rank 0 serves) and check `alive` about
    once a second. Every rank makes the same calls in the same order (one counter names the
    keys); rank 0 deletes the keys of calls that every rank is past."""

    def __init__(self, alive: Callable[[], None] | None = None, poll_s: float = 0.05):
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.alive, self.poll_s, self.calls = alive, poll_s, 0
        self._keys: list[tuple[int, str]] = []  # rank 0: (call, key) not yet deleted

    def _key(self, *parts: str) -> str:
        key = "/".join(("darl/sync", str(self.calls), *parts))
        if self.rank == 0:
            self._keys.append((self.calls, key))
        return key

    def _wait(self, ready: Callable[[], bool]) -> None:
        last = time.monotonic()
        while not ready():
            if self.alive is not None and time.monotonic() - last > 1.0:
                self.alive()
                last = time.monotonic()
            time.sleep(self.poll_s)

    def from_main(self, obj=None):
        """Rank 0's `obj` on every rank; the others wait for it here (not in a collective)."""
        self.calls += 1
        key = self._key()
        if self.rank == 0:
            self.store.set(key, json.dumps(obj))
            return obj
        self._wait(lambda: self.store.check([key]))
        return json.loads(self.store.get(key))

    def any(self, flag: bool) -> bool:
        """Whether any rank's `flag` is set; every rank waits for all of them here."""
        self.calls += 1
        count, value = self._key("n"), self._key("v")
        self.store.add(value, int(bool(flag)))
        self.store.add(count, 1)
        self._wait(lambda: self.store.add(count, 0) >= self.world)
        result = self.store.add(value, 0) > 0
        if self.rank == 0:  # every rank reached this call, so every rank is past the earlier ones
            done = [k for c, k in self._keys if c < self.calls]
            self._keys = [(c, k) for c, k in self._keys if c >= self.calls]
            for key in done:
                self.store.delete_key(key)
        return result
