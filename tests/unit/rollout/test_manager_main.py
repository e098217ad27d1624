"""`python -m megatron_darl.rollout` as the launcher starts it: a resolved YAML config,
the node's ring (created by the 'learner', this test), a weight-notice file and one engine URL.
It fills the ring with procedural prompts scored by the reward pool, honours the gate (eta=0:
one batch per version), follows a new version from the notice, answers a state request, and
exits 0 on a stop notice."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid

import pytest
import reasoning_gym  # noqa: F401  (a hard dependency: imported, never skipped)
import torch
import transformers

from megatron_darl.channel.json_files import read_json
from megatron_darl.channel.shm_ring import ShmRing
from megatron_darl.channel.weight_notice import WeightNotice, publish_notice, read_status
from megatron_darl.rollout.manager_process import EmbeddedEngineRestarter
from megatron_darl.types import WeightVersion, group_trajectories
from tests.helpers import repo_env

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=64, max_position_embeddings=1024, tie_word_embeddings=False,
            eos_token_id=3, bos_token_id=2)  # the demo tokenizer's <|im_end|> ends a response


def read_groups(ring: ShmRing, n_records: int, timeout_s: float) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n_records and time.monotonic() < deadline:
        t = ring.get_trajectory(timeout=0.2)
        if t is not None:
            out.append(t)
    return out


@pytest.mark.timeout(150)
def test_manager_process_end_to_end(tmp_path):
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).save_pretrained(str(tmp_path / "v0"))
    torch.manual_seed(1)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).save_pretrained(str(tmp_path / "v1"))
    (tmp_path / "cfg.yaml").write_text(
        f"model: {{hf_dir: {tmp_path / 'v0'}, tokenizer: 'builtin:demo'}}\n"
        "data: {source: 'reasoning_gym:chain_sum', size: 40, eval_size: 0}\n"
        f"train: {{batch_prompts: 2, run_dir: {tmp_path / 'run'}}}\n"
        "algo: {max_head_offpolicyness: 0}\n"
        "rollout: {group_size: 2, max_new_tokens: 6, request_timeout_s: 60}\n"
        "reward: {num_workers: 1}\n"
    )
    name = f"darl-main-{uuid.uuid4().hex[:8]}"
    notice, status, saved = tmp_path / "notice.json", tmp_path / "notice.json.status", tmp_path / "state.json"
    ring = ShmRing.create(name, 1 << 20)
    starter = EmbeddedEngineRestarter(str(tmp_path / "v0"), startup_timeout_s=90, log_dir=str(tmp_path))
    env = repo_env(OMP_NUM_THREADS="1", MEGATRON_DARL_CACHE=str(tmp_path / "cache"))
    proc = None

    async def start_engine():
        engine = await starter.astart_engine(0)
        await engine.aclose()
        return engine.url

    loop = asyncio.new_event_loop()
    try:
        url = loop.run_until_complete(start_engine())
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_darl.rollout", "--config", str(tmp_path / "cfg.yaml"),
             "--ring", name, "--weight-notice", str(notice), "--engine-url", url],
            env=env, cwd=str(tmp_path), stdout=open(tmp_path / "manager.log", "w"), stderr=subprocess.STDOUT)
        first = read_groups(ring, 4, 60)  # version 0, eta 0: exactly one batch of 2 groups x G=2
        assert len(first) == 4, (tmp_path / "manager.log").read_text()[-3000:]
        assert read_groups(ring, 1, 1.5) == [], "the gate admits no second batch before version 1"
        publish_notice(str(notice), WeightNotice(WeightVersion(1, "disk", str(tmp_path / "v1"))))
        second = read_groups(ring, 4, 60)
        assert len(second) == 4
        publish_notice(str(notice), WeightNotice(WeightVersion(1, "disk", str(tmp_path / "v1")),
                                                 state_request=str(saved)))
        deadline = time.monotonic() + 30
        while not saved.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        publish_notice(str(notice), WeightNotice(WeightVersion(1, "disk", str(tmp_path / "v1")), stop=True))
        assert proc.wait(timeout=60) == 0, (tmp_path / "manager.log").read_text()[-3000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        loop.run_until_complete(starter.aclose())
        loop.close()
        ring.unlink()

    groups = group_trajectories(first + second)
    assert len(groups) == 4 and all(len(g) == 2 for g in groups.values())
    assert all((t.behav_versions == 0).all() for t in first)
    assert all(t.metadata["task"] == "procedural" and 0.0 <= t.reward <= 1.0 for t in first + second)
    assert any((t.behav_versions == 1).any() for t in second)
    state = read_json(str(saved))
    assert state["version"] == 1 and state["loader"]["epoch"] == 0 and state["gate"]["version"] == 1
    st = read_status(str(status))
    assert st.version == 1 and st.groups_written == 4 and st.state_path == str(saved)
    assert st.metrics["rollout/groups_written"] == 4.0
    assert json.loads(json.dumps(state))  # JSON-able, as a checkpoint stores it
