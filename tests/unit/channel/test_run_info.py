"""The run-info record: every role reads the same typed record, and only its own attempt's."""

from __future__ import annotations

import json
import threading
import time

import pytest

from megatron_darl.channel.run_info import RunInfo, read_marker, wait_for_run_info, write_marker
from megatron_darl.config import load_config
from megatron_darl.launch.session import make_run_info


def _info(tmp_path, **changes) -> RunInfo:
    cfg = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path / 'run'}", "rollout.num_engines=3"])
    info = make_run_info(cfg, "0123456789", "17.0", "10.0.0.5", 29500)
    for k, v in changes.items():
        setattr(info, k, v)
    return info


def test_round_trip_keeps_every_field(tmp_path):
    info = _info(tmp_path, resume=str(tmp_path / "ckpt" / "step_00000004"), rollout_state="x.json")
    path = info.save()
    assert path == str(tmp_path / "run" / "run_info.json")
    again = RunInfo.load(path)
    assert again == info
    assert again.ring == "darl-0123456789-ring" and again.num_engines == 3
    assert (again.master_addr, again.master_port, again.attempt) == ("10.0.0.5", 29500, "17.0")
    assert again.weight_sync == "shm" and again.weights_root == "/dev/shm/darl-0123456789-weights"


def test_engines_on_rollout_nodes_publish_to_the_shared_run_folder(tmp_path):
    cfg = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path}", "launch.mode=slurm",
                             "launch.rollout_nodes=1"])
    info = make_run_info(cfg, "0123456789", "1.0", "a", 1)
    assert info.weight_sync == "disk" and info.weights_root == str(tmp_path / "weights")


def test_external_engines_are_listed_not_counted(tmp_path):
    cfg = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path}", "rollout.backend=sglang",
                             "rollout.engine_urls=[http://h:1,http://h:2]"])
    info = make_run_info(cfg, "0123456789", "a", "a", 1)
    assert info.engine_urls == ["http://h:1", "http://h:2"] and info.num_engines == 0


def test_unknown_or_missing_keys_are_named(tmp_path):
    data = _info(tmp_path).to_json()
    with pytest.raises(ValueError, match="unknown run-info keys \\['colour'\\]"):
        RunInfo.from_json({**data, "colour": 1}, "x.json")
    del data["ring"]
    with pytest.raises(ValueError, match="lacks \\['ring'\\]"):
        RunInfo.from_json(data, "x.json")
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        RunInfo.load(str(path))


def test_a_reader_waits_for_its_own_attempt(tmp_path):
    old = _info(tmp_path, attempt="17.0")
    path = old.save()
    with pytest.raises(TimeoutError, match="belongs to attempt '17.0', not '17.1'.*shares"):
        wait_for_run_info(path, "17.1", timeout_s=0.6)
    new = _info(tmp_path, attempt="17.1")
    threading.Timer(0.5, new.save).start()
    t0 = time.monotonic()
    assert wait_for_run_info(path, "17.1", timeout_s=30).attempt == "17.1"
    assert time.monotonic() - t0 < 30
    assert json.loads(open(path).read())["attempt"] == "17.1"


def test_markers(tmp_path):
    path = str(tmp_path / "engines" / "stop")
    assert read_marker(path) is None
    write_marker(path, "17.1")
    assert read_marker(path) == "17.1"


def test_distributed_keeps_its_fallback_folders_where_disk_or_shm_would_write(tmp_path):
    local = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path}", "rollout.weight_sync=distributed"])
    info = make_run_info(local, "0123456789", "1.0", "a", 1)
    assert info.weight_sync == "distributed" and info.weights_root == "/dev/shm/darl-0123456789-weights"
    remote = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path}", "rollout.weight_sync=distributed",
                                "launch.mode=slurm", "launch.rollout_nodes=1"])
    info = make_run_info(remote, "0123456789", "1.0", "a", 1)
    assert info.weight_sync == "distributed" and info.weights_root == str(tmp_path / "weights")
