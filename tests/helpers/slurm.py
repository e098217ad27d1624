"""Helpers of the Slurm tests: the cluster they need, and what a job leaves behind.

What it is: `slurm_cluster` (a fixture: a reachable Slurm controller with at least two idle
nodes; without one the tests skip saying why, or FAIL when DARL_REQUIRE_SLURM=1, as CI sets it
after `scripts/local_slurm.sh up`), `job_id_of(output)`, `job_components` (each component's
state and node list, from `scontrol`), `wait_job_gone`, `run_sbatch`, and `demo_dir`: a folder
holding `configs/` and `slurm/` of this repository, where the README's commands run as written
(the demo's warm start, cached in `runs/cpu_demo/model`, is made once for all of them).
What it is not: the cluster itself (`scripts/local_slurm.sh` brings one up) or a test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

REQUIRE = os.environ.get("DARL_REQUIRE_SLURM") == "1"


def cluster_problem() -> str | None:
    """Why there is no usable cluster here, or None."""
    for tool in ("sbatch", "sinfo", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            return f"no Slurm client ({tool} not on PATH); scripts/local_slurm.sh up makes a local cluster"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s (no Slurm controller reachable: SLURM_CONF?)"
    if out.returncode != 0:
        return f"no Slurm controller answers (sinfo: {out.stderr.strip()[:200]}); scripts/local_slurm.sh up"
    usable = {line.split()[0] for line in out.stdout.splitlines()
              if line.split()[1].rstrip("*~#$@^-") in ("idle", "mix", "alloc")}
    if len(usable) < 2:
        return f"the Slurm tests need 2 usable nodes (heterogeneous jobs); sinfo says {out.stdout.split()}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    why = cluster_problem()
    if why is not None:
        if REQUIRE:
            pytest.fail(f"DARL_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo")
    for name in ("configs", "slurm"):
        (d / name).symlink_to(REPO / name)
    return d


def job_id_of(output: str) -> str:
    m = re.search(r"submitted Slurm job (\d+)", output)
    assert m, f"no job id printed:\n{output[-3000:]}"
    return m.group(1)


def job_components(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job` fields of each component (one for a plain job)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    rows = []
    for line in out.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        rows.append(fields)
    return sorted(rows, key=lambda f: int(f.get("HetJobOffset", "0")))


def wait_job_gone(job_id: str, timeout_s: float = 120) -> list[str]:
    """Until no component of the job is pending, running or completing; its final states."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [c.get("JobState", "") for c in job_components(job_id)]
        if not any(s in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED") for s in states):
            return states
        assert time.monotonic() < deadline, f"job {job_id} still {states} after {timeout_s} s"
        time.sleep(1)


def run_sbatch(args: list[str], cwd: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`sbatch --wait ARGS`: returns when the job ended, with the job's exit code. The job runs
    this test's Python (the scripts' PYTHON variable)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    return subprocess.run(["sbatch", "--wait", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env=env)
