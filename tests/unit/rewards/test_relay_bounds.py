"""What a candidate writes back costs the worker at most the wall limit plus a small bound.

Graded through the real RewardPool, along the root path and the user path ("userns": natively as
a user, as root in test_sandbox_user.py). Before: a reply of about 1 MB that encodes a set of
integers all hashing alike cost the worker seconds of CPU per item after the wall deadline (the
set's build is quadratic: 7 s for 40,000 here), and a program that stopped reading its stdin (or
filled it itself through /proc/self/fd/0) blocked the worker's write until the pool's timeout
killed it. Error text the candidate wrote reached RewardResult.detail unescaped (a lone
surrogate), a HumanEval-format prompt that is a bare signature failed every item, and the test
ran in the worker with its rights (a hostile test wrote the host's /tmp; a heavy one held the
worker until the pool's timeout). Each is measured here against the naive bound: the item's own
wall limit, plus BOUND_S.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards import sandbox_relay
from megatron_darl.rewards.api import RewardInput
from megatron_darl.rewards.pool import RewardPool
from tests.helpers import REPO, repo_env
from tests.helpers.sandbox import needs_sandbox

pytestmark = needs_sandbox
WALL_S = 4.0
BOUND_S = 3.0  # the exit grace and the launcher's stop (sandbox_calls.EXIT_GRACE_S, sandbox.TERM_GRACE_S)
# 43,000 integers that all hash to 0 (1 MB), written as the reply on the program's channel (fd 3):
# the trusted side builds the set
FLOOD = """
import json, os, time
flood = {"value": {"set": [i * (2**61 - 1) for i in range(1, 43001)]}}
os.write(3, (json.dumps(flood, separators=(",", ":")) + "\\n").encode())
time.sleep(60)
"""
# the serving loop never starts; stdin shrunk and, where it may (user path), filled by the program
BLOCK = """
import fcntl, os, time
try:
    fcntl.fcntl(0, 1031, 4096)  # F_SETPIPE_SZ
    os.write(os.open("/proc/self/fd/0", os.O_WRONLY | os.O_NONBLOCK), b"x" * 4096)
except OSError:
    pass
time.sleep(60)
"""
BIG_ARG_TEST = "def check(candidate):\n    assert candidate('x' * 1000000) == 1\n"


def _humaneval(body: str, test: str = "def check(candidate):\n    assert candidate(2) == 4\n",
               prompt: str = "def f(x):\n    \"\"\"x squared\"\"\"\n") -> RewardInput:
    return RewardInput(prompt, body, "code", {"format": "humaneval", "prompt": prompt, "test": test,
                                              "entry_point": "f"})


def _functional(body: str, arg: str = "2", output: str = "4") -> RewardInput:
    return RewardInput("", body, "code", {"format": "functional", "fn_name": "f",
                                          "cases": [{"input": arg, "output": output}]})


def _timed(items: list[RewardInput], wall_s: float = WALL_S) -> list[tuple[float, str, str, float]]:
    """(score, status, detail, seconds) per item, each graded alone in a warm pool."""
    out = []
    config = RewardConfig(num_workers=1, timeout_s=120, code_wall_s=wall_s, code_cpu_s=int(wall_s))
    with RewardPool(config) as pool:
        pool.score([_functional("def f(x):\n    return x * x\n")])  # warm: imports done
        for item in items:
            start = time.monotonic()
            (r,) = pool.score([item])
            out.append((r.score, r.status, r.detail, time.monotonic() - start))
    return out


@pytest.mark.timeout(600)
def test_a_hash_flood_costs_at_most_the_wall_limit(sandbox):
    flood = "def f(x):\n" + "".join("    " + ln + "\n" for ln in FLOOD.strip().splitlines())
    results = _timed([_humaneval("    return x * x\n" + flood.replace("def f", "def g")),  # control
                      _humaneval(flood), _functional(flood)], wall_s=3.0)
    assert results[0][:2] == (1.0, "ok"), results[0]
    for score, status, detail, seconds in results[1:]:
        assert (score, status) == (0.0, "ok"), detail
        assert seconds <= 3.0 + BOUND_S, f"{seconds:.1f}s: {detail}"


@pytest.mark.timeout(600)
def test_a_program_that_blocks_its_stdin_costs_at_most_the_wall_limit(sandbox):
    body = "    return 1\n" + BLOCK
    items = [_humaneval(body, test=BIG_ARG_TEST),
             _functional("def f(x):\n    return 1\n" + BLOCK, arg=json.dumps("x" * 1000000), output="1")]
    for score, status, detail, seconds in _timed(items):
        assert (score, status) == (0.0, "ok"), detail  # not the pool's timeout: the worker lives
        assert seconds <= WALL_S + BOUND_S, f"{seconds:.1f}s: {detail}"
        assert "timeout" in detail, detail


@pytest.mark.timeout(600)
def test_error_text_reaches_the_detail_escaped(sandbox):
    raiser = "    raise ValueError('\\ud800 \\x1b[2J' + 'e' * 10)\n"
    (score, status, detail, _), = _timed([_humaneval(raiser)])
    assert (score, status) == (0.0, "ok") and "ValueError" in detail, detail
    detail.encode("utf-8")  # strict: no lone surrogate
    assert "\x1b" not in detail and "\\ud800" in detail and "\\x1b" in detail, detail


@pytest.mark.timeout(600)
def test_a_bare_signature_prompt_grades_like_any_other(sandbox):
    results = _timed([_humaneval("    return x * x\n", prompt="def f(x):\n"),
                      _humaneval("    return x + x + 1\n", prompt="def f(x):\n")])
    assert [r[:2] for r in results] == [(1.0, "ok"), (0.0, "ok")], results


@pytest.mark.timeout(600)
def test_a_hostile_or_heavy_test_spends_the_sandbox_not_the_worker(sandbox):
    mark = f"/tmp/darl-hostile-test-{os.getpid()}"
    hostile = f"def check(candidate):\n    open({mark!r}, 'w').write('ran with the worker\\'s rights')\n"
    heavy = "def check(candidate):\n    while True:\n        pass\n"
    try:
        results = _timed([_humaneval("    return x * x\n", test=hostile), _humaneval("    return x * x\n", test=heavy)])
        assert not os.path.exists(mark)  # the test's sandbox has a read-only /tmp of its own
    finally:
        if os.path.exists(mark):
            os.remove(mark)
    for score, status, detail, seconds in results:
        assert (score, status) == (0.0, "ok"), detail
        assert seconds <= WALL_S + BOUND_S, f"{seconds:.1f}s: {detail}"


# the candidate writes replies without end while the test never calls: what waits for the checker
# in the worker stays under the cap (before: it grew for the whole wall limit, 60 MiB over 4 s)
ENDLESS = """
from megatron_darl.rewards import sandbox_relay
from megatron_darl.rewards.sandbox import SandboxLimits
most = [0]
pump = sandbox_relay._Side.pump
def counting(self, readable, writable):
    lines = pump(self, readable, writable)
    most[0] = max(most[0], len(self.write_buf))
    return lines
sandbox_relay._Side.pump = counting
source = "def f(x):\\n    return x\\nimport os\\nline = b'{\\"value\\": \\"' + b'x' * 60000 + b'\\"}\\\\n'\\n" \\
         "while True:\\n    os.write(3, line * 16)\\n"
test = "def check(candidate):\\n    import time\\n    time.sleep(100)\\n"
print(sandbox_relay.run_checked(source, "f", "def f(x):\\n", test, SandboxLimits(wall_s=4))[0], most[0])
"""


@pytest.mark.timeout(120)
def test_endless_replies_fill_the_candidates_pipe_not_the_workers_memory():
    done = subprocess.run([sys.executable, "-c", ENDLESS], cwd=REPO, env=repo_env(), capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    score, most = done.stdout.split()
    assert float(score) == 0.0 and int(most) <= 3 * sandbox_relay.MAX_CAPTURE, done.stdout
