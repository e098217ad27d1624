"""The weight probe: a fixed token sequence both sides score, to check that an engine serves the
weights the learner published.

What it is: `probe_ids` (the probe's token ids: deterministic, drawn once from the model's
vocabulary with a fixed seed, so every learner and every manager of a run, and every run of a
model, get the same ones without a tokenizer), `WeightProbe` (the learner's untempered prompt
log-probs of the probe under one version, carried in the weight notice) and `probe_figures`
(max and mean |delta log-prob| and KL between an engine's and the learner's log-probs of it).
The ids travel with the notice, so the manager scores exactly what the learner scored.
What it is not: the engine request (`rollout/probe.py`) or what a failure does (`engine_pool.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PROBE_SEED = 52  # fixed: the same probe in every run of a model, so figures compare across runs


def probe_ids(num_tokens: int, vocab_size: int, seed: int = PROBE_SEED) -> list[int]:
    """`num_tokens` token ids uniform over `[0, vocab_size)`, the same for the same arguments.
    Random ids, not text: every row of the embedding and of the output head is touched with the
    same weight, and a wrong tensor anywhere shifts many of the log-probs (tests/unit/engine/
    test_probe_signal.py)."""
    import numpy as np

    if num_tokens < 2 or vocab_size < 1:
        raise ValueError(f"a probe needs >= 2 tokens and a vocabulary (got {num_tokens}, {vocab_size})")
    return [int(i) for i in np.random.default_rng(seed).integers(0, vocab_size, size=num_tokens)]


@dataclass(frozen=True)
class WeightProbe:
    """The learner's log-probs of `ids` under `version`: `logprobs[t-1]` is log p(ids[t] | ids[:t])
    at temperature 1 (what SGLang's `input_token_logprobs` answers from t = 1)."""

    version: int
    ids: list[int]
    logprobs: list[float]

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.ids) - 1:
            raise ValueError(f"weight probe of version {self.version}: {len(self.ids)} ids need "
                             f"{len(self.ids) - 1} log-probs, got {len(self.logprobs)}")

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "ids": list(self.ids), "logprobs": list(self.logprobs)}

    @classmethod
    def from_json(cls, d: Any, where: str) -> "WeightProbe":
        try:
            return cls(version=int(d["version"]), ids=[int(i) for i in d["ids"]],
                       logprobs=[float(x) for x in d["logprobs"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad weight probe (needs version, ids, logprobs): {exc}") from None


def probe_figures(engine: list[float], learner: list[float]) -> dict[str, float]:
    """`max_abs`, `mean_abs` |engine - learner| and `kl`, the sampled estimate of KL(learner ||
    engine) on the probe's own tokens, mean of `r - 1 - log r` with `r = exp(engine - learner)`
    (the k3 estimator: >= 0 per token, 0 only where they agree). A non-finite engine log-prob
    makes every figure inf (it fails any threshold)."""
    if len(engine) != len(learner) or not engine:
        raise ValueError(f"probe log-probs: the engine answered {len(engine)}, the learner has {len(learner)}")
    if not all(math.isfinite(e) for e in engine):
        return {"max_abs": math.inf, "mean_abs": math.inf, "kl": math.inf}
    d = [e - learned for e, learned in zip(engine, learner)]
    kl = sum(math.expm1(x) - x for x in d) / len(d)
    return {"max_abs": max(abs(x) for x in d), "mean_abs": sum(abs(x) for x in d) / len(d), "kl": kl}
