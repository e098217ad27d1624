"""A /dev/shm smaller than `ring.size_bytes` stops the run at start, saying what to change.

Docker gives a container 64 MB of /dev/shm; the demo's ring is 256 MiB. Before, the learner
failed when it created the ring ("No space left on device"), after the warm start. Now the
preflight names `--shm-size` and a `ring.size_bytes` that fits. The end-to-end case mounts a
real 64 MiB tmpfs on /dev/shm in a private mount namespace, as such a container has (root; failed
where DARL_REQUIRE_MOUNTS=1 and root cannot mount).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from megatron_darl.channel.shm_space import shm_space_problem
from tests.helpers import REPO, repo_env
from tests.helpers.require import require_mounts


def test_a_ring_larger_than_the_free_space_is_refused_with_both_fixes(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    problem = shm_space_problem(free + (1 << 30), str(tmp_path))
    assert problem and f"does not fit in {tmp_path}" in problem and "--shm-size=" in problem
    suggested = int(re.search(r"ring\.size_bytes=(\d+)\)", problem).group(1))
    assert shm_space_problem(suggested, str(tmp_path)) is None  # the smaller ring it names fits
    assert shm_space_problem(1 << 20, str(tmp_path)) is None


def test_demo_refuses_at_start_in_a_64mb_dev_shm(tmp_path):
    require_mounts("mounts a 64 MiB tmpfs on /dev/shm in a private mount namespace")
    run = ("mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$0\" -c "
           "'import sys; from megatron_darl.launch.cli import train_main; sys.exit(train_main(sys.argv[1:]))' \"$@\"")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", run, sys.executable,
                           "--config", os.path.join(REPO, "configs/cpu_demo_darl.yaml"),
                           f"train.run_dir={tmp_path}/run"],
                          env=repo_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "darl-train: cannot start" in done.stderr
    assert "ring.size_bytes: ring.size_bytes=268435456 (256 MiB) does not fit in /dev/shm: 64 MiB free" in done.stderr
    assert "--shm-size=" in done.stderr and "ring.size_bytes=16777216" in done.stderr
    assert not os.path.exists(f"{tmp_path}/run/model")  # refused before the warm start
