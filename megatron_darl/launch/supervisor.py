"""Local launcher: start a run's processes on this machine, stream their logs, tear all down.

What it is: `Supervisor`, which starts child processes (learner ranks, engines, the rollout
manager) each in its own process group with a parent-death signal, prefixes and tees their
output (`[engine0] ...` on the console, `<run_dir>/logs/engine0.log` on disk), waits for them,
and on exit, Ctrl-C, SIGTERM or the failure of any one child stops every other child (SIGTERM,
then SIGKILL after a grace period) and runs the registered cleanups (shared-memory unlink).
A crashed child is reported by name and exit code (`ChildFailed`).
What it is not: the training loop, or what runs where (`local.py`, `slurm_job.py`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

PR_SET_PDEATHSIG = 1


def _die_with_parent(ignore: tuple[signal.Signals, ...] = ()) -> None:  # in the child between fork and exec
    os.setsid()  # own process group: the supervisor kills the whole tree of a child
    for sig in ignore:  # SIG_IGN survives exec: the child is safe from them until it installs handlers
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux/glibc: children then rely on the supervisor's teardown
        pass


class ChildFailed(RuntimeError):
    """A child process exited with a non-zero code while the run was going."""

    def __init__(self, role: str, code: int):
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        super().__init__(f"process {role!r} stopped with {how}; the whole run was stopped")
        self.role, self.code = role, code


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log_path: str
    essential: bool = True  # its exit (even with code 0) ends the run when `until` is not it
    critical: bool = True  # its failure (non-zero exit) ends the run; False: another process replaces it
    _pump: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()


@dataclass
class Supervisor:
    """Owns every child of a run; use as a context manager so teardown always happens."""

    log_dir: str
    echo: TextIO | None = field(default_factory=lambda: sys.stdout)  # None: logs to files only
    grace_s: float = 10.0
    children: list[Child] = field(default_factory=list)
    _cleanups: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> "Supervisor":
        os.makedirs(self.log_dir, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def on_shutdown(self, fn: Callable[[], None]) -> None:
        """Register a cleanup (e.g. unlink a shared-memory segment) run after children stop."""
        self._cleanups.append(fn)

    def start(self, role: str, argv: list[str], env: dict[str, str] | None = None,
              essential: bool = True, critical: bool = True, cwd: str | None = None,
              ignore: tuple[signal.Signals, ...] = (), inherit: bool = True) -> Child:
        """Start `argv` as child `role` in its own process group, its output teed to `<log_dir>/<role>.log`.

        Args:
            role: the child's name: its log file, its console prefix `[role]`, and `ChildFailed`'s message.
            argv: the command line to run.
            env: variables added to this process's environment, or with `inherit=False` the child's whole
                environment (`PYTHONUNBUFFERED=1` is always set); None: none added.
            essential: its exit, even with code 0, ends the run (unless it is the child `wait` waits for).
            critical: its failure (non-zero exit) ends the run; False: another process replaces it.
            cwd: the child's working directory; None: this process's.
            ignore: signals the child starts with ignored (SIG_IGN), until it installs its own handlers.
            inherit: start from this process's environment; False: from `env` alone (an SGLang server's,
                with variables left out: `EngineSpec.environment`).
        """
        log_path = os.path.join(self.log_dir, f"{role}.log")
        full_env = {**(os.environ if inherit else {}), "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, cwd=cwd, preexec_fn=lambda: _die_with_parent(ignore), text=True, errors="replace",
        )
        child = Child(role, proc, log_path, essential, critical)
        child._pump = threading.Thread(target=self._pump, args=(child,), daemon=True, name=f"log-{role}")
        child._pump.start()
        self.children.append(child)
        return child

    def _pump(self, child: Child) -> None:
        """Copy a child's output to its log file and, prefixed with its role, to the console."""
        assert child.proc.stdout is not None
        with open(child.log_path, "a", encoding="utf-8") as log:
            for line in child.proc.stdout:
                log.write(line)
                log.flush()
                if self.echo is not None:
                    with self._lock:
                        self.echo.write(f"[{child.role}] {line}")
                        self.echo.flush()

    def check(self, until: Child | None = None) -> None:
        """Raise ChildFailed if a critical child failed (non-zero) or an essential one exited."""
        for c in self.children:
            code = c.poll()
            if code is None or c is until:
                continue
            if (code != 0 and c.critical) or c.essential:
                raise ChildFailed(c.role, code)

    def wait(self, until: Child, poll_s: float = 0.2, timeout_s: float | None = None) -> int:
        """Block until `until` exits (returning its code) while watching every other child."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            code = until.poll()
            if code is not None:
                if code != 0:
                    raise ChildFailed(until.role, code)
                return code
            self.check(until)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{until.role!r} did not finish within {timeout_s} s")
            time.sleep(poll_s)

    def shutdown(self) -> None:
        """Stop every child (SIGINT to its group, SIGKILL after the grace period), then clean up.
        SIGINT, not SIGTERM: learner ranks take SIGTERM as preemption and would checkpoint first."""
        live = [c for c in self.children if c.poll() is None]
        for c in live:
            _signal_group(c.pid, signal.SIGINT)
        deadline = time.monotonic() + self.grace_s
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:  # the group may hold grandchildren even when the leader exited
            _signal_group(c.pid, signal.SIGKILL)
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if c._pump is not None:
                c._pump.join(timeout=2)
        for fn in reversed(self._cleanups):
            try:
                fn()
            except Exception as exc:  # cleanup must go on for the others
                print(f"[launcher] cleanup failed: {exc}", file=sys.stderr)
        self._cleanups.clear()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
