"""Process-group setup for the learner: torch.distributed plus Megatron's `parallel_state`.

What it is: `init_parallel` starts torch.distributed (gloo on CPU, NCCL on GPU, from the usual
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT environment), builds the TP x PP (x VPP) x DP groups,
seeds the RNG trackers and returns a `ParallelContext` holding the process groups that the rest
of the learner passes explicitly; `destroy_parallel` tears it all down.
What it is not: a launcher. Processes are started by `launch/` or by the CLI's self-launch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_darl.channel.ports import free_port
from megatron_darl.config.learner import ParallelConfig
from megatron_darl.learner import cpu_compat

RENDEZVOUS_ENV = "DARL_RENDEZVOUS_FILE"  # where learner rank 0 publishes the port it bound (MASTER_PORT=0)


@dataclass
class ParallelContext:
    """This rank's place in the layout and the groups new code must pass explicitly."""

    device: torch.device
    tp: int
    pp: int
    vpp: int | None
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    pg: object  # megatron.core.process_groups_config.ProcessGroupCollection

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_main(self) -> bool:
        """Global rank 0: the rank that owns batches and returns metrics."""
        return dist.get_rank() == 0


def _backend(cfg: ParallelConfig, on_gpu: bool) -> str:
    if cfg.backend == "auto":
        return "nccl" if on_gpu else "gloo"
    if cfg.backend == "nccl" and not on_gpu:
        raise ValueError("parallel.backend=nccl needs CUDA; use gloo (or auto) on CPU")
    return cfg.backend


def init_parallel(cfg: ParallelConfig, seed: int, timeout_s: float = 600.0) -> ParallelContext:
    """Initialise torch.distributed and parallel_state for this process (env:// rendezvous;
    a single process with no env vars runs as world size 1 on a free loopback port)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    for field, msg in cfg.check():
        raise ValueError(f"parallel.{field}: {msg}")
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local_device(torch.cuda.device_count()))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        cpu_compat.apply_cpu_compat()
        device = torch.device("cpu")
    if not dist.is_initialized():
        init_world(_backend(cfg, on_gpu), timeout_s)
    world = dist.get_world_size()
    dp = cfg.dp(world)
    if cfg.vpp is not None and not on_gpu:
        raise ValueError("parallel.vpp: virtual pipeline stages are GPU-only here (Megatron's "
                         "interleaved schedule needs CUDA streams)")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        create_gloo_process_groups=not on_gpu,
    )
    if on_gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.seed_cpu(seed, ps.get_tensor_model_parallel_rank())
    pg = ProcessGroupCollection.use_mpu_process_groups()
    return ParallelContext(
        device=device, tp=cfg.tp, pp=cfg.pp, vpp=cfg.vpp, dp=dp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        pg=pg,
    )


def local_device(visible: int, environ=os.environ) -> int:
    """This rank's GPU among the `visible` ones the task sees. With every GPU of the node visible
    (`--gpus-per-node`) it is LOCAL_RANK; with one per task (`--gpus-per-task=1`, `--gpu-bind`,
    a per-rank CUDA_VISIBLE_DEVICES) it is that one, whatever LOCAL_RANK says."""
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    if visible <= 0:
        raise RuntimeError(f"learner rank (LOCAL_RANK={local_rank}) sees no GPU "
                           f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})")
    if visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    raise RuntimeError(f"LOCAL_RANK={local_rank}, but this task sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                       f"{environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}): give each learner rank one GPU "
                       "(--gpus-per-task=1) or every rank all of the node's (--gpus-per-node)")


def init_world(backend: str, timeout_s: float) -> None:
    """torch.distributed's default group from the torchrun-style environment. With
    `DARL_RENDEZVOUS_FILE` set and MASTER_PORT=0 (what the launcher gives), rank 0 binds its store
    on a port the OS picks and publishes it in that file; the other ranks read it there. A port
    picked by the launcher long before rank 0 binds it can be taken meanwhile on a busy node."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    timeout = timedelta(seconds=timeout_s)
    path = os.environ.get(RENDEZVOUS_ENV)
    if not path or os.environ.get("MASTER_PORT", "0") != "0":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rendezvous_store(path, os.environ["MASTER_ADDR"], rank, world, timeout_s)
    os.environ["MASTER_PORT"] = str(store.port)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def rendezvous_store(path: str, addr: str, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0: a TCPStore on a port bound now, written to `path`; the others: a client of it,
    once `path` exists (on the run folder every node shares), waiting at most `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(addr, 0, world, True, timeout, wait_for_workers=False)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"addr": addr, "port": store.port}, fh)
        os.replace(tmp, path)
        return store
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path, encoding="utf-8") as fh:
                port = int(json.load(fh)["port"])
            break
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"learner rank {rank}: rank 0 did not publish its rendezvous port in {path} "
                                   f"within {timeout_s:.0f} s") from None
            time.sleep(0.1)
    return dist.TCPStore(addr, port, world, False, timeout)


def destroy_parallel(keep_world: bool = False) -> None:
    """Tear down parallel_state and, unless `keep_world`, the default process group (safe to
    call twice). `keep_world=True` lets the same processes build another TP/PP layout."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized() and not keep_world:
        dist.destroy_process_group()

