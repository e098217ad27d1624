"""The measured-durations plugin (tests/helpers/durations.py), run as a developer runs it: pytest
in a subprocess over a tiny test folder with its own durations file, the plugin loaded with `-p`.
A test measured at >= 10 s is marked slow (`-m "not slow"` leaves it out), `--fast` also leaves
out the tests measured at >= 2 s and the users of a shared fixture measured at >= 5 s to set up,
and says how many, a test without an entry runs in every tier,
and `--record-durations` writes what this run measured, keeping the entries of tests it did not
run and dropping those of tests that no longer exist."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import repo_env
from tests.helpers.durations import read, write_durations

TESTS = '''
import time

def test_long():
    pass

def test_medium():
    pass

def test_short():
    time.sleep(0.3)

def test_new():
    pass
'''
SHARED = '''
import time

import pytest

@pytest.fixture(scope="module")
def big():
    time.sleep(0.2)
    return 1

def test_first_user(big):
    pass

def test_second_user(big):
    pass
'''


def pytest_run(folder, *args: str, target: str = "") -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-p", "tests.helpers.durations", "-p", "no:cacheprovider",
               "-c", str(folder / "pytest.ini"), "--rootdir", str(folder), "--durations-file",
               str(folder / "durations.json"), target or str(folder), "-v", *args]
    # only the plugin under test: the installed ones (hypothesis's costs seconds a start) stay out
    return subprocess.run(command, cwd=folder, env=repo_env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: measured\n")
    (tmp_path / "test_tiny.py").write_text(TESTS)
    (tmp_path / "test_shared.py").write_text(SHARED)
    write_durations({"test_tiny.py::test_long": 12.0, "test_tiny.py::test_medium": 3.0,
                     "test_tiny.py::test_short": 0.1, "test_tiny.py::test_gone": 50.0,
                     "test_shared.py::test_first_user": 6.1, "test_shared.py::test_second_user": 0.1,
                     "test_removed.py::test_x": 4.0},
                    str(tmp_path / "durations.json"), fixtures={"test_shared.py::big": 6.0})
    return tmp_path


def _ran(out: str) -> list[str]:
    return sorted(line.split("::")[1].split()[0] for line in out.splitlines() if " PASSED" in line)


def test_not_slow_leaves_out_what_was_measured_at_10_s(folder):
    done = pytest_run(folder, "-m", "not slow")
    assert done.returncode == 0, done.stdout
    assert _ran(done.stdout) == ["test_first_user", "test_medium", "test_new", "test_second_user", "test_short"]


def test_fast_leaves_out_what_was_measured_at_2_s_and_says_so(folder):
    done = pytest_run(folder, "--fast")
    assert done.returncode == 0, done.stdout
    # test_second_user was fast only because test_first_user paid for the shared fixture: both go
    assert _ran(done.stdout) == ["test_new", "test_short"]
    assert "--fast: left out 4 tests" in done.stdout and "1 tests have no measured duration" in done.stdout


def test_record_writes_this_runs_durations_keeping_the_deselected_and_dropping_the_gone(folder):
    done = pytest_run(folder, "-m", "not slow", "--record-durations")
    assert done.returncode == 0, done.stdout
    got, fixtures = read(str(folder / "durations.json"))
    assert sorted(got) == ["test_shared.py::test_first_user", "test_shared.py::test_second_user",
                           "test_tiny.py::test_long", "test_tiny.py::test_medium", "test_tiny.py::test_new",
                           "test_tiny.py::test_short"]
    assert 0.2 <= fixtures["test_shared.py::big"] < 5.0  # measured, the old 6 s replaced
    assert got["test_tiny.py::test_long"] == 12.0  # not run: kept as measured before
    assert 0.3 <= got["test_tiny.py::test_short"] < 5.0 and got["test_tiny.py::test_medium"] < 2.0
    assert "durations: wrote 6 tests" in done.stdout
    assert json.loads((folder / "durations.json").read_text())["about"]


def test_a_run_over_one_file_rewrites_only_its_entries(folder):
    done = pytest_run(folder, "--record-durations", target=str(folder / "test_tiny.py"))
    assert done.returncode == 0, done.stdout
    got, _ = read(str(folder / "durations.json"))
    # test_shared.py did not run: its entries stay as measured; test_tiny.py's are this run's, its
    # gone test is dropped; test_removed.py no longer exists: dropped
    assert got["test_shared.py::test_first_user"] == 6.1 and got["test_shared.py::test_second_user"] == 0.1
    assert sorted(k for k in got if k.startswith("test_tiny.py")) == [
        "test_tiny.py::test_long", "test_tiny.py::test_medium", "test_tiny.py::test_new", "test_tiny.py::test_short"]
    assert got["test_tiny.py::test_long"] < 2.0 and "test_removed.py::test_x" not in got
