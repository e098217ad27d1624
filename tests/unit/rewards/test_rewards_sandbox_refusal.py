"""Issue 23: where the sandbox cannot hold its guarantees, it refuses, saying why; never scores 0 silently.

Before, a machine that refused namespaces (a container without CAP_SYS_ADMIN, Docker's default)
ran every program under the audit-hook fallback, which cannot stop a subprocess, and said
nothing; a non-root run errored on every code item. Now the launcher does not run the program
without its namespaces (SandboxRefused: a grader error the pool logs, not a score of 0), and a
run whose data are code tasks stops before it starts, naming the reason. The refusal is reproduced for real: the child processes drop CAP_SYS_ADMIN
(`setpriv`, as Docker does) or root itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_darl.rewards.sandbox import sandbox_problem
from tests.helpers import repo_env

NO_SYS_ADMIN = ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin"]

PROBE = """
import json, os, sys
from megatron_darl.config.data import DataConfig
from megatron_darl.launch.preflight import data_checks
from megatron_darl.rewards.sandbox import SandboxRefused, run_sandboxed, sandbox_problem
marker = sys.argv[1]
try:
    r = run_sandboxed(f"open({marker!r}, 'w').write('ran')\\nprint('ran')", "")
    status, stderr = r.status, r.stderr
except SandboxRefused as exc:  # the program did not run
    status, stderr = "refused", str(exc)
from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.worker import Grader, handle
item = {"prompt": "", "response": "print(5)", "kind": "code",
        "answer": {"format": "stdio", "cases": [{"input": "", "output": "5"}]}}
graded = handle(Grader(RewardConfig()), {"id": 1, "item": item})
print(json.dumps({"status": status, "stderr": stderr, "problem": sandbox_problem(), "graded": graded,
                  "preflight": data_checks(DataConfig(source="humaneval")),
                  "procedural": data_checks(DataConfig(source="reasoning_gym:chain_sum", size=8, eval_size=8))}))
"""


def _probe(prefix: list[str], tmp_path) -> dict:
    """Run PROBE under `prefix` (a command that takes privileges away, then runs the rest)."""
    marker = tmp_path / "ran"
    os.chmod(tmp_path, 0o777)  # a sandbox uid could write here if the program ran at all
    env = repo_env()
    done = subprocess.run([*prefix, sys.executable, "-c", PROBE, str(marker)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["ran"] = marker.exists()
    return out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops CAP_SYS_ADMIN from a root process with setpriv (root and util-linux needed)")
def test_without_namespaces_the_program_does_not_run_and_a_code_run_is_refused(tmp_path):
    out = _probe(NO_SYS_ADMIN, tmp_path)
    assert not out["ran"], "the program ran without namespaces (the fallback cannot stop a subprocess)"
    assert out["status"] == "refused" and "unshare(net namespace): Operation not permitted" in out["stderr"]
    assert out["graded"]["status"] == "error" and "SandboxRefused" in out["graded"]["detail"]  # the pool logs it
    assert "needs network, mount and PID namespaces" in out["problem"] and "SYS_ADMIN" in out["problem"]
    assert any(e.startswith("data.source: code tasks, but the code sandbox cannot run") for e in out["preflight"])
    assert out["procedural"] == []  # a run without code tasks does not need the sandbox


NOT_ROOT = """
import os
from megatron_darl.rewards.sandbox import run_sandboxed, sandbox_problem
os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    run_sandboxed("print('ran')", "")
    print("ran")
except PermissionError as exc:
    print("refused:", exc)
print(sandbox_problem())
"""


@pytest.mark.skipif(os.geteuid() == 0, reason="as root, test_a_code_run_is_refused_when_not_root drops to uid 65534")
def test_not_root_is_named_before_a_code_run_starts():
    from megatron_darl.config.data import DataConfig
    from megatron_darl.launch.preflight import data_checks

    problem = sandbox_problem()
    assert problem and "needs root" in problem and f"uid {os.geteuid()}" in problem
    assert any("code tasks, but the code sandbox needs root" in e for e in data_checks(DataConfig(source="humaneval")))


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes another user, which needs root")
def test_a_code_run_is_refused_when_not_root():
    done = subprocess.run([sys.executable, "-c", NOT_ROOT], env=repo_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    refused, problem = done.stdout.strip().splitlines()[-2:]
    assert refused.startswith("refused: run_sandboxed: the code sandbox needs root")
    assert problem.startswith("the code sandbox needs root") and "uid 65534" in problem
