"""No quota shared with the host can be exhausted from the sandbox; no memory cgroup outlives a worker.

Each attack is graded through the real RewardPool, along the root path and the user path
("userns": natively as a user, as root in test_sandbox_user.py). An attack program is an item
whose right answer is what a sandbox must allow: it prints how many inotify or fanotify
instances, keys or keyrings, or memfds it could make, and the expected output is 0 (a count
above 0 scores 0). Before the seccomp filter (rewards/sandbox_seccomp.py) 128 inotify instances
made inside stopped the host's root (root path) or the job's uid (user path) from making any, 200
keys exhausted the uid's key quota so that other items' correct solutions failed with EDQUOT, and
memory held in memfds passed the limit of the path without a cgroup. Here, while the attackers
run, the host still makes inotify instances and the correct solutions of other items score 1.
A worker killed mid-run (the pool's timeout) leaves no memory cgroup, and a pool removes those a
crashed one left behind (where this process may make cgroups: root here; a user has none).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards import sandbox_cgroup
from megatron_darl.rewards.api import RewardInput
from megatron_darl.rewards.pool import RewardPool
from tests.helpers import REPO, repo_env
from tests.helpers.sandbox import needs_sandbox
from tests.unit.rewards.test_exact_answers import PROBLEMS, _items

pytestmark = needs_sandbox
HOLD_S = 4.0  # how long an attacker keeps what it made, so that the host's checks overlap it
_LIBC = ctypes.CDLL(None, use_errno=True)

INOTIFY = f"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
made = []
for _ in range(200):
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    made.append(fd)
    libc.inotify_add_watch(fd, b"/tmp", 0x100)  # a watch too: max_user_watches
for _ in range(20):
    fd = libc.fanotify_init(0, 0)
    if fd >= 0:
        made.append(fd)
print(len(made), flush=True)
time.sleep({HOLD_S})
"""
KEYS = f"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, REQUEST_KEY, KEYCTL = {{"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}}[os.uname().machine]
made = 0
for i in range(200):
    made += libc.syscall(ADD_KEY, b"user", b"k%d" % i, b"v" * 64, 64, -3) >= 0  # the session keyring
for i in range(20):
    made += libc.syscall(KEYCTL, 1, b"ring%d" % i) >= 0  # KEYCTL_JOIN_SESSION_KEYRING: a new keyring
    made += libc.syscall(REQUEST_KEY, b"user", b"k0", None, 0) >= 0
print(made, flush=True)
time.sleep({HOLD_S})
"""
MEMFD = """
import os
made = 0
for i in range(16):
    try:
        fd = os.memfd_create("m%d" % i)
    except OSError:
        continue
    os.ftruncate(fd, 1 << 20)
    made += 1
print(made)
"""

# SysV shared memory touched then detached: resident in no process (the watch without a cgroup
# missed it: 512 MiB held under a 256 MiB limit); the expected output is what the attack prints
SHM = """
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
for i in range(4):
    sid = libc.shmget(0, 64 << 20, 0o1000 | 0o600)
    p = libc.shmat(sid, None, 0) if sid >= 0 else None
    if p in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(p, 1, 64 << 20)
    libc.shmdt(ctypes.c_void_p(p))
    held += 64
time.sleep(0.5)
print(held)
"""


def _attack(program: str) -> RewardInput:
    return RewardInput("", f"```python\n{program}```", "code",
                       {"format": "stdio", "cases": [{"input": "", "output": "0\n"}]})


def _correct_items(count: int) -> list[RewardInput]:
    """Right answers to the problems of test_exact_answers.py, each scoring 1 alone."""
    names = sorted(PROBLEMS)
    items = []
    for i in range(count):
        args, expected, right, _ = PROBLEMS[names[i % len(names)]]
        items.append(_items(right, args, expected, ("stdio", "functional")[i % 2]))
    return items


def _host_inotify() -> bool:
    fd = _LIBC.inotify_init1(0)
    if fd < 0:
        return False
    os.close(fd)
    return True


def _leftover_cgroups(makers: list[int]) -> list[str]:
    found = sandbox_cgroup._parent_folder()
    if found is None:
        return []
    return [n for n in os.listdir(found[0]) if any(n.startswith(f"darl-sandbox-{pid}-") for pid in makers)]


def _score_while_checking_host(items: list[RewardInput]):
    """The items' results, the host's inotify checks made while they ran, and the workers."""
    config = RewardConfig(num_workers=2, timeout_s=120, code_wall_s=15)
    with RewardPool(config) as pool:
        pool.score(_correct_items(2))  # the workers are up: the checks below overlap the attackers
        makers = pool.worker_pids()
        results: list = []
        runner = threading.Thread(target=lambda: results.extend(pool.score(items)))
        runner.start()
        checks = []
        while runner.is_alive():
            checks.append(_host_inotify())
            time.sleep(0.2)
        runner.join()
        makers += pool.worker_pids()
    return results, checks, makers


@pytest.mark.timeout(600)
def test_inotify_and_fanotify_are_denied_and_the_host_keeps_its_own(sandbox):
    items = [_attack(INOTIFY), _attack(INOTIFY)] + _correct_items(6)
    results, checks, makers = _score_while_checking_host(items)
    assert [(r.score, r.status) for r in results[:2]] == [(1.0, "ok")] * 2, results[:2]  # made none
    assert [r.score for r in results[2:]] == [1.0] * 6, results[2:]
    assert len(checks) >= 5 and all(checks), checks  # HOLD_S of attack: the host made one each time
    assert _leftover_cgroups(makers) == []


@pytest.mark.timeout(600)
def test_key_calls_are_denied_and_other_items_keep_scoring(sandbox):
    items = [_attack(KEYS), _attack(KEYS)] + _correct_items(20)
    results, checks, makers = _score_while_checking_host(items)
    assert [(r.score, r.status) for r in results[:2]] == [(1.0, "ok")] * 2, results[:2]  # made none
    failed = [r for r in results[2:] if r.score != 1.0]
    assert failed == [], f"{len(failed)}/20 correct solutions failed, e.g. {failed[:3]}"
    assert _leftover_cgroups(makers) == []


@pytest.mark.timeout(600)
def test_memfd_is_denied(sandbox):
    results, _, makers = _score_while_checking_host([_attack(MEMFD)] + _correct_items(2))
    assert [(r.score, r.status) for r in results] == [(1.0, "ok")] * 3, results
    assert _leftover_cgroups(makers) == []


@pytest.mark.timeout(600)
def test_detached_shared_memory_counts_against_the_limit(sandbox):
    attack = RewardInput("", f"```python\n{SHM}```", "code",
                         {"format": "stdio", "cases": [{"input": "", "output": "256\n"}]})
    with RewardPool(RewardConfig(num_workers=1, timeout_s=120, code_wall_s=15, code_memory_mb=160)) as pool:
        result = pool.score([attack])[0]
    assert (result.score, result.status) == (0.0, "ok"), result  # killed at the limit, before printing
    assert "SIGKILL" in result.detail or "memory" in result.detail, result


@pytest.mark.timeout(600)
def test_a_killed_worker_leaves_no_cgroup_and_no_program(sandbox):
    # the program outlives the pool's timeout: its worker is killed mid-run
    config = RewardConfig(num_workers=1, timeout_s=4, code_wall_s=60, code_cpu_s=60)
    hang = RewardInput("", "import time\nprint('x', flush=True)\ntime.sleep(120)\n", "code",
                       {"format": "stdio", "cases": [{"input": "", "output": "0"}]})
    with RewardPool(config) as pool:
        pool.score(_correct_items(1))
        before = pool.worker_pids()
        result = pool.score([hang])[0]
        assert (result.score, result.status) == (0.0, "timeout"), result
        assert _leftover_cgroups(before) == []  # at once: the kill removed it
        assert pool.score(_correct_items(1))[0].score == 1.0  # the replacement grades


def test_a_pool_sweeps_the_cgroups_a_crash_left_behind():
    found = sandbox_cgroup._parent_folder()
    probe = sandbox_cgroup.memory_cgroup(64)
    sandbox_cgroup.remove(probe)
    if found is None or probe is None:
        pytest.skip("no memory cgroup can be made by this process (the user path's PID 1 watches memory)")
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a maker that is gone, as after a crash
    left = os.path.join(found[0], f"darl-sandbox-{pid}-deadbeef")
    os.mkdir(left)
    try:
        RewardPool(RewardConfig(num_workers=1)).close()
        assert not os.path.exists(left)
    finally:
        if os.path.isdir(left):
            os.rmdir(left)


def test_without_libseccomp_no_program_runs_and_the_refusal_names_it():
    probe = ("import sys; sys.modules['pyseccomp'] = None\n"  # the binding absent: its import fails
             "from megatron_darl.rewards.sandbox import SandboxRefused, run_sandboxed, sandbox_problem\n"
             "try:\n    run_sandboxed('print(1)')\nexcept SandboxRefused as e:\n    print('refused:', e)\n"
             "print('problem:', sandbox_problem())\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=repo_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    refused, problem = done.stdout.splitlines()
    for line in (refused, problem):
        assert "pip install pyseccomp" in line and "apt-get install libseccomp2" in line, line
    assert refused.startswith("refused: the code sandbox's seccomp filter needs pyseccomp"), refused
