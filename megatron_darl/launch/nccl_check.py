"""One NCCL on both ends of a weight broadcast, checked before a run starts.

What it is: `nccl_checks(cfg)`, part of preflight: with `rollout.weight_sync=distributed` and a
learner on NCCL (`parallel.backend=nccl`, or `auto` on a machine with CUDA), it asks the
learner's interpreter (`launch.python`, else this one) and the engines' (`launch.engine_python`
for SGLang servers) which NCCL their torch loads (`torch.cuda.nccl.version()`, in a subprocess
bounded by a timeout) and refuses a pair that differs, with both versions and the fix: NCCL
refuses a communicator between peers of different versions, so the first broadcast of the run
would fail on every engine. The pinned pair needs it: torch 2.13.0 (megatron-darl) pins
nvidia-nccl-cu13 2.29.7, torch 2.14.1 (sglang 0.5.23) pins 2.30.7 (docs/clusters.md, section
"Weight sync").
An interpreter that cannot run, has no torch, or a torch without NCCL (a CPU build) is named
with the key it comes from.
What it is not: the SGLang environment's own probe (`launch/engine_env.py`: sglang, driver,
devices) or anything that opens a communicator.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable

PROBE = r"""
import json
try:
    import torch
except Exception as exc:
    print(json.dumps({"error": f"cannot import torch: {type(exc).__name__}: {exc}"})); raise SystemExit
try:
    v = torch.cuda.nccl.version()
    v = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    print(json.dumps({"nccl": v, "torch": torch.__version__}))
except Exception as exc:
    print(json.dumps({"error": f"torch {torch.__version__} has no NCCL (a CPU build?): {type(exc).__name__}: {exc}",
                      "torch": torch.__version__}))
"""

# what each pinned torch loads (its nvidia-nccl-cu13 requirement, from `pip install --dry-run`)
PINNED = {"2.13.0": "2.29.7", "2.14.1": "2.30.7"}
Probe = Callable[[str], dict]


def probe_nccl(python: str, timeout_s: float = 60.0) -> dict:
    """{"nccl": version, "torch": version} of `python`'s torch, or {"error": why}."""
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f}s"}
    except OSError as exc:
        return {"error": f"cannot run it: {exc}"}
    try:
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"its probe failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[-300:]}"}
    return found if isinstance(found, dict) and ("nccl" in found or "error" in found) else \
        {"error": f"its probe answered {out.stdout.strip()[-200:]!r}"}


def uses_nccl(cfg, cuda: bool | None = None) -> bool:
    """Whether the learner's side of the weight broadcast is NCCL (`parallel.backend`)."""
    if cfg.parallel.backend != "auto":
        return cfg.parallel.backend == "nccl"
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return cuda


def nccl_checks(cfg, probe: Probe = probe_nccl, cuda: bool | None = None) -> list[str]:
    """Problems that stop a distributed weight sync on NCCL before it starts (see the module)."""
    from megatron_darl.launch.engine_env import engine_python

    rc = cfg.rollout
    if rc.weight_sync != "distributed" or not uses_nccl(cfg, cuda) or (rc.backend == "sglang" and rc.engine_urls):
        return []  # external servers (rollout.engine_urls) run wherever their owner put them
    learner = cfg.launch.python or sys.executable
    engine = engine_python(cfg)
    if engine == learner:
        return []  # one interpreter, one NCCL
    sides = [("launch.python" if cfg.launch.python else "the learner's interpreter", learner),
             ("launch.engine_python", engine)]
    found = [probe(python) for _, python in sides]
    errors = [f"{key} ({python!r}): weight_sync=distributed on NCCL needs its torch's NCCL version: {f['error']}"
              for (key, python), f in zip(sides, found, strict=True) if "error" in f]
    if errors or found[0]["nccl"] == found[1]["nccl"]:
        return errors
    return [_mismatch(sides, found)]


def _mismatch(sides: list[tuple[str, str]], found: list[dict]) -> str:
    (lkey, lpy), (ekey, epy) = sides
    have = [f"NCCL {f['nccl']} (torch {f.get('torch', '?')}) in {key} {py!r}"
            for (key, py), f in zip(sides, found, strict=True)]
    newer = max(found, key=lambda f: tuple(int(x) for x in f["nccl"].split(".") if x.isdigit()))["nccl"]
    return (f"rollout.weight_sync=distributed: the learner and the engines load different NCCLs "
            f"({have[0]}; {have[1]}); "
            f"NCCL refuses a communicator between different versions, so every broadcast would fail. Install the "
            f"same NCCL in both, e.g. the newer one in the other environment: `<python> -m pip install --no-deps "
            f"nvidia-nccl-cu13=={newer}` (nvidia-nccl-cu12 for a CUDA 12 torch; docs/clusters.md, section "
            f"\"Weight sync\"), or use rollout.weight_sync=disk")
