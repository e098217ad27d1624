"""The `eval` config section: held-out evaluation before, during and after training."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    """Held-out evaluation during and after training."""

    num_problems: int = 500  # problems drawn from data.eval_source (0: no evaluation)
    samples_per_problem: int = 1  # k of avg@k / pass@k
    temperature: float = 0.0  # 0 = greedy
    # None: rollout.max_new_tokens; held-out prompts that do not fit the model's context beside it are skipped
    max_new_tokens: int | None = None
    # held-out accuracy inside training every N steps (eval/periodic.py, on the learner's main
    # rank; logged as eval/accuracy), 0 = only before and after training
    every_steps: int = 0
    # held-out accuracy inside training each time the rollout side's generated samples pass a
    # multiple of N (at the first step boundary at or after it), and of version 0 before the first
    # step and of the last version; logged with eval/sample_mark (the multiple). 0: off
    every_samples: int = 0
    # a second evaluation at each in-loop point: avg@sampled_k at sampled_temperature
    # (eval/sampled_accuracy), beside the main one (samples_per_problem at temperature). 0: off
    sampled_k: int = 0
    sampled_temperature: float = 1.0

    def check(self) -> list[tuple[str, str]]:
        errs: list[tuple[str, str]] = []
        if self.num_problems < 0:
            errs.append(("num_problems", "must be >= 0 (0: no evaluation)"))
        if self.samples_per_problem < 1:
            errs.append(("samples_per_problem", "must be >= 1"))
        if self.temperature < 0:
            errs.append(("temperature", "must be >= 0"))
        if self.every_steps < 0:
            errs.append(("every_steps", "must be >= 0 (0: no evaluation during training)"))
        elif self.every_steps > 0 and self.num_problems == 0:
            errs.append(("every_steps", "needs eval.num_problems > 0 (the problems it evaluates on)"))
        if self.every_samples < 0:
            errs.append(("every_samples", "must be >= 0 (0: no evaluation at sample intervals)"))
        elif self.every_samples > 0 and self.num_problems == 0:
            errs.append(("every_samples", "needs eval.num_problems > 0 (the problems it evaluates on)"))
        if self.sampled_k < 0:
            errs.append(("sampled_k", "must be >= 0 (0: no second, sampled evaluation)"))
        elif self.sampled_k > 0 and self.every_steps == 0 and self.every_samples == 0:
            errs.append(("sampled_k", "is an in-loop evaluation: needs eval.every_steps or eval.every_samples > 0"))
        if self.sampled_k > 0 and self.sampled_temperature <= 0:
            errs.append(("sampled_temperature", "must be > 0 (the sampled evaluation samples; greedy is the main one)"))
        return errs
