"""Whether the code sandbox can run on this machine, for the tests that grade code.

What it is: `SANDBOX_PROBLEM` (None, or why not: not root, namespaces refused), found once per
test session by `sandbox_problem()`, the same check a run makes before it starts, and the
`needs_sandbox` mark that skips a test with that reason.
What it is not: the refusal tests (test_rewards_sandbox_refusal.py check that the sandbox refuses).
"""

import pytest

from megatron_darl.rewards.sandbox import sandbox_problem

SANDBOX_PROBLEM = sandbox_problem()
needs_sandbox = pytest.mark.skipif(SANDBOX_PROBLEM is not None, reason=f"cannot run here: {SANDBOX_PROBLEM}")
