"""The child side of the code sandbox: a standalone script that confines, then runs, one program.

What it is: the program `sandbox.run_sandboxed` starts (`python -I -S sandbox_launcher.py
SPEC`) in a new session, in one of two modes:
  root  detaches from the host (network, mount and PID namespaces; where the kernel refuses one
        it reports why and exits, status 123, without running the program, unless the caller
        chose the audit-hook fallback, `isolate=False`), makes every mount read-only and gives
        the program a fresh tmpfs /tmp (the interpreter bound into it read-only when it lives
        under /tmp) with a scratch folder, then forks the program's process, which sets resource
        limits, drops to a dedicated unprivileged uid and execs Python
  user  (an ordinary user, sandbox_userns.py) unshares a user namespace with the others, builds a
        new read-only root that shows only the system folders and the interpreter, and runs the
        program in a nested user namespace without capabilities; PID 1 of the PID namespace
        going away ends every process the program started
In both the program gets a scrubbed environment and CPU-time, address-space, file-size and
process-count limits. Its exit status is the program's (128 + signal when a signal ended it),
and it writes what isolation it achieved, or why it refused, to a report file.
What it is not: importable library code (stdlib only, no package imports, so it starts fast and
runs without the package on the path), nor a defence against kernel exploits.
"""

import _signal as signal  # the C module: `signal` imports enum, a cost paid per program
import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_MOVE = 32, 4096, 16384, 1 << 18, 8192
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
MIN_UID = 1000  # sandbox uids are above the system's users (SandboxLimits.uid_base)
REFUSED = 123  # exit status when the isolation the guarantees need was not obtained
SCRATCH = "/tmp/scratch"  # where the program runs when a private /tmp could be mounted

# Runs inside the sandboxed interpreter before the program. Audit hooks are the fallback used
# only when the caller asks for it (`isolate=False`, the tests): they stop Python-level sockets and writes outside the
# scratch folder; they cannot stop a subprocess, which is why namespaces come first.
PRELUDE = r"""
import os, sys
_net, _fs, _scratch = {block_net!r}, {block_fs!r}, {scratch!r}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {{"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.symlink", "os.link",
    "os.truncate", "os.chmod", "os.chown", "shutil.rmtree", "shutil.copyfile"}}
def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == _scratch or real.startswith(_scratch + os.sep)
def _hook(event, args):
    if _net and event.startswith("socket.") and event != "socket.getdefaulttimeout":
        raise PermissionError("sandbox: network access is disabled")
    if _fs and event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or bool(flags & _WRITE)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the scratch folder: {{path}}")
    if _fs and event in _PATH_EVENTS and args and not all(
            _inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
        raise PermissionError(f"sandbox: {{event}} outside the scratch folder")
if _net or _fs:
    sys.addaudithook(_hook)
del _hook
sys.argv = sys.argv[1:]
sys.path.insert(0, os.getcwd())
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _unshare(libc: ctypes.CDLL, flag: int) -> str | None:
    """None on success, else why the kernel refused."""
    if libc.unshare(flag) == 0:
        return None
    return os.strerror(ctypes.get_errno())


def _mount(libc, source, target, fstype, flags, data=None) -> bool:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    return libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) == 0


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) for every mount, parents before children."""
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            # mount points are octal-escaped (\040 for a space)
            point = fields[4].encode().decode("unicode_escape")
            flags = sum(keep.get(opt, 0) for opt in fields[5].split(","))
            points.append((point, flags))
    return points


def _under_tmp(path: str) -> bool:
    return path == "/tmp" or path.startswith("/tmp/")


def _private_filesystem(libc, spec: dict) -> bool:
    """Make every mount read-only in our mount namespace and put a fresh tmpfs on /tmp, with
    the scratch folder the only place the program's uid may write. The tmpfs is prepared at
    `spec["stage"]` (a root-only folder of the host's) and moved onto /tmp when ready, so that
    an interpreter installed under /tmp (a virtualenv there) is bound into it read-only at its
    own path first: the program and every process it starts see only the private /tmp."""
    if "/tmp" in spec["expose"]:
        return False  # an interpreter whose prefix is /tmp itself: no private /tmp can hold it
    stage = spec["stage"]
    os.mkdir(stage, 0o700)  # on the host's /tmp, before it is made read-only
    if not _mount(libc, None, "/", None, MS_REC | MS_PRIVATE):
        return False
    for point, flags in _mount_points():
        # a mount we cannot remount (e.g. locked by the container) stays as it is; the uid drop
        # still keeps the program out of everything but world-writable folders
        _mount(libc, None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
    size = f"size={max(1, int(spec['max_file_mb']))}m,mode=755"
    if not _mount(libc, "tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, size):
        return False
    os.mkdir(stage + SCRATCH[len("/tmp"):], 0o700)
    for path in spec["expose"]:
        if _under_tmp(path) and not _bind_read_only(libc, path, stage + path[len("/tmp"):]):
            return False
    if not _mount(libc, stage, "/tmp", None, MS_MOVE):
        return False
    for i, path in enumerate(spec["expose"]):
        _expose(libc, path, f"/tmp/.stage{i}")
    return True


def _bind_read_only(libc, source: str, target: str) -> bool:
    """Bind `source` (and the mounts under it) at `target`, read-only; the folders created on
    the way are open to traversal, whatever the host's (a 0700 mkdtemp folder) are."""
    os.makedirs(target, 0o755)
    return (_mount(libc, source, target, None, MS_BIND | MS_REC)
            and _mount(libc, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY))


def _closed_parent(path: str) -> str | None:
    """The first folder above `path` that other users may not traverse, or None."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        folder = "/" + "/".join(parts[:depth])
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _expose(libc, path: str, stage: str) -> None:
    """Make `path` (the interpreter's install) reachable by the program's uid when a parent
    folder is closed to others (pyenv under /root, mode 700): stage a bind of it, hide the
    closed parent under an empty read-only tmpfs, and move the bind back to its own path, so
    that absolute library paths (RPATH) still resolve and the rest of the parent stays hidden."""
    closed = _closed_parent(path)
    if closed is None:
        return
    os.mkdir(stage)
    if not _mount(libc, path, stage, None, MS_BIND | MS_REC):
        return
    _mount(libc, "tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.makedirs(path, 0o755)
    _mount(libc, stage, path, None, MS_MOVE)
    _mount(libc, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    _mount(libc, None, closed, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.rmdir(stage)


def _userns():
    """sandbox_userns.py, next to this script (imported by path: no package here)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sandbox_userns

    return sandbox_userns


def _stage_program(spec: dict, scratch: str, code: bytes) -> None:
    path = os.path.join(scratch, "main.py")
    with open(path, "wb") as f:
        f.write(code)
    os.chown(scratch, spec["uid"], spec["uid"])
    os.chown(path, spec["uid"], spec["uid"])


def _set_limits(spec: dict) -> None:
    mb = 1024 * 1024
    limits = {
        resource.RLIMIT_CPU: (spec["cpu_s"], spec["cpu_s"] + 1),
        resource.RLIMIT_AS: (spec["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (spec["max_file_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (spec["max_procs"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NOFILE: (256, 256),
    }
    for which, value in limits.items():
        resource.setrlimit(which, value)


def _exec_program(spec: dict, scratch: str, isolation: list[str], libc) -> None:
    """In the forked child: limits, privilege drop, exec. Never returns."""
    if spec["mode"] == "user":
        _userns().drop(libc)
        # after the nested namespace: RLIMIT_NPROC (5.15+) counts the processes of this user in
        # this namespace, i.e. of this program only; set earlier it would cap the levels above
        _set_limits(spec)
    else:
        _set_limits(spec)
        uid = spec["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # last: nothing after this may need root
        if os.getuid() != uid or os.geteuid() != uid:
            os._exit(125)
    os.chdir(scratch)
    prelude = PRELUDE.format(
        block_net="net" not in isolation, block_fs="mount" not in isolation, scratch=scratch
    )
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.closerange(3, 65536)
    py = spec["python"]
    if "mount" not in isolation and _closed_parent(os.path.realpath(py)) is not None:
        py = spec["fallback_python"]  # our interpreter is out of the uid's reach
    os.execve(py, [py, "-I", "-B", "-c", prelude, "main.py"], env)


def _wait_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _run_init(spec: dict, scratch: str, isolation: list[str], libc) -> int:
    """PID 1 of the new namespace (or the plain parent without one): start the program, reap
    orphans until it exits. When PID 1 exits, the kernel kills what is left in the namespace."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    pid = os.fork()
    if pid == 0:
        try:
            _exec_program(spec, scratch, isolation, libc)
        except BaseException as e:  # report why the program could not start
            sys.stderr.write(f"[sandbox] could not start the program: {e!r}\n")
            sys.stderr.flush()
        os._exit(126)
    status = 126
    while True:
        try:
            done, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if done == pid:
            status = 128 + os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
            if spec["mode"] == "user":
                break  # our exit (PID 1) makes the kernel kill and reap what is left
            # what the program left running dies now, and is reaped here rather than left as
            # zombies that would count against the uid's process limit in the next run
            _kill_uid(spec["uid"])
    return status


def _kill_uid(uid: int) -> None:
    """Kill every process of `uid` (a helper that becomes `uid` and signals -1)."""
    if uid < MIN_UID:
        return  # as root or a system user, kill(-1) would hit the machine: never
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


_INIT = {"pid": 0, "stop": False}  # user mode: PID 1 of the sandbox, and whether to stop


def _stop(spec: dict) -> None:
    """SIGTERM (a timeout, or the death of whoever started us: the reward worker): root kills
    the program's uid, the wait loop then reaps everything; a user kills PID 1, which takes its
    whole PID namespace with it."""
    if spec["mode"] != "user":
        _kill_uid(spec["uid"])
        return
    _INIT["stop"] = True
    if _INIT["pid"]:
        os.kill(_INIT["pid"], signal.SIGKILL)


def _refuse(report, isolation: list[str], scratch: str, why: str) -> None:
    """Report why the program did not run, and exit: the caller raises SandboxRefused."""
    with report:
        marshal.dump({"isolation": isolation, "scratch": scratch, "refused": why}, report)
    os._exit(REFUSED)


def _main_user(spec: dict, code: bytes, report, libc) -> int:
    """An ordinary user: namespaces and a new root (sandbox_userns.py), then PID 1 and the
    program. PID 1 writes the report once it is inside the new root."""
    userns = _userns()
    try:
        userns.check_kernel()
        userns.enter(libc)
        root = userns.build_root(libc, spec, SCRATCH)
        with open(root + SCRATCH + "/main.py", "wb") as f:
            f.write(code)
    except (userns.Refused, OSError) as exc:
        _refuse(report, [], spec["fallback_scratch"], str(exc))
    if _INIT["stop"]:
        return 128 + signal.SIGTERM
    init = os.fork()
    if init == 0:
        try:
            userns.enter_root(libc, root)
        except (userns.Refused, OSError) as exc:
            _refuse(report, [], SCRATCH, str(exc))
        with report:
            marshal.dump({"isolation": userns.ISOLATION, "scratch": SCRATCH}, report)
        os._exit(_run_init(spec, SCRATCH, userns.ISOLATION, libc))
    report.close()
    _INIT["pid"] = init
    if _INIT["stop"]:
        os.kill(init, signal.SIGKILL)
    return _wait_status(init)


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        spec = marshal.load(f)  # written by sandbox.py with this interpreter
    # read and open everything on the host's /tmp before a private /tmp may hide it
    with open(spec["program"], "rb") as f:
        code = f.read()
    report = open(spec["report"], "wb")
    libc = _libc()
    signal.signal(signal.SIGTERM, lambda *_: _stop(spec))
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # orphans of the program come to us (not to the machine's init) and are reaped by us
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != spec["parent_pid"] or (spec["mode"] == "root" and spec["uid"] < MIN_UID):
        os._exit(124)
    if spec["mode"] == "user":
        os._exit(_main_user(spec, code, report, libc))
    isolation: list[str] = []
    refused: list[str] = []
    if spec["isolate"]:
        for name, flag in (("net", CLONE_NEWNET), ("mount", CLONE_NEWNS), ("pid", CLONE_NEWPID)):
            why = _unshare(libc, flag)
            if why is None:
                isolation.append(name)
            else:
                refused.append(f"unshare({name} namespace): {why}")
    scratch = spec["fallback_scratch"]
    if "mount" in isolation:
        if _private_filesystem(libc, spec):
            scratch = SCRATCH
        else:
            isolation.remove("mount")
            refused.append("could not mount a private read-only filesystem with its own /tmp"
                           + (" (the interpreter's prefix is /tmp itself)" if "/tmp" in spec["expose"] else ""))
    if spec["isolate"] and refused:
        # the audit-hook fallback cannot stop a subprocess: never run the program on it silently
        _refuse(report, isolation, scratch, "; ".join(refused))
    _stage_program(spec, scratch, code)
    with report:
        marshal.dump({"isolation": isolation, "scratch": scratch}, report)
    if "pid" in isolation:
        # after unshare(CLONE_NEWPID) only our next child enters the namespace, as its PID 1
        init = os.fork()
        if init == 0:
            os._exit(_run_init(spec, scratch, isolation, libc))
        os._exit(_wait_status(init))
    os._exit(_run_init(spec, scratch, isolation, libc))


if __name__ == "__main__":
    main()
