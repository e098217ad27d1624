"""Before start: a max_new_tokens (rollout's, or the evaluation's) that leaves no position of the
model's context for a prompt fits no prompt (the engines refuse a prompt plus max_new_tokens
beyond the context), so `darl-train` stops at once, naming the key, its value and the context's
file."""

import json

from megatron_darl.config import load_config
from megatron_darl.launch.cli import train_main
from megatron_darl.launch.preflight import context_checks, preflight

DEMO = "configs/cpu_demo_darl.yaml"  # built-in tiny Qwen3: max_position_embeddings 256


def test_demo_budget_at_the_context_stops_before_start(monkeypatch, capsys):
    started = []
    monkeypatch.setattr("megatron_darl.launch.local.run_local", lambda cfg: started.append(cfg) or 0)
    assert context_checks(load_config(DEMO, [])) == []
    assert train_main(["--config", DEMO, "rollout.max_new_tokens=256"]) == 1
    err = capsys.readouterr().err
    assert "rollout.max_new_tokens=256 >= the model's context of 256 tokens (max_position_embeddings in " \
           "built-in model builtin:tiny-qwen3" in err
    assert "rollout.max_new_tokens <= 256 - n" in err
    assert started == []


def test_eval_budget_counts_only_when_there_is_an_evaluation():
    problems = context_checks(load_config(DEMO, ["eval.max_new_tokens=300"]))
    assert len(problems) == 1 and problems[0].startswith("eval.max_new_tokens=300 >= the model's context of 256")
    assert context_checks(load_config(DEMO, ["eval.max_new_tokens=300", "eval.num_problems=0"])) == []


def test_context_comes_from_the_model_folder(tmp_path):
    hf = {"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    base = [f"model.hf_dir={tmp_path}", "model.tokenizer=builtin:demo"]
    problems = context_checks(load_config(DEMO, [*base, "rollout.max_new_tokens=64", "data.max_prompt_tokens=16"]))
    assert len(problems) == 1 and f"max_position_embeddings in {tmp_path}/config.json" in problems[0]
    assert "every prompt of up to data.max_prompt_tokens=16: rollout.max_new_tokens <= 48" in problems[0]
    assert context_checks(load_config(DEMO, [*base, "rollout.max_new_tokens=63"])) == []
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert context_checks(load_config(DEMO, [*base, "rollout.max_new_tokens=100000"])) == []  # unknown: unchecked


def test_demo_file_whose_rows_all_exceed_the_context_is_refused_before_start(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"}) + "\n"
                            for a in range(5)))
    cfg = load_config(DEMO, [f"data.source=jsonl:{data}", "data.prompt_template={question}", "data.eval_source=null",
                             f"train.run_dir={tmp_path}/run", "rollout.max_new_tokens=250"])
    problems = preflight(cfg)  # 14-character questions, 6 positions left: none fits
    assert any("builtin:demo cannot use this data" in p and "prompt_exceeds_context=5" in p and f"{data}:1" in p
               for p in problems), problems
