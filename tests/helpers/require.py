"""What a test needs of the machine, as a skip with its reason or, where a switch says the
machine must have it, a failure.

What it is: `require(switch, problem)`: nothing when `problem` is None; else the calling test
skips saying `problem`, or FAILS where the environment sets `switch` to 1. The switches CI sets
(.ci/run): DARL_REQUIRE_SLURM (tests/helpers/slurm.py), DARL_REQUIRE_NETWORK (network.py),
DARL_REQUIRE_SANDBOX (sandbox.py, and the sandbox tests' own checks of namespaces) and
DARL_REQUIRE_MOUNTS (private mount namespaces as root: a read-only bind mount, a small tmpfs:
`mounts_problem`). A test that needs root skips as an ordinary user whatever the switches (that
is a property of the pass, not of the machine): the restricted passes list those skips
(tests/expected_skips/).
What it is not: the probes themselves (each check says what it tried).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

MOUNTS = "DARL_REQUIRE_MOUNTS"
SANDBOX = "DARL_REQUIRE_SANDBOX"


def require(switch: str, problem: str | None) -> None:
    """Skip the calling test with `problem`, or fail it where `switch`=1; nothing if None."""
    if problem is None:
        return
    if os.environ.get(switch) == "1":
        pytest.fail(f"{switch}=1 but {problem}", pytrace=False)
    pytest.skip(problem)


def needs_root(what: str) -> None:
    """Skip (never fail) as an ordinary user: `what` needs root."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: {what}")


@functools.cache
def mounts_problem() -> str | None:
    """Why root cannot make a private mount namespace with a tmpfs here, or None."""
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare for a private mount namespace"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", "/mnt"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"mount namespaces refused here: {probe.stderr.strip()}"


@functools.cache
def userns_problem() -> str | None:
    """Why this process cannot make a user namespace here, or None."""
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare for a user namespace"
    probe = subprocess.run(["unshare", "--user", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"user namespaces refused here: {probe.stderr.strip()}"


def require_mounts(what: str) -> None:
    """As root, with private mounts (DARL_REQUIRE_MOUNTS=1: required); as a user, a skip."""
    needs_root(what)
    require(MOUNTS, mounts_problem())
