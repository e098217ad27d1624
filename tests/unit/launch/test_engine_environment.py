"""An SGLang server's environment leaves out the engine host's library paths.

The engine host runs in the learner's environment, often after a site's `module load cuda`
(CUDA 12: LD_LIBRARY_PATH, CUDA_HOME) and with the learner's PYTHONPATH; SGLang's servers run
CUDA 13 wheels and their own torch from `launch.engine_python`, and the loader searches
LD_LIBRARY_PATH before a wheel's RUNPATH. A fake SGLang interpreter started through the engine
host's own start path (a real process) writes the environment it got; darl-engine, which runs
in the learner's environment, keeps everything."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from megatron_darl.config import load_config
from megatron_darl.engine.command import SGLANG_DROPPED_ENV, engine_specs
from megatron_darl.launch.engine_host import EngineHost
from megatron_darl.launch.supervisor import Supervisor

SITE = {"LD_LIBRARY_PATH": "/opt/cuda-12.4/lib64", "LD_PRELOAD": "/opt/site/libhook.so", "CUDA_HOME": "/opt/cuda-12.4",
        "CUDA_PATH": "/opt/cuda-12.4", "PYTHONPATH": "/learner/site-packages", "NCCL_DEBUG": "WARN"}


def _specs(python: str, *over: str, backend: str = "sglang"):
    cfg = load_config(None, ["model.hf_dir=/m", f"rollout.backend={backend}", *over])
    return engine_specs(cfg, [0], python=python)


def test_an_sglang_server_is_started_without_the_hosts_library_paths(tmp_path, monkeypatch):
    dump = tmp_path / "env.txt"
    fake = tmp_path / "sglang-python"
    fake.write_text(f"#!/bin/sh\nenv > {dump}.tmp && mv {dump}.tmp {dump}\nexec sleep 60\n")
    fake.chmod(0o755)
    for key, value in SITE.items():
        monkeypatch.setenv(key, value)
    [spec] = _specs(str(fake), "launch.engine_env_keep=[CUDA_HOME]")
    host = SimpleNamespace(bind="127.0.0.1", address="127.0.0.1", engines={}, log=lambda msg: None,
                           sup=Supervisor(str(tmp_path / "logs"), echo=None))
    with host.sup:
        EngineHost._start(host, spec, 0)  # the engine host's own start of engine 0
        deadline = time.monotonic() + 30
        while not dump.exists():
            assert time.monotonic() < deadline, (tmp_path / "logs" / "engine0.log").read_text()
            time.sleep(0.05)
    got = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert not {"LD_LIBRARY_PATH", "LD_PRELOAD", "CUDA_PATH", "PYTHONPATH"} & set(got), got
    assert got["CUDA_HOME"] == "/opt/cuda-12.4"  # named by launch.engine_env_keep
    assert got["NCCL_DEBUG"] == "WARN" and got["HOME"] == os.environ["HOME"]  # the rest is the host's
    assert "127.0.0.1" in got["no_proxy"] and got["SGLANG_CACHE_DIR"]  # what the spec adds


def test_darl_engine_keeps_the_whole_environment_and_the_dropped_names_are_the_documented_ones():
    environ = {**SITE, "HOME": "/home/u"}
    [ours] = _specs("/env/bin/python", backend="torch")
    assert {k: ours.environment(environ=environ)[k] for k in environ} == environ
    [sgl] = _specs("/sgl/bin/python")
    assert set(sgl.environment(environ=environ)) & set(SITE) == {"NCCL_DEBUG"}
    assert set(SGLANG_DROPPED_ENV) == {"LD_LIBRARY_PATH", "LD_PRELOAD", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT",
                                       "PYTHONPATH", "PYTHONHOME"}
