"""The `launch` config section: where the processes of a run are placed (this machine, or a
Slurm job through submitit), with `SlurmNodes`, the resources of one component of the job.

What it is: the dataclasses, each field documented where it is declared, with their checks.
What it is not: the launchers (`launch/`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class SlurmNodes:
    """Slurm resources of one component of the job (sbatch options of that het-group)."""

    partition: str = ""  # empty: the cluster's default partition
    account: str = ""  # empty: the user's default account
    qos: str = ""  # empty: the default QoS
    time_min: int = 60  # time limit in minutes
    gpus_per_node: int = 0  # 0 on CPU clusters
    cpus_per_task: int = 2  # trainer: per learner rank; rollout: the node's engine host and its engines
    mem_gb: int = 0  # per node; 0 = Slurm default
    extra: dict[str, str] = field(default_factory=dict)  # more sbatch options, e.g. {constraint: h100}

    def check(self) -> list[tuple[str, str]]:
        errs = []
        for name in ("time_min", "cpus_per_task"):
            if getattr(self, name) < 1:
                errs.append((name, "must be >= 1"))
        for name in ("gpus_per_node", "mem_gb"):
            if getattr(self, name) < 0:
                errs.append((name, "must be >= 0"))
        return errs


@dataclass
class LaunchConfig:
    """Process placement. `mode=local` starts everything on this machine; `slurm` submits one
    Slurm job through submitit: trainer nodes (learner ranks; the rollout manager and the ring
    buffer on global rank 0's node) and, with `rollout_nodes > 0`, rollout nodes running the
    engines, as a heterogeneous job."""

    mode: str = "local"  # local | slurm
    trainer_nodes: int = 1  # Slurm: nodes of component 0 (learner ranks + rollout manager)
    rollout_nodes: int = 0  # Slurm: nodes of component 1 (engines); 0 = engines on the first trainer node
    learner_procs_per_node: int = 1  # learner ranks per trainer node (= its GPUs on GPU nodes)
    engine_gpus: int = 1  # GPUs per engine on GPU nodes (SGLang --tp-size)
    engine_args: list[str] = field(default_factory=list)  # extra flags for every engine server
    trainer: SlurmNodes = field(default_factory=SlurmNodes)  # Slurm resources of a trainer node
    rollout: SlurmNodes = field(default_factory=SlurmNodes)  # Slurm resources of a rollout node
    job_name: str = "darl"
    max_requeue: int = 3  # Slurm: requeues after preemption or time limit, each resuming from its checkpoint
    # Slurm: USR2 this long before the time limit: the step in progress, then a checkpoint, then
    # requeue; it must hold stop_timeout_s (checked at submit; every save says when it did not fit)
    signal_before_s: int = 600
    setup: list[str] = field(default_factory=list)  # Slurm: shell lines before the job starts (module load ...)
    python: str = ""  # Slurm: the Python the nodes run (empty: this interpreter)
    # Slurm, rollout.backend=sglang: the Python of SGLang's own environment (requirements-sglang.txt;
    # sglang pins another torch than megatron-darl), which runs `-m sglang.launch_server` (empty: `python`)
    engine_python: str = ""
    # each engine must answer /health_generate within this of its own start; 0: 300 s for
    # darl-engine, 1800 s for SGLang (8 cold servers per node compile their kernels at once)
    startup_timeout_s: float = 0.0
    # SGLang's JIT caches (Triton, FlashInfer, inductor, CUDA), one folder per server of a node:
    # <dir>/engine<k>; empty: node-local, $TMPDIR (or /tmp)/darl-sglang-cache-<uid>
    engine_cache_dir: str = ""
    # rollout.backend=sglang: variables of the engine host's environment an SGLang server keeps
    # among those it is otherwise started without (engine/command.py SGLANG_DROPPED_ENV:
    # LD_LIBRARY_PATH, LD_PRELOAD, CUDA_HOME, CUDA_PATH, CUDA_ROOT, PYTHONPATH, PYTHONHOME)
    engine_env_keep: list[str] = field(default_factory=list)
    stop_timeout_s: float = 300.0  # after SIGTERM, learners must checkpoint and exit within this

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {"mode": ("local", "slurm")}

    def check(self) -> list[tuple[str, str]]:
        errs: list[tuple[str, str]] = []
        if self.trainer_nodes < 1:
            errs.append(("trainer_nodes", "must be >= 1"))
        if self.rollout_nodes < 0:
            errs.append(("rollout_nodes", "must be >= 0"))
        if self.learner_procs_per_node < 1:
            errs.append(("learner_procs_per_node", "must be >= 1"))
        if self.engine_gpus < 1:
            errs.append(("engine_gpus", "must be >= 1"))
        if self.mode == "local" and self.trainer_nodes != 1:
            errs.append(("trainer_nodes", "a local run has one node; use launch.mode=slurm for more"))
        if self.max_requeue < 0:
            errs.append(("max_requeue", "must be >= 0"))
        if self.startup_timeout_s < 0:
            errs.append(("startup_timeout_s", "must be >= 0 (0: 300 s for darl-engine, 1800 s for SGLang)"))
        if self.signal_before_s < 0:
            errs.append(("signal_before_s", "must be >= 0"))
        for name in ("trainer", "rollout"):
            errs.extend((f"{name}.{k}", m) for k, m in getattr(self, name).check())
        gpus = self.trainer.gpus_per_node
        if gpus and self.rollout_nodes and self.learner_procs_per_node != gpus:
            errs.append(("learner_procs_per_node", f"one learner rank per GPU: set it to trainer.gpus_per_node "
                         f"({gpus})"))
        if gpus and not self.rollout_nodes and self.learner_procs_per_node >= gpus:
            errs.append(("learner_procs_per_node", f"with rollout_nodes=0 the engines share the first trainer node: "
                         f"leave GPUs for them (< trainer.gpus_per_node={gpus})"))
        return errs

    def engine_startup_s(self, backend: str) -> float:
        """Each engine's startup budget, from its own start (see `startup_timeout_s`)."""
        return self.startup_timeout_s or (1800.0 if backend == "sglang" else 300.0)

    @property
    def learner_world(self) -> int:
        return self.trainer_nodes * self.learner_procs_per_node
