"""Which interpreter runs a rollout node's engines, and the refusal of an SGLang environment
that cannot serve: SGLang pins another torch than megatron-darl, so its servers run from their own
environment (`launch.engine_python`); a missing sglang, another release, a driver older than the
CUDA of SGLang's torch, or a failing `torch.cuda.init()` is named before any engine starts, with
the key to change."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from megatron_darl.config import load_config
from megatron_darl.launch.engine_env import check_sglang_python, engine_python
from megatron_darl.rollout.sglang_requests import SGLANG_VERSION


def _cfg(*over: str):
    return load_config(None, ["model.hf_dir=/m", *over])


def _fake_python(tmp_path, version: str, **probe) -> str:
    """An executable that answers the probe as an interpreter with sglang `version` would (on a
    GPU node with a CUDA 13 driver unless `probe` says otherwise)."""
    answer = {"sglang": version, "torch": "2.14.1", "torch_cuda": "13.0", "driver_cuda": 13000, "devices": 8, **probe}
    path = tmp_path / f"python-sglang-{version}"
    path.write_text(f"#!/bin/sh\necho '{json.dumps(answer)}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_sglang_servers_use_their_own_environment_and_darl_engines_ours():
    assert engine_python(_cfg("rollout.backend=sglang", "launch.engine_python=/opt/sgl/bin/python")) == "/opt/sgl/bin/python"
    assert engine_python(_cfg("rollout.backend=sglang", "launch.python=/env/bin/python")) == "/env/bin/python"
    assert engine_python(_cfg("launch.engine_python=/opt/sgl/bin/python")) == sys.executable  # darl-engine
    assert engine_python(_cfg("launch.python=/env/bin/python", "launch.engine_python=/x")) == "/env/bin/python"


def test_the_pinned_release_passes(tmp_path):
    check_sglang_python(_fake_python(tmp_path, SGLANG_VERSION))


def test_another_release_is_refused_naming_both_versions_and_the_key(tmp_path):
    with pytest.raises(RuntimeError, match=rf"sglang 0\.4\.9.*{SGLANG_VERSION}.*launch\.engine_python"):
        check_sglang_python(_fake_python(tmp_path, "0.4.9"))


def test_an_environment_without_sglang_is_refused(tmp_path):
    # this test environment has no sglang (it cannot: sglang pins another torch)
    with pytest.raises(RuntimeError, match=r"cannot import sglang \(launch\.engine_python"):
        check_sglang_python(sys.executable)
    with pytest.raises(RuntimeError, match="cannot run the SGLang interpreter"):
        check_sglang_python(os.path.join(str(tmp_path), "no-such-python"))


def test_a_driver_older_than_sglangs_cuda_is_refused_naming_the_floor(tmp_path):
    with pytest.raises(RuntimeError, match=r"driver runs CUDA up to 12\.4, but torch 2\.14\.1 .* built for CUDA "
                                           r"13\.0: sglang 0\.5\.23 needs driver 580 or newer"):
        check_sglang_python(_fake_python(tmp_path, SGLANG_VERSION, driver_cuda=12040))


def test_the_real_probe_on_a_machine_without_a_usable_gpu(tmp_path, monkeypatch):
    """The probe itself, run by a real interpreter with an sglang of the pinned version: where
    CUDA cannot start (here: no driver, CPU torch), it says so before any server starts."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text(f"__version__ = {SGLANG_VERSION!r}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    import torch

    if torch.cuda.is_available():
        assert check_sglang_python(sys.executable)["devices"] >= 1
        return
    with pytest.raises(RuntimeError, match=r"cannot use the GPUs: (no NVIDIA driver|torch\.cuda\.init)"):
        check_sglang_python(sys.executable)
