"""scripts/gpu_wheels.sh, without the download: its arguments, the pip command it would run
(`--dry-run`), and its checks of the folder pip leaves (a stand-in `--python` writes the wheels),
so that a CPU build of torch served by a misconfigured index is refused, not carried."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"
# a stand-in interpreter: `-m pip wheel --wheel-dir DIR ...` touches $FAKE_WHEELS in DIR; else the real one
FAKE_PY = f"""#!/usr/bin/env bash
if [ "$1" = -m ]; then
  while [ "$1" != --wheel-dir ]; do shift; done
  for w in $FAKE_WHEELS; do touch "$2/$w"; done
  exit 0
fi
exec {sys.executable} "$@"
"""


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_the_dry_run_prints_the_pip_command(tmp_path):
    done = _run("--dry-run", str(tmp_path / "w"))
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    assert argv[:6] == ["python3", "-m", "pip", "wheel", "--wheel-dir", str(tmp_path / "w")]
    assert argv[6:] == [str(ROOT), "pytest", "pytest-timeout", "setuptools>=64", "wheel"]
    assert not (tmp_path / "w").exists()
    other = shlex.split(_run("--python", "python3.11", "--index-url", "https://x.invalid/simple", "--dry-run",
                             "d").stdout)
    assert other[0] == "python3.11" and other[6:8] == ["--index-url", "https://x.invalid/simple"]


def test_the_project_pins_the_torch_whose_linux_wheel_is_the_cuda_build():
    # the script takes torch from pyproject.toml through `pip wheel .`: the pin is what it fetches
    assert '"torch==2.13.0"' in (ROOT / "pyproject.toml").read_text()


def test_bad_arguments_are_refused_with_the_usage():
    for args in ((), ("--bogus", "d"), ("a", "b"), ("--python",), ("--index-url",)):
        done = _run(*args)
        assert done.returncode == 2, args
        assert "usage: scripts/gpu_wheels.sh" in done.stderr, args
    helped = _run("--help")
    assert helped.returncode == 0 and "pip install --no-index --find-links DIR -e ." in helped.stdout


def _fake_python(tmp_path: Path) -> str:
    py = tmp_path / "fakepy"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    return str(py)


def test_a_cuda_torch_passes_and_the_projects_own_wheel_is_dropped(tmp_path):
    wheels = ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl nvidia_cublas_cu12-12.8.4.1-py3-none-any.whl "
              "megatron_darl-0.1.0-py3-none-any.whl pytest-8.4.0-py3-none-any.whl")
    done = _run("--python", _fake_python(tmp_path), str(tmp_path / "w"), env={"FAKE_WHEELS": wheels})
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == sorted(wheels.split()[:2] + [wheels.split()[3]])
    assert "gpu_wheels: 3 wheels" in done.stdout and f"cp{sys.version_info[0]}{sys.version_info[1]}" in done.stdout
    assert f"pip install --no-index --find-links {tmp_path / 'w'} -e ." in done.stdout


def test_a_cpu_torch_or_none_is_refused(tmp_path):
    py = _fake_python(tmp_path)
    cases = ("torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl nvidia_nccl_cu12-2.27.3-py3-none-any.whl",
             "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",  # no CUDA libraries with it
             "numpy-2.3.0-cp311-cp311-manylinux_2_28_x86_64.whl")
    for i, wheels in enumerate(cases):
        done = _run("--python", py, str(tmp_path / f"w{i}"), env={"FAKE_WHEELS": wheels})
        assert done.returncode == 1 and "no CUDA build of torch 2.13.0" in done.stderr, (wheels, done.stderr)
