"""Launch role: where the processes of a run are placed, and its config.

What it is: the `LaunchConfig` dataclass (local one-machine runs and Slurm placement through
submitit) and the placement types the launchers share.
What it is not: the launchers themselves (`local.py`, `slurm.py`), which start processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class LaunchConfig:
    """Process placement. `mode=local` starts everything on this machine; `slurm` submits a
    heterogeneous job (het-group 0: trainer nodes, het-group 1: rollout nodes)."""

    mode: str = "local"  # local | slurm
    trainer_nodes: int = 1  # Slurm: nodes in het-group 0 (learner ranks + rollout manager)
    rollout_nodes: int = 0  # Slurm: nodes in het-group 1 (SGLang servers); 0 = engines on trainer nodes
    gpus_per_node: int = 0  # 0 on CPU machines
    learner_procs_per_node: int = 1  # learner ranks per trainer node (= GPUs on GPU nodes)
    partition: str = ""  # Slurm partition (empty: cluster default)
    account: str = ""  # Slurm account (empty: none)
    time_min: int = 60  # Slurm time limit in minutes
    cpus_per_task: int = 2
    mem_gb: int = 0  # per node; 0 = Slurm default
    max_requeue: int = 3  # requeues on preemption before giving up (resume from last checkpoint)
    slurm_extra: dict[str, str] = field(default_factory=dict)  # extra sbatch options, e.g. {"qos": "high"}
    startup_timeout_s: float = 300.0  # every child must report healthy within this

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {"mode": ("local", "slurm")}

    def check(self) -> list[tuple[str, str]]:
        errs: list[tuple[str, str]] = []
        if self.trainer_nodes < 1:
            errs.append(("trainer_nodes", "must be >= 1"))
        if self.learner_procs_per_node < 1:
            errs.append(("learner_procs_per_node", "must be >= 1"))
        return errs
