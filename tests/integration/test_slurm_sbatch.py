"""The sbatch scripts in slurm/ on a real Slurm cluster: every one is a valid job for it
(`sbatch --test-only`), and the generic one runs a config to completion as a heterogeneous job
(trainer node : rollout node, the README's resource line) through the same entry points as
darl-train. The config is the end-to-end harness's small run (2 steps of the warm-started tiny
model, no evaluation): the demo recipe as one heterogeneous job is the README's darl-train
command, run literally by test_slurm_jobs.py; running it twice proved the same placement."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers import REPO
from tests.helpers.e2e import new_run
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


@pytest.mark.timeout(900)
def test_generic_script_runs_a_config_as_a_heterogeneous_job(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "sbatch", train={"steps": 2})
    one = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1"]  # the README's resource line
    res = run_sbatch([*one, ":", *one, str(REPO / "slurm" / "darl.sbatch"), run.config], cwd=str(tmp_path),
                     timeout_s=800)
    job = res.stdout.split()[-1]
    log = (tmp_path / f"slurm-darl-{job}.out").read_text()
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}\n{log[-5000:]}"
    comps = job_components(job)
    assert [c["HetJobOffset"] for c in comps] == ["0", "1"] and comps[0]["NodeList"] != comps[1]["NodeList"]
    info = json.loads(open(os.path.join(run.run_dir, "run_info.json")).read())
    assert info["attempt"] == f"{job}.0"
    engine = json.loads(open(os.path.join(run.run_dir, "engines", "engine0.json")).read())
    assert engine["attempt"] == info["attempt"] and engine["node"] == comps[1]["NodeList"]  # on the rollout node
    summary = json.loads(open(os.path.join(run.run_dir, "learner_summary.json")).read())
    assert summary["final_version"] == 2 and summary["steps_done"] == 2
    leftover = subprocess.run(["pgrep", "-f", run.run_dir], capture_output=True, text=True).stdout.split()
    assert not leftover and not [n for n in os.listdir("/dev/shm") if n.startswith(f"darl-{info['run_id']}-")]
