"""Config facts checked before start, and overrides that take what users type.

Probes: `data.prompt_template={question}` on the command line (YAML read it as a mapping and the
override failed; `Q: {question} A:` failed with a parser traceback), while `${other.key}` stays an
OmegaConf interpolation and `\\${` a literal; a template naming a field the data lacks, found
before anything starts; the built-in demo model (`builtin:tiny-qwen3`, demo tokenizer) with a
JSONL source, whose warm start crashed with a traceback: it now warm-starts on the file's
reference answers, and a source without reference answers is refused before start.
"""

from __future__ import annotations

import json
import os

import pytest

from megatron_darl.config import ConfigError, load_config, to_yaml
from megatron_darl.launch.cli import train_main
from megatron_darl.launch.preflight import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "cpu_demo_darl.yaml")
# preflight checks the ring against this machine's /dev/shm: 16 MiB fits Docker's 64 MB default
# (.ci/restricted_pass runs these tests there)
SMALL_RING = "ring.size_bytes=16777216"


@pytest.mark.parametrize("typed, value", [
    ("{question}", "{question}"),
    ("Q: {question} A:", "Q: {question} A:"),
    ("'{question}'", "{question}"),  # quoted as in YAML: the quotes are removed
    ('"Solve: {question}\\n"', "Solve: {question}\n"),
    ("{question} = ? [{level}]", "{question} = ? [{level}]"),
    ('"a" or "{question}"', '"a" or "{question}"'),  # quotes that are part of the text
    ("", ""),
])
def test_template_overrides_take_the_text_as_typed(typed, value):
    cfg = load_config(DEMO, [f"data.prompt_template={typed}"])
    assert cfg.data.prompt_template == value
    assert load_config(DEMO, [f"+data.prompt_template={typed}"]).data.prompt_template == value


def test_interpolation_and_its_escape_keep_omegaconf_semantics(tmp_path):
    cfg = load_config(DEMO, ["data.prompt_template=${data.source} {question}"])
    assert cfg.data.prompt_template == "reasoning_gym:chain_sum {question}"
    literal = load_config(DEMO, ["data.prompt_template=\\${question}"])
    assert literal.data.prompt_template == "${question}"
    saved = tmp_path / "resolved.yaml"  # the children of a run load the saved config again
    saved.write_text(to_yaml(literal))
    assert load_config(str(saved)).data.prompt_template == "${question}"
    with pytest.raises(ConfigError, match=r"data\.prompt_template.*write a literal"):
        load_config(DEMO, ["data.prompt_template=Price ${question}"])


def test_non_text_overrides_still_parse_as_yaml_and_errors_name_the_override(capsys):
    cfg = load_config(DEMO, ["data.dataset_kwargs={min_terms: 3}", "algo.k=4", "data.system_prompt=null",
                             "data.chat_template=true", "data.system_prompt=Be brief: {x}"])
    assert cfg.data.dataset_kwargs["min_terms"] == 3 and cfg.algo.k == 4
    assert cfg.data.system_prompt == "Be brief: {x}"
    assert load_config(DEMO, ["data.system_prompt=~"]).data.system_prompt is None
    with pytest.raises(ConfigError, match=r"train\.run_dir"):
        load_config(DEMO, ["train.run_dir=null"])  # not optional: refused, not a folder named 'null'
    assert train_main(["--config", DEMO, "data.dataset_kwargs={min_terms: 3", "--print-config"]) == 1
    err = capsys.readouterr().err
    assert "data.dataset_kwargs" in err and "not valid YAML" in err and "Traceback" not in err


def test_template_field_the_data_lacks_is_refused_before_start(tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}) + "\n")
    cfg = load_config(DEMO, [f"data.source=jsonl:{data}", "data.eval_source=null", f"train.run_dir={tmp_path}/run"])
    problems = preflight(cfg)  # the demo recipe's template is "{expression} =": a chain_sum field
    assert any("prompt_template '{expression} ='" in p and f"{data}:1" in p for p in problems), problems
    ok = load_config(DEMO, [f"data.source=jsonl:{data}", "data.prompt_template={question}",
                            f"train.run_dir={tmp_path}/run", SMALL_RING])
    assert preflight(ok) == []


def write_math(path, n: int = 64) -> str:
    rows = [{"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a in range(8) for b in range(8)]
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows[:n])
    return str(path)


def demo_with_file(tmp_path, source: str, *extra: str):
    return load_config(DEMO, [f"data.source={source}", "data.prompt_template={question}", "data.eval_source=null",
                              f"train.run_dir={tmp_path}/run", "demo.sft_steps=3", SMALL_RING, *extra])


def test_builtin_demo_model_warm_starts_on_a_jsonl_source(tmp_path):
    from megatron_darl.launch import warmstart

    cfg = demo_with_file(tmp_path, f"jsonl:{write_math(tmp_path / 'math.jsonl')}")
    assert preflight(cfg) == []
    ready = warmstart.prepare_model(cfg)  # crashed with a traceback before
    with open(os.path.join(ready.model.hf_dir, "warmstart.json"), encoding="utf-8") as fh:
        stats = json.load(fh)
    assert stats["sft_steps"] == 3 and stats["sft_final_loss"] == stats["sft_final_loss"]  # finite, not NaN
    assert os.path.isfile(os.path.join(ready.model.hf_dir, "model.safetensors"))


@pytest.mark.parametrize("source, extra", [
    ("humaneval", []),
    ("jsonl:{custom}", ["data.format=custom", "data.prompt_field=q"]),
])
def test_builtin_demo_model_without_reference_answers_is_refused_before_start(tmp_path, source, extra, capsys):
    custom = tmp_path / "custom.jsonl"
    custom.write_text(json.dumps({"q": "What is 1 + 1?"}) + "\n")
    cfg = demo_with_file(tmp_path, source.format(custom=custom), *extra)
    problems = preflight(cfg)
    assert any("demo.sft_steps" in p and "reference answer" in p for p in problems), problems


def test_builtin_demo_model_on_rows_its_tokenizer_cannot_encode_is_refused_before_start(tmp_path):
    data = tmp_path / "zh.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a} 加 {a} 等于多少？", "answer": f"#### {2 * a}"}) + "\n"
                            for a in range(5)), encoding="utf-8")
    problems = preflight(demo_with_file(tmp_path, f"jsonl:{data}"))
    assert any("builtin:demo cannot use this data" in p and "unknown_characters=5" in p and f"{data}:1" in p
               for p in problems), problems
