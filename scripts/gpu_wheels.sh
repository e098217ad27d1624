#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs, in one folder, for a GPU machine with no package index.
# What it is: `pip wheel` of this checkout's dependencies as pyproject.toml declares them (on Linux
# x86_64, `torch==2.13.0` from PyPI is the CUDA build: its nvidia-* and triton wheels come with it),
# plus pytest and pytest-timeout (`pytest -m gpu`) and setuptools and wheel (the editable install
# builds the project). A dependency published only as source is built into a wheel here, so the
# GPU machine compiles nothing. Run it on Linux x86_64 with the Python minor version of the GPU
# machine (`--python python3.11`); there, from a checkout of the same commit:
#   pip install --no-index --find-links DIR -e . && python bench/gpu_check.py
# What it is not: Transformer Engine or SGLang (the check needs neither), nor the test extras the
# GPU tests do not use (msgspec, gguf, accelerate, ruff). Gigabytes: torch's CUDA libraries.
#   scripts/gpu_wheels.sh [--dry-run] [--python PYTHON] [--index-url URL] DIR
set -euo pipefail
usage() { echo "usage: scripts/gpu_wheels.sh [--dry-run] [--python PYTHON] [--index-url URL] DIR" >&2; }
value() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "gpu_wheels: $1 needs a value" >&2; usage; exit 2; }; }
dry=0 py=python3 dir=""
index=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --dry-run) dry=1 ;;
    --python) value "$@"; py=$2; shift ;;
    --index-url) value "$@"; index=(--index-url "$2"); shift ;;
    -*) echo "gpu_wheels: unknown option $1" >&2; usage; exit 2 ;;
    *) if [ -n "$dir" ]; then echo "gpu_wheels: one DIR only ($dir, $1)" >&2; usage; exit 2; fi; dir=$1 ;;
  esac
  shift
done
if [ -z "$dir" ]; then usage; exit 2; fi
repo=$(cd "$(dirname "$0")/.." && pwd)
cmd=("$py" -m pip wheel --wheel-dir "$dir" ${index[@]+"${index[@]}"} "$repo" pytest pytest-timeout "setuptools>=64" wheel)
platform="$(uname -s) $(uname -m)"
if [ "$dry" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  [ "$platform" = "Linux x86_64" ] || echo "gpu_wheels: this is $platform; the wheels must be made on Linux x86_64" >&2
  exit 0
fi
if [ "$platform" != "Linux x86_64" ]; then
  echo "gpu_wheels: this is $platform: pip would fetch wheels for it, not for a Linux x86_64 GPU machine" >&2; exit 2
fi
mkdir -p "$dir"
"${cmd[@]}"
rm -f "$dir"/megatron_darl-*.whl  # this checkout, which the GPU machine installs editable from its own copy
torch_whl=$(ls "$dir"/torch-2.13.0*.whl 2>/dev/null | head -1 || true)
if [ -z "$torch_whl" ] || [[ "$torch_whl" == *+cpu* ]] || ! ls "$dir"/nvidia_* >/dev/null 2>&1; then
  echo "gpu_wheels: $dir has no CUDA build of torch 2.13.0 (${torch_whl:-no torch wheel}; nvidia-* wheels:" \
       "$(ls "$dir"/nvidia_* 2>/dev/null | wc -l)): pip's index (PIP_INDEX_URL, pip.conf) served another build;" \
       "give PyPI with --index-url" >&2
  exit 1
fi
tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
echo "gpu_wheels: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1), for $tag on Linux x86_64 in $dir"
echo "gpu_wheels: on the GPU machine, from a checkout of this commit:"
echo "  pip install --no-index --find-links $dir -e . && python bench/gpu_check.py"
