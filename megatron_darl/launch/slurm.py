"""`darl-train ... launch.mode=slurm`: the run as one Slurm job, submitted through submitit.

What it is: `run_slurm(cfg)`. It checks the placement against the config and the SGLang
environment an SGLang recipe names (`engine_env.submit_checks`: `launch.engine_python`, the
pinned sglang, the driver floor), then submits ONE job
through a submitit executor whose batch script (`job_script`) is heterogeneous when
`launch.rollout_nodes > 0`: component 0, the trainer nodes, runs submitit's task (a
`slurm_job.TrainerTask` per learner rank), component 1, the rollout nodes, runs one engine host
per node (`python -m megatron_darl.launch.engine_host`). Resources per component come from
`launch.trainer` / `launch.rollout` (partition, account, QoS, time, GPUs, CPUs, memory, extra
options). It prints the job id, the log files and the TensorBoard folder, streams the session's
log while the job runs (and through a requeue), and returns the job's result as its exit code;
Ctrl-C cancels the job.
What it is not: what runs inside the job (`slurm_job.py`, `session.py`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import submitit

from megatron_darl.config import RunConfig
from megatron_darl.config.launch import SlurmNodes

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
          "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}


def slurm_problems(cfg: RunConfig) -> list[str]:
    """What makes this config impossible to place on Slurm, each naming its keys."""
    lc, rc, out = cfg.launch, cfg.rollout, []
    external = rc.backend == "sglang" and bool(rc.engine_urls)
    if external and lc.rollout_nodes:
        out.append("rollout.engine_urls names engines you run yourself: set launch.rollout_nodes=0")
    if lc.rollout_nodes and not external:
        if rc.num_engines % lc.rollout_nodes:
            out.append(f"rollout.num_engines={rc.num_engines} must divide evenly over launch.rollout_nodes="
                       f"{lc.rollout_nodes}")
        per = rc.num_engines // lc.rollout_nodes
        if lc.rollout.gpus_per_node and per * lc.engine_gpus > lc.rollout.gpus_per_node:
            out.append(f"{per} engines per rollout node x launch.engine_gpus={lc.engine_gpus} > "
                       f"launch.rollout.gpus_per_node={lc.rollout.gpus_per_node}")
        if rc.backend == "sglang" and not lc.rollout.gpus_per_node:
            out.append("rollout.backend=sglang: SGLang servers need GPUs: set launch.rollout.gpus_per_node")
        if rc.weight_sync == "shm":
            out.append("rollout.weight_sync=shm: engines on rollout nodes cannot read the learner node's "
                       "shared memory; use disk (or auto)")
    if lc.stop_timeout_s > lc.signal_before_s:
        out.append(f"launch.stop_timeout_s={lc.stop_timeout_s:.0f} > launch.signal_before_s={lc.signal_before_s}: "
                   f"Slurm's time limit would kill the learners before the checkpoint they start at its warning "
                   f"may finish; raise launch.signal_before_s (a 4B checkpoint writes about 56 GB)")
    if not lc.rollout_nodes and not external:
        free = lc.trainer.gpus_per_node - lc.learner_procs_per_node
        if rc.backend == "sglang" and (not lc.trainer.gpus_per_node or rc.num_engines * lc.engine_gpus > free):
            out.append(f"rollout.backend=sglang with launch.rollout_nodes=0: {rc.num_engines} engines x "
                       f"launch.engine_gpus={lc.engine_gpus} GPUs must fit in the first trainer node's "
                       f"{max(free, 0)} GPUs left by the learners")
    return out


NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # node-local by convention on clusters


def node_hosts() -> list[str]:
    """The host name of every node Slurm knows (`sinfo %n`); [] when it does not answer."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%n"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted(set(out.stdout.split())) if out.returncode == 0 else []


def _mount_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) holding `path`, from /proc/mounts."""
    best = ("/", "")
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                point = parts[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                    best = (point, parts[2])
    except OSError:  # no /proc (not Linux): the type stays unknown; the folder-name check still runs
        return best
    return best


def run_dir_problem(run_dir: str, hosts: list[str]) -> str | None:
    """Why `train.run_dir` cannot hold a run whose nodes are `hosts`, or None. Found after the
    job starts it is worse than late: Slurm cannot write the job's log there and fails without
    one (submitit warns of this). A cluster whose every node is this machine shares all of it."""
    here = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    if hosts and set(hosts) <= here:
        return None
    path = os.path.realpath(run_dir)
    point, fstype = _mount_of(path)
    local = [d for d in (*NODE_LOCAL_DIRS, os.environ.get("TMPDIR", "")) if d and (path + "/").startswith(
        os.path.realpath(d).rstrip("/") + "/")]
    if fstype in ("tmpfs", "ramfs") or local:
        why = f"{fstype} mounted at {point}" if fstype in ("tmpfs", "ramfs") else f"under {local[0]}"
        return (f"train.run_dir={run_dir} is node-local ({why}): the job's nodes would not see it, and Slurm "
                f"writes the job's log there; use a file system every node shares")
    return None


def _sbatch_lines(nodes: int, tasks_per_node: int, res: SlurmNodes) -> list[str]:
    opts: dict[str, object] = {"nodes": nodes, "ntasks-per-node": tasks_per_node,
                               "cpus-per-task": res.cpus_per_task, "time": res.time_min}
    for key, value in (("partition", res.partition), ("account", res.account), ("qos", res.qos)):
        if value:
            opts[key] = value
    if res.gpus_per_node:
        opts["gpus-per-node"] = res.gpus_per_node
    if res.mem_gb:
        opts["mem"] = f"{res.mem_gb}G"
    opts.update(res.extra)
    return [f"#SBATCH --{k.replace('_', '-')}={shlex.quote(str(v))}" for k, v in opts.items()]


def job_script(cfg: RunConfig, folder: Path, submit_command: str) -> str:
    """The batch script of the run's job (heterogeneous with rollout nodes)."""
    lc = cfg.launch
    run_dir = os.path.abspath(cfg.train.run_dir)
    het = lc.rollout_nodes > 0
    python = shlex.quote(lc.python or sys.executable)
    lines = ["#!/bin/bash", "# megatron-darl run, written by darl-train (launch.mode=slurm): component 0 = trainer "
             "nodes" + (", component 1 = rollout nodes" if het else ""),
             f"#SBATCH --job-name={shlex.quote(lc.job_name)}",
             f"#SBATCH --output={folder}/%j_0_log.out", f"#SBATCH --error={folder}/%j_0_log.err",
             "#SBATCH --open-mode=append", f"#SBATCH --signal=USR2@{lc.signal_before_s}", "#SBATCH --requeue"]
    lines += _sbatch_lines(lc.trainer_nodes, lc.learner_procs_per_node, lc.trainer)
    if het:
        lines += ["#SBATCH hetjob"] + _sbatch_lines(lc.rollout_nodes, 1, lc.rollout)
    lines += ["", *lc.setup, "export SUBMITIT_EXECUTOR=slurm PYTHONUNBUFFERED=1",
              f"RUN_DIR={shlex.quote(run_dir)}", 'ATTEMPT="$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"',
              'mkdir -p "$RUN_DIR/logs" "$RUN_DIR/engines"']
    group0 = "--het-group=0 " if het else ""
    if het:
        lines += ["# component 1: one engine host per rollout node; it waits for the session's run info",
                  f'srun --het-group=1 --cpus-per-task={lc.rollout.cpus_per_task} --unbuffered --kill-on-bad-exit=1 '
                  f'--ntasks-per-node=1 --open-mode=append '
                  f'--output="$RUN_DIR/logs/engine_host%t.out" {python} -u -m megatron_darl.launch.engine_host '
                  f'--run-info "$RUN_DIR/run_info.json" &', "ROLLOUT=$!"]
    # every srun names its CPUs: Slurm 22.05-23.02 do not pass the job's --cpus-per-task on to
    # srun, which would pin each task (8 SGLang servers, or manager + reward workers) to one core
    lines += ["# component 0: one task per learner rank; global rank 0 runs the session",
              f"srun {group0}--cpus-per-task={lc.trainer.cpus_per_task} --unbuffered --kill-on-bad-exit=1 "
              f"--open-mode=append --output={folder}/%j_%t_log.out "
              f"--error={folder}/%j_%t_log.err {submit_command}", "rc=$?"]
    if het:
        lines += ['echo "$ATTEMPT" > "$RUN_DIR/engines/stop"  # engine hosts stop (the session also says so)',
                  'for _ in $(seq 60); do kill -0 "$ROLLOUT" 2>/dev/null || break; sleep 1; done',
                  'kill "$ROLLOUT" 2>/dev/null; wait']
    lines += ['exit "$rc"', ""]
    return "\n".join(lines)


class DarlSlurmExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor with this project's (heterogeneous) batch script."""

    def __init__(self, folder: str, cfg: RunConfig):
        super().__init__(folder, max_num_timeout=cfg.launch.max_requeue,
                         python=shlex.quote(cfg.launch.python) if cfg.launch.python else None)
        self.cfg = cfg
        lc = cfg.launch
        self.update_parameters(time=lc.trainer.time_min, nodes=lc.trainer_nodes,
                               ntasks_per_node=lc.learner_procs_per_node, signal_delay_s=lc.signal_before_s)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return job_script(self.cfg, self.folder, command)


def job_states(job_id: str) -> list[str]:
    """The state of every component of the job ([] when Slurm no longer knows it)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    states = [f.split("=", 1)[1] for line in out.stdout.splitlines() for f in line.split() if f.startswith("JobState=")]
    if states:
        return states
    acct = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "State", "-j", job_id], capture_output=True, text=True,
                          timeout=60)  # purged from the controller's memory: accounting may know
    return [s.split()[0] for s in acct.stdout.split() if s] if acct.returncode == 0 else []


def overall(states: list[str]) -> str:
    """One state for all components: active while any is; else the worst end."""
    if not states:
        return "UNKNOWN"
    for s in states:
        if s in ACTIVE:
            return s
    for s in ("CANCELLED", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "PREEMPTED", "BOOT_FAIL", "DEADLINE"):
        if s in states:
            return s
    return states[0]


class _Tail:
    """New lines of a growing file, printed with a prefix."""

    def __init__(self, path: Path, out=sys.stdout):
        self.path, self.pos, self.out = path, 0, out

    def pump(self) -> None:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as fh:
                fh.seek(self.pos)
                text = fh.read()
                self.pos = fh.tell()
        except FileNotFoundError:
            return
        if text:
            self.out.write(text)
            self.out.flush()


def run_slurm(cfg: RunConfig) -> int:
    """Submit the run, follow it, return its exit code (see the module docstring)."""
    from megatron_darl.launch.engine_env import submit_checks

    problems = slurm_problems(cfg) or submit_checks(cfg)  # the SGLang environment before the queue wait
    if problems:
        print("darl-train: cannot place this run on Slurm:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if shutil.which("sbatch") is None:
        print("darl-train: launch.mode=slurm needs Slurm's sbatch on PATH (run it where you submit jobs)",
              file=sys.stderr)
        return 1
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    from megatron_darl.launch.slurm_job import TrainerTask

    run_dir = os.path.abspath(cfg.train.run_dir)
    problem = run_dir_problem(run_dir, node_hosts())
    if problem:
        print(f"darl-train: cannot submit: {problem}", file=sys.stderr)
        return 1
    folder = os.path.join(run_dir, "slurm")
    os.makedirs(folder, exist_ok=True)
    try:
        job = DarlSlurmExecutor(folder, cfg).submit(TrainerTask(cfg))
    except (FailedJobError, FailedSubmissionError) as exc:  # sbatch refused the script: its own words
        print(f"darl-train: sbatch refused the job (script in {folder}/.submission_file_*.sh):\n{exc}",
              file=sys.stderr)
        return 1
    lc = cfg.launch
    print(f"darl-train: submitted Slurm job {job.job_id}: {lc.trainer_nodes} trainer node(s) x "
          f"{lc.learner_procs_per_node} learner rank(s)" +
          (f" + {lc.rollout_nodes} rollout node(s) (heterogeneous job)" if lc.rollout_nodes else ""), flush=True)
    print(f"darl-train: session log {folder}/{job.job_id}_0_log.out (other ranks: "
          f"{folder}/{job.job_id}_<rank>_log.out; every role: {run_dir}/logs/)", flush=True)
    print(f"darl-train: TensorBoard: tensorboard --logdir {run_dir}/tb", flush=True)
    return follow(job, Path(folder), run_dir)


def follow(job, folder: Path, run_dir: str, poll_s: float = 2.0) -> int:
    """Stream the session's log until the job ends; its result is the exit code. Ctrl-C cancels."""
    tails = [_Tail(folder / f"{job.job_id}_0_log.out"), _Tail(folder / f"{job.job_id}_0_log.err", sys.stderr)]
    last, state = None, "UNKNOWN"
    try:
        while True:
            for t in tails:
                t.pump()
            state = overall(job_states(job.job_id))
            if state != last:
                print(f"darl-train: job {job.job_id} {state}", flush=True)
                last = state
            if state not in ACTIVE and state != "UNKNOWN":
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print(f"\ndarl-train: Ctrl-C: cancelling job {job.job_id}", flush=True)
        subprocess.run(["scancel", job.job_id], timeout=60, check=False)
        for _ in range(120):
            if overall(job_states(job.job_id)) not in ACTIVE:
                break
            time.sleep(1)
        print(f"darl-train: job {job.job_id} cancelled", flush=True)
        return 130
    for t in tails:
        t.pump()
    return _outcome(job, state, run_dir)


def _outcome(job, state: str, run_dir: str) -> int:
    task0 = job.task(0)
    if state == "CANCELLED":
        print(f"darl-train: job {job.job_id} was cancelled; continue it with checkpoint.resume=auto", flush=True)
        return 1
    if task0.paths.result_pickle.exists():
        try:
            code = int(task0.result() or 0)
        except Exception as exc:  # the session failed: submitit carries its traceback
            print(f"darl-train: job {job.job_id} failed:\n{exc}", file=sys.stderr, flush=True)
            return 1
        print(f"darl-train: job {job.job_id} finished with exit code {code}; run folder {run_dir}", flush=True)
        return code
    print(f"darl-train: job {job.job_id} ended {state} without a result; see {task0.paths.stdout} and "
          f"{run_dir}/logs/", file=sys.stderr, flush=True)
    return 1
