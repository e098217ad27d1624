"""The expected-skips check (tests/helpers/expected_skips.py), run as CI runs it: pytest in a
subprocess over a tiny test folder, the plugin loaded with `-p`. A run whose skips are exactly
the list passes; an extra skip, a listed test that ran, or a listed test that skipped for another
reason fails the run (exit 1) with the difference, the file and the way to update it printed; a
failure of the tests themselves stays a failure; `--expected-skips-update` writes the list (its
`*` patterns and header kept); the environment variable stands in for the option."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, repo_env
from tests.helpers.expected_skips import compare

TESTS = '''
import pytest

def test_runs():
    pass

@pytest.mark.skip(reason="needs a GPU")
def test_gpu():
    pass

@pytest.mark.parametrize("uid", [7])
def test_user(uid):
    pytest.skip(f"as uid {uid} the other path runs")
'''
LISTED = ("test_tiny.py::test_gpu | needs a GPU\n"
          "test_tiny.py::test_user[7] | as uid * the other path runs\n")


def pytest_run(folder, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """pytest over `folder` with the plugin and no ini file of the repository's."""
    command = [sys.executable, "-m", "pytest", "-p", "tests.helpers.expected_skips", "-p", "no:cacheprovider",
               "-c", str(folder / "pytest.ini"), "--rootdir", str(folder), str(folder), *args]
    # only the plugin under test: the installed ones (hypothesis's costs seconds a start) stay out
    env = dict(env or repo_env(), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_tiny.py").write_text(TESTS)
    (tmp_path / "skips.txt").write_text("# the tiny pass\n" + LISTED)
    return tmp_path


def test_the_listed_skips_pass(folder):
    done = pytest_run(folder, "--expected-skips", str(folder / "skips.txt"))
    assert done.returncode == 0, done.stdout
    assert "1 passed, 2 skipped" in done.stdout and "expected skips" not in done.stdout


def test_an_extra_skip_fails_naming_it_the_file_and_the_update(folder):
    (folder / "skips.txt").write_text("test_tiny.py::test_gpu | needs a GPU\n")
    (folder / "test_gone.py").write_text("import pytest\n\npytest.importorskip('no_such_module_here')\n")
    done = pytest_run(folder, "--expected-skips", str(folder / "skips.txt"))
    assert done.returncode == 1, done.stdout
    assert "skipped, not listed:       + test_tiny.py::test_user[7] | as uid 7 the other path runs" in done.stdout
    assert "+ test_gone.py | could not import 'no_such_module_here'" in done.stdout  # a whole module
    assert f"edit {folder / 'skips.txt'}" in done.stdout and "--expected-skips-update" in done.stdout


def test_a_listed_test_that_runs_fails(folder):
    (folder / "skips.txt").write_text(LISTED + "test_tiny.py::test_runs | was slow once\n")
    done = pytest_run(folder, "--expected-skips", str(folder / "skips.txt"))
    assert done.returncode == 1, done.stdout
    assert "listed, did not skip so:   - test_tiny.py::test_runs | was slow once" in done.stdout


def test_another_reason_is_a_difference(folder):
    (folder / "skips.txt").write_text(LISTED.replace("needs a GPU", "needs two GPUs"))
    done = pytest_run(folder, "--expected-skips", str(folder / "skips.txt"))
    assert done.returncode == 1, done.stdout
    assert "+ test_tiny.py::test_gpu | needs a GPU" in done.stdout
    assert "- test_tiny.py::test_gpu | needs two GPUs" in done.stdout


def test_a_failing_test_still_fails_and_the_environment_names_the_file(folder):
    (folder / "test_tiny.py").write_text(TESTS + "\ndef test_broken():\n    assert False\n")
    done = pytest_run(folder, env=repo_env(DARL_EXPECTED_SKIPS=str(folder / "skips.txt")))
    assert done.returncode == 1 and "1 failed" in done.stdout and "expected skips" not in done.stdout, done.stdout
    (folder / "skips.txt").write_text("")  # the environment's file is read: an empty list fails
    done = pytest_run(folder, env=repo_env(DARL_EXPECTED_SKIPS=str(folder / "skips.txt")))
    assert "skipped, not listed:       + test_tiny.py::test_gpu | needs a GPU" in done.stdout, done.stdout


def test_update_writes_the_list_keeping_patterns_and_header(folder):
    (folder / "skips.txt").write_text("# the tiny pass\n" + LISTED.splitlines()[1] + "\n")
    done = pytest_run(folder, "--expected-skips", str(folder / "skips.txt"), "--expected-skips-update")
    assert done.returncode == 0, done.stdout
    assert (folder / "skips.txt").read_text() == "# the tiny pass\n" + LISTED
    assert pytest_run(folder, "--expected-skips", str(folder / "skips.txt")).returncode == 0


def test_without_the_option_nothing_is_checked_and_children_do_not_inherit_the_variable(folder):
    done = pytest_run(folder)
    assert done.returncode == 0 and "expected skips" not in done.stdout, done.stdout
    child = "import os\n\ndef test_child():\n    assert 'DARL_EXPECTED_SKIPS' not in os.environ\n"
    (folder / "test_child.py").write_text(child)
    done = pytest_run(folder, env=repo_env(DARL_EXPECTED_SKIPS=str(folder / "skips.txt")))
    assert done.returncode == 0 and "2 passed, 2 skipped" in done.stdout, done.stdout  # test_child saw none


def test_compare_lists_what_to_add_and_remove():
    skipped = {"a::x": "needs root", "a::y": "offline: [Errno 101] Network is unreachable"}
    expected = {"a::y": "offline: *", "a::z": "needs a GPU"}
    assert compare(skipped, expected) == (["a::x | needs root"], ["a::z | needs a GPU"])
    assert compare({"a::y": "online"}, expected) == (["a::y | online"], ["a::y | offline: *", "a::z | needs a GPU"])
    assert compare({"a::y": "x [Errno 101] y"}, {"a::y": "x [Errno 101] *"}) == ([], [])  # brackets are text
    assert compare({"a::y": "x E y"}, {"a::y": "x [E] y"}) == (["a::y | x E y"], ["a::y | x [E] y"])
    assert REPO.joinpath("tests", "expected_skips").is_dir()  # where the passes' lists live


def test_what_a_restricted_pass_leaves_out_still_exists():
    # pytest ignores a --deselect that matches nothing: a renamed test would silently run there
    import re

    text = REPO.joinpath(".ci", "restricted_pass").read_text()
    block = re.search(r"^DESELECT=\((.*?)\)", text, re.S | re.M)
    assert block, "no DESELECT=(...) in .ci/restricted_pass"
    ids = block.group(1).split()
    assert ids
    for node in ids:
        path, name = node.split("::")
        assert re.search(rf"^def {name}\(", REPO.joinpath(path).read_text(), re.M), node
