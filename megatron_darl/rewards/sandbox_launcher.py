"""The child side of the code sandbox: a standalone script that confines, then runs, one program.

What it is: the program `sandbox.run_sandboxed` starts (`python -I -S sandbox_launcher.py
SPEC`) in a new session, in one of two modes, which give the program the same view:
  root  unshares network, mount, PID and IPC namespaces (where the kernel refuses one it reports
        why and exits, status 123, without running the program, unless the caller chose the
        audit-hook fallback, `isolate=False`), builds the new root of sandbox_userns.py (read-only
        nosuid binds of the system folders and the interpreter, a minimal /dev, its own /proc, a
        writable /tmp/scratch) and forks PID 1 there, which enters a user namespace of its own
        (mapped one to one by this launcher: uids keep their meaning) capped at no further user
        namespace; the program's process sets its limits, drops to a dedicated unprivileged uid,
        sets no-new-privileges, joins a fresh session keyring and execs Python
  user  (an ordinary user, sandbox_userns.py) unshares a user namespace with the others, builds the
        same new root, and runs the program in a nested user namespace without capabilities
In both, PID 1 of the PID namespace going away ends every process the program started, and the
program gets a scrubbed environment and CPU-time, address-space, file-size and process-count
limits; its memory as a whole is capped by a memory cgroup (spec "cgroup", which the launcher
joins first) where the machine gives one, else PID 1 kills the program once its processes hold
more resident memory together than the limit, SysV shared memory no process holds included
(checked every WATCH_S). Its exit status is the
program's (128 + signal when a signal ended it), and it writes what isolation it achieved, or why
it refused, to a report file.
What it is not: importable library code (stdlib only, no package imports, so it starts fast and
runs without the package on the path), nor a defence against kernel exploits.
"""

import _signal as signal  # the C module: `signal` imports enum, a cost paid per program
import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC = 0x00020000, 0x20000000, 0x40000000, 0x08000000
CLONE_NEWUSER = 0x10000000
NAMESPACES = (("net", CLONE_NEWNET), ("mount", CLONE_NEWNS), ("pid", CLONE_NEWPID), ("ipc", CLONE_NEWIPC))
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
WATCH_S = 0.01  # without a memory cgroup: how often PID 1 sums the program's resident memory
MIN_UID = 1000  # sandbox uids are above the system's users (SandboxLimits.uid_base)
REFUSED = 123  # exit status when the isolation the guarantees need was not obtained
SCRATCH = "/tmp/scratch"  # where the program runs, in the new root (the one writable folder)

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


def _closed_parent(path: str) -> str | None:
    """The first folder above `path` that other users may not traverse, or None."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        folder = "/" + "/".join(parts[:depth])
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


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
        _userns().load_filter(libc, spec.get("seccomp"))
    else:
        _set_limits(spec)
        uid = spec["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # nothing after this may need root
        if os.getuid() != uid or os.geteuid() != uid:
            os._exit(125)
        if spec["isolate"]:
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                os._exit(125)
            _userns().join_session_keyring(libc)
            _userns().load_filter(libc, spec.get("seccomp"))  # after the join: it denies keyctl
    os.chdir(scratch)
    prelude = PRELUDE.format(
        block_net="net" not in isolation, block_fs="mount" not in isolation, scratch=scratch
    )
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.closerange(3, 65536)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())  # PID 1 may block SIGCHLD; exec keeps the mask
    py = spec["python"]
    if "mount" not in isolation and _closed_parent(os.path.realpath(py)) is not None:
        py = spec["fallback_python"]  # our interpreter is out of the uid's reach
    flags = ["-I", "-B"] if spec.get("site", True) else ["-I", "-B", "-S"]  # -S: the checker, stdlib only
    try:
        os.execve(py, [py, *flags, "-c", prelude, "main.py"], env)
    except PermissionError as e:  # name the folder, not only errno 13
        raise PermissionError(f"cannot execute {py} as uid {os.getuid()}: {_closed_parent(py) or py} is "
                              "closed to other users (chmod o+rx it)") from e


def _wait_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _run_init(spec: dict, scratch: str, isolation: list[str], libc) -> int:
    """PID 1 of the new namespace (or the plain parent without one): start the program, reap
    orphans until it exits. When PID 1 exits, the kernel kills what is left in the namespace."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    watch = "pid" in isolation and not spec.get("cgroup")
    if watch:  # before the fork: a SIGCHLD must wait for sigtimedwait, not be lost
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGCHLD,))
    pid = os.fork()
    if pid == 0:
        try:
            _exec_program(spec, scratch, isolation, libc)
        except BaseException as e:  # report why the program could not start
            sys.stderr.write(f"[sandbox] could not start the program: {e!r}\n")
            sys.stderr.flush()
        os._exit(126)
    status = None
    while status is None:
        try:
            done, raw = os.waitpid(-1, os.WNOHANG if watch else 0)
        except ChildProcessError:
            return 126
        if done == pid:
            status = 128 + os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
        elif done == 0:  # watching: nothing to reap now
            _watch_memory(spec)
            signal.sigtimedwait((signal.SIGCHLD,), WATCH_S)
    if spec["mode"] != "user":
        # what the program left running dies now, and is reaped here rather than left as
        # zombies that would count against the uid's process limit in the next run
        _kill_uid(spec["uid"])
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    return status  # a user's PID 1: its exit makes the kernel kill and reap what is left


def _resident_bytes() -> int:
    """Resident memory of every process in sight but ours (PID 1 of the sandbox's /proc)."""
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                with open(f"/proc/{name}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * page
            except (OSError, IndexError, ValueError):
                pass  # it just exited
    return total


def _detached_shm_bytes() -> int:
    """Resident memory of the SysV shared memory segments of the sandbox's IPC namespace that no
    process has attached: resident in no process, so `_resident_bytes` cannot see it."""
    try:
        with open("/proc/sysvipc/shm", "rb") as f:
            header, *rows = f.read().split(b"\n")
    except OSError:
        return 0
    names = header.split()
    if b"rss" not in names or b"nattch" not in names:
        return 0
    rss, nattch = names.index(b"rss"), names.index(b"nattch")
    total = 0
    for row in rows:
        fields = row.split()
        if len(fields) > max(rss, nattch) and fields[nattch] == b"0":
            total += int(fields[rss])
    return total


def _watch_memory(spec: dict) -> None:
    """Without a memory cgroup: past the limit for the program as a whole, kill all of it."""
    held = _resident_bytes() + _detached_shm_bytes()
    limit = spec["memory_mb"] * 1024 * 1024
    if held <= limit:
        return
    sys.stderr.write(f"[sandbox] the program's processes held {held >> 20} MiB together, past the "
                     f"memory limit of {spec['memory_mb']} MiB: killed\n")
    sys.stderr.flush()
    if spec["mode"] == "user":
        os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of the namespace
    else:
        _kill_uid(spec["uid"])


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


_INIT = {"pid": 0, "stop": False}  # PID 1 of the sandbox (isolated), and whether to stop


def _stop(spec: dict) -> None:
    """SIGTERM (a timeout, or the death of whoever started us: the reward worker): root kills
    the program's uid; both kill PID 1, which takes its whole PID namespace with it."""
    if spec["mode"] != "user":
        _kill_uid(spec["uid"])
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
            userns.cap_user_namespaces(1)  # the one drop() makes
        except (userns.Refused, OSError) as exc:
            _refuse(report, [], SCRATCH, str(exc))
        with report:
            marshal.dump({"isolation": userns.ISOLATION, "scratch": SCRATCH}, report)
        os._exit(_run_init(spec, SCRATCH, userns.ISOLATION, libc))
    return _wait_init(init, report)


def _wait_init(init: int, report) -> int:
    report.close()
    _INIT["pid"] = init
    if _INIT["stop"]:
        os.kill(init, signal.SIGKILL)
    return _wait_status(init)


def _main_root(spec: dict, code: bytes, report, libc) -> int:
    """Root: network, mount, PID and IPC namespaces, the user path's new root, and PID 1 in a
    user namespace of its own (one to one with the host's uids) where no further one can be made."""
    refused = [f"unshare({name} namespace): {why}" for name, flag in NAMESPACES
               if (why := _unshare(libc, flag)) is not None]
    if refused:  # the audit-hook fallback cannot stop a subprocess: never run the program on it silently
        _refuse(report, [], spec["fallback_scratch"], "; ".join(refused))
    userns = _userns()
    try:
        root = userns.build_root(libc, spec, SCRATCH)
        _stage_program(spec, root + SCRATCH, code)
        host_proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)  # the host's, kept past pivot_root
    except (userns.Refused, OSError) as exc:
        _refuse(report, [], spec["fallback_scratch"], str(exc))
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(ready_r)
        os.close(go_w)
        try:
            userns.enter_root(libc, root)
            if libc.unshare(CLONE_NEWUSER) != 0:
                raise userns.Refused(userns.why("unshare(user namespace)"))
            os.write(ready_w, b"1")
            if os.read(go_r, 1) != b"1":
                raise userns.Refused("the launcher could not map the program's user namespace")
            userns.cap_user_namespaces(0)
        except (userns.Refused, OSError) as exc:
            _refuse(report, [], SCRATCH, str(exc))
        with report:
            marshal.dump({"isolation": userns.ISOLATION, "scratch": SCRATCH}, report)
        os._exit(_run_init(spec, SCRATCH, userns.ISOLATION, libc))
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) == b"1":
        try:  # every uid and gid as itself: the dedicated uid stays the one kill_uid signals
            for name in ("uid_map", "gid_map"):
                fd = os.open(f"{init}/{name}", os.O_WRONLY, dir_fd=host_proc)
                os.write(fd, b"0 0 4294967295")
                os.close(fd)
            os.write(go_w, b"1")
        except OSError as exc:
            sys.stderr.write(f"[sandbox] mapping the program's user namespace: {exc}\n")
    os.close(go_w)
    return _wait_init(init, report)


def _main_fallback(spec: dict, code: bytes, report, libc) -> int:
    """Root, `isolate=False` (the tests' audit-hook fallback): no namespace at all."""
    scratch = spec["fallback_scratch"]
    _stage_program(spec, scratch, code)
    with report:
        marshal.dump({"isolation": [], "scratch": scratch}, report)
    return _run_init(spec, scratch, [], libc)


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        spec = marshal.load(f)  # written by sandbox.py with this interpreter
    if spec.get("cgroup"):  # first: every process of the sandbox is counted in it
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    # read and open everything on the host's /tmp before the new root hides it
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
    os._exit((_main_root if spec["isolate"] else _main_fallback)(spec, code, report, libc))


if __name__ == "__main__":
    main()
