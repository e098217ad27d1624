"""An honest step 0: with `data.partition: hash` the warm start's target stop
reads the VALIDATION split, and every check also scores the TEST split (the one the curves are
scored on), recorded so that a report can show step 0 beside the checks before it; the record
says what the stop selected on ("none", "validation", "test"). Real tiny model on one-digit
chain_sum (200 questions: large test / validation shares so that each split has 30 questions)."""

from __future__ import annotations

import os
import statistics

import pytest

pytest.importorskip("transformers")

from megatron_darl.config import load_config
from megatron_darl.data.partition import split_of
from megatron_darl.data.tokenizers import load_tokenizer, resolve_tokenizer_dir
from megatron_darl.launch import warmstart

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "cpu_demo_darl.yaml")
SPLIT = ["data.dataset_kwargs.min_digits=1", "data.dataset_kwargs.max_digits=1", "data.partition=hash",
         "data.test_frac=0.3", "data.val_frac=0.3", "data.eval_size=30", "data.val_size=30", "eval.num_problems=30"]


def _cfg(tmp_path, *extra):
    return load_config(DEMO, [f"train.run_dir={tmp_path}", *SPLIT, *extra])


@pytest.mark.parametrize("extra, selected", [((), "validation"), (("demo.sft_target=0",), "none"),
                                             (("data.partition=none",), "test")])
def test_what_the_stop_reads(tmp_path, extra, selected):
    cfg = _cfg(tmp_path, *extra)
    tok = load_tokenizer(str(resolve_tokenizer_dir("builtin:demo")))
    stop, test, on = warmstart.stop_and_test_prompts(cfg, tok)
    assert on == selected
    if cfg.data.partition == "hash":
        questions = {s: {p.question for p in ps} for s, ps in (("stop", stop), ("test", test))}
        assert questions["stop"].isdisjoint(questions["test"]) and len(test) == 30 and len(stop) == 30
        assert all(split_of(p.question, 0.3, 0.3) == "validation" for p in stop)
    else:
        assert test is None and (stop is not None) == (on == "test")


def test_the_warm_start_records_its_test_checks_and_what_it_selected_on(tmp_path):
    cfg = warmstart.prepare_model(_cfg(tmp_path, "demo.sft_steps=15", "demo.sft_target=0.99"))
    stats = warmstart.read_stats(cfg.model.hf_dir)
    assert stats["sft_selected_on"] == "validation" and stats["sft_steps"] == 15
    assert [s for s, _ in stats["sft_test_checks"]] == [s for s, _ in stats["sft_checks"]] == [5, 10, 15]
    summ = stats["test_checks_summary"]
    accs = [a for _, a in stats["sft_test_checks"]]
    assert summ["mean"] == pytest.approx(statistics.fmean(accs)) and summ["final"] == accs[-1]
    assert summ["last_steps"] == [5, 15] and 0.0 <= stats["sft_test_accuracy"] <= 1.0


def test_test_checks_summary_keeps_the_last_ten():
    history = [[5 * i, i / 100] for i in range(1, 16)]
    summ = warmstart.test_checks_summary(history)
    assert summ["last"] == 10 and summ["last_steps"] == [30, 75]
    assert summ["mean"] == pytest.approx(sum(range(6, 16)) / 1000) and summ["range"] == [0.06, 0.15]
    assert summ["sd"] == pytest.approx(statistics.stdev([i / 100 for i in range(6, 16)]))




def test_the_partition_keys_the_cache_only_when_set(tmp_path):
    """A warm start cached before the partition existed keeps its fingerprint (partition none
    ignores the fractions); with a partition, the fractions make another warm start."""
    fp = lambda *o: warmstart._fingerprint(load_config(DEMO, [f"train.run_dir={tmp_path}", *o]), "tok")  # noqa: E731
    assert fp("data.test_frac=0.2") == fp()
    assert (fp("data.partition=hash") != fp()
            and fp("data.partition=hash", "data.test_frac=0.2") != fp("data.partition=hash"))
