"""The process group both sides of a weight broadcast join: the learner's main rank and the engines.

What it is: `init_custom_group`, built the way SGLang's `init_custom_process_group` builds it (a
TCP rendezvous hosted by rank 0, the learner; a group beside the default one, or without one),
so that the trainer's sender (`trainer/weight_sender.py`) and darl-engine
(`engine/weight_group.py`) meet SGLang servers and each other on the same terms.
A group on NCCL is built with `TORCH_NCCL_ASYNC_ERROR_HANDLING=0` (read by ProcessGroupNCCL when
it is constructed, so only this group is affected): with torch's default (3, SkipCleanUp) the
NCCL watchdog tears the whole process down when a collective times out or a peer is lost, and
a learner would die with the engine it was sending to. Without it, the caller bounds each
collective itself and aborts the group (`abort_group`, torch's `_abort_process_group`, which
torch documents for use with that setting turned off), then falls back to a folder.
What it is not: the learner's own TP/PP/DP groups (`learner/parallel.py`).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

_ENV_LOCK = threading.Lock()
NO_TEARDOWN = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
_held: dict[str, list] = {}  # variable -> [holders, value before the first]


@contextmanager
def _environment(values: dict[str, str]):
    """`values` set in os.environ for the block, the previous values restored when the last
    block holding them ends (blocks of several threads may overlap: a group's construction
    waits for its peers, which may be threads of this process building theirs)."""
    with _ENV_LOCK:
        for k, v in values.items():
            _held.setdefault(k, [0, os.environ.get(k)])[0] += 1
            os.environ[k] = v
    try:
        yield
    finally:
        with _ENV_LOCK:
            for k in values:
                _held[k][0] -= 1
                if _held[k][0] == 0:
                    old = _held.pop(k)[1]
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old


def abort_group(group) -> None:
    """Abort a weight group's communicator (NCCL: kernels waiting on a lost peer return); a no-op
    where the backend has nothing to abort (gloo: its own timeout ends the operation)."""
    from torch.distributed import distributed_c10d as c10d

    if group is None or group is c10d.GroupMember.WORLD:  # None would abort every group, the learner's too
        raise ValueError("abort_group: a weight group is needed, not the default group")
    try:
        if c10d.get_backend(group) == "nccl":
            c10d._abort_process_group(group)
    except (RuntimeError, ValueError, NotImplementedError, AttributeError):
        pass  # already destroyed or aborted


def init_custom_group(master_address: str, master_port: int, world_size: int, group_name: str, rank: int = 0,
                      backend: str = "nccl", timeout_s: float = 600.0):
    """A process group beside the default one (or without one), rendezvous over TCP at
    master_address:master_port, hosted by rank 0 (the learner). The construction SGLang's
    `init_custom_process_group` uses on the engine side (darl-engine and the tests call it with
    their own rank). Every collective on it fails after `timeout_s` instead of hanging, and on
    NCCL neither a timeout nor a lost peer tears the process down (module docstring)."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank=rank,
                                              world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    with _environment(NO_TEARDOWN if backend == "nccl" else {}):  # see the module docstring
        group, _ = c10d._new_process_group_helper(
            world, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store), group_name=group_name,
            timeout=timeout,
        )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}  # group rank == rank in this group
    return group
