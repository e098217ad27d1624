"""The weight probe's learner side: its fixed ids, the learner's untempered log-probs of them in
`Publisher.score_probe`, the notice field that carries them (older notices still read) and the
figures the manager compares, each against a naive reference computed here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_darl.channel.weight_notice import WeightNotice, read_notice
from megatron_darl.channel.weight_probe import WeightProbe, probe_figures, probe_ids
from megatron_darl.trainer.publication import Publisher
from megatron_darl.types import WeightVersion

VOCAB = 50


class BigramLearner:
    """A learner whose policy is a bigram table: log p(b | a) = log_softmax(W[a] / T)[b]."""

    is_main = True
    vocab_size = VOCAB

    def __init__(self, temperature: float = 0.7):
        self.W = np.random.default_rng(3).normal(size=(VOCAB, VOCAB)) * 3
        self.temperature = temperature
        self.seen_temperatures: list[float] = []

    def compute_logprobs(self, batch):
        self.seen_temperatures.append(self.temperature)
        out = np.zeros(batch.tokens.shape, np.float32)
        for i, row in enumerate(batch.tokens):
            z = self.W[row[:-1]] / self.temperature
            lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
            out[i, 1:] = z[np.arange(len(row) - 1), row[1:]] - lse
        return out


def test_probe_ids_are_fixed_and_in_the_vocabulary():
    a, b = probe_ids(300, VOCAB), probe_ids(300, VOCAB)
    assert a == b and len(a) == 300 and 0 <= min(a) and max(a) < VOCAB
    assert len(set(a)) > VOCAB // 2  # spread over the vocabulary
    assert probe_ids(300, 1000) != a
    with pytest.raises(ValueError):
        probe_ids(1, VOCAB)


def test_score_probe_is_untempered_and_restores_the_temperature(tmp_path):
    learner = BigramLearner(temperature=0.7)
    pub = Publisher(learner, str(tmp_path / "w"), str(tmp_path / "n.json"), str(tmp_path / "s.json"), "shm",
                    probe_tokens=64)
    probe = pub.score_probe(5)
    assert learner.seen_temperatures == [1.0] and learner.temperature == 0.7
    ids = probe_ids(64, VOCAB)
    naive = []
    for a, b in zip(ids[:-1], ids[1:]):
        row = learner.W[a]
        naive.append(row[b] - math.log(sum(math.exp(x) for x in row)))
    assert probe.version == 5 and probe.ids == ids
    np.testing.assert_allclose(probe.logprobs, naive, atol=1e-5)
    assert Publisher(learner, str(tmp_path / "w"), str(tmp_path / "n.json"), str(tmp_path / "s.json"),
                     "shm").score_probe(5) is None  # probe_tokens 0: off


def test_the_notice_carries_the_probe_and_older_notices_still_read(tmp_path):
    learner = BigramLearner()
    pub = Publisher(learner, str(tmp_path / "w"), str(tmp_path / "n.json"), str(tmp_path / "s.json"), "shm",
                    probe_tokens=16)
    w = WeightVersion(version=3, weight_sync="shm", location="/dev/shm/x/v3")
    pub.notify(w, probe=pub.score_probe(3))
    got = read_notice(str(tmp_path / "n.json"))
    assert got.probe == pub.score_probe(3) and got.weights == w
    pub.notify(stop=True)  # other fields change: the probe stays with its version
    assert read_notice(str(tmp_path / "n.json")).probe == got.probe
    pub.notify(WeightVersion(version=4, weight_sync="shm", location="/dev/shm/x/v4"))
    assert read_notice(str(tmp_path / "n.json")).probe is None  # never carried to another version
    old = {"weights": {"version": 2, "kind": "disk", "location": "/w/v2"}, "stop": False, "state_request": None}
    assert WeightNotice.from_json(old, "old.json").probe is None
    with pytest.raises(ValueError, match="bad weight probe"):
        WeightNotice.from_json({**old, "probe": {"version": 2, "ids": [1, 2]}}, "bad.json")
    with pytest.raises(ValueError, match="2 ids need 1 log-probs"):
        WeightProbe(version=1, ids=[1, 2], logprobs=[])


def test_probe_figures_against_a_naive_computation():
    learner = [-1.0, -2.0, -0.5, -3.0]
    engine = [-1.0, -2.5, -0.25, -3.0]
    d = [0.0, -0.5, 0.25, 0.0]
    got = probe_figures(engine, learner)
    assert got["max_abs"] == 0.5 and got["mean_abs"] == pytest.approx(0.75 / 4)
    assert got["kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4)
    assert probe_figures(learner, learner) == {"max_abs": 0.0, "mean_abs": 0.0, "kl": 0.0}
    assert probe_figures([float("nan"), -1, -1, -1], learner)["max_abs"] == math.inf
    with pytest.raises(ValueError, match="the engine answered 3"):
        probe_figures(engine[:3], learner)


def test_the_probe_fits_the_context_with_the_token_the_engine_generates(tmp_path):
    """An engine refuses a prompt as long as the context (it generates one token after it)."""
    learner = BigramLearner()
    learner.hf_config = {"max_position_embeddings": 40}
    pub = Publisher(learner, str(tmp_path / "w"), str(tmp_path / "n.json"), str(tmp_path / "s.json"), "shm",
                    probe_tokens=64)
    probe = pub.score_probe(1)
    assert len(probe.ids) == 39 and probe.ids == probe_ids(39, VOCAB) and len(probe.logprobs) == 38
