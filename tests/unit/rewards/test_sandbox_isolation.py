"""What a sandboxed program cannot reach, along both paths: IPC objects, keys, privileges, the host.

Each probe is a real program run by `run_sandboxed`, along the root path ("namespaces") and the
user path ("userns": natively as a user, as root in test_sandbox_user.py). Before, neither path
had an IPC namespace (SysV objects outlived the program; the host's were writable), both kept the
caller's session keyring (its keys readable), and memory was bounded per process only; the root
path also ran setuid binaries with effective uid 0, let the program make a user namespace holding
every capability, and showed the host's /proc, its UNIX sockets and its world-readable files.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import socket
import tempfile

import pytest

from megatron_darl.rewards.sandbox import SandboxLimits
from tests.helpers import REPO
from tests.helpers.sandbox import SandboxMode

LIMITS = SandboxLimits(cpu_s=4, wall_s=20, memory_mb=384, max_procs=16, max_file_mb=4)
LIBC = ctypes.CDLL(None, use_errno=True)
IPC_CREAT, IPC_RMID = 0o1000, 0
SYS_ADD_KEY, SYS_KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine, (None, None))
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_LINK = 1, 8
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING = -3, -4


@pytest.fixture(params=["namespaces", "userns"])
def isolated(request) -> SandboxMode:
    mode = SandboxMode(request.param)
    mode.check()  # the path this process cannot take is skipped, naming the test that takes it
    return mode


def _run_ok(sandbox: SandboxMode, program: str) -> list[str]:
    result = sandbox.run(program, "", LIMITS)
    assert result.status == "ok", result.stderr[-3000:]
    return result.stdout.splitlines()


SYSV = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
host = libc.shmget(HOST_KEY, 0, 0)
if host >= 0:
    addr = libc.shmat(host, None, 0)
    ctypes.memmove(addr, b"overwritten", 11)
    print("host segment written")
print("made", libc.shmget(SHM_KEY, 1 << 20, 0o1666), libc.msgget(MSG_KEY, 0o1666), libc.semget(SEM_KEY, 1, 0o1666))
"""


def _sysv_keys(kind: str) -> set[int]:
    with open(f"/proc/sysvipc/{kind}") as f:
        return {int(line.split()[0]) for line in f.readlines()[1:]}


def test_ipc_objects_neither_reach_the_host_nor_outlive_the_program(isolated):
    LIBC.shmat.restype = ctypes.c_void_p
    host_key, shm_key, msg_key, sem_key = (0x5D000000 + secrets.randbelow(1 << 20) * 4 + i for i in range(4))
    host = LIBC.shmget(host_key, 4096, IPC_CREAT | 0o666)  # world-writable, as the issue found one
    assert host >= 0
    addr = LIBC.shmat(host, None, 0)
    ctypes.memmove(addr, b"host data\0\0", 11)
    program = (SYSV.replace("HOST_KEY", str(host_key)).replace("SHM_KEY", str(shm_key))
               .replace("MSG_KEY", str(msg_key)).replace("SEM_KEY", str(sem_key)))
    try:
        lines = _run_ok(isolated, program)
        left = (shm_key in _sysv_keys("shm"), msg_key in _sysv_keys("msg"), sem_key in _sysv_keys("sem"))
        content = ctypes.string_at(addr, 9)
    finally:
        LIBC.shmdt(ctypes.c_void_p(addr))
        LIBC.shmctl(host, IPC_RMID, None)
        for key, get, ctl in ((shm_key, LIBC.shmget, LIBC.shmctl), (msg_key, LIBC.msgget, LIBC.msgctl)):
            ident = get(key, 0, 0)
            if ident >= 0:
                ctl(ident, IPC_RMID, None)
        ident = LIBC.semget(sem_key, 0, 0)
        if ident >= 0:
            LIBC.semctl(ident, 0, IPC_RMID)
    assert "host segment written" not in lines and content == b"host data"
    assert lines[-1].startswith("made ") and "-1" not in lines[-1].split()  # made inside, in its own namespace
    assert left == (False, False, False), "IPC objects of the program outlived it on the host"


KEYS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(256)
for serial in SERIALS:
    n = libc.syscall(KEYCTL, 11, serial, buf, 256)  # KEYCTL_READ
    print("read", serial, buf.raw[:n] if n >= 0 else "refused:" + os.strerror(ctypes.get_errno()))
found = libc.syscall(KEYCTL, 10, -3, b"user", DESCRIPTION, 0)  # KEYCTL_SEARCH in the session keyring
print("search", found)
"""


def test_keys_of_the_callers_session_keyring_are_out_of_reach(isolated):
    if SYS_KEYCTL is None:
        pytest.skip(f"keyctl syscall numbers known here for x86_64 and aarch64, not {os.uname().machine}")
    secret = secrets.token_hex(8).encode()
    description = f"darl-test-{secrets.token_hex(4)}".encode()
    # a session keyring of this test's own, holding a key, and a key linked in the user keyring too
    assert LIBC.syscall(SYS_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, description) > 0
    session_key = LIBC.syscall(SYS_ADD_KEY, b"user", description, secret, len(secret), KEY_SPEC_SESSION_KEYRING)
    user_key = LIBC.syscall(SYS_ADD_KEY, b"user", description + b"-u", secret, len(secret), KEY_SPEC_SESSION_KEYRING)
    assert session_key > 0 and user_key > 0, os.strerror(ctypes.get_errno())
    assert LIBC.syscall(SYS_KEYCTL, KEYCTL_LINK, user_key, KEY_SPEC_USER_KEYRING) == 0, os.strerror(ctypes.get_errno())
    program = (KEYS.replace("KEYCTL", str(SYS_KEYCTL)).replace("SERIALS", repr([session_key, user_key]))
               .replace("DESCRIPTION", repr(description)))
    lines = _run_ok(isolated, program)
    assert secret.decode() not in "\n".join(lines)
    assert sum(line.startswith("read ") and "refused:" in line for line in lines) == 2, lines
    assert lines[-1] == "search -1", lines


SETUID = """
import os, subprocess, time
status = os.popen("grep NoNewPrivs /proc/self/status").read().split()
su = subprocess.Popen(["su", "root", "-c", "true"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
time.sleep(0.5)  # su waits for a password here, with the effective uid it got
try:
    uids = [line.split()[1:] for line in open(f"/proc/{su.pid}/status") if line.startswith("Uid:")][0]
except OSError:
    uids = ["gone"]
su.kill()
su.wait()
print("euid", os.geteuid(), "su", " ".join(uids), "nnp", status[-1])
print("nosuid", all("nosuid" in line.split()[5] for line in open("/proc/self/mountinfo")))
"""


def test_setuid_binaries_gain_nothing(isolated):
    if not os.path.exists("/usr/bin/su"):
        pytest.skip("no /usr/bin/su to try")
    lines = _run_ok(isolated, SETUID)
    euid, su_uids = lines[0].split(" su ")[0].split()[1], lines[0].split(" su ")[1].split(" nnp ")[0].split()
    assert su_uids != ["gone"] and set(su_uids) == {su_uids[0]} and su_uids[1] == euid != "0", lines
    assert lines[0].endswith("nnp 1") and lines[1] == "nosuid True", lines


NESTED = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, flags in (("user", 0x10000000), ("user+net", 0x10000000 | 0x40000000)):
    ok = libc.unshare(flags) == 0
    print(name, "made" if ok else "refused:" + os.strerror(ctypes.get_errno()))
    if ok:
        caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
        print("caps", caps)
"""


def test_no_namespace_with_capabilities_inside(isolated):
    lines = _run_ok(isolated, NESTED)
    assert [line.split(":")[0] for line in lines] == ["user refused", "user+net refused"], lines


HOST_VIEW = """
import os, socket
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
for path in SOCKETS:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        print("connected", path)
    except OSError as e:
        print("refused", path, e.strerror)
for path in FILES:
    try:
        print("READ", path, open(path).read(40) if os.path.isfile(path) else os.listdir(path)[:3])
    except OSError as e:
        print("refused", path, e.strerror)
"""


def test_host_processes_sockets_and_world_readable_files_are_out_of_sight(isolated):
    tag = secrets.token_hex(4)
    folder = tempfile.mkdtemp(prefix="darl-visible-", dir="/var/tmp")
    os.chmod(folder, 0o755)
    files = [os.path.join(folder, "notes"), f"/dev/shm/darl-visible-{tag}"]
    for path in files:
        with open(path, "w") as f:
            f.write("world-readable host data")
        os.chmod(path, 0o644)
    socket_dirs = [d for d in ("/run", "/dev/shm", "/tmp") if os.access(d, os.W_OK)]
    servers, sockets = [], []
    for d in socket_dirs:
        path = os.path.join(d, f"darl-sock-{tag}")
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(4)
        server.settimeout(0.2)
        servers.append(server)
        sockets.append(path)
    targets = files + [str(REPO / "pyproject.toml"), f"/proc/{os.getpid()}/cmdline"]
    program = HOST_VIEW.replace("SOCKETS", repr(sockets)).replace("FILES", repr(targets))
    try:
        lines = _run_ok(isolated, program)
        for server in servers:
            with pytest.raises(socket.timeout):
                server.accept()  # nothing reached a host socket
    finally:
        for server, path in zip(servers, sockets):
            server.close()
            os.unlink(path)
        os.unlink(files[1])
        shutil.rmtree(folder)
    assert lines[0] == "pids [1, 2]", lines  # PID 1 of the sandbox and the program: no host process
    assert not any(line.startswith(("connected", "READ")) for line in lines), lines
    assert sum(line.startswith("refused") for line in lines) == len(sockets) + len(targets)


MEMORY = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (150 << 20)  # resident: every page written
        time.sleep(1.5)
        print("held", flush=True)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


def test_the_program_as_a_whole_holds_no_more_memory_than_its_limit(isolated):
    """Four processes of 150 MiB each, each under the per-process limit (384 MiB): together
    they would hold 600 MiB. Those that held their block for 1.5 s held it at the same time."""
    result = isolated.run(MEMORY, "", LIMITS)
    held = result.stdout.count("held")
    assert held * 150 <= LIMITS.memory_mb, (held, result.stderr[-2000:])
