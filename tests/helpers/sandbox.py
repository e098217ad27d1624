"""Whether, and along which path, the code sandbox runs here, for the tests that grade code.

What it is: `sandbox_problem_here()` (None, or why not), found once per test session by
`sandbox_problem()`, the check a run makes before it starts; `require_sandbox()` and the
`needs_sandbox` mark that calls it (through the `sandbox_runs_here` fixture, tests/conftest.py):
a test skips with that reason, or FAILS where DARL_REQUIRE_SANDBOX=1 (.ci/run sets it: there the
sandbox must run, as root and as a user); `SandboxMode`, one path of the sandbox for the
parametrized containment tests ("namespaces" and "fallback" as root, "userns" as an ordinary
user: as root, test_sandbox_user.py runs the userns tests as an unprivileged uid, so
CI's root pass covers both paths); and `sandbox_processes`, what is left running of sandboxed
programs.
What it is not: the refusal tests (test_sandbox_refusal.py check that the sandbox refuses).
"""

from __future__ import annotations

import functools
import os
import signal

import pytest

from megatron_darl.rewards.sandbox import (
    SandboxLimits,
    kill_uid,
    root_path,
    run_sandboxed,
    sandbox_problem,
    sandbox_uid,
)

REQUIRE = os.environ.get("DARL_REQUIRE_SANDBOX") == "1"
# root of the machine takes the root path; any other uid (or root of a user namespace) the user path
ROOT = root_path()


@functools.cache
def sandbox_problem_here() -> str | None:
    return sandbox_problem()


def require_sandbox() -> None:
    """Skip the calling test where the sandbox cannot run (or fail it, DARL_REQUIRE_SANDBOX=1)."""
    problem = sandbox_problem_here()
    if problem is None:
        return
    if REQUIRE:
        pytest.fail(f"DARL_REQUIRE_SANDBOX=1 but {problem}", pytrace=False)
    pytest.skip(f"cannot run here: {problem}")


needs_sandbox = pytest.mark.usefixtures("sandbox_runs_here")  # the fixture: tests/conftest.py


def _status(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def sandbox_processes(uid: int | None = None) -> list[int]:
    """Live processes (zombies included) of sandboxed programs. As root: those of the sandbox uid
    `uid` (every sandbox uid when None); as a user: this user's processes inside a PID namespace
    below ours, i.e. of the user path's sandboxes (their PID 1 included)."""
    base = SandboxLimits().uid_base
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = _status(pid)
        except OSError:
            continue
        real = int(fields.get("Uid", "-1").split()[0])
        if ROOT:
            hit = real == uid if uid is not None else base <= real < base + 2**22
        else:
            hit = real == os.geteuid() and len(fields.get("NSpid", "").split()) > 1
        if hit:
            found.append(int(pid))
    return found


class SandboxMode:
    """One path of the sandbox: "namespaces" (root), "fallback" (root, audit hooks, isolate=False)
    or "userns" (an ordinary user). `check()` skips (or fails) a test where this path cannot run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.root = name != "userns"

    def __repr__(self) -> str:
        return self.name

    def check(self) -> None:
        if self.root and not ROOT:
            pytest.skip(f"the {self.name} path runs as root; as uid {os.geteuid()} the userns tests run")
        if not self.root and ROOT:
            pytest.skip("as root, test_sandbox_user.py runs the userns tests as an unprivileged uid")
        if self.name != "fallback":
            require_sandbox()

    def run(self, program: str, stdin: str = "", limits: SandboxLimits | None = None):
        return run_sandboxed(program, stdin, limits, isolate=self.name != "fallback")

    def processes(self, limits: SandboxLimits) -> list[int]:
        """What is left of the programs this test process sandboxed."""
        return sandbox_processes(sandbox_uid(limits) if self.root else None)

    def kill(self, limits: SandboxLimits) -> None:
        if self.root:
            kill_uid(sandbox_uid(limits))
            return
        for pid in self.processes(limits):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
