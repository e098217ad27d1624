"""No input row is dropped without a word.

The probe: a JSONL file with 12 bad rows among good ones. Nine are bad as JSON (invalid JSON,
not an object, missing or empty fields...), three only once encoded (a 1 MB prompt, characters
outside the demo vocabulary, bytes that are not UTF-8). Every one must be counted by reason in
the loader's metrics (`rollout/prompts_rejected...`, which the rollout manager reports to the
learner's TensorBoard) and named with file:line in the log, all before the first draw; none may
ever be drawn. A generated source (reasoning-gym, checked as drawn) logs and counts each
rejection when it happens.

And a live rollout side that writes nothing (every group dropped by the equal-reward filter: no
answer of these rows can be right) stops the learner after `train.data_wait_timeout_s`, naming
the step and what the rollout manager last reported, instead of a wait without a bound.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from megatron_darl.config.data import DataConfig
from megatron_darl.data.sources import build_loader
from tests.helpers.e2e import assert_nothing_left, new_run

GOOD = [("What is 2 + 3?", "#### 5"), ("Tom has 4 apples and eats 1. How many are left?", "#### 3"),
        ("What is 7 - 2?", "#### 5"), ("What is 3 * 3?", "#### 9")]


def row(question, answer) -> bytes:
    return json.dumps({"question": question, "answer": answer}).encode()


# (line content, reason the row must be counted under)
BAD = [
    (b'{"question": "1 + 1 =", "answer": ', "invalid_json"),
    (b"[1, 2]", "not_an_object"),
    (b'"just text"', "not_an_object"),
    (b"null", "not_an_object"),
    (b'{"question": "2 + 2 ="}', "missing_field"),
    (b'{"answer": "#### 4"}', "missing_field"),
    (row("   ", "#### 1"), "empty_prompt"),
    (json.dumps({"question": 12, "answer": "#### 1"}).encode(), "bad_value"),
    (row("What is 3 + 3?", "####"), "bad_value"),
    (row("1 + " * 250_000 + "1 =", "#### 250001"), "prompt_too_long"),  # a 1 MB prompt
    (row("3 \u20ac + 4 \u20ac = ? \u00bd", "#### 7"), "unknown_characters"),  # outside the demo vocabulary
    (b'{"question": "What is \xff\xfe 1 + 1?", "answer": "#### 2"}', "invalid_utf8"),
]


def write_probe(path) -> tuple[str, dict[int, str]]:
    """The probe file: good and bad rows interleaved; returns the path and line -> reason."""
    lines, bad_lines = [], {}
    for i, (content, reason) in enumerate(BAD):
        lines.append(row(*GOOD[i % len(GOOD)]))
        lines.append(content)
        bad_lines[len(lines)] = reason
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path), bad_lines


def test_every_bad_row_is_counted_and_named_before_the_first_draw(tmp_path, demo_tok, caplog):
    path, bad_lines = write_probe(tmp_path / "probe.jsonl")
    cfg = DataConfig(source=f"jsonl:{path}", format="gsm8k", chat_template=False, max_prompt_tokens=256)
    with caplog.at_level(logging.WARNING):
        loader = build_loader(cfg, demo_tok)
    metrics = loader.metrics()
    assert metrics["rollout/prompts_rejected"] == len(BAD) == 12
    expected: dict[str, int] = {}
    for reason in bad_lines.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.count("/") == 2} == expected
    for line, reason in bad_lines.items():  # each named with file:line and its reason, at start
        assert f"{path}:{line}: {reason}" in caplog.text, (line, reason)
    assert len(caplog.text) < 100_000  # the 1 MB row is named, not copied into the log
    caplog.clear()
    drawn = loader.next_batch(3 * len(loader.source))  # three epochs
    assert {p.question for p in drawn} == {q for q, _ in GOOD}
    assert loader.metrics() == metrics and "rejected" not in caplog.text  # nothing left to reject later


def test_generated_source_rejections_are_logged_and_counted_when_drawn(demo_tok, caplog):
    # three 2-digit terms render to more than 10 tokens: every chain_sum prompt is too long
    kwargs = {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 2}
    cfg = DataConfig(size=50, dataset_kwargs=kwargs, chat_template=False, prompt_template="{expression} =",
                     max_prompt_tokens=9)
    loader = build_loader(cfg, demo_tok)
    with caplog.at_level(logging.WARNING):
        drawn = loader.next_batch(5)
    rejected = int(loader.metrics()["rollout/prompts_rejected"])
    assert rejected >= 1 and loader.metrics()["rollout/prompts_rejected/prompt_too_long"] == rejected
    names = [line for line in caplog.text.splitlines() if "rejected row" in line]
    assert len(names) == rejected  # every rejection named, not only the first
    assert all("reasoning_gym:chain_sum[seed=0,size=50][" in n and "prompt_too_long" in n for n in names)
    assert all(len(p.input_ids) <= 9 for p in drawn)


@pytest.mark.timeout(600)
def test_demo_model_on_the_probe_file_trains_and_reports_every_dropped_row(tmp_path):
    """Bad rows and the demo model on a file, end to end: `darl-train` with the built-in demo model
    (warm start on the file's answers) and the probe file finishes, its metrics count the 12
    dropped rows and the rollout manager's log names each with file:line."""
    from tests.helpers.e2e import DarlRun, base_config, write_config

    path, bad_lines = write_probe(tmp_path / "probe.jsonl")
    run_dir = str(tmp_path / "run")
    cfg = base_config(run_dir, "builtin:tiny-qwen3", train={"steps": 2}, demo={"sft_steps": 5},
                      data={"source": f"jsonl:{path}", "format": "gsm8k", "prompt_template": "{question}",
                            "chat_template": False, "max_prompt_tokens": 256, "eval_source": None})
    cfg["model"] = {"hf_dir": "builtin:tiny-qwen3", "tokenizer": "builtin:demo"}
    cfg["data"].pop("dataset_kwargs")
    run = DarlRun(write_config(str(tmp_path / "darl.yaml"), cfg), run_dir, str(tmp_path / "run.out"))
    try:
        run.start()
        code = run.wait(540)
        out = run.output()
    finally:
        run.kill()
    assert code == 0, out[-4000:]
    assert os.path.isfile(os.path.join(run_dir, "summary.json"))
    last = run.metrics()[-1]
    assert last["rollout/prompts_rejected"] == 12, {k: v for k, v in last.items() if "rejected" in k}
    assert last["rollout/prompts_rejected/invalid_utf8"] == 1 and last["rollout/prompts_rejected/prompt_too_long"] == 1
    with open(os.path.join(run_dir, "logs", "rollout.log"), encoding="utf-8") as fh:
        log = fh.read()
    for line, reason in bad_lines.items():
        assert f"{path}:{line}: {reason}" in log, (line, reason)


@pytest.mark.timeout(300)
def test_a_rollout_side_that_writes_nothing_stops_the_learner_naming_the_stall(tmp_path, warm_model):
    data = tmp_path / "unanswerable.jsonl"  # 9 digits: the demo's 4 new tokens cannot hold the answer
    data.write_bytes(b"\n".join(row(f"What is {a} + {b}?", "#### 987654321") for a in range(8) for b in range(8)))
    run = new_run(tmp_path, warm_model, "stall", rollout={"filter_equal_rewards": True},
                  data={"source": f"jsonl:{data}", "prompt_template": "{question}", "dataset_kwargs": {}},
                  train={"steps": 4, "data_wait_timeout_s": 20})
    try:
        run.start()
        code = run.wait(240)
        out = run.output()
        assert code != 0, out[-4000:]
        assert "step 0: no batch of 8 groups (8 never trained) within 20 s" in out, out[-4000:]
        assert "the rollout manager's last report" in out and "train.data_wait_timeout_s (now 20 s)" in out, out[-4000:]
        filtered = out.split("filtered (equal rewards) ", 1)[1].split(",", 1)[0]
        assert float(filtered) > 0 and "groups written 0" in out, out[-4000:]
        assert run.ledger() == []
        assert_nothing_left(run, run.run_info()["run_id"])
    finally:
        run.kill()
