"""Shared test harnesses and fixtures' building blocks, imported as `tests.helpers.<module>`.

One copy of each: the end-to-end run harness (`e2e`), the Slurm harness (`slurm`), the SGLang
release reader (`sglang_release`) and its protocol stand-in (`sglang_standin`), naive reference
maths (`algo_reference`), subprocess workers (`learner_worker`, `ring_workers`,
`ckpt_megatron_check`), the synchronous reference loop (`sync_reference`), user reward functions
for the pool tests (`reward_fns`), the checks for what a machine can do (`network`,
`sandbox`), and a command run as an unprivileged uid from root (`as_user`). Scripts among them
run as `python -m tests.helpers.<name>` from the repository root.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root


def repo_env(env: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`env` (default: this process's) with the repository root first on PYTHONPATH, so that a
    child started as `python -m tests.helpers.<name>` (or importing megatron_darl from this
    checkout) finds it whatever its working folder."""
    base = dict(os.environ if env is None else env)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p)
    base.update(extra)
    return base
