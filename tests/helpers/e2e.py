"""End-to-end test harness: small run configs and `darl-train` subprocesses to drive and inspect.

What it is: `base_config` / `new_run` / `write_config` (a small, fully specified run whose
folder holds its own model copy and config, so every process of the run names the folder on
its command line), `DarlRun` (a `darl-train` subprocess in its own session, with helpers to read
its metrics, ledger and run info, and a teardown that leaves nothing behind), `role_pid`,
`run_groups` and `assert_nothing_left` (no process names the run folder or stays in one of its
process groups, and no `/dev/shm/darl-<run_id>-*` remains), `kill_role` (SIGKILL one process of a
run: the run fails naming it and leaves nothing) and `resume_to_end` (the same config with
`checkpoint.resume=auto`, run to a zero exit).
What it is not: a test, or a fixture (`conftest.py` makes the warm-started model)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import yaml

# chain_sum with two one-digit terms: after ~40 supervised steps the tiny model answers some
# of them right, so groups have mixed rewards (non-zero advantages, losses and gradients)
SFT_STEPS = 40


def base_config(run_dir: str, model_dir: str, **sections) -> dict:
    """A small run (4 steps of 8 prompts x 4 samples, one embedded engine); `sections` update it."""
    cfg = {
        "model": {"hf_dir": model_dir, "tokenizer": model_dir},
        "parallel": {"tp": 1, "pp": 1},
        "optim": {"lr": 1.0e-4, "grad_clip": 1.0},
        "learner": {"micro_batch_tokens": 4096},
        "algo": {"policy_loss": "ppo", "old_logprob": "proximal", "ppo_n_minibatches": 2, "advantage": "grpo",
                 "replay": False, "sg": False, "pmis": False, "max_head_offpolicyness": 0},
        "rollout": {"backend": "torch", "num_engines": 1, "group_size": 4, "temperature": 1.0,
                    "max_new_tokens": 4, "pause_mode": "abort", "partial_rollout": True},
        "reward": {"num_workers": 1},
        "data": {"source": "reasoning_gym:chain_sum",
                 "dataset_kwargs": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                 "chat_template": False, "prompt_template": "{expression} =", "size": 2000, "eval_size": 0},
        "eval": {"num_problems": 0},
        "train": {"steps": 4, "batch_prompts": 8, "run_dir": run_dir, "seed": 7},
        "checkpoint": {"every_steps": 0},
        "logging": {"progress": False, "tensorboard": False},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def _sigint_as_at_a_terminal() -> None:
    """In the child, before exec: SIGINT at its default, as a shell at a terminal leaves it for
    the command a user types. A suite started in the background by a non-interactive shell
    (`.ci/run > log &`) inherits SIGINT ignored, and Python keeps a signal its parent ignored
    ignored (it maps SIGINT to KeyboardInterrupt only when the parent left it at the default): the
    launcher would never see the Ctrl-C that test_slurm_jobs sends it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def new_run(tmp_path, warm_model: str, name: str = "run", **sections) -> DarlRun:
    """A run folder holding its own copy of the model and its config, so that every process of
    the run (launcher, learners, manager, engines) names the folder on its command line."""
    run_dir = str(tmp_path / name)
    shutil.copytree(warm_model, os.path.join(run_dir, "model"))
    cfg = base_config(run_dir, os.path.join(run_dir, "model"), **sections)
    path = write_config(os.path.join(run_dir, "darl.yaml"), cfg)
    return DarlRun(path, run_dir, os.path.join(str(tmp_path), f"{name}.out"))


def write_config(path: str, cfg: dict) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg, fh, sort_keys=False)
    return path


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@dataclass
class DarlRun:
    """One `darl-train --config FILE` subprocess (its own session: nothing leaks into pytest's)."""

    config: str
    run_dir: str
    out_path: str
    proc: subprocess.Popen | None = None
    env: dict[str, str] | None = None  # the launcher's environment (None: this process's)
    _out: object = field(default=None, repr=False)

    def start(self) -> "DarlRun":
        os.makedirs(self.run_dir, exist_ok=True)
        self._out = open(self.out_path, "a", encoding="utf-8")
        env = dict(self.env if self.env is not None else os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        exe = shutil.which("darl-train")
        argv = [exe] if exe else [sys.executable, "-c", "from megatron_darl.launch.cli import train; train()"]
        self.proc = subprocess.Popen(argv + ["--config", self.config], stdout=self._out, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True, preexec_fn=_sigint_as_at_a_terminal)
        return self

    def run_to_end(self, timeout_s: float) -> "DarlRun":
        """Start, wait for a zero exit (the output's tail in the failure) and tear down."""
        try:
            self.start()
            assert self.wait(timeout_s) == 0, self.output()[-4000:]
        finally:
            self.kill()
        return self

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"darl-train did not finish within {timeout_s} s:\n{self.output()[-4000:]}") from None

    def kill(self) -> None:
        """Teardown of a test, also one that failed midway: SIGTERM to the launcher (it stops its
        children and unlinks its shared memory), SIGKILL to whatever is left after a grace
        period, then unlink the run's segments a SIGKILLed launcher could not."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        for pid in run_pids(self.run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if os.path.isfile(os.path.join(self.run_dir, "run_info.json")):
            prefix = f"darl-{self.run_info()['run_id']}-"
            for name in os.listdir("/dev/shm"):
                path = os.path.join("/dev/shm", name)
                if name.startswith(prefix):
                    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        if self._out is not None:
            self._out.close()
            self._out = None

    def output(self) -> str:
        with open(self.out_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def metrics(self) -> list[dict]:
        return _read_jsonl(os.path.join(self.run_dir, "metrics.jsonl"))

    def ledger(self) -> list[dict]:
        return _read_jsonl(os.path.join(self.run_dir, "trained_prompts.jsonl"))

    def run_info(self) -> dict:
        with open(os.path.join(self.run_dir, "run_info.json"), encoding="utf-8") as fh:
            return json.load(fh)

    def wait_for(self, pred, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if self.proc.poll() is not None:
                raise AssertionError(f"darl-train exited ({self.proc.returncode}) before {what}:\n"
                                     f"{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s} s:\n{self.output()[-4000:]}")
            time.sleep(0.2)


def run_pids(run_dir: str) -> list[int]:
    """Processes whose command line names the run folder (launcher children all read its config)."""
    out = subprocess.run(["pgrep", "-f", run_dir], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if int(p) != os.getpid()]


def role_pid(run_dir: str, module: str) -> int:
    """The pid of the run's process started as `python -m <module>`."""
    for pid in run_pids(run_dir):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except FileNotFoundError:
            continue
        if b"-m" in argv and module.encode() in argv:
            return pid
    raise AssertionError(f"no process of {module} for {run_dir}")


def _pgid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[2])  # field 5: pgrp
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def run_groups(run: DarlRun) -> set[int]:
    """Process groups of the run now: the launcher's and each child's (every child leads its
    own group; grandchildren such as reward workers stay in their parent's)."""
    groups = {_pgid(p) for p in run_pids(run.run_dir)} | {run.proc.pid}
    return {g for g in groups if g is not None and g != os.getpgid(0)}


def group_members(groups: set[int]) -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) in groups]


def assert_nothing_left(run: DarlRun, run_id: str, groups: set[int] = frozenset(), timeout_s: float = 15.0) -> None:
    """No process names the run folder or is in one of `groups` (taken while the run was going,
    see `run_groups`), and no /dev/shm/darl-<run_id>-* remains."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = sorted(set(run_pids(run.run_dir)) | set(group_members(set(groups))))
        shm = [n for n in os.listdir("/dev/shm") if n.startswith(f"darl-{run_id}-")]
        if not pids and not shm:
            return
        if time.monotonic() > deadline:
            procs = {p: open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                     for p in pids if os.path.exists(f"/proc/{p}/cmdline")}
            raise AssertionError(f"left behind: processes {procs}, shared memory {shm}")
        time.sleep(0.2)


def kill_role(run: DarlRun, module: str, role: str) -> None:
    """SIGKILL the run's `python -m <module>` process: the run must fail naming `role` and SIGKILL
    and leave nothing behind (processes of its groups, its shared memory)."""
    run_id, groups = run.run_info()["run_id"], run_groups(run)
    os.kill(role_pid(run.run_dir, module), signal.SIGKILL)
    code = run.wait(60)
    out = run.output()
    assert code != 0 and f"process '{role}' stopped with signal SIGKILL" in out, out[-3000:]
    assert_nothing_left(run, run_id, groups)


def resume_config(path: str, out: str) -> str:
    """The config at `path` with `checkpoint.resume=auto`, written to `out`."""
    with open(path, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    cfg["checkpoint"]["resume"] = "auto"
    return write_config(out, cfg)


def resume_to_end(run: DarlRun, out_path: str, timeout_s: float) -> DarlRun:
    """`run`'s command again with `checkpoint.resume=auto` in its folder, to a zero exit that
    leaves nothing behind; torn down when it fails (the caller kills it after use either way)."""
    cfg_path = resume_config(run.config, os.path.join(run.run_dir, "darl_resume.yaml"))
    resumed = DarlRun(cfg_path, run.run_dir, out_path).start()
    try:
        assert resumed.wait(timeout_s) == 0, resumed.output()[-4000:]
        assert_nothing_left(resumed, resumed.run_info()["run_id"])
    except BaseException:
        resumed.kill()
        raise
    return resumed
