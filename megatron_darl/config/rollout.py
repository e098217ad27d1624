"""The `rollout` config section: how trajectories are generated and how engines are driven.

What it is: `RolloutConfig`, each field documented where it is declared, with its checks.
What it is not: the engine protocol (`rollout/api.py`) or its request types (`types.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from megatron_darl.types import PAUSE_MODES


@dataclass
class RolloutConfig:
    """How trajectories are generated. Field comments are the documentation."""

    backend: str = "torch"  # "torch": embedded darl-engine processes; "sglang": SGLang servers
    engine_urls: list[str] = field(default_factory=list)  # sglang: servers to use (empty: launcher starts them)
    num_engines: int = 1  # engines the launcher starts (embedded: processes on this node)
    engine_threads: int = 1  # torch threads per embedded engine (1 beats 2 where engines share few cores)
    # embedded engines (backend torch), on CPU and GPU: dtype of their weights, activations and KV
    # cache (float32 | bfloat16 | float16 | fp8_e4m3: bf16 over projection weights rounded to FP8,
    # engine/fp8.py; logits and log-probs stay fp32). The learner keeps its
    # own, so anything but float32 makes behavior log-probs differ from the learner's on purpose
    # (logged as algo/mismatch_*). SGLang servers choose theirs: --dtype in launch.engine_args
    engine_dtype: str = "float32"
    api_key: str | None = None  # sent as Bearer token; the embedded engine requires it when set
    group_size: int = 8  # G: responses sampled per prompt (a group is never split)
    temperature: float = 1.0
    # training samples from the full tempered distribution: top_p must be 1 and top_k -1. The
    # behavior log-prob (darl-engine and SGLang 0.5.23 alike) and the learner's ratios are taken
    # over the full vocabulary, so truncated sampling would bias every ratio (docs/ALGORITHM.md,
    # "Truncated sampling"); `check` refuses it. Evaluation has its own sampling (`eval.*`).
    top_p: float = 1.0
    top_k: int = -1
    # response budget of every prompt; a prompt plus it must fit the model's context
    # (max_position_embeddings): longer prompts are skipped as bad rows, and a budget >= the context
    # is refused before start (SGLang and darl-engine refuse such a request with a 400)
    max_new_tokens: int = 256
    pause_mode: str = "abort"  # how engines pause for a weight update: abort | retract | in_place
    partial_rollout: bool = True  # keep interrupted responses and continue them under new weights
    max_concurrent_per_engine: int = 64  # in-flight requests per engine (least-loaded dispatch)
    request_timeout_s: float = 600.0  # one /generate call; a hung engine is marked down after it
    max_retries: int = 3  # transport retries with exponential backoff before an engine is marked down
    filter_equal_rewards: bool = False  # DAPO-style: drop groups whose rewards are all equal
    # how versions reach engines: "shm" (HF folder in /dev/shm, embedded engines on this node), "disk"
    # (folder on a shared file system), "distributed" (broadcast over a process group through SGLang's
    # /update_weights_from_distributed: NCCL on GPUs, gloo on CPU; no file), "auto": shm or disk by
    # where the engines run, never distributed (the rule: `weight_folder_kind`)
    weight_sync: str = "auto"
    weight_sync_timeout_s: float = 120.0  # distributed: bound of every join and broadcast of the weight groups
    # weight probe: after each version loads, every engine scores these many fixed tokens and the
    # manager compares with the learner's log-probs of them (0: off). An engine over a threshold
    # (`probe_thresholds`) is restarted; a second failure of the version stops the run.
    # On by default: one forward of <= 256 tokens per version, about 1% of a demo step
    # (bench/engine_dtype.py, docs/measurements.md); capped at the model's context - 1.
    probe_tokens: int = 256
    # an engine fails when its max |delta log-prob| passes `probe_max_abs` or its mean passes
    # `probe_mean_abs`; None: by dtype. Measured on 255-256 token probes: fp32 max <= 6e-6; bf16
    # mean 0.008-0.042, max 0.29; fp8_e4m3 mean 0.064-0.25, max up to 2.34 (a demo run at version
    # 81: rounding alone, heavy-tailed over random tokens); wrong-but-loadable weights mean >= 1.9,
    # max >= 7.95. So a float32 darl-engine: max 1e-3 (150x over its noise); any other engine
    # (SGLang servers included): mean 0.5 (2x over fp8's noise, 4x under the smallest corruption), no max
    probe_max_abs: float | None = None
    probe_mean_abs: float | None = None
    # tool calls inside a response (rollout/tools.py): "none", or "python": a call's code runs in the
    # code sandbox and its output continues the response as tool tokens (policy_mask 0: conditioned
    # on, never trained). max_new_tokens is then the budget of the whole episode, tool tokens included
    tool: str = "none"
    max_turns: int = 4  # generation turns per response: at most max_turns - 1 tool calls run
    tool_call_tokens: list[str] = field(default_factory=lambda: ["<tool_call>", "</tool_call>"])  # single tokens
    # what answers a call, around the program's output. Qwen3's chat template answers a call in a
    # user turn (configs/qwen3_4b_math_tools.yaml): "<|im_end|>\n<|im_start|>user\n<tool_response>\n
    # {output}\n</tool_response><|im_end|>\n<|im_start|>assistant\n" (one string)
    tool_response_template: str = "<tool_response>{output}</tool_response>"
    tool_max_output_tokens: int = 64  # of the program's output; longer output is cut (counted)
    tool_wall_s: float = 5.0  # sandbox limits of one call: wall clock, CPU seconds, memory
    tool_cpu_s: int = 3
    tool_memory_mb: int = 512
    tool_workers: int = 2  # calls running at once (threads of the rollout manager, off its event loop)

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "backend": ("torch", "sglang"),
        "engine_dtype": ("float32", "bfloat16", "float16", "fp8_e4m3"),
        "pause_mode": PAUSE_MODES,
        "weight_sync": ("auto", "shm", "disk", "distributed"),
        "tool": ("none", "python"),
    }

    def effective_weight_sync(self, engines_on_rollout_nodes: bool) -> str:
        """How versions reach the engines: "shm", "disk" or "distributed". A set value is kept
        as it is; `auto` is the folder `weight_folder_kind` picks."""
        if self.weight_sync != "auto":
            return self.weight_sync
        return self.weight_folder_kind(engines_on_rollout_nodes)

    def weight_folder_kind(self, engines_on_rollout_nodes: bool) -> str:
        """Where a version's folder goes: "shm" (/dev/shm) or "disk" (the run folder). This is
        the `auto` rule, for `auto` itself and for `distributed` (which writes a folder only for
        an engine whose broadcast failed); a set `shm` or `disk` is kept.

        `engines_on_rollout_nodes`: the engines run on nodes of their own, not the learner's
        (`launch.mode=slurm` with `launch.rollout_nodes > 0`). "shm" for embedded engines
        (backend torch) beside the learner, whose /dev/shm they share; "disk" otherwise: SGLang
        servers (started by the launcher or given as engine_urls, which may run anywhere) and
        embedded engines on rollout nodes."""
        if self.weight_sync in ("shm", "disk"):
            return self.weight_sync
        return "shm" if self.backend == "torch" and not engines_on_rollout_nodes else "disk"

    def _truncation_errors(self) -> list[tuple[str, str]]:
        """Training rollouts may not truncate the sampling distribution: the engines return
        log softmax(logits / T) of the FULL vocabulary as the behavior log-prob and the learner
        recomputes the same, while a token drawn under top-p / top-k has probability
        pi(y) / Z (Z: the kept mass), so every ratio would be off by Z and tokens outside the
        kept set would be weighted as if they could be drawn (docs/ALGORITHM.md)."""
        why = ("training samples from the full distribution: the behavior log-prob and the learner's ratios "
               "are taken over the full vocabulary, so truncated sampling would bias every ratio "
               "(docs/ALGORITHM.md, Truncated sampling); evaluation sets its own sampling (eval.*)")
        errs = []
        if not 0 < self.top_p <= 1:  # NaN fails this too
            errs.append(("top_p", f"must be 1 (no truncation), got {self.top_p}"))
        elif self.top_p < 1:
            errs.append(("top_p", f"{self.top_p} truncates the sampling distribution; must be 1: {why}"))
        if self.top_k != -1:
            errs.append(("top_k", f"{self.top_k} truncates the sampling distribution; must be -1 (none): {why}"))
        return errs

    def check(self) -> list[tuple[str, str]]:
        errs: list[tuple[str, str]] = []
        if self.group_size < 1:
            errs.append(("group_size", "must be >= 1"))
        if self.max_new_tokens < 1:
            errs.append(("max_new_tokens", "must be >= 1"))
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            errs.append(("temperature", "must be finite and > 0 (behavior log-probs are taken under it)"))
        errs += self._truncation_errors()
        if self.max_concurrent_per_engine < 1:
            errs.append(("max_concurrent_per_engine", "must be >= 1"))
        if not self.partial_rollout and self.pause_mode != "abort":
            errs.append(("partial_rollout", "false (restart interrupted samples) needs pause_mode=abort: "
                         "retract/in_place keep requests on the engine, which continue them"))
        if not self.weight_sync_timeout_s > 0:
            errs.append(("weight_sync_timeout_s", "must be > 0 (every collective of a weight group is bounded)"))
        if self.backend == "sglang" and self.engine_dtype != "float32":
            errs.append(("engine_dtype", f"{self.engine_dtype} sets darl-engine's dtype (backend torch); SGLang "
                         "servers take theirs from --dtype in launch.engine_args"))
        if self.probe_tokens != 0 and self.probe_tokens < 2:
            errs.append(("probe_tokens", f"{self.probe_tokens}: must be 0 (off) or >= 2 (token 0 has no log-prob)"))
        for key in ("probe_max_abs", "probe_mean_abs"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                errs.append((key, f"{getattr(self, key)}: must be > 0, or null for the dtype's default"))
        if self.num_engines < 1 and not self.engine_urls:
            errs.append(("num_engines", "must be >= 1 when no engine_urls are given"))
        return errs + self._tool_errors()

    def _tool_errors(self) -> list[tuple[str, str]]:
        errs: list[tuple[str, str]] = []
        for key in ("max_turns", "tool_max_output_tokens", "tool_cpu_s", "tool_memory_mb", "tool_workers"):
            if getattr(self, key) < 1:
                errs.append((key, f"{getattr(self, key)}: must be >= 1"))
        if not self.tool_wall_s > 0:
            errs.append(("tool_wall_s", f"{self.tool_wall_s}: must be > 0"))
        if len(self.tool_call_tokens) != 2 or len(set(self.tool_call_tokens)) != 2 or not all(self.tool_call_tokens):
            errs.append(("tool_call_tokens", f"{self.tool_call_tokens!r}: must be two different tokens, "
                         "the one that opens a call and the one that closes it"))
        if self.tool_response_template.count("{output}") != 1:
            errs.append(("tool_response_template", "must hold '{output}' exactly once (where the call's output goes)"))
        if self.tool != "none" and self.max_turns < 2:
            errs.append(("max_turns", f"{self.max_turns} with rollout.tool={self.tool!r} runs no call: must be >= 2"))
        return errs

    def probe_thresholds(self) -> tuple[float, float]:
        """(max, mean) |delta log-prob| an engine's probe may show (see `probe_max_abs`)."""
        exact = self.backend == "torch" and self.engine_dtype == "float32"
        top = self.probe_max_abs if self.probe_max_abs is not None else (1e-3 if exact else math.inf)
        mean = self.probe_mean_abs if self.probe_mean_abs is not None else (1e-3 if exact else 0.5)
        return top, mean
