"""The package installs as pyproject.toml declares it, offline, and the tree is clean under ruff.

What it is: an editable install of a copy of the checkout into a fresh virtual environment with
no package index (`pip install --no-index --no-deps --no-build-isolation -e .`, the command a
GPU machine without a registry runs), checked for its console scripts and its editable mapping;
and `ruff check` over the package, tests and scripts with the configuration in pyproject.toml.
What it is not: a test of the dependencies' versions (the environment running this has them).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {"darl-train", "darl-engine", "darl-convert", "darl-logprobs", "darl-eval", "darl-launch"}
LINTED = ["megatron_darl", "checkpoint_tools", "experiment", "tests", "scripts", "bench"]


def _copy_checkout(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())


def _venv_over_the_running_environment(venv: Path) -> Path:
    """A venv without pip that reaches the running environment's packages (its setuptools, wheel
    and pip), so nothing comes from an index; returns its interpreter. Not `--system-site-packages`:
    inside a venv that exposes the base interpreter's site-packages, not the venv's, and there
    setuptools may lack `bdist_wheel` (the failure a fresh `python3 -m venv` gave). The running
    environment's folders go in as plain paths of a `.pth` file, after the new venv's own
    site-packages, so its `.pth` files (the checkout's own editable install) are not run there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    (Path(site) / "running_environment.pth").write_text("".join(f"{p}\n" for p in ours))
    return py


def test_pyproject_declares_the_console_scripts_and_setup_py_adds_nothing():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert set(project["scripts"]) == SCRIPTS
    assert "torch==2.13.0" in project["dependencies"] and "megatron-core==0.16.1" in project["dependencies"]
    setup = (REPO / "setup.py").read_text()
    assert "setup()" in setup and "install_requires" not in setup and "entry_points" not in setup


def test_an_offline_editable_install_gives_the_console_scripts(tmp_path):
    src, venv = tmp_path / "checkout", tmp_path / "venv"
    _copy_checkout(src)
    py = _venv_over_the_running_environment(venv)
    out = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-e", "."], cwd=src, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert SCRIPTS <= {p.name for p in (venv / "bin").iterdir()}
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (info,) = Path(site).glob("megatron_darl-*.dist-info")
    direct = json.loads((info / "direct_url.json").read_text())
    assert direct["dir_info"].get("editable") is True and direct["url"] == src.as_uri()
    where = subprocess.run([str(py), "-c", "import megatron_darl, experiment; print(megatron_darl.__file__)"],
                           cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where) == src / "megatron_darl" / "__init__.py"
    usage = subprocess.run([str(venv / "bin" / "darl-train"), "--help"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: darl-train"), usage.stderr


def test_the_tree_is_clean_under_ruff():
    ruff = shutil.which("ruff")
    if ruff is None:  # the `test` extra installs it; an environment without it is not a tested one
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    out = subprocess.run([ruff, "check", "--no-cache", *LINTED], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr
