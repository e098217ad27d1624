"""The package reads top-down: no module imports, even inside a function or for type checking
only, a module that imports it back. Cycles there were config <-> learner/preflight <->
learner/memory_plan <-> warmstart, launch/runner <-> launch/slurm <-> launch/slurm_job,
rollout/manager <-> rollout/manager_process and learner_side <-> train; a cycle makes the order
of first imports matter and hides which module is the lower one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_darl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every package module `path` imports anywhere in its body."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out & known


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    mods = _modules()
    graph = {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}
    assert _cycles(graph) == []


@pytest.mark.parametrize("first", ["megatron_darl.config", "megatron_darl.learner.preflight",
                                   "megatron_darl.learner.memory_plan", "megatron_darl.warmstart",
                                   "megatron_darl.launch.slurm_job", "megatron_darl.launch.slurm",
                                   "megatron_darl.launch.runner", "megatron_darl.rollout.manager_process",
                                   "megatron_darl.rollout.manager", "megatron_darl.train"])
def test_each_module_of_the_old_circles_imports_first(first):
    out = subprocess.run([sys.executable, "-c", f"import {first}"], capture_output=True, text=True, timeout=120,
                         cwd=str(PACKAGE.parent))
    assert out.returncode == 0, out.stderr[-2000:]
