"""How a learner rank joins the world: the port it meets on and the GPU it takes.

Learner ranks meet on a port that learner rank 0 binds when it starts (real gloo processes).

Before, the launcher picked MASTER_PORT when it wrote the run-info record, minutes before rank 0
bound it (warm start, engines, evaluation before RL in between): on a busy node another process
could take it, and rank 0 failed with "address already in use" or the others joined a stranger.
A rank takes its GPU from what its task sees: with one GPU per task (`--gpus-per-task=1`,
`--gpu-bind`) LOCAL_RANK is not an index into the visible devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from megatron_darl.config import load_config
from megatron_darl.launch.local import LocalPlacement, learner_env
from megatron_darl.launch.session import make_run_info
from tests.helpers import repo_env

WORKER = """
import torch, torch.distributed as dist
from megatron_darl.learner.parallel import init_world
init_world("gloo", 60)
t = torch.ones(1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_port_taken_after_the_launcher_wrote_the_record_does_not_break_the_rendezvous(tmp_path):
    cfg = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path}", "launch.learner_procs_per_node=2"])
    addr, port = LocalPlacement(cfg, sup=None).rendezvous()
    info = make_run_info(cfg, "r1", "r1", addr, port)
    os.makedirs(info.engines_dir)
    squatter = socket.socket()  # another job on the node takes the port the record names
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    squatter.bind((addr, port))
    squatter.listen()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=repo_env(**learner_env(r, 2, info)))
                 for r in range(2)]
        outs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        squatter.close()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("sum 2" in o for o in outs), outs
    assert os.path.exists(info.rendezvous_file)


def test_a_rank_without_rank_0_names_the_file(tmp_path, monkeypatch):
    from megatron_darl.learner.parallel import rendezvous_store

    path = str(tmp_path / "rendezvous.x.json")
    with pytest.raises(TimeoutError, match="rendezvous.x.json"):
        rendezvous_store(path, "127.0.0.1", 1, 2, timeout_s=0.5)


@pytest.mark.parametrize("local_rank,visible,env,expected", [
    ("3", 8, "0,1,2,3,4,5,6,7", 3),  # --gpus-per-node=8: every rank sees the node's GPUs
    ("3", 1, "3", 0),  # --gpus-per-task=1 / --gpu-bind: rank 3 sees one GPU, cuda:0 (before: set_device(3))
    ("0", 1, "5", 0),
])
def test_the_gpu_is_picked_from_what_the_task_sees(local_rank, visible, env, expected):
    from megatron_darl.learner.parallel import local_device

    assert local_device(visible, {"LOCAL_RANK": local_rank, "CUDA_VISIBLE_DEVICES": env}) == expected


def test_a_rank_beyond_the_visible_gpus_says_what_it_sees():
    from megatron_darl.learner.parallel import local_device

    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=5, but this task sees 4 GPUs .*'0,1,2,3'"):
        local_device(4, {"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    with pytest.raises(RuntimeError, match="sees no GPU"):
        local_device(0, {"LOCAL_RANK": "0"})


WAITER = """
import time, torch, torch.distributed as dist
from megatron_darl.learner.collectives import broadcast_json
from megatron_darl.learner.parallel import init_world
from megatron_darl.trainer.preemption import Preempted, Preemption, StoppableLearner
init_world("gloo", 2)  # a 2 s collective timeout stands for NCCL's 600 s
main = dist.get_rank() == 0

class Learner:
    is_main = main
    def broadcast_batch(self, batch):
        return broadcast_json(batch, 0, None, torch.device("cpu"))

learner, preempted = StoppableLearner(Learner()), Preemption()
for step in range(2):
    if main:
        time.sleep(4)  # waiting for a long first batch of rollouts
    assert learner.broadcast_batch({"step": step} if main else None) == {"step": step}
    if main:
        time.sleep(4)  # evaluating between steps
    assert preempted() is False
if main:
    time.sleep(3)  # preempted while waiting for rollouts
    learner.send_stop(7)
else:
    try:
        learner.broadcast_batch(None)
        raise SystemExit("not released")
    except Preempted as stop:
        assert stop.step == 7
print("ok", flush=True)
"""


@pytest.mark.timeout(120)
def test_the_other_ranks_wait_for_the_main_one_outside_any_collective(tmp_path):
    """Before, they waited in a broadcast (for the batch) or an all-reduce (the preemption flag,
    while the main rank evaluated) and the collective's timeout killed the job."""
    env = repo_env(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", WORLD_SIZE="2",
                   DARL_RENDEZVOUS_FILE=str(tmp_path / "rendezvous.json"))
    procs = [subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(o.rstrip().endswith("ok") for o in outs), outs
