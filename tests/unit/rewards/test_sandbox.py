"""Sandbox containment: each hostile program is stopped and reported as a failure.

Every test runs along each path of the sandbox (tests/helpers/sandbox.py's SandboxMode): as root
with namespaces (user, network, mount, PID, IPC), the new root and a dropped uid, as root with the audit-hook fallback
(`isolate=False`), and as an ordinary user ("userns": user namespaces, a new read-only root, a
nested unprivileged uid). A path this process cannot take skips saying so: as root the userns
tests run as an unprivileged uid in test_sandbox_user.py, as a user the root paths have
no root. The unbounded fork bomb runs only after the bounded fork (64 processes) has shown the
process limit holds, and under a watchdog that kills the sandbox's processes if they ever grow
past the limit.
"""

import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time

import pytest

from megatron_darl.rewards.sandbox import SandboxLimits, SandboxRefused, kill_uid, run_sandboxed
from tests.helpers import REPO
from tests.helpers.require import SANDBOX, require
from tests.helpers.sandbox import ROOT, SandboxMode

# a machine that refuses namespaces (a container without CAP_SYS_ADMIN) refuses isolate=True runs
# (test_sandbox_refusal.py); the fallback still runs there
NO_NAMESPACES = ROOT and os.system("unshare --net --mount --pid --fork true >/dev/null 2>&1") != 0
LIMITS = SandboxLimits(cpu_s=2, wall_s=8, memory_mb=512, max_procs=8, max_file_mb=4)


def _mode(name: str) -> SandboxMode:
    if name == "namespaces" and NO_NAMESPACES:  # DARL_REQUIRE_SANDBOX=1: a failure
        require(SANDBOX, "this machine refuses network/mount/PID namespaces, which the sandbox needs")
    mode = SandboxMode(name)
    mode.check()  # skips a path this process cannot take, saying which test takes it
    return mode


@pytest.fixture(params=["namespaces", "fallback", "userns"])
def sandbox(request) -> SandboxMode:
    return _mode(request.param)


@pytest.fixture(params=["namespaces", "userns"])
def isolated(request) -> SandboxMode:
    """The paths that isolate with namespaces (not the audit-hook fallback)."""
    return _mode(request.param)


@pytest.fixture
def userns() -> SandboxMode:
    return _mode("userns")


BOUNDED_FORK = """
import os, time
made = 0
for _ in range(64):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    made += 1
print(made)
"""


def bounded_fork_contained(sandbox: SandboxMode) -> int:
    """Run the 64-fork program; return how many forks succeeded."""
    result = sandbox.run(BOUNDED_FORK, "", LIMITS)
    assert result.status == "ok", result.stderr
    return int(result.stdout.strip())


def test_bounded_fork_is_capped_by_process_limit(sandbox):
    made = bounded_fork_contained(sandbox)
    # the program itself is one of the max_procs processes of its uid (its user namespace)
    assert made <= LIMITS.max_procs - 1
    assert made >= 1  # forking itself works: the limit, not a ban, stopped it
    assert sandbox.processes(LIMITS) == []  # the sleeping children did not survive


def test_fork_bomb_is_contained(sandbox):
    if bounded_fork_contained(sandbox) > LIMITS.max_procs - 1:
        pytest.fail("bounded fork was not contained; refusing to run the fork bomb")
    peak, stop = [0], threading.Event()

    def watchdog():
        while not stop.is_set():
            n = len(sandbox.processes(LIMITS))
            peak[0] = max(peak[0], n)
            if n > 4 * LIMITS.max_procs:
                sandbox.kill(LIMITS)  # the limit failed: stop the bomb before it hurts the machine
            time.sleep(0.01)

    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    limits = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=512, max_procs=8, max_file_mb=4)
    try:
        result = sandbox.run(bomb, "", limits)
    finally:
        stop.set()
        guard.join()
        sandbox.kill(LIMITS)
    assert not result.passed
    assert result.status in ("failed", "timeout")
    # +1: as root, at the wall limit the sandbox kills the bomb through a helper that becomes the
    # uid (kill_uid); as a user, the PID namespace's PID 1: the watchdog counts either
    assert peak[0] <= limits.max_procs + 1
    assert sandbox.processes(LIMITS) == []


def test_infinite_loop_stopped_by_cpu_limit(sandbox):
    limits = SandboxLimits(cpu_s=1, wall_s=8, memory_mb=512, max_procs=8, max_file_mb=4)
    start = time.monotonic()
    result = sandbox.run("while True:\n    pass\n", "", limits)
    assert result.status == "failed" and "SIGXCPU" in result.stderr
    assert time.monotonic() - start < limits.wall_s


def test_sleeping_program_stopped_by_wall_limit(sandbox):
    limits = SandboxLimits(cpu_s=2, wall_s=1.0, memory_mb=512, max_procs=8, max_file_mb=4)
    start = time.monotonic()
    result = sandbox.run("import os, time\nos.fork()\ntime.sleep(60)\n", "", limits)
    assert result.status == "timeout"
    assert time.monotonic() - start < 5
    assert sandbox.processes(limits) == []


def test_10gb_allocation_fails(sandbox):
    result = sandbox.run("b = bytearray(10 * 2**30)\nprint('allocated')\n", "", LIMITS)
    assert result.status == "failed"
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_large_output_capped_by_file_size_limit(sandbox):
    result = sandbox.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "", LIMITS)
    assert result.status == "failed"
    assert len(result.stdout) <= LIMITS.max_file_mb * 2**20


def test_writes_outside_scratch_are_refused(sandbox, tmp_path):
    tag = secrets.token_hex(6)
    os.chmod(tmp_path, 0o777)  # writable by any uid on the host: only the sandbox keeps it out
    targets = [f"/tmp/darl-escape-{tag}", f"/var/tmp/darl-escape-{tag}",
               f"/dev/shm/darl-escape-{tag}", str(tmp_path / "escape"), f"../escape-{tag}"]
    program = (
        f"import os\nfor path in {targets!r}:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
        "    except OSError as e:\n        print('refused', path, type(e).__name__)\n"
        "open('inside.txt', 'w').write('ok')\nprint('inside', open('inside.txt').read())\n"
    )
    result = sandbox.run(program, "", LIMITS)
    assert result.status == "ok", result.stderr
    assert "WROTE" not in result.stdout
    assert result.stdout.count("refused") == len(targets)
    assert "inside ok" in result.stdout  # the scratch folder itself is writable
    for path in targets[:4]:
        assert not os.path.exists(path)


def test_socket_to_loopback_is_refused(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    program = (
        "import socket\ns = socket.socket()\ns.settimeout(2)\n"
        f"s.connect(('127.0.0.1', {port}))\nprint('connected')\n"
    )
    try:
        result = sandbox.run(program, "", LIMITS)
        with pytest.raises(socket.timeout):
            server.accept()  # nothing reached the listener
    finally:
        server.close()
    assert result.status == "failed"
    assert "connected" not in result.stdout


def test_parent_environment_is_not_readable(sandbox, monkeypatch):
    secret = "darl-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("DARL_SANDBOX_SECRET", secret)
    program = (
        "import os\nprint(dict(os.environ))\n"
        f"for pid in ({os.getpid()}, os.getppid()):\n"
        "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError as e:\n        print('refused', type(e).__name__)\n"
    )
    result = sandbox.run(program, "", LIMITS)
    assert result.status == "ok", result.stderr
    assert secret not in result.stdout and secret not in result.stderr
    assert "DARL_SANDBOX_SECRET" not in result.stdout
    assert result.stdout.count("refused") == 2


# both paths: the root path's PID 1 is in a user namespace of its own (no further one inside)
ALL_NAMESPACES = {"user", "net", "mount", "pid", "ipc"}
EXPECTED_ISOLATION = {"namespaces": ALL_NAMESPACES, "userns": ALL_NAMESPACES}


def test_namespaces_used_where_the_machine_allows(isolated):
    sandbox = isolated
    # an interpreter under /tmp (a virtualenv there) is bound into the private /tmp: still all
    # (tests/faults/test_sandbox.py runs one); only an interpreter whose prefix is /tmp has
    # no private /tmp, and there the program does not run
    if "/tmp" in {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}:
        with pytest.raises(SandboxRefused, match="prefix is /tmp"):
            sandbox.run("print(1)", "", LIMITS)
        return
    result = sandbox.run("print(1)", "", LIMITS)
    assert set(result.isolation) == EXPECTED_ISOLATION[sandbox.name]
    assert result.status == "ok" and result.stdout.strip() == "1"
    if sandbox.root:
        assert run_sandboxed("print(1)", "", LIMITS, isolate=False).isolation == ()
    else:
        with pytest.raises(PermissionError, match="fallback needs root"):
            run_sandboxed("print(1)", "", LIMITS, isolate=False)


def test_stdin_reaches_the_program_and_runs_unprivileged(isolated):
    program = "import os\nprint(input()[::-1], os.getuid() != 0, os.geteuid() != 0)\n"
    result = isolated.run(program, "abc\n", LIMITS)
    assert result.status == "ok" and result.stdout.split() == ["cba", "True", "True"]


PRIVILEGES = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, ret):
    print(name, "allowed" if ret == 0 else "refused:" + os.strerror(ctypes.get_errno()))
status = dict(l.split(":	", 1) for l in open("/proc/self/status").read().splitlines() if ":	" in l)
print("caps", status["CapEff"].strip(), status["CapPrm"].strip(), "nnp", status["NoNewPrivs"].strip())
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
attempt("userns", libc.unshare(0x10000000))
attempt("remount", libc.mount(None, b"/", None, ctypes.c_ulong(32 | 4096), None))
attempt("umount", libc.umount2(b"/usr", 2))
attempt("ptrace", libc.ptrace(16, 1, None, None))
for path in ("/proc/1/environ", "/proc/1/mem"):
    try:
        open(path, "rb").read(1)
        print(path, "allowed")
    except OSError as e:
        print(path, "refused:" + e.strerror)
"""


def test_userns_program_holds_no_privilege_over_its_sandbox(userns):
    """No capability, no namespace of its own (the launcher caps them), no mount to undo, and only
    its own processes in sight: PID 1 of its namespace (the launcher's, non-dumpable) cannot be
    traced or read."""
    result = userns.run(PRIVILEGES, "", LIMITS)
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "caps 0000000000000000 0000000000000000 nnp 1"
    assert lines[1] == "pids [1, 2]"  # PID 1 and the program: nothing of the host
    assert "userns refused:No space left on device" in lines
    for name in ("remount", "umount", "ptrace", "/proc/1/environ", "/proc/1/mem"):
        assert any(line.startswith(name + " refused:") for line in lines), result.stdout


def test_userns_files_of_the_user_are_out_of_reach(userns):
    """The program runs with the user's kernel uid, but sees a new root: the user's own private
    files (a 0600 file in a 0700 folder outside /tmp, the repository) are not there."""
    folder = tempfile.mkdtemp(prefix="darl-private-", dir="/var/tmp")
    secret = os.path.join(folder, "key")
    with open(secret, "w") as f:
        f.write("host secret")
    os.chmod(secret, 0o600)
    targets = [secret, folder, str(REPO / "setup.py"), os.path.expanduser("~")]
    program = ("import os\n"
               f"for path in {targets!r}:\n"
               "    try:\n"
               "        print('READ', path, open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
               "    except OSError as e:\n        print('refused', path, type(e).__name__)\n")
    try:
        result = userns.run(program, "", LIMITS)
    finally:
        shutil.rmtree(folder)
    assert result.status == "ok", result.stderr
    assert "READ" not in result.stdout and "host secret" not in result.stdout
    assert result.stdout.count("refused") == len(targets)


def test_kill_uid_refuses_system_uids():
    with pytest.raises(ValueError, match="refusing uid 0"):
        kill_uid(0)


def test_limits_validated():
    with pytest.raises(ValueError, match="max_procs"):
        SandboxLimits(max_procs=0)
    with pytest.raises(ValueError, match="uid_base"):
        SandboxLimits(uid_base=0)
