"""`darl-train` with `rollout.backend=sglang` against a stand-in of the pinned SGLang release.

The stand-in (`sglang_standin.py`) validates every body with sglang 0.5.23's own contract and
request classes (downloaded by `tests/sglang_release.py`) and answers as that release does
(weight_versions spans, abort shapes, 503 health while paused, the weight-update session). A few
training steps run to completion, every weight version reaches the server through
`/update_weights_from_disk` (or, with `weight_sync=distributed`, a broadcast inside the session),
no request or control call is refused, and the engine is never marked down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_darl.channel.ports import free_port
from megatron_darl.launch.engine_host import healthy
from tests.helpers import repo_env
from tests.helpers.e2e import new_run
from tests.helpers.sglang_release import require_release
from tests.helpers.sglang_standin import served_calls

STEPS = 3


def _healthy(url: str) -> bool:
    return healthy(url)


def train_against_standin(tmp_path, warm_model, **rollout):
    """`darl-train` for STEPS steps against a stand-in; (exit code, output, the stand-in's calls, run)."""
    release = require_release()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run = new_run(tmp_path, warm_model, "sglang", train={"steps": STEPS},
                  rollout={"backend": "sglang", "engine_urls": [url], "pause_mode": "abort", **rollout})
    calls = tmp_path / "calls.jsonl"
    env = repo_env(OMP_NUM_THREADS="1")
    log = open(tmp_path / "standin.log", "w")
    standin = subprocess.Popen([sys.executable, "-m", "tests.helpers.sglang_standin",
                                "--model", os.path.join(run.run_dir, "model"),
                                "--port", str(port), "--release-root", release.root, "--version", release.version,
                                "--calls", str(calls)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90
        while not _healthy(url):
            assert standin.poll() is None and time.monotonic() < deadline, (tmp_path / "standin.log").read_text()
            time.sleep(0.2)
        run.start()
        deadline = time.monotonic() + 240
        while run.proc.poll() is None:  # a refused body fails at once (the run would wait for data forever)
            refused = [c for c in served_calls(calls) if c["status"] != 200]
            assert not refused, f"the release's validation refused: {refused[:3]}"
            assert time.monotonic() < deadline, f"darl-train did not finish:\n{run.output()[-4000:]}"
            time.sleep(0.5)
        code, out = run.proc.returncode, run.output()
    finally:
        run.kill()
        standin.kill()
        standin.wait()
        log.close()
    return code, out, served_calls(calls), run


@pytest.mark.timeout(420)
def test_darl_train_against_an_sglang_standin(tmp_path, warm_model):
    code, out, served, run = train_against_standin(tmp_path, warm_model)
    refused = [c for c in served if c["status"] != 200]
    assert code == 0, out[-4000:]
    assert not refused, f"the release's validation refused: {refused[:3]}"
    assert [r["step"] for r in run.ledger()] == list(range(STEPS))
    updates = [c["body"] for c in served if c["route"] == "/update_weights_from_disk"]
    versions = [int(u["weight_version"]) for u in updates]
    assert len(versions) >= STEPS - 1 and versions == sorted(set(versions)) and versions[0] == 1, updates
    assert (any(c["route"] == "/pause_generation" for c in served)
            and any(c["route"] == "/continue_generation" for c in served))
    generated = [c for c in served if c["route"] == "/generate"]
    assert {v["version"] for c in generated for v in c["versions"]} >= {"default", "1"}
    failures = [m["rollout/engine_failures"] for m in run.metrics() if "rollout/engine_failures" in m]
    assert failures and max(failures) == 0, "the engine was never marked down"


@pytest.mark.timeout(420)
def test_darl_train_with_distributed_weight_sync_against_an_sglang_standin(tmp_path, warm_model):
    """rollout.weight_sync=distributed: every version reaches the server through one group it
    joined with the release's bodies and one broadcast per tensor, inside the release's
    weight-update session (begin, buckets, end); no weights file is read."""
    code, out, served, run = train_against_standin(tmp_path, warm_model, weight_sync="distributed")
    assert code == 0, out[-4000:]
    assert not [c for c in served if c["status"] != 200], [c for c in served if c["status"] != 200][:3]
    assert [r["step"] for r in run.ledger()] == list(range(STEPS))
    assert not [c for c in served if c["route"] == "/update_weights_from_disk" and "final_model" not in
                c["body"]["model_path"]], "a published version was read from a file"
    joins = [c["body"] for c in served if c["route"] == "/init_weights_update_group"]
    assert len(joins) == 1 and joins[0]["backend"] == "gloo" and joins[0]["rank_offset"] == 1
    versions = [int(c["body"]["weight_version"]) for c in served
                if c["route"] == "/update_weights_from_distributed" and c["body"]["weight_version"] is not None]
    assert versions == list(range(1, STEPS + 1)), versions
    # every version inside the release's weight-update session (the stand-in refuses a bucket
    # outside one: an earlier sender failed here), and no token decoded on part of one
    session = [c["route"] for c in served if c["route"] in ("/begin_weight_update", "/end_weight_update",
                                                             "/update_weights_from_distributed")]
    opened = [i for i, r in enumerate(session) if r == "/begin_weight_update"]
    assert len(opened) == STEPS and all(session[i + 1] == "/update_weights_from_distributed" for i in opened), session
    assert session.count("/end_weight_update") == STEPS and session[-1] == "/end_weight_update", session
    assert not [c for c in served if c["route"] == "/generate" and c["mixed_tokens"]]
    assert not any(d.startswith("v") for d in os.listdir(os.path.join(run.run_dir, "weights")))
    generated = [c for c in served if c["route"] == "/generate"]
    assert {v["version"] for c in generated for v in c["versions"]} >= {"default", "1"}
    fallbacks = [m["rollout/weight_sync_fallbacks"] for m in run.metrics() if "rollout/weight_sync_fallbacks" in m]
    assert fallbacks and max(fallbacks) == 0


@pytest.mark.timeout(420)
def test_darl_train_with_pause_mode_in_place_asks_for_no_flush(tmp_path, warm_model):
    """pause_mode=in_place keeps the running requests and their KV through every update, and the
    release (so the stand-in) fails an update whose flush it must refuse: every version loads,
    none asks for a flush. Whether a request is held at an update depends on the run's timing
    here; tests/unit/rollout/test_sglang_flush.py holds one on purpose and sees the refusal."""
    code, out, served, run = train_against_standin(tmp_path, warm_model, weight_sync="distributed",
                                                   pause_mode="in_place")
    assert code == 0, out[-4000:]
    assert not [c for c in served if c["status"] != 200], [c for c in served if c["status"] != 200][:3]
    last = [c["body"] for c in served if c["route"] == "/update_weights_from_distributed"
            and c["body"]["weight_version"] is not None]
    assert [int(b["weight_version"]) for b in last] == list(range(1, STEPS + 1))
    assert not any(b["flush_cache"] for b in last)
    assert any(c["route"] == "/pause_generation" and c["body"]["mode"] == "in_place" for c in served)
