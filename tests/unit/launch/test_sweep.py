"""The launcher removes shared memory left by runs whose processes died, and nothing else."""

import os
import subprocess
import sys

from megatron_darl.channel.shm_ring import ShmRing
from megatron_darl.launch.session import sweep_stale_runs


def _age(path, seconds=3600):
    t = os.path.getmtime(path) - seconds
    os.utime(path, (t, t))


def test_sweep_removes_dead_runs_only(tmp_path):
    d = str(tmp_path)
    dead_ring = "darl-aaaaaaaaaa-ring"
    subprocess.run([sys.executable, "-c", "from megatron_darl.channel.shm_ring import ShmRing;"
                    f"ShmRing.create({dead_ring!r}, 1 << 16, directory={d!r})"], check=True, timeout=60)
    (tmp_path / "darl-aaaaaaaaaa-weights" / "v1").mkdir(parents=True)
    live = ShmRing.create("darl-bbbbbbbbbb-ring", 1 << 16, directory=d)
    (tmp_path / "darl-bbbbbbbbbb-weights").mkdir()
    (tmp_path / "darl-cccccccccc-weights").mkdir()  # young: a run that is starting now
    (tmp_path / "unrelated-ring").write_text("x")
    for name in ("darl-aaaaaaaaaa-ring", "darl-aaaaaaaaaa-weights", "darl-bbbbbbbbbb-ring",
                 "darl-bbbbbbbbbb-weights", "unrelated-ring"):
        _age(tmp_path / name)
    try:
        removed = sweep_stale_runs(d)
        assert sorted(os.path.basename(p) for p in removed) == ["darl-aaaaaaaaaa-ring", "darl-aaaaaaaaaa-weights"]
        assert sorted(os.listdir(d)) == ["darl-bbbbbbbbbb-ring", "darl-bbbbbbbbbb-weights",
                                         "darl-cccccccccc-weights", "unrelated-ring"]
    finally:
        live.close()
        live.unlink()
