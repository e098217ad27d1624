"""`data.partition: hash` on the demo's 2-term chain_sum: the training stream, the validation split
and the test split share no question, the test split holds >= 1000 distinct questions, and every
record still grades through its payload. Without the partition the same streams do overlap (the
task has 16,200 questions), which is what the partition is for: the first test would fail on the
unpartitioned sources."""

from __future__ import annotations

import pytest

from megatron_darl.config import ConfigError, load_config
from megatron_darl.config.data import DataConfig
from megatron_darl.data.partition import BUCKETS, split_of
from megatron_darl.data.procedural import ProceduralVerifier
from megatron_darl.data.sources import build_source

KW = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
TRAIN_DRAWS = 20_000


def _cfg(**kw) -> DataConfig:
    return DataConfig(source="reasoning_gym:chain_sum", dataset_kwargs=KW, size=100_000, eval_size=1000, **kw)


def _questions(source, n: int | None = None) -> list[str]:
    return [source.record(i).question for i in range(n if n is not None else len(source))]


@pytest.fixture(scope="module")
def splits():
    cfg = _cfg(partition="hash", val_size=500)
    return {s: build_source(cfg, s) for s in ("train", "validation", "eval")}


def test_the_three_splits_are_disjoint_and_the_test_split_is_large(splits):
    train = set(_questions(splits["train"], TRAIN_DRAWS))
    val, test = _questions(splits["validation"]), _questions(splits["eval"])
    assert len(test) == len(set(test)) == 1000  # distinct test questions
    assert len(val) == len(set(val)) == 500
    assert not train & set(test) and not train & set(val) and not set(val) & set(test)
    assert all(split_of(q, 0.1, 0.1) == "test" for q in test)
    assert len(train) > 9000  # the training stream still covers most of its share of the task


def test_without_the_partition_the_streams_overlap():
    cfg = _cfg()
    train = set(_questions(build_source(cfg, "train"), TRAIN_DRAWS))
    test = _questions(build_source(cfg, "eval"))
    assert len(train & set(test)) > 500  # the earlier eval split was not disjoint from training
    assert build_source(cfg, "validation") is None


def test_records_grade_through_their_payload(splits):
    verifier = ProceduralVerifier()
    for split in ("train", "eval", "validation"):
        rec = splits[split].record(7)
        answer = rec.answer["entry"]["answer"]
        assert verifier.entry(rec.answer)["question"] == rec.question
        assert verifier.score(rec.answer, answer) == 1.0 and verifier.score(rec.answer, answer + "1") < 1.0


def test_split_shares_follow_the_fractions():
    qs = [f"State the final answer to the following arithmetic problem: {a} + {b} =" for a in range(10, 100)
          for b in range(10, 100)]
    share = {s: sum(split_of(q, 0.2, 0.1) == s for q in qs) / len(qs) for s in ("test", "validation", "train")}
    assert abs(share["test"] - 0.2) < 0.02 and abs(share["validation"] - 0.1) < 0.02
    assert BUCKETS == 1000


def test_a_too_large_held_out_split_names_the_key():
    cfg = _cfg(partition="hash", test_frac=0.01, val_frac=0.0)
    cfg.dataset_kwargs = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 200 questions
    # it stops once the task's questions run out (10,000 draws without a new one), not after
    # the 400,000 draws it may scan
    with pytest.raises(ValueError, match=r"data\.eval_size=1000: .* in 1\d{4} draws \(200 distinct in all splits, "
                                         r"none new in the last 10000\)"):
        build_source(cfg, "eval")


@pytest.mark.parametrize("override, key", [("data.partition=bogus", "data.partition"),
                                           ("data.test_frac=0", "data.test_frac"),
                                           ("data.val_frac=0.85", "data.val_frac"),
                                           ("data.eval_source=reasoning_gym:chain_sum", "data.eval_source")])
def test_bad_partition_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/cpu_demo_darl.yaml", ["data.partition=hash", override])
