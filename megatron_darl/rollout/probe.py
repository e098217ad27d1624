"""The rollout side of the weight probe: is each engine serving the version the learner published?

What it is: `ProbeChecker`. After an engine loaded version N (a push to every engine, or one
engine brought back by the health loop) and before it gets any request, the pool has it score
the probe that came with N's notice (`channel/weight_probe.py`: the learner's own log-probs of
it under N) through `/generate` with `logprob_start_len=0`, and compares: max and mean |delta|
and KL, kept per engine as `rollout/probe_*` (status file -> the learner's TensorBoard and
metrics.jsonl). An engine whose max or mean |delta| passes its threshold
(`RolloutConfig.probe_thresholds`, by engine dtype) is marked down and restarted with the
current weights; a second failure of the same version on the same engine raises `ProbeFailed`,
which stops the run naming the version, the engine and the figures. Dispatch is held while it
checks (the pool is paused, or the engine not yet up), so no sample is generated on a failed
version: what a failure costs is the requests in flight on the engine (pause modes that keep
them, retract and in_place), discarded and re-run elsewhere from their last kept tokens
(`rollout/probe_dropped_samples`).
What it is not: the learner's side (`trainer/publication.py`), the restart (`engine_pool.py`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from megatron_darl.channel.weight_probe import WeightProbe, probe_figures

log = logging.getLogger(__name__)


class ProbeFailed(RuntimeError):
    """An engine served wrong log-probs for the same version twice: its weights are not the
    learner's, and restarting it did not help."""


class ProbeChecker:
    """Checks engines against the current version's probe (`probe`, set with the weights; None:
    nothing to check). `max_abs`, `mean_abs`: the most max and mean |delta log-prob| allowed."""

    def __init__(self, max_abs: float, mean_abs: float, timeout_s: float) -> None:
        self.max_abs, self.mean_abs, self.timeout_s = max_abs, mean_abs, timeout_s
        self.probe: WeightProbe | None = None
        self.metrics: dict[str, float] = {}  # rollout/probe_* gauges, the latest check per engine
        self._failed: dict[tuple[int, int], dict[str, float]] = {}  # (version, engine) -> figures

    async def acheck(self, slot: Any) -> dict[str, float] | None:
        """Score the probe on `slot`'s engine, which serves `probe.version`: its figures, with
        `ok` 1.0 or 0.0; None when there is nothing to check (no probe, another version, a client
        without prompt log-probs). A wrong answer shape counts as a failure (inf figures).
        `ProbeFailed` at the second failure of a version on one engine."""
        probe = self.probe
        ask = getattr(slot.engine, "aprompt_logprobs", None)
        if probe is None or ask is None or slot.version != probe.version:
            return None
        t0 = time.perf_counter()
        try:
            got = await ask(probe.ids, timeout_s=self.timeout_s)
            figures = probe_figures(got, probe.logprobs)
        except ValueError as exc:
            log.warning("engine %d: probe answer unusable: %s", slot.index, exc)
            figures = {"max_abs": math.inf, "mean_abs": math.inf, "kl": math.inf}
        ok = figures["max_abs"] <= self.max_abs and figures["mean_abs"] <= self.mean_abs
        e = slot.index
        self.metrics["rollout/probe_s"] = time.perf_counter() - t0  # the last check's, inside a weight update
        self.metrics.update({f"rollout/probe_{k}/engine{e}": v for k, v in figures.items()})
        self.metrics[f"rollout/probe_version/engine{e}"] = float(probe.version)
        worst = max(v for k, v in self.metrics.items() if k.startswith("rollout/probe_max_abs/"))
        self.metrics["rollout/probe_max_abs"] = worst
        shown = ", ".join(f"{k} {v:.3g}" for k, v in figures.items())
        if ok:
            log.info("engine %d (%s) version %d probe ok: %s", e, slot.engine.url, probe.version, shown)
            return {**figures, "ok": 1.0}
        key = (probe.version, e)
        if key in self._failed:
            raise ProbeFailed(
                f"engine {e} ({slot.engine.url}) serves wrong weights for version {probe.version} twice, "
                f"the second time after it was restarted (or reloaded) with them: probe of {len(probe.ids)} tokens, "
                f"first {self._show(key)}, then "
                f"{shown} (thresholds: {self._limits()}). The weights it loads "
                f"are not the ones the learner published: check the weight sync (rollout.weight_sync) and the "
                f"engine's loader")
        self._failed[key] = figures
        log.error("engine %d (%s) version %d probe FAILED: %s (thresholds: %s): restarting it",
                  e, slot.engine.url, probe.version, shown, self._limits())
        return {**figures, "ok": 0.0}

    def _limits(self) -> str:
        return (f"max_abs {self.max_abs:g}, rollout.probe_max_abs; mean_abs {self.mean_abs:g}, "
                "rollout.probe_mean_abs")

    def _show(self, key: tuple[int, int]) -> str:
        return ", ".join(f"{k} {v:.3g}" for k, v in self._failed[key].items())
