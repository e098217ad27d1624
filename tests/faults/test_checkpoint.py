"""Learner side: a checkpoint that cannot be written fails at once, with its cause.

Probes: the checkpoints folder not writable (the run froze 10 minutes, then failed with a
misleading "did not save its state within 600 s"), and the disk full (the run failed with
`unexpected pos 704 vs 598`, no word of disk space, and left `step_*.tmp` and an orphan
`step_*.rollout.json`). Now: an unwritable folder is refused before the run starts; a save that
fails names the real cause ("not writable", "no space left on device", the rollout manager's own
error) without waiting out a timeout, and leaves no partial file behind, previous checkpoints
intact. The read-only folder and the full disk are real (a read-only bind mount and a small
tmpfs in a private mount namespace: root, as CI runs; skipped with the reason elsewhere, failed
where DARL_REQUIRE_MOUNTS=1 and root cannot mount).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from megatron_darl.channel.json_files import write_json_atomic
from megatron_darl.channel.weight_notice import RolloutStatus, read_notice, write_status
from megatron_darl.trainer.checkpoints import RunCheckpointer, rollout_sidecar
from tests.helpers.require import require_mounts


@pytest.fixture
def mounts_here() -> None:
    """Root with private mount namespaces (DARL_REQUIRE_MOUNTS=1: required), else a skip."""
    require_mounts("mounts a read-only folder and a small tmpfs in a private mount namespace")


needs_mounts = pytest.mark.usefixtures("mounts_here")


# ---- the learner's save, with stand-ins for the learner, the replay feed and the manager ----

class Publisher:
    """The notice the manager reads; `notify` is what the checkpointer calls."""

    def __init__(self, notice: str):
        self.notice = notice

    def notify(self, **fields):
        write_json_atomic(self.notice, {"weights": None, "stop": False, "state_request": None, **fields})


class Feed:
    received = 0

    def drain_to(self, count, step, alive, timeout_s):
        self.received = count

    def state_dict(self):
        return {"received": self.received}


class Learner:
    """Saves like learner/checkpoint.py (a `.tmp` folder renamed into place) or fails midway."""

    is_main = True

    def __init__(self, failure: BaseException | None = None):
        self.failure = failure

    def save(self, path, extra):
        tmp = path + ".tmp"
        os.makedirs(tmp)
        with open(os.path.join(tmp, "common.pt"), "wb") as fh:
            fh.write(b"0" * 1000)
        if self.failure is not None:
            raise self.failure
        os.rename(tmp, path)


class Manager(threading.Thread):
    """Answers state requests as the rollout manager does, or reports `error` in its status."""

    def __init__(self, notice: str, status: str, error: str | None = None):
        super().__init__(daemon=True)
        self.notice, self.status, self.error, self.stop = notice, status, error, threading.Event()
        write_status(status, RolloutStatus(version=0))

    def run(self):
        answered = None
        while not self.stop.wait(0.02):
            n = read_notice(self.notice)
            if n is None or not n.state_request or n.state_request == answered:
                continue
            answered = n.state_request
            if self.error:  # the field the manager's status carries when its write failed
                write_json_atomic(self.status, {**RolloutStatus(version=0).to_json(), "error": self.error})
                continue
            write_json_atomic(n.state_request, {"counters": {"groups_written": 3}})
            write_status(self.status, RolloutStatus(version=0, groups_written=3, state_path=n.state_request))


def checkpointer(tmp_path, ckpt_dir, learner, error=None):
    notice, status = str(tmp_path / "notice.json"), str(tmp_path / "status.json")
    manager = Manager(notice, status, error)
    manager.start()
    ckpt = RunCheckpointer(learner, Feed(), Publisher(notice), str(ckpt_dir), status, group_size=4, keep_last=2,
                           alive=lambda: None)
    return ckpt, manager


def leftovers(ckpt_dir) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(ckpt_dir), "step_*"))
                  if not os.path.isdir(p) or not p.endswith(tuple("0123456789")))


def test_a_good_save_still_writes_the_checkpoint_and_its_rollout_state(tmp_path):
    ckpt, manager = checkpointer(tmp_path, tmp_path / "ckpt", Learner())
    try:
        path = ckpt.save(2)
    finally:
        manager.stop.set()
    assert os.path.isdir(path) and json.load(open(rollout_sidecar(path)))["counters"]["groups_written"] == 3
    assert leftovers(tmp_path / "ckpt") == ["step_00000002.rollout.json"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failure, words", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device writing checkpoint"),
    (PermissionError(errno.EACCES, "Permission denied"), "is not writable"),
    (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), "was not saved"),
    # what dist_checkpointing raised on the full disk: a BaseException, without errno
    (CheckpointException("write", {0: (RuntimeError("Worker failure: unexpected pos 704 vs 598"),
                                       traceback.StackSummary())}), "no space left on device"),
])
def test_a_failed_save_names_its_cause_and_leaves_nothing_behind(tmp_path, failure, words, monkeypatch):
    ckpt_dir = tmp_path / "ckpt"
    if isinstance(failure, CheckpointException):  # the disk is full when it fails
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=0))
    good, manager = checkpointer(tmp_path, ckpt_dir, Learner())
    good.save(1)
    manager.stop.set()
    ckpt, manager = checkpointer(tmp_path, ckpt_dir, Learner(failure))
    try:
        with pytest.raises(RuntimeError, match=words) as exc:
            ckpt.save(2)
    finally:
        manager.stop.set()
    assert "step_00000002" in str(exc.value) and str(failure).splitlines()[-1] in str(exc.value)
    assert leftovers(ckpt_dir) == ["step_00000001.rollout.json"]  # no step_2.tmp, no orphan sidecar
    assert os.path.isdir(ckpt_dir / "step_00000001")  # the previous checkpoint is intact


@pytest.mark.timeout(120)
def test_the_managers_error_ends_the_wait_at_once(tmp_path):
    error = "OSError: [Errno 28] No space left on device: '/ckpt/step_00000002.rollout.json.1'"
    ckpt, manager = checkpointer(tmp_path, tmp_path / "ckpt", Learner(), error=error)
    try:
        with pytest.raises(RuntimeError, match="rollout manager could not save its state") as exc:
            ckpt.save(2, timeout_s=600)  # not a 600 s wait: the pytest timeout would end the test first
    finally:
        manager.stop.set()
    assert error in str(exc.value)
    assert leftovers(tmp_path / "ckpt") == []


@pytest.mark.timeout(120)
def test_an_unwritable_folder_fails_before_the_manager_is_asked(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the checkpoint folder's parent should be")
    ckpt, manager = checkpointer(tmp_path, blocker / "ckpt", Learner())
    try:
        with pytest.raises(RuntimeError, match=r"checkpoint folder .*file/ckpt is not writable: \w+Error"):
            ckpt.save(2)
    finally:
        manager.stop.set()
    assert read_notice(str(tmp_path / "notice.json")) is None  # no state request was ever made


# ---- real read-only folder and real full disk ----

class NamespacedRun:
    """`darl-train` in a private mount namespace prepared by `setup` (shell commands); when it
    ends, the listing of `inspect` as the run saw it is written to `listing` on the host."""

    def __init__(self, run, setup: str, inspect: str):
        self.run, self.setup, self.inspect = run, setup, inspect
        self.listing = run.out_path + ".listing"

    def start(self):
        run = self.run
        os.makedirs(run.run_dir, exist_ok=True)
        run._out = open(run.out_path, "a", encoding="utf-8")
        script = (f"{self.setup} || exit 97\n"
                  '"$@" &\nchild=$!\n'
                  "trap 'kill -TERM $child 2>/dev/null' TERM INT\n"  # the harness's teardown reaches darl-train
                  "while :; do wait $child; rc=$?; kill -0 $child 2>/dev/null || break; done\n"
                  f"ls -A {self.inspect} > {self.listing}\nexit $rc\n")
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                sys.executable, "-c", "from megatron_darl.launch.cli import train; train()", "--config", run.config]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        run.proc = subprocess.Popen(argv, stdout=run._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def seen(self) -> list[str]:
        with open(self.listing, encoding="utf-8") as fh:
            return fh.read().split()


@needs_mounts
@pytest.mark.timeout(300)
def test_read_only_checkpoint_folder_is_refused_before_start(tmp_path, warm_model):
    from tests.helpers.e2e import new_run

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run = new_run(tmp_path, warm_model, "ro", checkpoint={"dir": str(ckpt), "every_steps": 1})
    ns = NamespacedRun(run, f"mount --bind {ckpt} {ckpt} && mount -o remount,bind,ro {ckpt}", str(ckpt))
    try:
        ns.start()
        code = run.wait(240)  # today's code started the run and waited 600 s for the manager
        out = run.output()
    finally:
        run.kill()
    assert code == 1, out[-3000:]
    assert "cannot start" in out and f"checkpoint.dir: checkpoint folder {ckpt} is not writable" in out, out[-3000:]
    assert "Read-only file system" in out
    assert not os.path.exists(os.path.join(run.run_dir, "logs"))  # nothing was started


@needs_mounts
@pytest.mark.timeout(600)
def test_full_disk_fails_fast_with_the_cause_and_leaves_no_partial_checkpoint(tmp_path, warm_model):
    from tests.helpers.e2e import new_run

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # 2 MiB: the write probe and the manager's state fit, the learner's checkpoint (~40 MB) does not
    run = new_run(tmp_path, warm_model, "full", checkpoint={"dir": str(ckpt), "every_steps": 1},
                  train={"steps": 3})
    ns = NamespacedRun(run, f"mount -t tmpfs -o size=2m tmpfs {ckpt}", str(ckpt))
    try:
        ns.start()
        code = run.wait(480)
        out = run.output()
    finally:
        run.kill()
    assert code != 0, out[-3000:]
    assert "no space left on device writing checkpoint" in out and f"{ckpt}/step_00000001" in out, out[-4000:]
    assert "did not save its state within" not in out
    left = ns.seen()
    assert not [n for n in left if n.endswith(".tmp") or ".rollout.json" in n], left  # no partial checkpoint


@pytest.mark.timeout(600)
def test_kill_rollout_manager_then_resume_trains_every_prompt_once(tmp_path, warm_model):
    """A probe that held, kept as a test: kill -9 of the rollout manager after a checkpoint names
    the process, leaves nothing behind, and `checkpoint.resume=auto` continues with every prompt
    the manager had written trained once (the learner-kill variant is tests/integration/
    test_e2e_resume.py, whose checks this reuses). Nothing left behind: no process names the run
    folder or remains in a process group the run had (reward workers, engines the manager
    restarted) and no `/dev/shm/darl-<run_id>-*` segment, which the run did use."""
    from tests.helpers.e2e import group_members, kill_role, new_run, resume_to_end, run_groups
    from tests.integration.test_e2e_resume import STEPS, loader_sequence, newest_checkpoint

    run = new_run(tmp_path, warm_model, "mgr", algo={"max_head_offpolicyness": 1},
                  train={"steps": STEPS}, checkpoint={"every_steps": 2, "keep_last": 2})
    resumed = None
    try:
        run.start()
        run.wait_for(lambda: len(run.ledger()) >= 3, 240, "3 trained steps (a checkpoint at step 2)")
        run_id, groups = run.run_info()["run_id"], run_groups(run)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"darl-{run_id}-")], "no shared memory in use?"
        assert len(group_members(groups)) >= 4  # launcher, engine, rollout manager, learner
        kill_role(run, "megatron_darl.rollout", "rollout")
        ckpt_step, side = newest_checkpoint(run.run_dir)
        assert leftovers(os.path.join(run.run_dir, "checkpoints")) == [
            f"step_{s:08d}.rollout.json" for s in range(2, ckpt_step + 1, 2)][-2:]
        resumed = resume_to_end(run, str(tmp_path / "resumed.out"), 300)
    finally:
        run.kill()
        if resumed is not None:
            resumed.kill()
    ledger = resumed.ledger()
    assert [r["step"] for r in ledger] == list(range(STEPS)), ledger
    trained = [u for r in ledger for u in r["prompt_ids"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    drawn, inflight = side["counters"]["prompts_drawn"], {e["uid"] for e in side["episodes"]}
    written = set(loader_sequence(resumed.config, len(trained) + 4 * 8)[:drawn]) - inflight
    assert len(written) == side["counters"]["groups_written"]
    assert written <= set(trained), f"lost across the kill: {sorted(written - set(trained))}"


class SlowLearner(Learner):
    def save(self, path, extra):
        time.sleep(1.2)  # a 4B checkpoint writes about 56 GB
        super().save(path, extra)


@pytest.mark.timeout(60)
def test_a_save_longer_than_slurms_warning_says_so_and_so_does_the_next_start(tmp_path, capsys):
    """Slurm's USR2 comes launch.signal_before_s before the time limit; a save that does not fit
    in it would be killed midway at the next preemption: the save and the next attempt say so."""
    ckpt, manager = checkpointer(tmp_path, tmp_path / "ckpt", SlowLearner())
    ckpt.save_budget_s = 1.0
    try:
        ckpt.save(3)
    finally:
        manager.stop.set()
    recorded = json.load(open(tmp_path / "ckpt" / "save_time.json"))
    assert recorded["step"] == 3 and recorded["seconds"] >= 1.2
    assert "checkpoint of step 3 took 1 s, more than launch.signal_before_s=1 s" in capsys.readouterr().out
    again, manager = checkpointer(tmp_path, tmp_path / "ckpt", Learner())  # a requeued attempt
    manager.stop.set()
    again.save_budget_s = 1.0
    again.resume(None)
    assert "raise launch.signal_before_s to at least" in capsys.readouterr().out
    again.save_budget_s = 60.0
    again.resume(None)
    assert capsys.readouterr().out == ""
