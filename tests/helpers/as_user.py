"""Run a command as an unprivileged uid, from root, with this interpreter still reachable.

What it is: `as_user(uid, argv)`, the command line that runs `argv` as `uid` (no groups, no
capabilities), for the tests and the bench that must see the code sandbox the way a cluster user
does while they run as root. The command is this module (`python -m tests.helpers.as_user UID --
ARGV`): in a mount namespace of its own it hides a folder closed to other users above the
interpreter (pyenv in /root, mode 700) under an empty tmpfs and binds the interpreter's install
back at its own path, as .ci/restricted_pass does, then drops to `uid` and execs `argv`.
What it is not: a sandbox (the uid sees the machine as any user does) nor usable without root.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile

from megatron_darl.rewards.sandbox_launcher import _closed_parent as closed_parent  # the launcher's own check

CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE, MS_MOVE = 0x20000, 4096, 16384, 1 << 18, 8192


def as_user(uid: int, argv: list[str]) -> list[str]:
    """The command line that runs `argv` as `uid`; run it as root, from the repository root or
    with it on PYTHONPATH (tests.helpers.repo_env)."""
    return [sys.executable, "-m", "tests.helpers.as_user", str(uid), "--", *argv]


def user_folder(uid: int, prefix: str) -> str:
    """A fresh folder under /tmp that `uid` owns (pytest's own are closed to other users)."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chown(path, uid, uid)
    return path


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"as_user: mount({source} on {target}): {os.strerror(err)}")


def _expose_interpreter(libc) -> None:
    """In our own mount namespace: every install of this interpreter reachable by any uid."""
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "as_user: unshare(mount namespace) (root needed)")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    hidden: set[str] = set()
    for prefix in sorted({os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}):
        closed = closed_parent(prefix)
        if closed is None:
            continue
        stage = tempfile.mkdtemp(prefix="darl-as-user-")
        _mount(libc, prefix, stage, None, MS_BIND | MS_REC)
        if closed not in hidden:
            _mount(libc, "tmpfs", closed, "tmpfs", 0, "size=1m,mode=755")
            hidden.add(closed)
        os.makedirs(prefix, exist_ok=True)
        _mount(libc, stage, prefix, None, MS_MOVE)
        os.rmdir(stage)


def main() -> None:
    uid, sep, *argv = sys.argv[1:]
    if sep != "--" or not argv:
        raise SystemExit("usage: python -m tests.helpers.as_user UID -- COMMAND [ARGS...]")
    _expose_interpreter(ctypes.CDLL(None, use_errno=True))
    os.setgroups([])
    os.setgid(int(uid))
    os.setuid(int(uid))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
