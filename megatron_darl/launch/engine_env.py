"""The environment a rollout node's engines run in, checked before any server starts.

What it is: `engine_python(cfg)` (SGLang servers run from SGLang's own environment,
`launch.engine_python`: sglang pins another torch than megatron-darl) and
`check_sglang_python(python)`, which runs a probe in that interpreter and refuses, naming the
interpreter and the key, an environment that cannot serve: sglang missing or another release
than the client speaks, an NVIDIA driver older than the CUDA its torch is built for (sglang
0.5.23 is a CUDA 13 stack: torch 2.14.1, flashinfer cu13, cuda-python >= 13, so driver >= 580),
or a `torch.cuda.init()` that fails: one line in the engine host's error, before any server
starts. `submit_checks(cfg)` runs the same probe where a Slurm job is submitted (`launch/slurm.py`),
before the queue wait: an SGLang recipe whose engines the job starts needs `launch.engine_python`
set to an interpreter that exists and has the pinned sglang, and where the submitting machine
has an NVIDIA driver, it must meet the floor of that environment's CUDA (the rollout nodes are probed again at start).
What it is not: the engine command (`engine/command.py`) or the engine host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# CUDA 13.0 needs an NVIDIA driver of the R580 series or newer (NVIDIA's CUDA release notes)
DRIVER_FLOOR = {13: "580", 12: "525"}

PROBE = r"""
import ctypes, json, sys
out = {}
try:
    import sglang
    out["sglang"] = sglang.__version__
except Exception as exc:
    print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
try:
    v = ctypes.c_int()
    if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
        out["driver_cuda"] = v.value  # the newest CUDA the installed driver runs, e.g. 13000
except OSError as exc:
    out["cuda_error"] = f"no NVIDIA driver (libcuda.so.1): {exc}"
try:
    import torch
    out["torch"], out["torch_cuda"] = torch.__version__, torch.version.cuda
    if "cuda_error" not in out:
        torch.cuda.init()
        out["devices"] = torch.cuda.device_count()
except Exception as exc:
    out.setdefault("cuda_error", f"torch.cuda.init(): {type(exc).__name__}: {exc}")
print(json.dumps(out))
"""


def engine_python(cfg) -> str:
    """The interpreter that runs this node's engines: SGLang's own environment for SGLang servers
    (`launch.engine_python`), megatron-darl's for `darl-engine`."""
    own = cfg.launch.python or sys.executable
    return (cfg.launch.engine_python or own) if cfg.rollout.backend == "sglang" else own


def check_sglang_python(python: str, timeout_s: float = 120.0, need_gpus: bool = True) -> dict:
    """Refuse an SGLang environment that cannot serve (see the module docstring); returns what
    the probe found (versions, driver, devices). `need_gpus=False` (at submit): the driver is
    checked only where there is one, and devices not at all."""
    from megatron_darl.rollout.sglang_requests import SGLANG_VERSION

    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot run the SGLang interpreter {python!r} (launch.engine_python): {exc}") from exc
    try:
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"the SGLang interpreter {python!r} (launch.engine_python) failed its probe (exit "
                           f"{out.returncode}): {(out.stderr or out.stdout).strip()[-300:]}") from None
    if "import_error" in found:
        raise RuntimeError(f"{python!r} cannot import sglang (launch.engine_python; install "
                           f"requirements-sglang.txt in that environment): {found['import_error'][-300:]}")
    if found.get("sglang") != SGLANG_VERSION:
        raise RuntimeError(f"{python!r} has sglang {found.get('sglang')}; the client speaks sglang {SGLANG_VERSION} "
                           f"(requirements-sglang.txt, launch.engine_python)")
    _check_driver(python, found)
    if "cuda_error" in found and need_gpus:
        raise RuntimeError(f"SGLang's environment {python!r} (launch.engine_python) cannot use the GPUs: "
                           f"{found['cuda_error'][-300:]}")
    return found


def _check_driver(python: str, found: dict) -> None:
    need, have = found.get("torch_cuda"), found.get("driver_cuda")
    if not need or not have:
        return
    major, minor = (int(x) for x in str(need).split(".")[:2])
    if have < major * 1000 + minor * 10:
        floor = DRIVER_FLOOR.get(major)
        raise RuntimeError(
            f"the NVIDIA driver runs CUDA up to {have // 1000}.{have % 1000 // 10}, but torch "
            f"{found.get('torch')} in SGLang's environment {python!r} (launch.engine_python) is built for CUDA "
            f"{need}" + (f": sglang {found.get('sglang')} needs driver {floor} or newer" if floor else ""))


def submit_checks(cfg, timeout_s: float = 120.0) -> list[str]:
    """Problems of the SGLang environment found before a Slurm job is submitted (see the module
    docstring); [] for darl-engine and for servers the run does not start (rollout.engine_urls)."""
    if cfg.rollout.backend != "sglang" or cfg.rollout.engine_urls:
        return []
    python = cfg.launch.engine_python
    if not python:
        return ["launch.engine_python is unset: rollout.backend=sglang starts SGLang servers with the Python of "
                "SGLang's own environment (pip install -r requirements-sglang.txt there; sglang pins another torch "
                "than megatron-darl); set launch.engine_python=/path/to/sglang-env/bin/python"]
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return [f"launch.engine_python={python}: no such executable file on this machine (the rollout nodes run it "
                f"from the same path: a shared file system)"]
    try:
        check_sglang_python(python, timeout_s, need_gpus=False)
    except RuntimeError as exc:
        return [f"launch.engine_python={python}: {exc}" + (" (the NVIDIA driver of this machine, where the job is "
                                                           "submitted)" if "driver runs CUDA" in str(exc) else "")]
    return []
