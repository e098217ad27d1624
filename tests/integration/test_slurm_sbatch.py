"""The sbatch scripts in slurm/ on a real Slurm cluster: every one is a valid job for it
(`sbatch --test-only`), and the generic one runs the README's line (the CPU demo, 6 steps) to
completion as a heterogeneous job (trainer node : rollout node) through the same entry points
as darl-train."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers import REPO
from tests.helpers.slurm import job_components, run_sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))


def test_there_are_the_three_recipes():
    assert {p.name for p in SCRIPTS} >= {"darl.sbatch", "qwen3_4b_hetjob.sbatch", "qwen3_4b_one_node.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_is_a_valid_job(script, tmp_path):
    out = subprocess.run(["sbatch", "--test-only", f"--output={tmp_path}/x-%j.out", str(script),
                          "configs/cpu_demo_darl.yaml"], cwd=str(REPO), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "to start at" in out.stderr, out.stderr


@pytest.mark.timeout(1200)
def test_generic_script_runs_the_readme_line_as_a_heterogeneous_job(demo_dir):
    one = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1"]  # the README's line, run where it says
    res = run_sbatch([*one, ":", *one, "slurm/darl.sbatch", "configs/cpu_demo_darl.yaml", "train.steps=6"],
                     cwd=str(demo_dir), timeout_s=1100)
    job = res.stdout.split()[-1]
    log = (demo_dir / f"slurm-darl-{job}.out").read_text()
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}\n{log[-5000:]}"
    comps = job_components(job)
    assert [c["HetJobOffset"] for c in comps] == ["0", "1"] and comps[0]["NodeList"] != comps[1]["NodeList"]
    run = demo_dir / "runs" / "cpu_demo"
    info = json.loads((run / "run_info.json").read_text())
    assert info["attempt"] == f"{job}.0"
    engine = json.loads((run / "engines" / "engine0.json").read_text())
    assert engine["attempt"] == info["attempt"] and engine["node"] == comps[1]["NodeList"]  # on the rollout node
    summary = json.loads((run / "learner_summary.json").read_text())
    assert summary["final_version"] == 6 and summary["steps_done"] == 6
    assert "accuracy_after" in json.loads((run / "summary.json").read_text())
    leftover = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True).stdout.split()
    assert not leftover and not [n for n in os.listdir("/dev/shm") if n.startswith(f"darl-{info['run_id']}-")]
