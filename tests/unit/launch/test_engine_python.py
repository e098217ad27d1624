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
    assert (engine_python(_cfg("rollout.backend=sglang", "launch.engine_python=/opt/sgl/bin/python"))
            == "/opt/sgl/bin/python")
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


# ---- the same environment checked where the job is submitted, before the queue wait ------------

def _slurm_sglang(*over: str):
    return _cfg("launch.mode=slurm", "rollout.backend=sglang", "launch.rollout_nodes=1", "rollout.num_engines=8",
                "launch.rollout.gpus_per_node=8", *over)


def test_submit_refuses_an_sglang_recipe_without_a_usable_engine_python(tmp_path):
    from megatron_darl.launch.engine_env import submit_checks

    [err] = submit_checks(_slurm_sglang())
    assert err.startswith("launch.engine_python is unset") and "requirements-sglang.txt" in err
    missing = os.path.join(str(tmp_path), "sglang-env", "bin", "python")
    [err] = submit_checks(_slurm_sglang(f"launch.engine_python={missing}"))
    assert err.startswith(f"launch.engine_python={missing}: no such executable file")
    [err] = submit_checks(_slurm_sglang(f"launch.engine_python={_fake_python(tmp_path, '0.4.9')}"))
    assert "launch.engine_python=" in err and f"sglang 0.4.9; the client speaks sglang {SGLANG_VERSION}" in err
    old_driver = _fake_python(tmp_path, SGLANG_VERSION, driver_cuda=12040)
    [err] = submit_checks(_slurm_sglang(f"launch.engine_python={old_driver}"))
    assert "needs driver 580 or newer" in err and "where the job is submitted" in err


def test_submit_passes_a_good_environment_on_a_machine_without_gpus_and_skips_what_it_does_not_start(tmp_path):
    from megatron_darl.launch.engine_env import submit_checks

    login = _fake_python(tmp_path, SGLANG_VERSION, driver_cuda=None, devices=None,
                         cuda_error="no NVIDIA driver (libcuda.so.1): not found")
    assert submit_checks(_slurm_sglang(f"launch.engine_python={login}")) == []  # the nodes are probed at start
    assert submit_checks(_slurm_sglang(f"launch.engine_python={_fake_python(tmp_path, SGLANG_VERSION)}")) == []
    assert submit_checks(_cfg("launch.mode=slurm", "launch.rollout_nodes=1")) == []  # darl-engine: ours
    assert submit_checks(_cfg("launch.mode=slurm", "rollout.backend=sglang", "rollout.engine_urls=[http://h:1]")) == []


def test_run_slurm_stops_before_submitting(capsys):
    from megatron_darl.launch.slurm import run_slurm

    assert run_slurm(_slurm_sglang()) == 1
    err = capsys.readouterr().err
    assert "cannot place this run on Slurm" in err and "launch.engine_python is unset" in err
