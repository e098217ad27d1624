"""`darl-logprobs` on a random tiny Qwen3 saved by transformers, self-launched at TP=2, against
transformers' own log-probs; and its input errors name the file and line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import learner_worker as W
from tests.helpers import repo_env


def test_darl_logprobs_tp2_matches_transformers(tmp_path):
    hf = W.tiny_qwen3(str(tmp_path / "hf"), tied=False, seed=3)  # untied: lm_head through the adapter
    rng = np.random.RandomState(5)
    seqs = [rng.randint(0, 256, size=n).tolist() for n in (2, 17, 9, 30)]
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    env = repo_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "megatron_darl.launch.logprobs_command",
                           "--model", hf, "--data", str(data),
                           "--out", str(out), "--tp", "2", "--temperature", "0.8"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    assert [len(g) for g in got] == [len(s) - 1 for s in seqs]
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    ref = W.transformers_logprobs(hf, tokens, np.array([len(s) for s in seqs]), 0.8)
    for i, s in enumerate(seqs):
        assert np.abs(np.array(got[i]) - np.array(ref[i][1 : len(s)])).max() < 1e-4


def test_bad_input_line_is_named(tmp_path):
    from megatron_darl.launch.logprobs_command import read_sequences

    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n{"tokens": [3]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_sequences(str(path))
