"""Inside the Slurm job: what the trainer component's tasks run, and where they put the roles.

What it is: `TrainerTask`, the callable submitit runs in every task of component 0 (one task
per learner rank: per GPU, or `launch.learner_procs_per_node` on CPU clusters; also runnable
without submitit as `python -m megatron_darl.launch.slurm_job --config RESOLVED.yaml`, which
the sbatch scripts in `slurm/` do). Global rank 0 runs the run session with `SlurmPlacement`:
the rollout manager and its own learner rank on its node beside the ring buffer, engines from
the rollout component (or an engine host on its node when `launch.rollout_nodes=0`); every
other task waits for the session's run-info record and its go marker, then runs its learner
rank. Each learner rank gets RANK/LOCAL_RANK/WORLD_SIZE from Slurm (SLURM_PROCID, SLURM_LOCALID,
SLURM_NTASKS) and MASTER_ADDR/MASTER_PORT from the record (global rank 0's node, as Slurm
addresses it). Preemption: SIGTERM (Slurm's preemption) and USR2 (`--signal`, before the time
limit) make the learners checkpoint and stop; unless the run finished meanwhile or the job was
cancelled, the job then requeues itself through submitit's checkpoint-and-requeue (at most
`launch.max_requeue` times) and the requeued job resumes from the newest checkpoint.
What it is not: the submission and the login-side view of the job (`slurm.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from submitit.helpers import Checkpointable, DelayedSubmission

from megatron_darl.channel.announcements import stop_path
from megatron_darl.channel.run_info import RunInfo, read_marker, run_info_path, wait_for_run_info
from megatron_darl.config import ConfigError, RunConfig, load_config
from megatron_darl.launch.engine_host import node_address, slurm_attempt
from megatron_darl.launch.local import ENGINE_HOST_MODULE, PY, TRAINER_MODULE, LocalPlacement, learner_env
from megatron_darl.launch.preflight import preflight
from megatron_darl.launch.supervisor import ChildFailed, Supervisor

QUIET = (signal.SIGUSR1, signal.SIGUSR2)  # learners start with these ignored until their handlers are in


@dataclass
class SlurmTask:
    """This task's place in the job step, from Slurm's environment."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    job_id: str
    attempt: str

    @classmethod
    def from_env(cls) -> "SlurmTask":
        env = os.environ
        if "SLURM_JOB_ID" not in env:
            raise RuntimeError("not inside a Slurm job (no SLURM_JOB_ID): run it with srun or sbatch")
        world = int(env.get("SLURM_NTASKS", "1"))
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1")
        return cls(rank=int(env.get("SLURM_PROCID", "0")), world=world, local_rank=int(env.get("SLURM_LOCALID", "0")),
                   local_world=max(1, world // nodes), job_id=env["SLURM_JOB_ID"], attempt=slurm_attempt() or "")

    @property
    def restarts(self) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or "0")


class SlurmPlacement(LocalPlacement):
    """Global rank 0's view: manager, own learner rank and (rollout_nodes=0) engines on this node;
    the other learner ranks start on the go marker; rollout nodes' engines are announced."""

    def __init__(self, cfg: RunConfig, sup: Supervisor, task: SlurmTask):
        super().__init__(cfg, sup)
        self.task = task
        self.attempt = task.attempt
        self.address = node_address()

    def rendezvous(self) -> tuple[str, int]:
        return self.address, 0  # learner rank 0 binds the port itself when it starts

    def start_engines(self, info: RunInfo) -> None:
        if info.engine_urls or self.cfg.launch.rollout_nodes:  # someone else's, or the rollout component's
            return
        argv = [PY, "-m", ENGINE_HOST_MODULE, "--run-info", info.path, "--attempt", info.attempt, "--node", "0",
                "--nodes", "1", "--address", self.address]
        gpus = self.engine_gpus()
        if gpus:
            argv += ["--gpus", ",".join(gpus)]
        self.sup.start("engines", argv, env={"OMP_NUM_THREADS": "1"}, essential=False)

    def engine_gpus(self) -> list[str]:
        """With rollout_nodes=0: this node's GPUs after the learner ranks' ones."""
        total = self.cfg.launch.trainer.gpus_per_node
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        visible = visible or [str(i) for i in range(total)]
        if total and len(visible) < total:  # one GPU per task: the engines' GPUs are not this task's
            raise RuntimeError(f"launch.rollout_nodes=0 runs engines on the first trainer node's GPUs, but its "
                               f"task sees {len(visible)} of launch.trainer.gpus_per_node={total} "
                               f"(CUDA_VISIBLE_DEVICES={','.join(visible)}): request --gpus-per-node, not "
                               "--gpus-per-task, for the trainer component")
        return visible[self.cfg.launch.learner_procs_per_node:] if total else []

    def start_learners(self, info: RunInfo) -> None:
        t = self.task  # the other ranks start on the go marker the session wrote
        self.learners = [self.sup.start(f"learner{t.rank}", [PY, "-m", TRAINER_MODULE, "--run-info", info.path],
                                        env=task_env(t, info, self.cfg), ignore=QUIET)]

    def stop(self, info: RunInfo | None) -> None:
        from megatron_darl.launch.session import stop_engines

        stop_engines(info)
        super().stop(info)


def task_env(t: SlurmTask, info: RunInfo, cfg: RunConfig) -> dict[str, str]:
    threads = 1 if cfg.launch.trainer.gpus_per_node else cfg.launch.trainer.cpus_per_task
    return learner_env(t.rank, t.world, info, t.local_rank, t.local_world, threads)


class TrainerTask(Checkpointable):
    """One task of the trainer component (see the module docstring)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def __call__(self) -> int:
        task = SlurmTask.from_env()
        cfg = self.cfg
        if task.restarts:  # a requeued job continues from the newest checkpoint of its run folder
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))
        if task.world != cfg.launch.learner_world:
            raise RuntimeError(f"{task.world} trainer tasks in the job, but launch.trainer_nodes x "
                               f"learner_procs_per_node = {cfg.launch.learner_world}")
        return self._run_session(cfg, task) if task.rank == 0 else self._run_rank(cfg, task)

    def _run_session(self, cfg: RunConfig, task: SlurmTask) -> int:
        """Global rank 0. SIGTERM (preemption) and USR1/USR2 (the warning before the time limit)
        only ask the learners to checkpoint and stop; whether to requeue is decided once the
        session returned, so a run that finished meanwhile is not requeued (and not retrained)."""
        from megatron_darl.launch.session import RunSession

        signalled = []

        def on_signal(signum, frame):
            signalled.append(signum)
            session.preempt(signum, frame)

        with Supervisor(os.path.join(os.path.abspath(cfg.train.run_dir), "logs")) as sup:
            session = RunSession(cfg, SlurmPlacement(cfg, sup, task))
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):  # USR2 replaces submitit's own
                signal.signal(sig, on_signal)
            code = session.run()
        if signalled and not session.completed:
            return self._requeue(task, code)
        return code

    def _run_rank(self, cfg: RunConfig, task: SlurmTask) -> int:
        run_dir = os.path.abspath(cfg.train.run_dir)
        engines_dir = os.path.join(run_dir, "engines")

        def ended() -> None:  # the session stopped before the learners started
            if read_marker(stop_path(engines_dir)) == task.attempt:
                raise SystemExit(0)

        info = wait_for_run_info(run_info_path(run_dir), task.attempt, float("inf"), alive=ended)
        while read_marker(info.learners_go) != task.attempt:
            ended()
            time.sleep(0.5)
        with Supervisor(info.log_dir) as sup:
            child = sup.start(f"learner{task.rank}", [PY, "-m", TRAINER_MODULE, "--run-info", info.path],
                              env=task_env(task, info, cfg), ignore=QUIET)

            def forward(signum, _frame):
                if child.poll() is None:
                    os.kill(child.pid, signum)

            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, forward)
            code = child.proc.wait()
        if code != 0:
            raise ChildFailed(child.role, code)
        return 0

    def checkpoint(self, *args, **kwargs) -> DelayedSubmission | None:
        """submitit's checkpoint hook, called by its requeue path (`_requeue`) once the learners
        have checkpointed: what the requeued job runs (it resumes with checkpoint.resume=auto)."""
        return DelayedSubmission(TrainerTask(self.cfg))

    def _requeue(self, task: SlurmTask, code: int) -> int:
        """After a signal stopped the learners early: requeue a job that is still running
        (preempted, near its time limit, or signalled by its user), or say why not. A cancelled
        job (scancel sends the same SIGTERM) stays cancelled: Slurm would requeue even that."""
        state = job_state(task.job_id)
        limit = self.cfg.launch.max_requeue
        why = (f"launch.max_requeue={limit} reached" if task.restarts >= limit
               else None if state in ("RUNNING", "PREEMPTED") else f"the job is {state or 'gone'}")
        if why is not None:
            print(f"[launcher] stopped early; not requeued ({why}): continue with checkpoint.resume=auto", flush=True)
            return code or 3
        print("[launcher] preempted: requeueing the job; it resumes from the newest checkpoint", flush=True)
        if os.environ.get("SUBMITIT_FOLDER"):  # submitit's checkpoint-and-requeue, as its own USR2 handler does
            from submitit.core.job_environment import JobEnvironment, SignalHandler
            from submitit.core.utils import DelayedSubmission as Submitted

            env = JobEnvironment()
            SignalHandler(env, env.paths, Submitted.load(env.paths.submitted_pickle)).checkpoint_and_try_requeue(
                signal.SIGUSR2)  # dumps checkpoint(), `scontrol requeue`, exits without a result
        out = subprocess.run(["scontrol", "requeue", task.job_id], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            print(f"[launcher] requeue failed: {out.stderr.strip() or out.stdout.strip()}", flush=True)
            return code or 3
        raise SystemExit(-1)  # no result: the requeued job gives it


def job_state(job_id: str) -> str | None:
    """The job's state as Slurm has it now (its first component's), or None."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    for field in out.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    """The sbatch scripts' entry for a trainer task: `python -m megatron_darl.launch.slurm_job
    --config F [KEY=VALUE ...]` under srun (what submitit runs, without submitit)."""
    p = argparse.ArgumentParser(prog="python -m megatron_darl.launch.slurm_job")
    p.add_argument("--config", required=True, help="YAML recipe")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides + ["launch.mode=slurm"])
    except ConfigError as exc:
        print(f"darl (slurm task): {exc}", file=sys.stderr)
        return 1
    from megatron_darl.launch.packaged import resolve

    try:  # `model.hf_dir: package:...` as darl-train resolves it (each node prepares its own cache)
        cfg = resolve(cfg)
    except (ImportError, OSError, ValueError) as exc:
        print(f"darl (slurm task): cannot prepare model.hf_dir={cfg.model.hf_dir}: {exc}", file=sys.stderr)
        return 1
    problems = preflight(cfg)
    if problems:
        print("darl (slurm task): cannot start:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # until the task's own handlers are in
        signal.signal(sig, signal.SIG_IGN)
    return int(TrainerTask(cfg)() or 0)


if __name__ == "__main__":
    sys.exit(main())
