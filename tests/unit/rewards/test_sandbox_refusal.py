"""Where the sandbox cannot hold its guarantees, it refuses, saying why; never scores 0 silently.

Before, a machine that refused namespaces (a container without CAP_SYS_ADMIN, Docker's default)
ran every program under the audit-hook fallback, which cannot stop a subprocess, and said
nothing. Now the launcher does not run the program without its namespaces (SandboxRefused: a
grader error the pool logs, not a score of 0), and a run whose data are code tasks stops before
it starts, naming the reason. The refusal is reproduced for real: as root, the child processes
drop CAP_SYS_ADMIN (`setpriv`, as Docker does); as an ordinary user (the user path
needs user namespaces), they run where no user namespace can be made, and the message names
every switch that enables them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from megatron_darl.rewards.sandbox import root_path
from tests.helpers import repo_env
from tests.helpers.as_user import as_user
from tests.helpers.require import SANDBOX, needs_root, require, userns_problem

TEST_UID = 1_900_000_000 + os.getpid() % 1_000_000  # a uid of its own, no name, no files

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


def test_without_namespaces_the_program_does_not_run_and_a_code_run_is_refused(tmp_path):
    needs_root("drops CAP_SYS_ADMIN from a root process with setpriv")
    require(SANDBOX, None if shutil.which("setpriv") else "needs util-linux's setpriv to drop CAP_SYS_ADMIN")
    out = _probe(NO_SYS_ADMIN, tmp_path)
    assert not out["ran"], "the program ran without namespaces (the fallback cannot stop a subprocess)"
    assert out["status"] == "refused" and "unshare(net namespace): Operation not permitted" in out["stderr"]
    assert out["graded"]["status"] == "error" and "SandboxRefused" in out["graded"]["detail"]  # the pool logs it
    assert "needs network, mount, PID, IPC and user namespaces" in out["problem"] and "SYS_ADMIN" in out["problem"]
    assert any(e.startswith("data.source: code tasks, but the code sandbox cannot run") for e in out["preflight"])
    assert out["procedural"] == []  # a run without code tasks does not need the sandbox


# an ordinary user (uid 1000, no capabilities) whose machine allows no further user namespace:
# a user namespace of our own caps its descendants at one (max_user_namespaces is counted per
# namespace, for it and every namespace below), and the nested one the user runs in takes it
NO_USERNS = ["unshare", "--user", "--map-root-user", "sh", "-c",
             'echo 1 > /proc/sys/user/max_user_namespaces && exec unshare --user --map-user=1000 --map-group=1000 "$@"',
             "sh"]


def test_without_user_namespaces_a_user_is_refused_naming_the_switches(tmp_path):
    require(SANDBOX, userns_problem())  # the probe needs a user namespace to take them away
    # as root, the namespaces are made by an unprivileged uid (made by root, their uid 1000 would
    # be the machine's root, which the sandbox refuses for another reason: no process limit binds it)
    out = _probe(as_user(TEST_UID, NO_USERNS) if root_path() else NO_USERNS, tmp_path)
    assert not out["ran"], "the program ran without its user namespace"
    assert out["status"] == "refused"
    assert "unshare(user namespace): No space left on device (ENOSPC)" in out["stderr"]
    assert out["graded"]["status"] == "error" and "SandboxRefused" in out["graded"]["detail"]  # the pool logs it
    problem = out["problem"]
    assert problem.startswith("the code sandbox cannot run a program here as uid 1000: ")
    for switch in ("sysctl -w user.max_user_namespaces=", "sysctl -w kernel.unprivileged_userns_clone=1",
                   "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0", "CLONE_NEWUSER", "as root"):
        assert switch in problem, problem
    assert any(e.startswith("data.source: code tasks, but the code sandbox cannot run a program here as uid 1000")
               for e in out["preflight"])
    assert out["procedural"] == []  # a run without code tasks does not need the sandbox
