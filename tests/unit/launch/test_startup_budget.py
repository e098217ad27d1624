"""The engines' startup budget counts from each engine's own start, not from the session's.

Before, `launch.startup_timeout_s` (300 s) ran from the moment the session began waiting: on a
rollout node the engine host first waits for the run info and checks SGLang's interpreter, and 8
cold SGLang servers compile their kernels at once, so the run could stop while they were still
legitimately starting."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_darl.channel.run_info import write_marker
from megatron_darl.config import load_config
from megatron_darl.launch.engine_host import host_starting_path, wait_healthy
from megatron_darl.launch.session import HostClock, make_run_info
from megatron_darl.launch.supervisor import Child


def test_sglang_gets_a_longer_default_and_an_explicit_budget_wins():
    cfg = load_config(None, ["model.hf_dir=/m"])
    assert cfg.launch.engine_startup_s("torch") == 300 and cfg.launch.engine_startup_s("sglang") == 1800
    assert load_config(None, ["model.hf_dir=/m", "launch.startup_timeout_s=90"]).launch.engine_startup_s("sglang") == 90


def test_an_engine_started_long_ago_is_out_of_time_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        child = Child("engine0", proc, str(tmp_path / "engine0.log"))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="engine 0 did not answer"):
            wait_healthy("http://127.0.0.1:9", child, 5.0, None, "engine 0", started=time.monotonic() - 10)
        assert time.monotonic() - t0 < 3  # its budget ran from its own start, 10 s ago
    finally:
        proc.kill()
        proc.wait()


def test_each_host_has_the_budget_from_when_it_began_starting_its_engines(tmp_path, monkeypatch):
    cfg = load_config(None, ["model.hf_dir=/m", f"train.run_dir={tmp_path}"])
    info = make_run_info(cfg, "r", "r", "127.0.0.1", 0)
    os.makedirs(info.engines_dir)
    write_marker(host_starting_path(info.engines_dir, 1), "an earlier attempt")  # not this attempt's
    clock = HostClock(info, hosts=2, budget_s=1.0)
    monkeypatch.setattr(HostClock, "SLACK_S", 0.5)
    write_marker(host_starting_path(info.engines_dir, 0), "r")
    assert clock.late() == ""
    time.sleep(1.1)  # the session's own budget is spent: host 1 never began, host 0 is still in its time
    assert clock.late() == "engine host 1 never began starting its engines"
    write_marker(host_starting_path(info.engines_dir, 1), "r")
    assert clock.late() == ""  # host 1 starts now, with its budget from now
    time.sleep(0.6)
    assert clock.late().startswith("engine host 0 started them")
