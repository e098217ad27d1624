"""Rewards: math-verify grading, reasoning-gym verifiers, sandboxed code tests, user reward
functions, all run by `RewardPool` in worker processes with a per-item time limit."""

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.api import TASK_KINDS, RewardFn, RewardInput, RewardResult
from megatron_darl.rewards.pool import RewardPool

__all__ = ["RewardConfig", "RewardFn", "RewardInput", "RewardPool", "RewardResult", "TASK_KINDS"]
