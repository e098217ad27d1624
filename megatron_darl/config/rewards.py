"""The `reward` config section: the reward pool and the code sandbox's limits.

What it is: `RewardConfig`, each field documented where it is declared, with its checks.
What it is not: the graders or the pool (`rewards/`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    """How rewards are computed: a pool of worker processes, each grading one item at a time."""

    num_workers: int = 2  # worker processes; a worker grades one item at a time
    timeout_s: float = 30.0  # per-item wall limit; past it the worker is killed, the item scores 0
    fn: str | None = None  # user reward function "pkg.module:function" for kind "custom"
    code_cpu_s: int = 10  # sandbox: CPU seconds per program run (RLIMIT_CPU)
    code_wall_s: float = 15.0  # sandbox: wall seconds per program run
    # sandbox: MiB of address space per process (RLIMIT_AS) and of memory for the program as a whole
    # (a memory cgroup, or where none can be made, the resident memory of its processes together)
    code_memory_mb: int = 1024
    code_max_procs: int = 32  # sandbox: processes of the sandbox uid (RLIMIT_NPROC)
    code_max_file_mb: int = 16  # sandbox: largest file written, MiB (RLIMIT_FSIZE)

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for every invalid value; empty when the config is usable."""
        problems = []
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            problems.append(("num_workers", f"must be an integer >= 1, got {self.num_workers!r}"))
        for name in ("timeout_s", "code_cpu_s", "code_wall_s", "code_memory_mb",
                     "code_max_procs", "code_max_file_mb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                problems.append((name, f"must be a number > 0, got {value!r}"))
        if isinstance(self.code_memory_mb, (int, float)) and 0 < self.code_memory_mb < 64:
            problems.append(("code_memory_mb", "below 64 MiB the Python interpreter cannot start"))
        if self.fn is not None:
            module, sep, name = str(self.fn).partition(":")
            if not sep or not module or not name.isidentifier():
                problems.append(("fn", f"must look like 'pkg.module:function', got {self.fn!r}"))
        return problems

    def validate(self) -> None:
        """Raise ValueError naming every invalid field."""
        problems = self.check()
        if problems:
            raise ValueError(
                "RewardConfig: " + "; ".join(f"{name}: {msg}" for name, msg in problems)
            )
