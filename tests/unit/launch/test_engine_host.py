"""The engine host with real darl-engine processes: it announces each engine once healthy,
replaces one that dies or that the manager asks it to restart, with the same flags and the same
log file, and stops on the attempt's stop marker; a node that cannot read the weights folder
says so and stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from megatron_darl.channel.announcements import read_announcement, request_restart, stop_path
from megatron_darl.channel.run_info import write_marker
from megatron_darl.config import load_config, save_resolved
from megatron_darl.launch.engine_host import DIRECT, host_error_path, probe_path
from megatron_darl.launch.session import make_run_info
from tests.helpers import repo_env

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=False,
            eos_token_id=3, bos_token_id=2)


def _run(tmp_path, probe: bool = True, env: dict[str, str] | None = None):
    model = tmp_path / "model"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).save_pretrained(str(model))
    cfg = load_config(None, [f"model.hf_dir={model}", "model.tokenizer=builtin:demo",
                             f"train.run_dir={tmp_path / 'run'}",
                             "rollout.max_concurrent_per_engine=24", "train.seed=70", "launch.startup_timeout_s=120",
                             "rollout.weight_sync=disk"])
    info = make_run_info(cfg, "abcdef0123", "9.0", "127.0.0.1", 1)
    os.makedirs(info.engines_dir)
    save_resolved(cfg, info.run_dir)
    os.makedirs(info.weights_root)
    if probe:
        write_marker(probe_path(info.weights_root), info.attempt)
    info.save()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_darl.launch.engine_host", "--run-info", info.path,
                             "--attempt", info.attempt, "--address", "127.0.0.1"],
                            env=repo_env(OMP_NUM_THREADS="1", **(env or {})),
                            stdout=open(tmp_path / "host.out", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    return info, proc


def _announced(info, generation: int, proc, timeout_s: float = 150):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ann = read_announcement(info.engines_dir, 0, info.attempt)
        if ann is not None and ann.generation >= generation:
            return ann
        assert proc.poll() is None, (Path(info.run_dir).parent / "host.out").read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no announcement of generation {generation}")


def _cmdline(pid: int) -> list[str]:
    return open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--max-batch", "--seed", "--threads", "--model")}


@pytest.mark.timeout(400)
def test_host_announces_replaces_and_stops(tmp_path):
    info, proc = _run(tmp_path)
    try:
        first = _announced(info, 0, proc)
        flags = _flags(_cmdline(first.pid))
        assert flags == {"--model": str(tmp_path / "model"), "--threads": "1", "--max-batch": "24", "--seed": "70"}
        assert first.probe == info.attempt and first.log == os.path.join(info.log_dir, "engine0.log")
        os.kill(first.pid, signal.SIGKILL)  # an engine that dies is replaced: new port, same flags, same log
        second = _announced(info, 1, proc)
        assert second.url != first.url and second.pid != first.pid
        assert _flags(_cmdline(second.pid)) == flags
        with DIRECT.open(second.url + "/health_generate", timeout=10) as resp:
            assert resp.status == 200
        request_restart(info.engines_dir, 0, info.attempt, 1)  # what the manager does with a hung engine
        third = _announced(info, 2, proc)
        assert third.pid != second.pid and _flags(_cmdline(third.pid)) == flags
        log = Path(info.log_dir, "engine0.log").read_text()
        assert log.count("darl-engine: ") == 3, log  # all three generations logged in logs/
        assert not list(Path(info.run_dir).glob("engine*.log"))
        write_marker(stop_path(info.engines_dir), info.attempt)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert not os.path.exists(f"/proc/{third.pid}") or "Z" in open(f"/proc/{third.pid}/stat").read().split()[2]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(300)
def test_host_announces_with_a_dead_proxy_exported(tmp_path):
    """HPC sites export proxies on compute nodes; before, the health probe went to the proxy and
    the run stopped with "engines not ready ... not announced"."""
    proxy = {k: "http://127.0.0.1:9" for k in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY")}
    info, proc = _run(tmp_path, env={**proxy, "no_proxy": "", "NO_PROXY": ""})
    try:
        first = _announced(info, 0, proc)
        environ = dict(e.split("=", 1) for e in open(f"/proc/{first.pid}/environ").read().split("\0") if "=" in e)
        assert "127.0.0.1" in environ["no_proxy"].split(",")  # what SGLang's self-warmup needs
        write_marker(stop_path(info.engines_dir), info.attempt)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(200)
def test_a_node_that_cannot_read_the_weights_folder_says_so(tmp_path):
    info, proc = _run(tmp_path, probe=False)
    try:
        assert proc.wait(timeout=150) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = json.loads(Path(host_error_path(info.engines_dir, 0)).read_text())
    assert err["attempt"] == info.attempt
    assert "cannot read the run's weights folder" in err["message"] and "share" in err["message"]
    assert read_announcement(info.engines_dir, 0, info.attempt) is None
