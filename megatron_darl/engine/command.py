"""How an engine is started and how it says where it is: the one engine command builder, and
the announcements engines are found by.

What it is: `EngineSpec` (everything needed to start engine i: backend, model, threads or GPUs,
batch size, seed, API key) with `command(host, port)`, `env()` (what it adds to its host's
environment) and `environment()` (its whole environment: an SGLang server's leaves out the
host's library-path variables, `SGLANG_DROPPED_ENV`, unless `launch.engine_env_keep` names
them, and always `SGLANG_REFUSED_ENV`), built from a run's config by
`engine_specs(cfg, indices, gpus)`; the launcher's engine hosts and the manager's standalone
restarter both start engines only through it, so a restarted engine gets exactly the flags its
first start had. `EngineAnnouncement`: the small JSON an engine host writes to
`<engines_dir>/engine<i>.json` once engine i answers /health_generate (URL, pid, node, a
generation that grows with each restart); readers (the run session, the rollout manager) take
the current address of every engine from there. A restart request
(`<engines_dir>/engine<i>.restart`) asks the host of engine i to replace the generation named
in it; `<engines_dir>/stop` (holding the attempt id) tells every host of that attempt to stop.
What it is not: the process supervision (`launch/engine_host.py`) or the HTTP client.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

EMBEDDED_MODULE = "megatron_darl.engine"  # darl-engine
SGLANG_MODULE = "sglang.launch_server"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# An SGLang server runs from its own environment (CUDA 13 wheels, its own torch), started from a
# host whose environment is the learner's: a site's `module load cuda` (CUDA 12) sets
# LD_LIBRARY_PATH, which the dynamic loader searches before the wheels' RUNPATH (a libnccl.so.2
# or libcudart there shadows the wheels'), LD_PRELOAD likewise, CUDA_HOME / CUDA_PATH /
# CUDA_ROOT point SGLang's JIT compilers (FlashInfer, Triton, DeepGEMM) at that toolkit, and
# PYTHONPATH / PYTHONHOME put the learner's packages (torch 2.13) before SGLang's.
SGLANG_DROPPED_ENV = ("LD_LIBRARY_PATH", "LD_PRELOAD", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "PYTHONPATH",
                      "PYTHONHOME")
# Never passed to an SGLang server, whatever `launch.engine_env_keep` says: set to a true value it
# makes sglang 0.5.23 return untempered output log-probs (srt/layers/sampler.py:82, :322-323),
# while the learner computes log_softmax(logits / rollout.temperature) (docs/ALGORITHM.md,
# "Truncated sampling"): at a temperature other than 1 every ratio would be wrong.
SGLANG_REFUSED_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)


@dataclass
class EngineSpec:
    """Engine `index` of a run, as started on whatever port its host picks."""

    index: int
    backend: str  # "torch" (darl-engine) | "sglang"
    model_dir: str
    seed: int
    max_batch: int  # darl-engine --max-batch / SGLang --max-running-requests
    threads: int = 1  # darl-engine: torch threads (also OMP_NUM_THREADS)
    api_key: str | None = None
    tp: int = 1  # SGLang: GPUs per server (--tp-size)
    gpus: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES of this engine; [] on CPU
    extra_args: list[str] = field(default_factory=list)  # more flags for the server (launch.engine_args)
    python: str = sys.executable
    cache_dir: str = ""  # SGLang: this server's own JIT cache folder (node-local), "" for darl-engine
    keep_env: list[str] = field(default_factory=list)  # SGLang: SGLANG_DROPPED_ENV names kept (launch.engine_env_keep)
    dtype: str = "float32"  # darl-engine --dtype (rollout.engine_dtype); float32 adds no flag

    def command(self, host: str, port: int) -> list[str]:
        if self.backend == "sglang":
            argv = [self.python, "-m", SGLANG_MODULE, "--model-path", self.model_dir, "--host", host,
                    "--port", str(port), "--tp-size", str(self.tp), "--random-seed", str(self.seed),
                    "--max-running-requests", str(self.max_batch), "--skip-tokenizer-init",
                    "--weight-version", "0"]
        else:
            argv = [self.python, "-m", EMBEDDED_MODULE, "--model", self.model_dir, "--host", host,
                    "--port", str(port), "--threads", str(self.threads), "--max-batch", str(self.max_batch),
                    "--seed", str(self.seed)]
            argv += ["--dtype", self.dtype] if self.dtype != "float32" else []
        if self.api_key:
            argv += ["--api-key", self.api_key]
        return argv + list(self.extra_args)

    def env(self, hosts: tuple[str, ...] = ()) -> dict[str, str]:
        """What the engine's environment adds to its host's; `hosts` are the addresses it is
        reached at (bind and announced), kept off any proxy with loopback."""
        out = {"OMP_NUM_THREADS": str(self.threads), **no_proxy_env(hosts)}
        if self.gpus:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        if self.cache_dir:
            out.update(sglang_cache_env(self.cache_dir))
        return out


    def environment(self, hosts: tuple[str, ...] = (), environ: Any = None) -> dict[str, str]:
        """The engine's whole environment: its host's (`environ`, default os.environ) plus
        `env(hosts)`; an SGLang server's without SGLANG_DROPPED_ENV, except the names in
        `keep_env` (`launch.engine_env_keep`), and always without SGLANG_REFUSED_ENV."""
        base = dict(os.environ if environ is None else environ)
        if self.backend == "sglang":
            for key in SGLANG_REFUSED_ENV:
                base.pop(key, None)
            for key in SGLANG_DROPPED_ENV:
                if key not in self.keep_env:
                    base.pop(key, None)
        return {**base, **self.env(hosts)}


def sglang_cache_env(base: str) -> dict[str, str]:
    """SGLang's JIT caches in `base`, laid out as sglang 0.5.23's `third_party_cache_defaults` lays
    out SGLANG_CACHE_DIR, each set explicitly (SGLang only fills those left unset, so a site's
    shared TRITON_CACHE_DIR would otherwise win): 8 cold servers of a node compiling into one
    cache under ~/.cache, often on a network file system, race and stall each other."""
    return {"SGLANG_CACHE_DIR": base, "TRITON_CACHE_DIR": os.path.join(base, "triton"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(base, "inductor"), "CUDA_CACHE_PATH": os.path.join(base, "nv"),
            "FLASHINFER_WORKSPACE_BASE": base}


def engine_cache_root(configured: str = "") -> str:
    """`launch.engine_cache_dir`, or a node-local default: $TMPDIR (else /tmp)/darl-sglang-cache-<uid>."""
    return configured or os.path.join(os.environ.get("TMPDIR") or "/tmp", f"darl-sglang-cache-{os.getuid()}")


def engine_specs(cfg: Any, indices: list[int], gpus: list[str] | None = None,
                 python: str = sys.executable) -> list[EngineSpec]:
    """The specs of engines `indices` of the run `cfg` (a RunConfig). On GPU nodes `gpus` are the
    node's devices for engines; engine k of this node gets `launch.engine_gpus` of them."""
    rc, per = cfg.rollout, max(1, cfg.launch.engine_gpus)
    cache = engine_cache_root(cfg.launch.engine_cache_dir) if rc.backend == "sglang" else ""
    gpus = list(gpus or [])
    specs = []
    for k, index in enumerate(indices):
        mine = gpus[k * per:(k + 1) * per] if gpus else []
        if gpus and len(mine) < per:
            raise ValueError(f"engine {index} needs launch.engine_gpus={per} GPUs; only {len(gpus)} on this node "
                             f"for {len(indices)} engines")
        specs.append(EngineSpec(index=index, backend=rc.backend, model_dir=cfg.model.hf_dir,
                                seed=cfg.train.seed + index, max_batch=rc.max_concurrent_per_engine,
                                threads=rc.engine_threads, api_key=rc.api_key, tp=per if mine else 1, gpus=mine,
                                extra_args=list(cfg.launch.engine_args), python=python,
                                keep_env=list(cfg.launch.engine_env_keep), dtype=rc.engine_dtype,
                                cache_dir=os.path.join(cache, f"engine{k}") if cache else ""))
    return specs


def no_proxy_env(hosts: tuple[str, ...] = (), environ: Any = None) -> dict[str, str]:
    """`no_proxy` and `NO_PROXY`, both set to the environment's entries plus loopback and `hosts`.
    HPC sites export `http_proxy` on compute nodes, and an SGLang server warms itself up with
    `requests` at 127.0.0.1 (its own `/model_info` and `/generate`): through a proxy those fail
    and the server kills itself. Nothing an engine does needs a proxy."""
    environ = os.environ if environ is None else environ
    entries = [e.strip() for key in ("no_proxy", "NO_PROXY") for e in environ.get(key, "").split(",")]
    entries += list(LOOPBACK) + [h for h in hosts if h]
    merged = ",".join(dict.fromkeys(e for e in entries if e))
    return {"no_proxy": merged, "NO_PROXY": merged}


# ---- announcements --------------------------------------------------------------------------


