"""User reward functions for the pool tests, loaded by import path ("tests.helpers.reward_fns:NAME")."""

import os
import time


def length_reward(item) -> float:
    """A well-behaved user reward: the response length over 10."""
    return len(item.response) / 10.0


def raises(item) -> float:
    raise RuntimeError("user grader failed on purpose")


def not_a_number(item) -> float:
    return float("nan")


def crashes(item) -> float:
    os._exit(3)  # the worker process dies mid-item


def hangs(item) -> float:
    time.sleep(3600)
    return 1.0


def by_mode(item) -> float:
    """Dispatch on item.metadata["mode"], so one pool serves every test behaviour."""
    modes = {"length": length_reward, "raises": raises, "nan": not_a_number,
             "crashes": crashes, "hangs": hangs}
    return modes[item.metadata["mode"]](item)
