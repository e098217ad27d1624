"""The process group both sides of a weight broadcast join: the learner's main rank and the engines.

What it is: `init_custom_group`, built the way SGLang's `init_custom_process_group` builds it (a
TCP rendezvous hosted by rank 0, the learner; a group beside the default one, or without one),
so that the trainer's sender (`trainer/weight_sender.py`) and darl-engine
(`engine/weight_group.py`) meet SGLang servers and each other on the same terms.
What it is not: the learner's own TP/PP/DP groups (`learner/parallel.py`).
"""

from __future__ import annotations


def init_custom_group(master_address: str, master_port: int, world_size: int, group_name: str, rank: int = 0,
                      backend: str = "nccl", timeout_s: float = 600.0):
    """A process group beside the default one (or without one), rendezvous over TCP at
    master_address:master_port, hosted by rank 0 (the learner). The construction SGLang's
    `init_custom_process_group` uses on the engine side (darl-engine and the tests call it with
    their own rank). Every collective on it fails after `timeout_s` instead of hanging."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank=rank,
                                              world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store), group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}  # group rank == rank in this group
    return group
