"""Learner <-> manager files: atomic replacement, change detection, clear errors."""

from __future__ import annotations

import json
import os
import threading

import pytest

from megatron_darl.channel.weight_notice import (
    NoticePoller,
    RolloutStatus,
    WeightNotice,
    publish_notice,
    read_notice,
    read_status,
    write_status,
)
from megatron_darl.types import WeightVersion


def test_notice_round_trip_and_poller_reports_changes_once(tmp_path):
    path = str(tmp_path / "sub" / "notice.json")
    poller = NoticePoller(path)
    assert poller.poll() is None and read_notice(path) is None  # no file yet
    n1 = WeightNotice(WeightVersion(1, "disk", "/w/1", 123))
    publish_notice(path, n1)
    assert read_notice(path) == n1 and poller.poll() == n1 and poller.poll() is None
    n2 = WeightNotice(WeightVersion(1, "disk", "/w/1", 123), state_request="/ckpt/rollout.json")
    publish_notice(path, n2)
    assert poller.poll() == n2 and poller.poll() is None
    assert [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".tmp-")] == []


def test_readers_never_see_a_torn_notice(tmp_path):
    path = str(tmp_path / "notice.json")
    publish_notice(path, WeightNotice(WeightVersion(0, "shm", "/dev/shm/darl/v0")))
    big = "x" * 200_000  # a large payload makes a non-atomic write observable
    stop, seen, errors = threading.Event(), [], []

    def read():
        while not stop.is_set():
            try:
                n = read_notice(path)
                seen.append(n.weights.version)
            except Exception as exc:  # a torn file would fail to parse
                errors.append(exc)

    t = threading.Thread(target=read)
    t.start()
    for v in range(1, 60):
        publish_notice(path, WeightNotice(WeightVersion(v, "disk", big)))
    stop.set()
    t.join()
    assert errors == [] and seen and seen == sorted(seen)


def test_bad_notice_names_the_file(tmp_path):
    path = tmp_path / "notice.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="notice.json: not a valid JSON notice"):
        read_notice(str(path))
    path.write_text('{"weights": {"version": 1}}')
    with pytest.raises(ValueError, match="notice.json: bad weight version"):
        read_notice(str(path))


def test_a_notice_names_the_weight_sync_setting_and_one_written_as_kind_still_reads(tmp_path):
    """`WeightVersion.weight_sync` was `kind`: a notice a learner of before the rename wrote
    (same file, old key) reads as the same version."""
    path = tmp_path / "notice.json"
    publish_notice(str(path), WeightNotice(WeightVersion(2, "distributed", "10.0.0.1#v2", 8)))
    written = json.loads(path.read_text())["weights"]
    assert written == {"version": 2, "weight_sync": "distributed", "location": "10.0.0.1#v2", "num_bytes": 8}
    written["kind"] = written.pop("weight_sync")
    path.write_text(json.dumps({"weights": written}))
    assert read_notice(str(path)).weights == WeightVersion(2, "distributed", "10.0.0.1#v2", 8)


def test_status_round_trip(tmp_path):
    path = str(tmp_path / "status.json")
    st = RolloutStatus(version=4, groups_written=10, groups_filtered=2, state_path="/s", metrics={"a": 1.5})
    write_status(path, st)
    assert read_status(path) == st
    assert read_status(str(tmp_path / "missing.json")) is None
