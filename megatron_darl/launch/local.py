"""The placement of a run on this one machine.

What it is: `run_local(cfg)`, what `darl-train` (and `darl-launch`) runs with
`launch.mode=local` (`launch.mode=slurm` goes to `slurm.run_slurm`, which places the same roles
through `slurm_job.py`, built on this module). `LocalPlacement`: every role a child process of
this one under a `Supervisor` (own process group, `[role]`-prefixed console output, `<run_dir>/logs/<role>.log`):
an engine host for the embedded engines, the rollout manager, and `launch.learner_procs_per_node`
learner ranks with a torchrun-style environment (gloo on CPU).
What it is not: the session's steps (`session.py`), supervision itself (`supervisor.py`), or
anything a role does; the trainer is named only as a module to run (`TRAINER_MODULE`).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

from megatron_darl.channel.run_info import RunInfo
from megatron_darl.config import RunConfig
from megatron_darl.launch.supervisor import Child, ChildFailed, Supervisor

PY = sys.executable
TRAINER_MODULE = "megatron_darl.trainer"  # one learner rank: python -m TRAINER_MODULE --run-info PATH
MANAGER_MODULE = "megatron_darl.rollout"
ENGINE_HOST_MODULE = "megatron_darl.launch.engine_host"


def learner_env(rank: int, world: int, info: RunInfo, local_rank: int | None = None,
                local_world: int | None = None, threads: int = 1) -> dict[str, str]:
    """The torchrun-style environment of learner rank `rank`. MASTER_PORT=0: rank 0 binds a port
    when it starts and publishes it in `info.rendezvous_file` (learner/parallel.py)."""
    from megatron_darl.learner.parallel import RENDEZVOUS_ENV

    return {"RANK": str(rank), "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world if local_world is None else local_world),
            "MASTER_ADDR": info.master_addr, "MASTER_PORT": str(info.master_port),
            RENDEZVOUS_ENV: info.rendezvous_file, "OMP_NUM_THREADS": str(threads)}


class LocalPlacement:
    """Every role on this machine, as children of this process."""

    def __init__(self, cfg: RunConfig, sup: Supervisor):
        self.cfg, self.sup = cfg, sup
        self.attempt = ""  # the session's run id
        self.learners: list[Child] = []

    def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", 0  # learner rank 0 binds the port itself

    def start_engines(self, info: RunInfo) -> None:
        if info.engine_urls:  # SGLang servers someone else runs
            return
        if self.cfg.rollout.backend == "sglang":
            raise ValueError("rollout.backend=sglang on a local run needs rollout.engine_urls "
                             "(or launch.mode=slurm, which starts SGLang servers on the rollout nodes)")
        # critical, not essential: it restarts engines itself and exits only when stopped
        self.sup.start("engines", [PY, "-m", ENGINE_HOST_MODULE, "--run-info", info.path, "--attempt", info.attempt,
                                   "--address", "127.0.0.1"], env={"OMP_NUM_THREADS": "1"}, essential=False)

    def start_rollout(self, info: RunInfo) -> None:
        # not essential: it exits 0 by itself when the learner says stop; a crash still stops the run
        self.sup.start("rollout", [PY, "-m", MANAGER_MODULE, "--run-info", info.path],
                       env={"OMP_NUM_THREADS": "1"}, essential=False)

    def start_learners(self, info: RunInfo) -> None:
        world = info.learner_world
        self.learners = [self.sup.start(f"learner{r}", [PY, "-m", TRAINER_MODULE, "--run-info", info.path],
                                        env=learner_env(r, world, info))
                         for r in range(world)]

    def wait_learners(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.check()
            if all(c.poll() == 0 for c in self.learners):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def check(self) -> None:
        """A learner that finished is fine; any child that failed, or another essential one that
        exited, stops the run."""
        for c in self.sup.children:
            code = c.poll()
            if code is None or (c in self.learners and code == 0):
                continue
            if (code != 0 and c.critical) or c.essential:
                raise ChildFailed(c.role, code)

    def preempt(self, signum: int) -> None:
        for c in self.learners:
            if c.poll() is None:
                os.kill(c.pid, signum)

    def stop(self, info: RunInfo | None) -> None:
        self.sup.shutdown()  # engine host and engines included; then the cleanups below
        if info is None:
            return
        from megatron_darl.channel.shm_ring import segment_path

        path = segment_path(info.ring)
        if os.path.exists(path):
            os.unlink(path)
        if info.weights_root.startswith("/dev/shm/"):  # shm, or distributed fallbacks
            shutil.rmtree(info.weights_root, ignore_errors=True)


def start_local_engines(cfg: RunConfig, sup: Supervisor) -> list[str]:
    """`rollout.num_engines` embedded engines on `cfg.model.hf_dir` as children of `sup`, once they
    answer /health_generate (darl-eval's engines; a training run's come from its engine host)."""
    from megatron_darl.channel.ports import free_port
    from megatron_darl.engine.command import engine_specs
    from megatron_darl.launch.engine_host import wait_healthy

    started = []
    for spec in engine_specs(cfg, list(range(cfg.rollout.num_engines))):
        port = free_port("127.0.0.1")
        child = sup.start(f"engine{spec.index}", spec.command("127.0.0.1", port), env=spec.env(("127.0.0.1",)))
        started.append((f"http://127.0.0.1:{port}", child))
    for i, (url, child) in enumerate(started):
        wait_healthy(url, child, cfg.launch.engine_startup_s(cfg.rollout.backend), cfg.rollout.api_key, f"engine {i}")
    return [url for url, _ in started]


def run_local(cfg: RunConfig) -> int:
    """`darl-train` on one machine; returns the exit code."""
    from megatron_darl.launch.session import PREEMPT_SIGNALS, RunSession

    with Supervisor(os.path.join(os.path.abspath(cfg.train.run_dir), "logs")) as sup:
        placement = LocalPlacement(cfg, sup)
        session = RunSession(cfg, placement)
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, session.preempt)
        try:
            return session.run()
        finally:
            for sig in PREEMPT_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
