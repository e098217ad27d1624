"""`darl-train ... launch.mode=slurm` on a real Slurm cluster (scripts/local_slurm.sh: virtual
nodes on this machine; CI brings it up): one heterogeneous job through submitit, learner ranks
spanning nodes, Ctrl-C, preemption and requeue.

- The README's command, as written: the CPU demo as one heterogeneous job, trainer component on
  one node and its darl-engine on another, exit 0, job id printed, summaries in the run folder;
  with a dead proxy exported (every scheme, no `no_proxy`), which the job inherits.
- TP=2 with one learner rank on each of two nodes (rendezvous from the Slurm environment, gloo)
  gives exactly the losses of TP=2 on one machine.
- Ctrl-C cancels the job, says so, and nothing of the run is left (processes, shared memory).
- Preemption (SIGTERM, then USR2, as submitit simulates it) checkpoints, requeues the job, and
  the requeued job resumes: every step trained once, every prompt at most once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.e2e import assert_nothing_left, new_run
from tests.helpers.network import dead_proxy_env
from tests.helpers.slurm import job_components, job_id_of, wait_job_gone

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
HET = {"mode": "slurm", "rollout_nodes": 1, "trainer": {"cpus_per_task": 1}, "rollout": {"cpus_per_task": 1}}
SYNC = {"algo": {"max_head_offpolicyness": 0, "replay": False, "sg": False, "pmis": False, "policy_loss": "ppo",
                 "old_logprob": "proximal", "ppo_n_minibatches": 2}}


def _darl_train(args: list[str], cwd: str, out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    exe = [sys.executable, "-c", "from megatron_darl.launch.cli import train; train()"]
    return subprocess.Popen(exe + args, cwd=cwd, stdout=open(out, "w"), stderr=subprocess.STDOUT,
                            env=dict(env or os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


@pytest.mark.timeout(1200)
def test_readme_command_runs_the_demo_as_one_heterogeneous_job(demo_dir, tmp_path):
    out = tmp_path / "darl.out"  # the command as the README writes it, run where configs/ is
    argv = ["--config", "configs/cpu_demo_darl.yaml", "launch.mode=slurm", "launch.rollout_nodes=1", "train.steps=6"]
    # as on an HPC site that exports a proxy on its nodes: the job inherits it, nothing may use it
    proc = _darl_train(argv, str(demo_dir), out, env=dead_proxy_env(dict(os.environ)))
    try:
        code = proc.wait(timeout=1100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert code == 0, text[-5000:]
    job = job_id_of(text)
    comps = job_components(job)
    assert [c["HetJobOffset"] for c in comps] == ["0", "1"], comps  # one heterogeneous job
    assert all(c["JobState"] == "COMPLETED" for c in comps), comps
    trainer_node, rollout_node = comps[0]["NodeList"], comps[1]["NodeList"]
    assert trainer_node != rollout_node
    run = demo_dir / "runs" / "cpu_demo"
    engine = json.loads((run / "engines" / "engine0.json").read_text())
    assert engine["node"] == rollout_node and engine["attempt"] == f"{job}.0"  # darl-engine on the other node
    assert "darl-engine: " in (run / "logs" / "engine0.log").read_text()
    learner = json.loads((run / "learner_summary.json").read_text())
    assert learner["final_version"] == 6 and learner["steps_done"] == 6
    summary = json.loads((run / "summary.json").read_text())
    assert {"accuracy_before", "accuracy_after", "gain"} <= set(summary)
    assert f"{run}/tb" in text and "finished with exit code 0" in text


@pytest.mark.timeout(900)
def test_learner_ranks_on_two_nodes_give_the_one_machine_losses(tmp_path, warm_model):
    common = dict(SYNC, parallel={"tp": 2}, train={"steps": 3})
    nodes = new_run(tmp_path, warm_model, "two_nodes", **common,
                    launch={"mode": "slurm", "trainer_nodes": 2, "learner_procs_per_node": 1, "rollout_nodes": 0,
                            "trainer": {"cpus_per_task": 1}})
    local = new_run(tmp_path, warm_model, "one_machine", **common, launch={"learner_procs_per_node": 2})
    try:
        for r in (nodes, local):
            r.start()
        for r in (nodes, local):
            assert r.wait(800) == 0, r.output()[-5000:]
    finally:
        for r in (nodes, local):
            r.kill()
    comps = job_components(job_id_of(nodes.output()))
    assert len(comps) == 1 and comps[0]["NodeList"] in ("node[1-2]", "node[2-3]", "node[1,3]"), comps
    info = nodes.run_info()
    assert info["learner_world"] == 2 and info["master_port"] == 0  # rank 0 bound one and published it:
    published = json.loads(Path(info["engines_dir"], f"rendezvous.{info['attempt']}.json").read_text())
    assert published["port"] > 0 and published["addr"] == info["master_addr"]
    a, b = ({m["step"]: m for m in r.metrics()} for r in (nodes, local))
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in range(3):
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    assert any(a[s]["train/grad_norm"] > 0 for s in range(3)), "all-zero gradients prove nothing"
    assert nodes.ledger() == local.ledger()


@pytest.mark.timeout(600)
def test_ctrl_c_cancels_the_job_and_leaves_nothing(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "cancel", algo={"max_head_offpolicyness": 1}, train={"steps": 200},
                  launch=HET)
    try:
        run.start()
        run.wait_for(lambda: len(run.ledger()) >= 1, 400, "a trained step")
        job = job_id_of(run.output())
        run_id = run.run_info()["run_id"]
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"darl-{run_id}-")], "no shared memory in use?"
        before = _signal_state(run.proc.pid)  # for the failure message: how the launcher takes SIGINT
        os.kill(run.proc.pid, signal.SIGINT)  # the user's Ctrl-C
        code = run.wait(200)
        out = run.output()
        assert code == 130 and f"job {job} cancelled" in out, (
            f"exit {code}; launcher before the signal: {before}\n{out[-4000:]}\n"
            f"session log:\n{_tail(Path(run.run_dir) / 'slurm' / f'{job}_0_log.out')}")
        assert set(wait_job_gone(job)) == {"CANCELLED"}
        assert {c["Restarts"] for c in job_components(job)} == {"0"}  # cancelled, not requeued as if preempted
        assert len(run.ledger()) < 200
        assert_nothing_left(run, run_id, timeout_s=90)
    finally:
        run.kill()


def _signal_state(pid: int) -> str:
    """The command line and signal masks (/proc/PID/status SigBlk, SigIgn, SigCgt) of a process."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        masks = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                 if line.startswith(("State", "SigBlk", "SigIgn", "SigCgt"))]
    except OSError as exc:
        return f"pid {pid}: {exc}"
    return f"pid {pid} `{cmd.strip()}` " + ", ".join(masks)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as exc:
        return f"({exc})"


def _release_when_requeued(run, job: str, timeout_s: float) -> None:
    """Slurm holds a requeued batch job for about two minutes before it may start again
    (Reason=BeginTime); make it eligible at once, to keep the test short."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.proc.poll() is None:
        comps = job_components(job)
        if comps and all(c.get("JobState") == "PENDING" and c.get("Reason") == "BeginTime" for c in comps):
            for c in comps:
                subprocess.run(["scontrol", "update", f"JobId={c['JobId']}", "StartTime=now"], timeout=60, check=True)
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job} was not requeued within {timeout_s} s:\n{run.output()[-4000:]}")


@pytest.mark.timeout(900)
def test_preempted_job_requeues_and_resumes_from_its_checkpoint(tmp_path, warm_model):
    steps = 20  # far more than are done when the signals come: the run must not finish first
    run = new_run(tmp_path, warm_model, "requeue", algo={"max_head_offpolicyness": 1}, train={"steps": steps},
                  checkpoint={"every_steps": 0}, launch=HET)
    try:
        run.start()
        run.wait_for(lambda: len(run.ledger()) >= 2, 400, "two trained steps")
        job = job_id_of(run.output())
        for sig in ("TERM", "USR2"):  # what Slurm sends on preemption / before the time limit
            subprocess.run(["scancel", f"--signal={sig}", job], check=True, timeout=60)
        _release_when_requeued(run, job, 300)
        code = run.wait(700)
        out = run.output()
        assert code == 0, out[-5000:]
        assert "requeueing the job" in out and f"job {job} finished with exit code 0" in out, out[-5000:]
        assert run.run_info()["attempt"] == f"{job}.1"  # the second attempt finished the run
    finally:
        run.kill()
    ledger = run.ledger()
    assert [r["step"] for r in ledger] == list(range(steps)), [r["step"] for r in ledger]
    ids = [u for r in ledger for u in r["prompt_ids"]]
    assert len(ids) == len(set(ids)), "a prompt was trained twice across the requeue"
    summary = json.loads(Path(run.run_dir, "learner_summary.json").read_text())
    assert summary["final_version"] == steps and 0 < summary["steps_done"] < steps  # resumed, not restarted
    ckpts = sorted(p.name for p in Path(run.run_dir, "checkpoints").glob("step_*") if p.is_dir())
    assert ckpts and int(ckpts[-1][5:]) == steps - summary["steps_done"]
