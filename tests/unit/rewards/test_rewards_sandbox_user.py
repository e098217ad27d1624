"""Issue 33: the sandbox's tests pass as an ordinary user, also in a test pass that runs as root.

Cluster jobs run as the submitting user, never root. The containment tests run along the user
path ("userns" in their ids) natively where pytest runs as a user (.ci/restricted_pass nonroot);
as root, the path is the root one, so this test runs every userns test again as an unprivileged
uid (tests/helpers/as_user.py: no groups, no capabilities, the interpreter reachable) with
DARL_REQUIRE_SANDBOX=1, where none may skip: CI's root pass covers both paths.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO, repo_env
from tests.helpers.as_user import as_user, user_folder

# every test of the user path: those with a userns case, and the pool killing a hung program's worker
USERNS_TESTS = ["tests/unit/rewards/test_rewards_sandbox.py", "tests/faults/test_faults_sandbox.py",
                "tests/unit/rewards/test_rewards_pool.py::test_hung_program_killed_with_its_worker"]
TEST_UID = 1_900_000_000 + os.getpid() % 1_000_000  # a uid of its own, no name, no files


@pytest.mark.timeout(900)
def test_userns_tests_pass_as_an_unprivileged_uid():
    if os.geteuid() != 0:
        pytest.skip(f"becomes another uid, which needs root; as uid {os.geteuid()} the userns tests "
                    "run in this session")
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "userns or hung_program", *USERNS_TESTS]
    listed = subprocess.run([sys.executable, *pytest_args, "--collect-only"], cwd=REPO, env=repo_env(),
                            capture_output=True, text=True, timeout=300)
    selected = [line for line in listed.stdout.splitlines() if "::" in line]
    assert len(selected) >= 15, listed.stdout[-3000:]
    base = user_folder(TEST_UID, "darl-userns-tests-")
    try:
        done = subprocess.run(as_user(TEST_UID, [sys.executable, *pytest_args, f"--basetemp={base}/pytest"]),
                              cwd=REPO, capture_output=True, text=True, timeout=840,
                              env=repo_env(DARL_REQUIRE_SANDBOX="1", HOME=base, OMP_NUM_THREADS="1"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    # every selected test passed: none skipped, none failed
    assert re.search(rf"^{len(selected)} passed, \d+ deselected in ", out, re.MULTILINE), out[-6000:]
