"""The code sandbox's steps for an ordinary user, and the new root both paths share.

What it is: the isolation `sandbox_launcher.py` sets up when it runs as an ordinary user (spec
"mode": "user"), and the parts the root path reuses (build_root, enter_root,
cap_user_namespaces, join_session_keyring); stdlib only, imported by the launcher from its own
folder (it runs as `python -I -S`, without the package). In order, for a user:
  check_kernel()        Linux 5.15+ (older kernels count RLIMIT_NPROC per user, machine-wide)
  enter(libc)           the launcher unshares user, mount, network, PID and IPC namespaces and
                        maps itself to root of the new user namespace (ns1): capabilities over its
                        own mounts and network, nothing outside them
  build_root(..)        a new root on a tmpfs, built in ns1: read-only nosuid binds of /usr, /bin,
                        /sbin, /lib*, /etc and the interpreter's installs (sys.prefix,
                        sys.base_prefix) with benchmark data hidden (spec "hide"), /dev with null,
                        zero, random and urandom only, /proc, an empty read-only /tmp and the
                        writable scratch folder /tmp/scratch on a tmpfs of its own
  enter_root(..)        in PID 1 of the new PID namespace: its own /proc (only the sandbox's
                        processes), pivot_root into the new root with the old one detached, PID 1
                        made non-dumpable; then cap_user_namespaces(1): the one `drop` makes
  drop(libc)            in the program's process: a nested user namespace (ns2) where the user is
                        uid 1000, no new privileges, a fresh session keyring; execve then clears
                        every capability, and ns1's mounts are locked read-only (a less privileged
                        namespace cannot clear the flag)
What the program can read: those binds, with the user's own permissions (its kernel uid is the
user's); not the user's home, the run's data, the host's /tmp, /run (sockets), /proc of the host.
Its processes (a per-namespace RLIMIT_NPROC counts them) die with PID 1, which replaces the root
path's kill of a dedicated uid.
What it is not: a defence against kernel exploits, nor the root path (sandbox_launcher.py): root
keeps dropping to a dedicated uid, as root is exempt from RLIMIT_NPROC in any namespace.
"""

import ctypes
import errno
import os
import resource

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH, AT_FDCWD, AT_RECURSIVE = 2, -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 1, 2, 4, 8
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (Linux 5.12+)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203,
                  "ppc64": 203, "s390x": 217, "loongarch64": 41}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "arm64": 219, "riscv64": 219, "ppc64le": 250, "ppc64": 250,
              "s390x": 280, "loongarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 4, 38, 22, 2
PROGRAM_UID = 1000  # the program's uid in its own user namespace (ns2)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "random", "urandom")
ISOLATION = ["user", "net", "mount", "pid", "ipc"]
MIN_KERNEL = (5, 15)


class Refused(Exception):
    """The kernel refused a step the guarantees need; the program must not run."""


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def why(call: str) -> str:
    err = ctypes.get_errno()
    return f"{call}: {os.strerror(err)} ({errno.errorcode.get(err, err)})"


def check_kernel() -> None:
    release = os.uname().release
    try:
        version = tuple(int(x) for x in release.split("-")[0].split(".")[:2])
    except ValueError:
        return  # an unusual release string: let the kernel's own answers decide
    if version < MIN_KERNEL:
        raise Refused(f"Linux {release} counts RLIMIT_NPROC per user, not per user namespace "
                      "(5.15+): every sandbox of this user would share one process budget")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _check_process_limit_binds() -> None:
    """A fork with RLIMIT_NPROC at 0 must fail. It succeeds for the machine's root (the kernel
    exempts kernel uid 0, e.g. root of a user namespace mapped to it, in every namespace) and for
    CAP_SYS_RESOURCE: there no process limit would hold, so the program must not run."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (0, hard))
    try:
        pid = os.fork()
    except BlockingIOError:
        return  # EAGAIN: the limit binds
    finally:
        resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    raise Refused(f"uid {os.geteuid()} is exempt from RLIMIT_NPROC here (the machine's root, e.g. a user "
                  "namespace mapped to uid 0): no process limit would hold; run as root of the machine or "
                  "as an ordinary user")


def enter(libc) -> None:
    """unshare(user, mount, network, PID, IPC) and become root of the new user namespace (ns1)."""
    uid, gid = os.geteuid(), os.getegid()
    _check_process_limit_binds()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC) != 0:
        raise Refused(why("unshare(user namespace)"))
    _write("/proc/self/setgroups", "deny")  # needed to map a group without CAP_SETGID outside
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        raise Refused(why(f"mount({source or fstype} on {target})"))


def _set_attr(libc, target: str, attrs: int, recursive: bool = True) -> None:
    """Add mount flags (mount_setattr: keeps the atime and other flags a namespace may not change)."""
    attr = _MountAttr(attrs, 0, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), flags, ctypes.byref(attr),
                    ctypes.sizeof(attr)) != 0:
        raise Refused(why(f"mount_setattr({target})"))


def _covered(path: str, bound: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound)


def _binds(spec: dict) -> list[str]:
    """What the new root shows besides the system folders (real paths, parents first): the
    interpreter's installs and the folders of its executable."""
    python = spec["python"]
    paths = {os.path.realpath(p) for p in spec["expose"]}
    paths |= {os.path.realpath(os.path.dirname(python)), os.path.dirname(os.path.realpath(python))}
    for path in ("/", "/tmp"):
        if path in paths:
            what = "binding it would show the whole host" if path == "/" else "no private /tmp can hold it"
            raise Refused(f"the interpreter's prefix is {path} itself: {what}")
    return sorted(paths)


def build_root(libc, spec: dict, scratch: str) -> str:
    """The new root at spec["stage"] (a folder of the host's, private to the caller), mounted
    read-only but for `scratch`; returns its path. Needs ns1 (`enter`)."""
    root = spec["stage"]
    os.mkdir(root, 0o700)
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    bound: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)  # merged /usr: /bin -> usr/bin
    for path in [p for p in SYSTEM_DIRS if os.path.isdir(p) and not os.path.islink(p)] + _binds(spec):
        if _covered(path, bound):
            continue
        os.makedirs(root + path, 0o755)
        _mount(libc, path, root + path, None, MS_BIND | MS_REC)
        _set_attr(libc, root + path, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
        bound.append(path)
    for path in spec.get("hide", ()):  # benchmark data in the interpreter's installs: an empty folder
        if _covered(path, bound) and os.path.isdir(root + path):
            _mount(libc, "tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=555")
    _devices(libc, root)
    os.mkdir(root + "/proc", 0o555)
    os.makedirs(root + scratch, 0o755)
    size = f"size={max(1, int(spec['max_file_mb']))}m,mode=700"
    _mount(libc, "tmpfs", root + scratch, "tmpfs", MS_NOSUID | MS_NODEV, size)
    _set_attr(libc, root, MOUNT_ATTR_RDONLY, recursive=False)  # the tmpfs root: nothing to write
    return root


def _devices(libc, root: str) -> None:
    """/dev with null, zero, random and urandom (binds of the host's nodes) and the fd links."""
    os.mkdir(root + "/dev", 0o755)
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{root}/dev/{name}", "w").close()
            _mount(libc, "/dev/" + name, f"{root}/dev/{name}", None, MS_BIND)
            _set_attr(libc, f"{root}/dev/{name}", MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")


def enter_root(libc, root: str) -> None:
    """In PID 1 of the new PID namespace: its /proc and pivot_root into the new root."""
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program (same kernel uid) may not ptrace us
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    machine = os.uname().machine
    number = SYS_PIVOT_ROOT.get(machine)
    if number is None:
        raise Refused(f"pivot_root: no syscall number known for {machine}")
    os.chdir(root)
    if libc.syscall(number, b".", b".") != 0:  # the old root ends up stacked on the new one
        raise Refused(why("pivot_root"))
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise Refused(why("umount(old root)"))
    os.chdir("/")


def cap_user_namespaces(count: int) -> None:
    """In PID 1, as root of its own user namespace (never the machine's): at most `count` user
    namespaces below it (the user path: the one drop() makes; root: none), whatever the program
    tries; the sysctl counts per user namespace, for it and every one below."""
    _write("/proc/sys/user/max_user_namespaces", str(count))


def join_session_keyring(libc) -> None:
    """A fresh, empty session keyring: none of the caller's keys (Kerberos or AFS tokens, keys
    linked from the user keyring) stay in reach through the inherited one."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is None:
        raise OSError(0, f"keyctl: no syscall number known for {os.uname().machine}")
    if libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() != errno.ENOSYS:
        raise OSError(ctypes.get_errno(), why("keyctl(KEYCTL_JOIN_SESSION_KEYRING)"))  # ENOSYS: no keys at all


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_filter(libc, bpf) -> None:
    """Install the seccomp filter (sandbox_seccomp.py, compiled by libseccomp in the caller) on
    this process and all it starts; after no-new-privileges and the session keyring it denies."""
    if not bpf:
        return
    program = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = _SockFprog(len(bpf) // 8, ctypes.cast(program, ctypes.c_void_p))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), why("prctl(PR_SET_SECCOMP)"))


def drop(libc) -> None:
    """In the program's process, before exec: a nested user namespace (and mount namespace, so
    that ns1's mounts are locked) where the user is PROGRAM_UID; no new privileges either."""
    # dumpable again (PID 1 is not, and fork keeps it): our /proc/self files are then ours to
    # write; execve would reset it anyway
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), why("unshare(nested user namespace)"))
    _write("/proc/self/uid_map", f"{PROGRAM_UID} 0 1")
    _write("/proc/self/gid_map", f"{PROGRAM_UID} 0 1")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), why("prctl(PR_SET_NO_NEW_PRIVS)"))
    join_session_keyring(libc)
