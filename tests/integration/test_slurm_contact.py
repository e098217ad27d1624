"""What a real Slurm cluster meets first, on a real Slurm cluster: every task the jobs start gets
the CPUs its component asked for, and a job sbatch refuses comes back in sbatch's own words.

Slurm 22.05-23.02 (the local test cluster runs 22.05) do not pass the job's `--cpus-per-task` on
to `srun`: a step without the flag gives each task one CPU, so 8 SGLang servers (or the manager,
its reward workers and learner 0) would share one core. Each test runs a real job whose
interpreter is a recorder: it writes the `SLURM_CPUS_PER_TASK` each entry point sees, and runs
everything else with the real Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_darl.config import load_config
from megatron_darl.launch.slurm import job_script
from tests.helpers import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def _recorder(tmp_path: Path) -> tuple[Path, Path]:
    record = tmp_path / "record.txt"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
case "$*" in
  *megatron_darl.launch.*) echo "${{SLURM_CPUS_PER_TASK:-unset}} $*" >> {record}; exit 0;;
  *"import sglang"*) exit 0;;  # the scripts' SGLang version check
esac
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    return fake, record


def _seen(record: Path) -> dict[str, set[str]]:
    """Entry point -> the SLURM_CPUS_PER_TASK values its tasks saw."""
    out: dict[str, set[str]] = {}
    for line in record.read_text().splitlines():
        cpus, rest = line.split(" ", 1)
        role = "engine_host" if "launch.engine_host" in rest else "trainer"
        out.setdefault(role, set()).add(cpus)
    return out


def _sbatch(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--wait", f"--output={cwd}/job-%j.out", *args], cwd=str(cwd),
                          capture_output=True, text=True, timeout=280, env={**os.environ, **env})


def _log(cwd: Path) -> str:
    return "\n".join(p.read_text() for p in cwd.glob("job-*.out"))


@pytest.mark.timeout(300)
def test_generated_job_gives_each_component_its_cpus(tmp_path):
    fake, record = _recorder(tmp_path)
    cfg = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path / 'run'}", "launch.mode=slurm",
                             "launch.rollout_nodes=1", "launch.learner_procs_per_node=2", f"launch.python={fake}",
                             "launch.trainer={cpus_per_task: 3, time_min: 5}",
                             "launch.rollout={cpus_per_task: 5, time_min: 5}"])
    script = tmp_path / "job.sh"
    # the trainer command: what submitit would run, with the recorder as its interpreter
    script.write_text(job_script(cfg, tmp_path, f"{fake} -m megatron_darl.launch.slurm_job"))
    res = _sbatch([str(script)], tmp_path, {})
    assert res.returncode == 0, res.stderr + _log(tmp_path)
    assert _seen(record) == {"engine_host": {"5"}, "trainer": {"3"}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,args,expected", [
    ("darl.sbatch", ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=3", ":", "--nodes=1",
                     "--ntasks-per-node=1", "--cpus-per-task=5"], {"engine_host": {"5"}, "trainer": {"3"}}),
    ("qwen3_4b_hetjob.sbatch", ["--time=5"], {"engine_host": {"96"}, "trainer": {"12"}}),
    ("qwen3_4b_one_node.sbatch", ["--time=5"], {"trainer": {"24"}}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_sbatch_scripts_give_each_component_its_cpus(tmp_path, script, args, expected):
    fake, record = _recorder(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    extra = ["configs/cpu_demo_darl.yaml", f"train.run_dir={tmp_path / 'run'}"] if script == "darl.sbatch" else []
    res = _sbatch([*args, str(REPO / "slurm" / script), *extra], tmp_path,
                  {"PYTHON": str(fake), "SGLANG_PYTHON": str(fake), "RUN_DIR": str(tmp_path / "run")})
    assert res.returncode == 0, res.stderr + _log(tmp_path)
    assert _seen(record) == expected, _log(tmp_path)


def test_sbatch_errors_come_back_as_its_own_words(tmp_path, capsys):
    """Before, a job sbatch refused came back as submitit's traceback."""
    from megatron_darl.launch.slurm import run_slurm

    cfg = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path / 'run'}", "launch.mode=slurm",
                             "launch.trainer={partition: no_such_partition}"])
    assert run_slurm(cfg) == 1
    err = capsys.readouterr().err
    assert "darl-train: sbatch refused the job" in err and "invalid partition" in err.lower(), err
    assert "Traceback" not in err
