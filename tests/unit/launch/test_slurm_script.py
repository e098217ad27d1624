"""The Slurm job the launcher submits: one batch script, heterogeneous with rollout nodes, each
component with its own resources; and the placement checks made before submitting."""

from __future__ import annotations

from pathlib import Path

from megatron_darl.config import load_config
from megatron_darl.launch.slurm import job_script, overall, slurm_problems


def _script(*overrides: str) -> str:
    cfg = load_config(None, ["model.hf_dir=/m", "train.run_dir=/shared/run", "launch.mode=slurm", *overrides])
    return job_script(cfg, Path("/shared/run/slurm"), "python -u -m submitit.core._submit /shared/run/slurm")


def _components(script: str) -> list[list[str]]:
    """The #SBATCH options of each het component (split at `#SBATCH hetjob`)."""
    parts: list[list[str]] = [[]]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            parts.append([])
        elif line.startswith("#SBATCH --"):
            parts[-1].append(line[len("#SBATCH --"):])
    return parts


def test_heterogeneous_job_with_resources_per_component():
    s = _script("launch.trainer_nodes=2", "launch.rollout_nodes=3", "rollout.num_engines=24",
                "launch.learner_procs_per_node=8", "launch.trainer={partition: train, account: rl, qos: high, "
                "time_min: 600, gpus_per_node: 8, cpus_per_task: 12, mem_gb: 900, extra: {constraint: h100}}",
                "launch.rollout={partition: infer, gpus_per_node: 8, cpus_per_task: 96, time_min: 590}",
                "launch.signal_before_s=300")
    trainer, rollout = _components(s)
    assert {"nodes=2", "ntasks-per-node=8", "partition=train", "account=rl", "qos=high", "time=600",
            "gpus-per-node=8", "cpus-per-task=12", "mem=900G", "constraint=h100", "signal=USR2@300",
            "requeue"} <= set(trainer)
    assert set(rollout) == {"nodes=3", "ntasks-per-node=1", "partition=infer", "gpus-per-node=8",
                            "cpus-per-task=96", "time=590"}
    assert "srun --het-group=1" in s and "-m megatron_darl.launch.engine_host" in s
    assert "srun --het-group=0" in s and "-m submitit.core._submit /shared/run/slurm" in s
    assert s.index("--het-group=1") < s.index("--het-group=0")  # engines first, in the background
    assert 'echo "$ATTEMPT" > "$RUN_DIR/engines/stop"' in s and s.rstrip().endswith('exit "$rc"')


def test_one_component_without_rollout_nodes():
    s = _script("launch.setup=[module load cuda, source /env/bin/activate]")
    assert "hetjob" not in s and "--het-group" not in s and "engine_host" not in s
    assert len(_components(s)) == 1
    assert "module load cuda\nsource /env/bin/activate\n" in s


def test_placement_problems_name_their_keys():
    def problems(*o):
        return slurm_problems(load_config(None, ["model.hf_dir=/m", "launch.mode=slurm", *o]))

    assert problems("launch.rollout_nodes=1", "rollout.num_engines=2") == []
    assert any("rollout.num_engines=3 must divide" in p for p in problems("launch.rollout_nodes=2",
                                                                         "rollout.num_engines=3"))
    assert any("launch.rollout.gpus_per_node" in p for p in problems("launch.rollout_nodes=1",
                                                                     "rollout.backend=sglang"))
    assert any("weight_sync=shm" in p for p in problems("launch.rollout_nodes=1", "rollout.weight_sync=shm"))
    assert any("launch.rollout_nodes=0" in p for p in problems("launch.rollout_nodes=1", "rollout.backend=sglang",
                                                                 "rollout.engine_urls=[http://h:1]"))
    assert any("launch.stop_timeout_s=300 > launch.signal_before_s=120" in p for p in problems(
        "launch.signal_before_s=120"))  # the checkpoint started at Slurm's warning would be killed
    assert any("GPUs left by the learners" in p for p in problems(
        "rollout.backend=sglang", "launch.trainer.gpus_per_node=8", "launch.learner_procs_per_node=6",
        "rollout.num_engines=4"))


def test_config_checks_gpus_per_learner():
    from megatron_darl.config import ConfigError

    for bad, key in ((["launch.rollout_nodes=1", "launch.trainer.gpus_per_node=8", "launch.learner_procs_per_node=4"],
                      "launch.learner_procs_per_node: one learner rank per GPU"),
                     (["launch.trainer_nodes=2"], "launch.trainer_nodes: a local run has one node")):
        try:
            load_config(None, ["model.hf_dir=/m", *bad])
        except ConfigError as exc:
            assert key in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")


def test_overall_state_of_the_components():
    assert overall(["RUNNING", "COMPLETED"]) == "RUNNING"
    assert overall(["COMPLETED", "COMPLETED"]) == "COMPLETED"
    assert overall(["CANCELLED", "COMPLETED"]) == "CANCELLED"
    assert overall(["COMPLETED", "FAILED"]) == "FAILED"
    assert overall(["REQUEUED", "CANCELLED"]) == "REQUEUED"
    assert overall([]) == "UNKNOWN"


def _srun_lines(script: str) -> list[str]:
    """Each srun command of a bash script, continuation lines joined."""
    joined = script.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("srun ")]


def test_every_srun_names_its_cpus():
    """Slurm 22.05-23.02 do not pass the job's --cpus-per-task on to srun: every task would be
    pinned to one core (8 SGLang servers, or the manager with its reward workers)."""
    s = _script("launch.rollout_nodes=1", "launch.trainer={cpus_per_task: 12}", "launch.rollout={cpus_per_task: 96}")
    engines, learners = _srun_lines(s)
    assert "--het-group=1 --cpus-per-task=96" in engines and "--het-group=0 --cpus-per-task=12" in learners
    (one,) = _srun_lines(_script("launch.trainer={cpus_per_task: 7}"))
    assert "--cpus-per-task=7" in one


def test_every_srun_of_the_sbatch_scripts_names_its_cpus():
    scripts = sorted((Path(__file__).resolve().parents[3] / "slurm").glob("*.sbatch"))
    assert len(scripts) >= 3
    for path in scripts:
        lines = _srun_lines(path.read_text())
        assert lines and all("--cpus-per-task=" in line for line in lines), (path.name, lines)


def test_engines_beside_learners_take_the_gpus_the_learners_leave(monkeypatch):
    import pytest

    from megatron_darl.launch.slurm_job import SlurmPlacement, SlurmTask

    cfg = load_config(None, ["model.hf_dir=/m", "launch.mode=slurm", "launch.rollout_nodes=0",
                             "launch.learner_procs_per_node=4", "launch.trainer={gpus_per_node: 8}"])
    placement = SlurmPlacement(cfg, None, SlurmTask(0, 4, 0, 4, "1", "1.0"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert placement.engine_gpus() == ["4", "5", "6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # --gpus-per-task=1: rank 0's task sees its own GPU only
    with pytest.raises(RuntimeError, match="sees 1 of launch.trainer.gpus_per_node=8.*--gpus-per-node"):
        placement.engine_gpus()


def test_a_node_local_run_folder_is_refused_before_submission(monkeypatch):
    from megatron_darl.launch.slurm import run_dir_problem

    cluster = ["gpu01", "gpu02"]
    assert "node-local (under /tmp)" in run_dir_problem("/tmp/runs/x", cluster)
    assert "train.run_dir=/dev/shm/r" in run_dir_problem("/dev/shm/r", cluster)
    monkeypatch.setenv("TMPDIR", "/scratch/job7")
    assert "under /scratch/job7" in run_dir_problem("/scratch/job7/run", cluster)
    assert run_dir_problem("/work/runs/x", cluster) is None
    assert run_dir_problem("/tmp/runs/x", ["localhost"]) is None  # every node is this machine: nothing is local


def test_the_trainer_task_prepares_a_packaged_model_as_darl_train_does(capsys, tmp_path):
    """`package:` names are resolved in the Slurm task too (it once passed them on as a path):
    an unknown one is refused before anything starts, naming the key."""
    from megatron_darl.launch import slurm_job

    rc = slurm_job.main(["--config", "configs/cpu_smollm2_word_problems_darl.yaml", "model.hf_dir=package:nope",
                         f"train.run_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot prepare model.hf_dir=package:nope" in err and "unknown packaged model" in err, err
