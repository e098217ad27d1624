"""The seccomp filter of every sandboxed program: the calls that reach a quota shared with the host.

What it is: `filter_bpf()`, the BPF program (bytes) that denies, with EPERM, the system calls
whose quotas a program could exhaust for others: inotify and fanotify instances and watches
(counted per uid, and up the user namespaces to the host's: 128 instances made inside stopped
host root, or the job's uid, from making any), the key calls `add_key`, `request_key` and
`keyctl` (the uid's key quota: 200 keys made other sandboxes' fresh session keyrings fail with
EDQUOT), and `memfd_create` (memory held in unmapped memfds is resident in no process, so the
memory watch of the path without a cgroup could not see it). The filter is compiled here, once
per process, by libseccomp (Debian's libseccomp2, through PyPI's `pyseccomp`, which calls it over
ctypes), and exported as raw BPF; the launcher installs it with one prctl in the program's
process, after the fresh session keyring is joined and no new privileges is set
(sandbox_userns.py `load_filter`): the launcher imports nothing, so no program pays for a compile.
Syscalls of another ABI than the native one (32-bit calls on x86_64) kill the program: libseccomp's
default for a foreign architecture.
`SeccompMissing` names what is missing where the library is absent; the sandbox then refuses.
What it is not: the namespaces or the limits (sandbox_launcher.py), nor hand-written BPF.
"""

from __future__ import annotations

import errno
import functools
import tempfile

# the calls denied, with why: each reaches a per-uid quota that the sandbox's namespaces share
DENIED = (
    "inotify_init", "inotify_init1", "inotify_add_watch",  # fs.inotify.max_user_instances/watches
    "fanotify_init", "fanotify_mark",
    "add_key", "request_key", "keyctl",  # kernel.keys.maxkeys/maxbytes of the uid
    "memfd_create",  # memory no process holds resident: invisible to the watch without a cgroup
)
INSTALL = ("install PyPI's pyseccomp (a dependency of this package: pip install pyseccomp) and "
           "Debian's libseccomp2 (apt-get install libseccomp2; other systems: libseccomp)")


class SeccompMissing(RuntimeError):
    """libseccomp or its Python binding is absent: no program may run without the filter."""


@functools.cache
def filter_bpf() -> bytes:
    """The filter as raw BPF (an array of struct sock_filter); SeccompMissing where it cannot be
    compiled here."""
    try:
        import pyseccomp
    except ImportError as exc:
        raise SeccompMissing(f"the code sandbox's seccomp filter needs pyseccomp ({exc}): {INSTALL}") from None
    except (RuntimeError, OSError) as exc:  # pyseccomp raises RuntimeError without libseccomp.so
        raise SeccompMissing(f"the code sandbox's seccomp filter needs libseccomp ({exc}): {INSTALL}") from None
    deny = pyseccomp.ERRNO(errno.EPERM)
    rules = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    for name in DENIED:
        try:
            rules.add_rule(deny, name)
        except (ValueError, OSError, RuntimeError):
            continue  # a call this architecture does not have (inotify_init on aarch64)
    with tempfile.TemporaryFile() as f:
        rules.export_bpf(f)
        f.seek(0)
        bpf = f.read()
    if not bpf or len(bpf) % 8:
        raise SeccompMissing(f"libseccomp exported {len(bpf)} bytes, not a BPF program: {INSTALL}")
    return bpf
