"""The one engine command builder and the engine announcements."""

from __future__ import annotations

import argparse

import pytest

from megatron_darl.channel.announcements import (
    EngineAnnouncement,
    announce,
    read_announcement,
    read_announcements,
    read_restart_request,
    request_restart,
)
from megatron_darl.config import load_config
from megatron_darl.engine.command import engine_specs


def _parse_embedded(argv: list[str]) -> argparse.Namespace:
    """darl-engine's own parser reads the built command (no flag the server does not know)."""
    from megatron_darl.engine import server as engine_server

    seen = {}
    real = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        seen["ns"] = real(self, args, namespace)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            engine_server.main(argv)
    finally:
        argparse.ArgumentParser.parse_args = real
    return seen["ns"]


def test_embedded_command_carries_every_setting():
    cfg = load_config(None, ["model.hf_dir=/m", "rollout.max_concurrent_per_engine=96", "rollout.engine_threads=2",
                             "rollout.api_key=k", "train.seed=40", "rollout.num_engines=2"])
    specs = engine_specs(cfg, [0, 1])
    argv = specs[1].command("127.0.0.1", 31000)
    assert argv[1:3] == ["-m", "megatron_darl.engine"]
    ns = _parse_embedded(argv[3:])
    assert (ns.model, ns.host, ns.port, ns.threads, ns.max_batch, ns.seed, ns.api_key) == \
        ("/m", "127.0.0.1", 31000, 2, 96, 41, "k")
    assert specs[1].env()["OMP_NUM_THREADS"] == "2"
    assert specs[0].command("h", 1) != specs[1].command("h", 1)  # each engine its own seed


def test_sglang_command_and_gpu_split():
    cfg = load_config(None, ["model.hf_dir=/m", "rollout.backend=sglang", "rollout.max_concurrent_per_engine=128",
                             "launch.engine_gpus=2", "launch.engine_args=[--mem-fraction-static,0.8]"])
    specs = engine_specs(cfg, [4, 5], gpus=["0", "1", "2", "3"])
    argv = specs[1].command("0.0.0.0", 30000)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--model-path"] == "/m" and flags["--tp-size"] == "2" and flags["--max-running-requests"] == "128"
    assert flags["--port"] == "30000" and flags["--random-seed"] == str(cfg.train.seed + 5)
    assert "--skip-tokenizer-init" in argv and argv[-2:] == ["--mem-fraction-static", "0.8"]
    assert [s.env()["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="launch.engine_gpus=2 GPUs; only 3"):
        engine_specs(cfg, [0, 1], gpus=["0", "1", "2"])


def test_sglang_flags_are_sglang_0_5_23_server_args():
    """The flags are SGLang's (read from sglang 0.5.23's server_args / arg_groups): a renamed or
    misspelled one would make every server refuse to start."""
    known = {"--model-path", "--host", "--port", "--tp-size", "--random-seed", "--max-running-requests",
             "--skip-tokenizer-init", "--weight-version", "--api-key"}
    cfg = load_config(None, ["model.hf_dir=/m", "rollout.backend=sglang", "rollout.api_key=k"])
    argv = engine_specs(cfg, [0], gpus=["0"])[0].command("h", 1)
    assert {a for a in argv if a.startswith("--")} == known


def _ann(attempt: str, index: int, generation: int) -> EngineAnnouncement:
    return EngineAnnouncement(attempt=attempt, index=index, url=f"http://h:{1000 + generation}", pid=1, node="n",
                              generation=generation, log="l", probe=attempt)


def test_announcements_of_another_attempt_are_invisible(tmp_path):
    d = str(tmp_path)
    announce(d, _ann("5.0", 0, 0))
    announce(d, _ann("5.1", 1, 0))
    assert read_announcement(d, 0, "5.1") is None
    assert list(read_announcements(d, "5.1", 2)) == [1]
    announce(d, _ann("5.1", 0, 3))
    assert read_announcements(d, "5.1", 2)[0].url == "http://h:1003"


def test_restart_requests_name_attempt_and_generation(tmp_path):
    d = str(tmp_path)
    assert read_restart_request(d, 2, "a") is None
    request_restart(d, 2, "a", 4)
    assert read_restart_request(d, 2, "a") == 4
    assert read_restart_request(d, 2, "b") is None


def test_each_sglang_server_compiles_into_its_own_node_local_cache(tmp_path, monkeypatch):
    """8 cold servers of a node used to share one JIT cache under ~/.cache (often a network disk)."""
    import glob
    import os
    import re
    import zipfile

    from tests.helpers.sglang_release import CACHE, fetch_release

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/home/.triton")  # a site-wide setting does not win
    cfg = load_config(None, ["model.hf_dir=/m", "rollout.backend=sglang"])
    envs = [s.env() for s in engine_specs(cfg, [8, 9], gpus=["0", "1"])]
    roots = [e["SGLANG_CACHE_DIR"] for e in envs]
    assert roots[0] != roots[1] and all(r.startswith(str(tmp_path)) for r in roots)
    assert envs[0]["TRITON_CACHE_DIR"] == os.path.join(roots[0], "triton")
    # the keys are the ones sglang 0.5.23 redirects under SGLANG_CACHE_DIR (srt/environ.py)
    fetch_release()
    (wheel,) = glob.glob(os.path.join(CACHE, "sglang-0.5.23", "sglang-0.5.23-*.whl"))
    src = zipfile.ZipFile(wheel).read("sglang/srt/environ.py").decode()
    body = src[src.index("def third_party_cache_defaults"):src.index("def redirect_third_party_caches")]
    assert set(re.findall(r'"([A-Z_]+)":', body)) - {"TILELANG_CACHE_DIR"} <= set(envs[0])
    explicit = load_config(None, ["model.hf_dir=/m", "rollout.backend=sglang", "launch.engine_cache_dir=/local/c"])
    assert engine_specs(explicit, [0], gpus=["0"])[0].env()["SGLANG_CACHE_DIR"] == "/local/c/engine0"
    assert "SGLANG_CACHE_DIR" not in engine_specs(load_config(None, ["model.hf_dir=/m"]), [0])[0].env()


def test_sglang_never_gets_the_untempered_logprob_switch():
    """SGLANG_RETURN_ORIGINAL_LOGPROB would make SGLang return untempered log-probs, which the
    learner (log_softmax(logits / T)) does not compute: dropped even when engine_env_keep names it."""
    environ = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "HOME": "/home/u"}
    for keep in ([], ["SGLANG_RETURN_ORIGINAL_LOGPROB"]):
        cfg = load_config(None, ["model.hf_dir=/m", "rollout.backend=sglang", f"launch.engine_env_keep={keep}"])
        got = engine_specs(cfg, [0])[0].environment(environ=environ)
        assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in got and got["HOME"] == "/home/u"
