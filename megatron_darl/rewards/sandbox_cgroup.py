"""One memory cgroup per sandboxed program, where the machine lets this process make one.

What it is: `memory_cgroup(limit_mb)` makes a child of this process's own memory cgroup (cgroup
v1's memory controller, or v2 where `memory` is enabled for the children of our cgroup) with a
hard limit of `limit_mb` MiB of memory and no swap beyond it, and returns its folder, or None
where the machine does not allow it (an ordinary user without a delegated cgroup, a read-only
/sys/fs/cgroup in a container). The sandbox launcher moves itself into it before it starts the
program, so the program and every process it starts share that one limit; the kernel's OOM
killer ends the program past it. `remove(folder)` deletes it once the program is gone;
`sweep(owner)` kills what is left in, and deletes, the cgroups a process made (`owner`: the pool,
when it kills a worker mid-run; None: every one whose maker is dead, when a pool starts, for those
a crash left behind). A cgroup is named after the process that made it: darl-sandbox-PID-HEX.
What it is not: the fallback where no cgroup can be made: there PID 1 of the sandbox watches the
resident memory of the program's processes (sandbox_launcher.py, `_watch_memory`).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time

CGROUP_ROOT = "/sys/fs/cgroup"
_NAME = re.compile(r"darl-sandbox-([0-9]+)-[0-9a-f]+")


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _v1_memory_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields = post.split()
            if len(fields) >= 3 and fields[0] == "cgroup" and "memory" in fields[2].split(","):
                return pre.split()[4]
    return None


def _parent_folder() -> tuple[str, str] | None:
    """(our memory cgroup's folder, "v1" or "v2"), or None without a memory controller."""
    own = _own_paths()
    v2_controllers = os.path.join(CGROUP_ROOT, "cgroup.controllers")
    if os.path.exists(v2_controllers) and "" in own:  # the unified hierarchy only
        folder = CGROUP_ROOT + own[""]
        try:
            with open(os.path.join(folder, "cgroup.subtree_control")) as f:
                if "memory" in f.read().split():
                    return folder, "v2"
        except OSError:
            return None
        return None
    mount = _v1_memory_mount()
    if mount is None or "memory" not in own:
        return None
    return mount + own["memory"], "v1"


def _write(folder: str, name: str, value: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(value)


def memory_cgroup(limit_mb: int) -> str | None:
    """A fresh memory cgroup limited to `limit_mb` MiB (swap included), or None where not allowed."""
    try:
        found = _parent_folder()
    except OSError:
        return None
    if found is None:
        return None
    parent, version = found
    folder = os.path.join(parent, f"darl-sandbox-{os.getpid()}-{secrets.token_hex(4)}")
    limit = str(int(limit_mb) * 1024 * 1024)
    try:
        os.mkdir(folder)
    except OSError:
        return None  # not ours to divide (an ordinary user, a read-only cgroup file system)
    try:
        if version == "v2":
            _write(folder, "memory.max", limit)
            if os.path.exists(os.path.join(folder, "memory.swap.max")):
                _write(folder, "memory.swap.max", "0")
        else:
            _write(folder, "memory.limit_in_bytes", limit)
            if os.path.exists(os.path.join(folder, "memory.memsw.limit_in_bytes")):
                _write(folder, "memory.memsw.limit_in_bytes", limit)  # no swap beyond the limit
    except OSError:
        remove(folder)
        return None
    return folder


def oom_kills(folder: str | None) -> int:
    """How many processes the kernel killed in the cgroup at its limit (0 where it cannot say)."""
    if folder is None:
        return 0
    for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
        try:
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    field, _, value = line.partition(" ")
                    if field == key:
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def remove(folder: str | None, attempts: int = 50) -> None:
    """Delete the cgroup; its last processes may take a moment to be reaped (EBUSY meanwhile)."""
    if folder is None:
        return
    for _ in range(attempts):
        try:
            os.rmdir(folder)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_members(folder: str) -> None:
    """SIGKILL every process in the cgroup (v2: cgroup.kill, Linux 5.14+; else one by one)."""
    try:
        _write(folder, "cgroup.kill", "1")
        return
    except OSError:
        pass
    try:
        with open(os.path.join(folder, "cgroup.procs")) as f:
            pids = [int(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def sweep(owner: int | None = None) -> int:
    """Kill and delete the sandbox cgroups made by process `owner` (None: by any process that is
    no longer alive) under our memory cgroup; how many were deleted."""
    try:
        found = _parent_folder()
        names = os.listdir(found[0]) if found else []
    except OSError:
        return 0
    removed = 0
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        maker = int(match.group(1))
        if (maker != owner) if owner is not None else _alive(maker):
            continue
        folder = os.path.join(found[0], name)
        for _ in range(20):  # a process may still be starting in it: kill until it empties
            _kill_members(folder)
            remove(folder, attempts=5)
            if not os.path.isdir(folder):
                removed += 1
                break
    return removed
