"""Held-out accuracy during training, every `eval.every_steps` steps, in the learner's process.

What it is: `PeriodicEvaluator`, held by the main learner rank. When version v is published and
v is a multiple of `eval.every_steps`, `maybe_run(v, publisher)` loads that Hugging Face folder
into an in-process `Decoder` (the embedded engine's decoding core, continuous batching),
answers the same held-out problems as the launcher's before/after evaluation and `darl-eval`
(same prompts, seeds and eval settings, through the same `aevaluate`), grades them in a reward
pool kept for the run, and returns the figures to log at that step.
What it is not: the launcher's before/after evaluation through the engines (`heldout.py`) or
the scores' maths (`scoring.py`).

- `eval/accuracy` (avg@k) with `eval/accuracy_lo` / `eval/accuracy_hi` (95% interval),
  `eval/pass_at_k`, `eval/version`;
- `eval/samples_generated`: samples the rollout side has generated so far (written to the
  ring plus those of groups the equal-reward filter dropped), the x axis of sample efficiency;
  from the rollout manager's status, which it rewrites every second (so at most that old);
- `eval/wall_s`: seconds since this process started training (a resumed run counts from its
  resumption) with every evaluation's own time taken out, the x axis of wall-clock curves;
  `perf/eval_s` is this evaluation's time;
- with `eval.sampled_k` > 0, a second evaluation of the same problems: `eval/sampled_accuracy`
  (avg@k at `eval.sampled_temperature`) and `eval/sampled_pass_at_k`.

When: every `eval.every_steps` versions, and/or (`eval.every_samples`) at the first step boundary
at which the generated samples pass a multiple of it (`eval/sample_mark`: the largest multiple
passed), of version 0 before the first step (`evaluate_start`, mark 0) and of the last version
(`final=True`: the sample budget or train.steps reached; mark: the budget, or the samples).
Every evaluation is also a line of `<run_dir>/evals.jsonl` (the curve, version 0 included).

It runs in the learner, not through the engines: the policy evaluated is exactly the one just
published, and the engines keep generating meanwhile, so `eval/wall_s` slightly flatters
asynchronous runs (by at most the summed `perf/eval_s`). Models too large to hold a second fp32
copy beside the learner should evaluate saved checkpoints with `darl-eval` instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import torch

from megatron_darl.config import RunConfig
from megatron_darl.engine.decoder import Decoder, Sequence
from megatron_darl.eval.scoring import ProblemScores, aevaluate
from megatron_darl.types import GenerateRequest, GenerateResponse


class DecoderEngine:
    """A `Decoder` behind the `agenerate` call that `aevaluate` makes: concurrent requests join
    one batch (at most `max_batch` rows, as the engine server's `--max-batch`) and decode
    together; one background task steps the decoder while anything is waiting or running."""

    url = "in-process"

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self._waiting: list[tuple[Sequence, asyncio.Future]] = []
        self._futures: dict[str, asyncio.Future] = {}
        self._driver: asyncio.Task | None = None

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        if req.rid in self._futures:
            raise ValueError(f"DecoderEngine: request id {req.rid!r} is already in flight")
        fut = asyncio.get_running_loop().create_future()
        seq = Sequence(rid=req.rid, tokens=list(req.input_ids), prompt_len=len(req.input_ids), sampling=req.sampling)
        self._futures[req.rid] = fut
        self._waiting.append((seq, fut))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._adrive())
        seq = await fut
        return GenerateResponse(rid=seq.rid, output_ids=seq.output_ids, output_logprobs=list(seq.logprobs),
                                output_versions=list(seq.versions), finish_reason=seq.finish["type"],
                                weight_version=self.decoder.version)

    async def _adrive(self) -> None:
        await asyncio.sleep(0)  # let every request of this gather() enqueue first: one batch
        try:
            while self._waiting or self.decoder.rows:
                while self._waiting and self.decoder.free_slots > 0:
                    self.decoder.add(self._waiting.pop(0)[0])
                for seq in self.decoder.step():
                    self._futures.pop(seq.rid).set_result(seq)
                await asyncio.sleep(0)
        except Exception as exc:  # every caller gets the error (nobody awaits this task itself)
            self.decoder.remove()
            self._waiting.clear()
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"in-process evaluation decode failed: {exc!r}"))
            self._futures.clear()


class PeriodicEvaluator:
    """Greedy (or `eval.temperature`) held-out accuracy of published versions; main rank only."""

    def __init__(self, cfg: RunConfig, device: str | None = None):
        from megatron_darl.data.tokenizers import load_tokenizer
        from megatron_darl.eval.heldout import eval_prompts, stop_ids
        from megatron_darl.rollout.turns import tool_turns

        if (cfg.eval.every_steps <= 0 and cfg.eval.every_samples <= 0) or cfg.eval.num_problems <= 0:
            raise ValueError(f"PeriodicEvaluator: eval.every_steps={cfg.eval.every_steps} or eval.every_samples="
                             f"{cfg.eval.every_samples}, and eval.num_problems={cfg.eval.num_problems}, must be > 0 "
                             f"(both intervals 0 turn it off)")
        self.cfg = cfg
        self.every = cfg.eval.every_steps
        self.every_samples = cfg.eval.every_samples
        self.next_mark = self.every_samples  # samples at which the next sample-scheduled evaluation is due
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_dir)
        prompts = eval_prompts(cfg, self.tokenizer)
        if not prompts:
            raise ValueError(f"eval.every_steps={self.every}, eval.every_samples={self.every_samples}: no held-out "
                             f"problems to evaluate on (data.eval_source / data.eval_size give none); set both "
                             f"to 0 or add them")
        self.prompts = prompts
        self.stop_ids = stop_ids(self.tokenizer)
        self.turns = tool_turns(cfg.rollout, self.tokenizer)  # rollout.tool: samples call tools as in training
        self.engine: DecoderEngine | None = None
        self.loaded: str | None = None
        self.pool = None
        self.eval_s_total = 0.0
        self.t_start = time.perf_counter()
        self.ledger = os.path.join(cfg.train.run_dir, "evals.jsonl")

    def due(self, version: int, generated: float | None = None, final: bool = False) -> float | None:
        """The sample mark of an evaluation of `version` now (the samples passed, or 0), or None
        when none is due; advances the sample schedule past `generated`."""
        mark = None
        if self.every_samples > 0 and generated is not None and generated >= self.next_mark:
            mark = float(generated // self.every_samples * self.every_samples)
            self.next_mark = mark + self.every_samples
        if final and self.every_samples > 0:  # the last version: at the budget when one stopped the run
            budget = self.cfg.train.max_generated_samples
            return float(budget) if budget and generated is not None and generated >= budget else generated or 0.0
        if mark is not None:
            return mark
        if self.every > 0 and version % self.every == 0:
            return generated if generated is not None else 0.0
        return None

    def evaluate_start(self, publisher: Any) -> dict[str, float]:
        """Version 0 before the first step (sample-scheduled evaluation only): the curve's step 0."""
        if self.every_samples <= 0:
            return {}
        return self._run(0, publisher, 0.0, 0.0)

    def maybe_run(self, version: int, publisher: Any, final: bool = False) -> dict[str, float]:
        """Evaluate `publisher.eval_folder(version)` when it is due (`due`); {} otherwise."""
        generated = samples_generated(publisher.rollout_metrics(), self.cfg.rollout.group_size)
        mark = self.due(version, generated, final)
        return {} if mark is None else self._run(version, publisher, generated, mark)

    def _run(self, version: int, publisher: Any, generated: float | None, mark: float) -> dict[str, float]:
        t0 = time.perf_counter()
        folder = publisher.eval_folder(version)
        scores = self.evaluate_folder(folder)
        r = scores.result("held-out")
        out = {"eval/accuracy": r.avg_at_k, "eval/accuracy_lo": r.ci95[0], "eval/accuracy_hi": r.ci95[1],
               "eval/pass_at_k": r.pass_at_k, "eval/version": float(version), "eval/problems": float(r.num_problems),
               "eval/sample_mark": mark}
        if scores.tool_call_rate() is not None:
            out["eval/tool_call_rate"] = scores.tool_call_rate()
        ecfg = self.cfg.eval
        if ecfg.sampled_k > 0:
            sampled = self.evaluate_folder(folder, ecfg.sampled_k, ecfg.sampled_temperature).result("sampled")
            out.update({"eval/sampled_accuracy": sampled.avg_at_k, "eval/sampled_pass_at_k": sampled.pass_at_k})
        eval_s = time.perf_counter() - t0
        self.eval_s_total += eval_s
        out.update({"eval/wall_s": time.perf_counter() - self.t_start - self.eval_s_total, "perf/eval_s": eval_s})
        if generated is not None:
            out["eval/samples_generated"] = generated
        os.makedirs(os.path.dirname(os.path.abspath(self.ledger)), exist_ok=True)
        with open(self.ledger, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(out) + "\n")
        return out

    def evaluate_folder(self, folder: str, k: int | None = None, temperature: float | None = None) -> ProblemScores:
        """Scores of the HF model folder `folder` on the held-out problems (k samples each at
        `temperature`; None: eval.samples_per_problem, eval.temperature)."""
        from megatron_darl.rewards.pool import RewardPool

        if self.engine is None:
            self.engine = DecoderEngine(Decoder(folder, device=self.device,
                                                max_batch=self.cfg.rollout.max_concurrent_per_engine,
                                                seed=self.cfg.train.seed))
        elif folder != self.loaded:  # the sampled evaluation reuses the weights just loaded
            self.engine.decoder.load_weights(folder)
        self.loaded = folder
        if self.pool is None:
            self.pool = RewardPool(self.cfg.reward)
        ecfg = self.cfg.eval
        k = ecfg.samples_per_problem if k is None else k
        temperature = ecfg.temperature if temperature is None else temperature
        return asyncio.run(aevaluate([self.engine], self.prompts, self.tokenizer, self.pool,
                                     k=k, temperature=temperature,
                                     max_new_tokens=ecfg.max_new_tokens or self.cfg.rollout.max_new_tokens,
                                     stop_token_ids=self.stop_ids, seed=self.cfg.train.seed, turns=self.turns))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.turns is not None:
            self.turns.close()
            self.turns = None
        self.engine = None


def samples_generated(rollout_metrics: dict[str, float], group_size: int) -> float | None:
    """Samples generated so far from the rollout manager's counters: those written to the ring
    plus the G samples of each group the equal-reward filter dropped; None before its first
    status."""
    if "rollout/samples_written" not in rollout_metrics:
        return None
    return rollout_metrics["rollout/samples_written"] + group_size * rollout_metrics.get("rollout/filtered_groups", 0.0)


def build_periodic_evaluator(cfg: RunConfig, is_main: bool) -> PeriodicEvaluator | None:
    """The main rank's evaluator when `eval.every_steps` or `eval.every_samples` > 0; None elsewhere."""
    on = cfg.eval.every_steps > 0 or cfg.eval.every_samples > 0
    return PeriodicEvaluator(cfg) if is_main and on and cfg.eval.num_problems > 0 else None
