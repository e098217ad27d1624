"""`darl-eval` serves a model with an embedded engine and grades it: its greedy accuracy on
held-out problems equals a direct `transformers` greedy evaluation of the same problems."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.e2e import base_config, write_config


def _transformers_accuracy(cfg_path: str, model_dir: str, n: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_darl.config import load_config
    from megatron_darl.data.sources import build_loader
    from megatron_darl.eval.heldout import stop_ids

    cfg = load_config(cfg_path, [f"model.hf_dir={model_dir}", f"data.eval_size={n}"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    right = 0
    for p in build_loader(cfg.data, tok, "eval").next_batch(n):
        with torch.no_grad():
            out = model.generate(torch.tensor([p.input_ids]), max_new_tokens=cfg.rollout.max_new_tokens,
                                 do_sample=False, eos_token_id=stop_ids(tok), pad_token_id=tok.pad_token_id)
        right += tok.decode(out[0, len(p.input_ids):], skip_special_tokens=True).strip() == p.answer["entry"]["answer"]
    return right / n


@pytest.mark.timeout(240)
def test_darl_eval_matches_transformers_greedy(tmp_path, warm_model):
    cfg_path = write_config(str(tmp_path / "eval.yaml"), base_config(str(tmp_path / "run"), warm_model))
    n = 40
    proc = subprocess.run([sys.executable, "-m", "megatron_darl", "eval", "--model", warm_model, "--data",
                           "reasoning_gym:chain_sum", "--config", cfg_path, "--num-problems", str(n)],
                          capture_output=True, text=True, timeout=200, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["num_problems"] == n and result["k"] == 1
    assert result["avg_at_k"] == pytest.approx(_transformers_accuracy(cfg_path, warm_model, n))
    assert "held-out accuracy" in proc.stderr


def test_darl_eval_names_a_bad_data_spec(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_darl", "eval", "--model", str(tmp_path), "--data",
                           "hf:gsm8k"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "unknown kind 'hf'" in proc.stderr
