"""One reward worker process: reads items as JSON lines, grades each, writes one JSON line back.

What it is: `Grader` dispatches a RewardInput to its grader by kind (math-verify, reasoning-gym
verifiers, the code sandbox, or the user's `RewardConfig.fn` for kind "custom"), and `main` is
the process loop RewardPool starts (`python -c ...` with the parent's sys.path). The protocol
is line-based JSON on a private copy of stdout: first {"ready": true} (or {"ready": false,
"error": ...}) once the graders are imported, then one {"id", "score", "status", "detail"}
per request. File descriptor 1 is pointed at stderr so a grader's prints cannot corrupt it.
What it is not: where time limits live: a grader here may hang forever; the pool kills the
worker past RewardConfig.timeout_s and starts another.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from typing import Any

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.api import RewardFn, RewardInput


def load_reward_fn(path: str) -> RewardFn:
    """Import "pkg.module:function"; errors name the path and what is wrong with it."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"RewardConfig.fn={path!r} must look like 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"RewardConfig.fn={path!r}: cannot import {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"RewardConfig.fn={path!r}: {module_name} has no callable {attr!r}")
    return fn


class Grader:
    """Grades one item at a time in this process; graders are imported when it is built."""

    def __init__(self, config: RewardConfig) -> None:
        # imported now, not on the first item, so import time never counts against an item
        import reasoning_gym.factory  # noqa: F401

        import megatron_darl.rewards.math_grader  # noqa: F401
        from megatron_darl.data.procedural import ProceduralVerifier
        from megatron_darl.rewards.code_grader import limits_from_config

        self.procedural_verifier = ProceduralVerifier()  # caches re-created datasets

        self.limits = limits_from_config(config)
        self.user_fn = load_reward_fn(config.fn) if config.fn else None
        self.user_fn_path = config.fn

    def grade(self, item: RewardInput) -> tuple[float, str]:
        """(score, detail); raises on a grader error (bad payload, failing user function)."""
        if item.kind == "math":
            from megatron_darl.rewards.math_grader import grade_math

            gold = item.answer.get("answer", item.answer.get("ground_truth"))
            if gold is None:
                raise ValueError("math item: answer payload lacks 'answer' (or 'ground_truth')")
            return grade_math(item.response, str(gold)), ""
        if item.kind == "procedural":
            from megatron_darl.rewards.procedural_grader import grade_procedural

            return grade_procedural(item.response, item.answer, self.procedural_verifier), ""
        if item.kind == "code":
            from megatron_darl.rewards.code_grader import grade_code

            return grade_code(item.response, item.answer, self.limits)
        if self.user_fn is None:
            raise ValueError("custom item but RewardConfig.fn is not set")
        score = self.user_fn(item)
        number = isinstance(score, (int, float)) and not isinstance(score, bool)
        if not number or not math.isfinite(score):
            raise ValueError(f"{self.user_fn_path} returned {score!r}; a finite float is required")
        return float(score), ""


def handle(grader: Grader, request: dict[str, Any]) -> dict[str, Any]:
    """The reply to one request; grader exceptions become status "error" with score 0."""
    from megatron_darl.rewards.sandbox_calls import printable

    reply: dict[str, Any] = {"id": request.get("id")}
    try:
        score, detail = grader.grade(RewardInput(**request["item"]))
        reply.update(score=score, status="ok", detail=detail)
    except Exception as e:  # any grader failure costs this item only
        reply.update(score=0.0, status="error", detail=f"{type(e).__name__}: {e}"[:500])
    # a detail may quote what a candidate wrote (an error, a value): lone surrogates and control
    # characters escaped, so that every log and JSON encoder downstream takes it
    reply["detail"] = printable(str(reply["detail"]))
    return reply


def _die_with_parent() -> None:
    """A worker (and, through the sandbox launcher, its program) must not outlive the pool's
    process: Linux delivers SIGKILL to us when the parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def main() -> None:
    """Worker loop: argv[-1] is the RewardConfig as JSON."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _die_with_parent()
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # prints from graders and user functions go to stderr
    try:
        grader = Grader(RewardConfig(**json.loads(sys.argv[-1])))
    except Exception as e:  # reported to the pool, which raises it
        channel.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    channel.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if line.strip():
            channel.write(json.dumps(handle(grader, json.loads(line))) + "\n")
