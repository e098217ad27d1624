"""Learner ranks meet on a port that learner rank 0 binds when it starts (real gloo processes).

Before, the launcher picked MASTER_PORT when it wrote the run-info record, minutes before rank 0
bound it (warm start, engines, evaluation before RL in between): on a busy node another process
could take it, and rank 0 failed with "address already in use" or the others joined a stranger."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_darl.config import load_config
from megatron_darl.launch.runner import LocalPlacement, learner_env
from megatron_darl.launch.session import make_run_info

REPO = Path(__file__).resolve().parents[3]
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
                                  text=True, env={**os.environ, "PYTHONPATH": str(REPO), **learner_env(r, 2, info)})
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
