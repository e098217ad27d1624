"""Fixtures of the rewards tests: `sandbox`, each test once per path of the code sandbox, "namespaces"
(root) and "userns" (an ordinary user); the path this process cannot take skips, naming the test
that takes it (tests/helpers/sandbox.py). A module with other paths defines its own `sandbox`."""

import pytest

from tests.helpers.sandbox import SandboxMode


@pytest.fixture(params=["namespaces", "userns"])
def sandbox(request) -> SandboxMode:
    mode = SandboxMode(request.param)
    mode.check()  # the path this process cannot take is skipped, naming the test that takes it
    return mode
