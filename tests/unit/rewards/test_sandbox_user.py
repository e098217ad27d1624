"""The sandbox's tests pass as an ordinary user, also in a test pass that runs as root.

Cluster jobs run as the submitting user, never root. The containment tests run along the user
path ("userns" in their ids) natively where pytest runs as a user (.ci/restricted_pass nonroot);
as root, the path is the root one, so this test runs every userns test again as an unprivileged
uid (tests/helpers/as_user.py: no groups, no capabilities, the interpreter reachable) with
DARL_REQUIRE_SANDBOX=1, where none may skip: CI's root pass covers both paths. Root of a user
namespace (a rootless container: enroot, podman) is an ordinary user to the kernel: it takes the
user path too, with its process limit, unless the namespace maps it to the machine's root, which
no process limit binds: refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO, repo_env
from tests.helpers.as_user import as_user, user_folder
from tests.helpers.require import SANDBOX, require, userns_problem
from tests.helpers.sandbox import ROOT

# every test of the user path: those with a userns case, and the pool killing a hung program's worker
USERNS_TESTS = ["tests/unit/rewards/test_sandbox.py", "tests/faults/test_sandbox.py",
                "tests/unit/rewards/test_sandbox_isolation.py", "tests/unit/rewards/test_sandbox_calls.py",
                "tests/unit/rewards/test_reward_hacks.py", "tests/unit/rewards/test_exact_answers.py",
                "tests/unit/rewards/test_sandbox_quotas.py", "tests/unit/rewards/test_relay_bounds.py",
                "tests/unit/rewards/test_pool.py::test_hung_program_killed_with_its_worker"]
TEST_UID = 1_900_000_000 + os.getpid() % 1_000_000  # a uid of its own, no name, no files


@pytest.mark.timeout(1500)
def test_userns_tests_pass_as_an_unprivileged_uid():
    if not ROOT:
        pytest.skip(f"becomes another uid, which needs root; as uid {os.geteuid()} the userns tests "
                    "run in this session")
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "userns or hung_program", *USERNS_TESTS]
    listed = subprocess.run([sys.executable, *pytest_args, "--collect-only"], cwd=REPO, env=repo_env(),
                            capture_output=True, text=True, timeout=300)
    selected = [line for line in listed.stdout.splitlines() if "::" in line]
    assert len(selected) >= 33, listed.stdout[-3000:]
    base = user_folder(TEST_UID, "darl-userns-tests-")
    try:
        done = subprocess.run(as_user(TEST_UID, [sys.executable, *pytest_args, f"--basetemp={base}/pytest"]),
                              cwd=REPO, capture_output=True, text=True, timeout=1440,
                              env=repo_env(DARL_REQUIRE_SANDBOX="1", HOME=base, OMP_NUM_THREADS="1"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    # every selected test passed: none skipped, none failed
    assert re.search(rf"^{len(selected)} passed, \d+ deselected in ", out, re.MULTILINE), out[-6000:]


FAKE_ROOT = """
import json, os
from megatron_darl.rewards.sandbox import SandboxLimits, SandboxRefused, root_path, run_sandboxed
fork = '''
import os, time
made = 0
for _ in range(64):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(1)
        os._exit(0)
    made += 1
print(os.getuid(), made)
'''
try:
    r = run_sandboxed(fork, "", SandboxLimits(cpu_s=2, wall_s=30, memory_mb=512, max_procs=8))
    out = {"status": r.status, "isolation": list(r.isolation), "stdout": r.stdout, "stderr": r.stderr}
except SandboxRefused as exc:
    out = {"status": "refused", "stderr": str(exc)}
print(json.dumps({"euid": os.geteuid(), "root_path": root_path(), **out}))
"""


def _as_namespace_root(prefix: list[str]) -> dict:
    """FAKE_ROOT's answer, run as root of a fresh user namespace (`unshare --map-root-user`)."""
    command = [*prefix, "unshare", "--user", "--map-root-user", sys.executable, "-c", FAKE_ROOT]
    done = subprocess.run(command, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_root_of_a_user_namespace_takes_the_user_path():
    require(SANDBOX, userns_problem())  # a machine that refuses them: test_sandbox_refusal.py
    # as root, the namespace is made by an unprivileged uid: its root is that uid to the kernel
    out = _as_namespace_root(as_user(TEST_UID, []) if ROOT else [])
    assert (out["euid"], out["root_path"]) == (0, False)
    assert out["status"] == "ok", out
    assert "user" in out["isolation"]
    uid, made = out["stdout"].split()
    assert uid == "1000" and 1 <= int(made) <= 7  # the process limit holds (8, the program included)
    if ROOT:  # made by the machine's root, its root is uid 0: exempt from RLIMIT_NPROC, refused
        out = _as_namespace_root([])
        assert out["status"] == "refused" and "is exempt from RLIMIT_NPROC here" in out["stderr"], out
