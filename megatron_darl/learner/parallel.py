"""Process-group setup for the learner: torch.distributed plus Megatron's `parallel_state`.

What it is: `init_parallel` starts torch.distributed (gloo on CPU, NCCL on GPU, from the usual
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT environment), builds the TP x PP (x VPP) x DP groups,
seeds the RNG trackers and returns a `ParallelContext` holding the process groups that the rest
of the learner passes explicitly; `destroy_parallel` tears it all down.
What it is not: a launcher. Processes are started by `launch/` or by the CLI's self-launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_darl.learner.api import ParallelConfig
from megatron_darl.learner import cpu_compat


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
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        cpu_compat.apply_cpu_compat()
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
        dist.init_process_group(_backend(cfg, on_gpu), timeout=timedelta(seconds=timeout_s))
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


def destroy_parallel(keep_world: bool = False) -> None:
    """Tear down parallel_state and, unless `keep_world`, the default process group (safe to
    call twice). `keep_world=True` lets the same processes build another TP/PP layout."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized() and not keep_world:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
