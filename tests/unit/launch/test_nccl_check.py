"""One NCCL on both ends of a distributed weight sync, refused at preflight otherwise.

Two fake interpreters (small executables answering the probe as a torch with a given NCCL would,
real subprocesses) stand for the learner's environment (torch 2.13.0) and SGLang's (torch
2.14.1); the real interpreter is probed as it is (a CPU build of torch reports no NCCL)."""

from __future__ import annotations

import json
import os
import stat
import sys

from megatron_darl.config import load_config
from megatron_darl.launch import preflight as preflight_mod
from megatron_darl.launch.nccl_check import nccl_checks, probe_nccl


def _python(tmp_path, name: str, answer: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho '{answer}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _torch(tmp_path, torch: str, nccl: str) -> str:
    return _python(tmp_path, f"python-torch-{torch}", json.dumps({"nccl": nccl, "torch": torch}))


def _cfg(learner: str, engine: str, *over: str):
    return load_config(None, ["model.hf_dir=/m", "rollout.backend=sglang", "rollout.weight_sync=distributed",
                              "parallel.backend=nccl", f"launch.python={learner}", f"launch.engine_python={engine}",
                              *over])


def test_different_nccls_are_refused_with_both_versions_and_the_fix(tmp_path):
    learner, engine = _torch(tmp_path, "2.13.0", "2.29.7"), _torch(tmp_path, "2.14.1", "2.30.7")
    [err] = nccl_checks(_cfg(learner, engine))
    assert "NCCL 2.29.7 (torch 2.13.0) in launch.python" in err and learner in err
    assert "NCCL 2.30.7 (torch 2.14.1) in launch.engine_python" in err and engine in err
    assert "pip install --no-deps nvidia-nccl-cu13==2.30.7" in err and "rollout.weight_sync" in err
    assert 'docs/clusters.md, section "Weight sync"' in err  # where the weight-sync details are
    # preflight carries it (its other checks need a model folder: only this one is looked at here)
    assert err in preflight_mod._machine_checks(_cfg(learner, engine))


def test_one_nccl_passes_and_other_setups_are_not_probed(tmp_path):
    a, b = _torch(tmp_path, "2.13.0", "2.30.7"), _torch(tmp_path, "2.14.1", "2.30.7")
    assert nccl_checks(_cfg(a, b)) == []

    def never(python):
        raise AssertionError(f"probed {python}")

    diff = (a, _torch(tmp_path, "2.14.1", "2.29.7"))
    assert nccl_checks(_cfg(*diff, "rollout.weight_sync=disk"), probe=never) == []
    assert nccl_checks(_cfg(*diff, "parallel.backend=gloo"), probe=never) == []
    assert nccl_checks(_cfg(*diff, "parallel.backend=auto"), probe=never, cuda=False) == []
    assert nccl_checks(_cfg(*diff, "parallel.backend=auto"), cuda=True) != []
    assert nccl_checks(_cfg(*diff, "rollout.engine_urls=[http://h:1]"), probe=never) == []
    assert nccl_checks(_cfg(a, "", "rollout.backend=torch"), probe=never) == []  # darl-engine: our interpreter


def test_an_interpreter_without_torch_nccl_or_at_all_is_named_with_its_key(tmp_path):
    learner = _torch(tmp_path, "2.13.0", "2.29.7")
    no_torch = _python(tmp_path, "python-no-torch", json.dumps({"error": "cannot import torch: ModuleNotFoundError"}))
    [err] = nccl_checks(_cfg(learner, no_torch))
    assert err.startswith(f"launch.engine_python ({no_torch!r})") and "cannot import torch" in err
    [err] = nccl_checks(_cfg(learner, os.path.join(str(tmp_path), "missing")))
    assert "launch.engine_python" in err and "cannot run it" in err
    silent = _python(tmp_path, "python-silent", "")
    [err] = nccl_checks(_cfg(learner, silent))
    assert "launch.engine_python" in err and "probe failed" in err
    # the real probe in a real interpreter: this machine's torch is a CPU build (no NCCL), or has one
    found = probe_nccl(sys.executable)
    assert ("no NCCL" in found["error"]) if "error" in found else found["nccl"].count(".") >= 1


def test_a_hung_interpreter_is_bounded(tmp_path):
    hung = _python(tmp_path, "python-hung", "x'; exec sleep 30; echo '")
    found = probe_nccl(hung, timeout_s=1.0)
    assert "no answer within 1s" in found["error"]
