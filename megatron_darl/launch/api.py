"""Launch role: where the processes of a run are placed.

What it is: `Placement`, the small protocol the run session (`session.py`) drives: start the
engines, the rollout manager and the learner ranks, watch them, forward a preemption, stop
everything. `local.LocalPlacement` places every role on this machine; `slurm_job.SlurmPlacement`
places them inside a Slurm allocation (a heterogeneous job whose component 0 holds the trainer
nodes and component 1 the rollout nodes; the `launch` config section is `config/launch.py`).
What it is not: the launchers themselves (`local.py`, `slurm.py`, `slurm_job.py`).
"""

from __future__ import annotations

from typing import Protocol

from megatron_darl.channel.run_info import RunInfo


class Placement(Protocol):
    """Where the roles of one run attempt go. The session calls, in order: `start_engines`,
    (evaluation), `start_rollout`, `start_learners`, `wait_learners`; `check` while it waits on
    something else; `preempt` from a signal handler; `stop` always, last."""

    attempt: str  # this execution of the run (see RunInfo.attempt)

    def rendezvous(self) -> tuple[str, int]: ...  # (MASTER_ADDR, MASTER_PORT); port 0: rank 0 binds one

    def start_engines(self, info: RunInfo) -> None: ...  # engine hosts that announce in info.engines_dir

    def start_rollout(self, info: RunInfo) -> None: ...  # the rollout manager, beside the ring

    def start_learners(self, info: RunInfo) -> None: ...  # every learner rank (or releases the other nodes')

    def wait_learners(self, timeout_s: float | None = None) -> bool: ...  # True: all exited 0; False: timeout

    def check(self) -> None: ...  # raise (local.ChildFailed) if a role failed; wait_learners checks too

    def preempt(self, signum: int) -> None: ...  # learners: checkpoint and stop

    def stop(self, info: RunInfo | None) -> None: ...  # stop every role, clean shared memory
