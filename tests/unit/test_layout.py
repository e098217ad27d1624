"""The package's layout shows its processes, and reads top-down.

- No module imports, even inside a function or for type checking only, a module that imports it
  back (cycles there were config <-> learner checks <-> memory plan <-> warm start, the launcher's
  local/Slurm placements, the rollout manager and its process entry, the trainer's rank and loop):
  a cycle makes the order of first imports matter and hides which module is the lower one.
- One folder per process over the channel they share: folders import one way (at most one pair
  of folders imports each other), at most four loose modules sit at the package root besides
  `__init__` and `__main__`, and no folder holds more than a fifth of the package's lines
  (`pytest -rP tests/unit/test_layout.py` prints the three figures).
- `config/` imports no process's code, `algo/` and `channel/` import no process's code either, and a
  name means one thing: no two modules share a file name among the ones that used to collide
  (cli, session, runner, preflight).
- docs/ARCHITECTURE.md's table "Folders, processes and imports" is the code's: each folder and
  loose module (`__init__`, `__main__` aside) has a row whose last column names exactly the folders
  and loose modules it imports (a file named, `engine/command.py`, stands for its folder;
  `checkpoint_tools/`, beside the package, counts like a folder; "everything" is no constraint)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_darl"
PROCESS_FOLDERS = {"trainer", "learner", "rollout", "engine", "rewards", "data", "eval", "launch"}
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
BESIDE = PACKAGE.parent / "checkpoint_tools"  # a package beside this one that the table names like a folder


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


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def _folder(path: Path) -> str | None:
    """The package folder a module file lives in; None for a loose module at the root."""
    return path.relative_to(PACKAGE).parts[0] if path.parent != PACKAGE else None


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


def _folder_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    mods = _modules()
    for m, targets in _graph().items():
        for t in targets:
            a, b = _folder(mods[m]), _folder(mods[t])
            if a and b and a != b:
                edges.setdefault((a, b), []).append(f"{m} -> {t}")
    return edges


def test_no_module_imports_one_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_folders_import_one_way():
    edges = _folder_edges()
    pairs = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    print(f"pairs of folders importing each other: {len(pairs)} {pairs}")  # pytest -rP shows it
    assert len(pairs) <= 1, {p: edges[p] + edges[(p[1], p[0])] for p in pairs}


def test_config_algo_and_channel_import_no_process():
    edges = _folder_edges()
    for low in ("config", "algo", "channel"):
        bad = {k: v for k, v in edges.items() if k[0] == low and k[1] in PROCESS_FOLDERS}
        assert not bad, bad
    assert not {k: v for k, v in edges.items() if k[0] == "config" and k[1] != "algo"}
    algo_config = PACKAGE / "algo" / "config.py"  # liftable with the maths: it imports nothing of ours
    assert not _imports(algo_config, set(_modules())), "algo/config.py imports the package"


def test_few_loose_modules_at_the_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    print(f"loose modules at the package root: {len(loose)} {loose}")
    assert len(loose) <= 4, loose


def test_no_folder_holds_more_than_a_fifth_of_the_package():
    lines = Counter()
    for path in PACKAGE.rglob("*.py"):
        folder = path.relative_to(PACKAGE).parts[0] if path.parent != PACKAGE else "<root>"
        lines[folder] += len(path.read_text().splitlines())
    total = sum(lines.values())
    shares = {f: round(n / total, 3) for f, n in lines.most_common()}
    print(f"share of the package's {total} lines per folder: {shares}")
    assert max(shares.values()) <= 0.20, shares


def test_a_module_name_means_one_thing():
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py", "api.py"))
    assert not {n: c for n, c in names.items() if c > 1}
    assert not list(PACKAGE.rglob("runner.py")) and len(list(PACKAGE.rglob("cli.py"))) == 1
    assert [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*preflight*.py")] == ["launch/preflight.py"]


def _unit(module: str) -> str | None:
    """The table's name of what holds `module`: a folder (`config/`, `checkpoint_tools/`) or a
    loose module (`types.py`); None for the package itself."""
    parts = module.split(".")
    if parts[0] != PACKAGE.name:
        return f"{parts[0]}/"
    if len(parts) == 1:
        return None
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def _code_imports() -> dict[str, set[str]]:
    """Each folder and loose module -> the others it imports (top level and inside functions)."""
    mods = _modules()
    known = set(mods) | {BESIDE.name} | {f"{BESIDE.name}.{p.stem}" for p in BESIDE.glob("*.py")}
    out: dict[str, set[str]] = {}
    for m, path in mods.items():
        unit = _unit(m)
        if unit is None or unit == "__main__.py":  # the entry; the table's `launch/` row names it
            continue
        out.setdefault(unit, set()).update(u for u in map(_unit, _imports(path, known)) if u not in (None, unit))
    return out


def _table_imports() -> dict[str, set[str] | None]:
    """Each row of ARCHITECTURE.md's "Folders, processes and imports" table -> the folders and
    loose modules its last column names: backticked paths (`config/`, `types.py`) outside
    parentheses, which are prose (None: "everything")."""
    section = ARCHITECTURE.read_text().split("\n## Folders, processes and imports\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str] | None] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] == "folder" or set(cells[0]) <= set("-: "):
            continue
        named = re.findall(r"`([^`]+(?:/|\.py))`", re.sub(r"\([^)]*\)", "", cells[-1]))
        rows[cells[0].strip("`")] = None if cells[-1].startswith("everything") else {
            f"{n.split('/')[0]}/" if "/" in n else n for n in named}
    return rows


def test_the_architecture_table_names_what_each_folder_imports():
    table, code = _table_imports(), _code_imports()
    assert table.get("launch/", ()) is None and len(table) > 8, table  # the table was found and read
    assert set(table) == set(code), {"without a row": sorted(set(code) - set(table)),
                                     "a row of nothing in the package": sorted(set(table) - set(code))}
    wrong = {}
    for unit, named in sorted(table.items()):
        if named is not None and named != code[unit]:
            wrong[unit] = {"imported, not in the table": sorted(code[unit] - named),
                           "in the table, never imported": sorted(named - code[unit])}
    assert not wrong, f"docs/ARCHITECTURE.md, \"Folders, processes and imports\": {wrong}"


def test_every_process_folder_has_its_entry():
    for folder in ("trainer", "rollout", "engine"):
        assert (PACKAGE / folder / "__main__.py").is_file(), folder


def test_tests_import_their_helpers_as_a_package():
    """Shared harnesses live once, in `tests/helpers/`, imported by name: no test edits sys.path."""
    tests = PACKAGE.parent / "tests"
    offenders = [str(p.relative_to(tests)) for p in tests.rglob("*.py") if "sys.path.insert" in p.read_text()
                 and p.name != "test_layout.py"]
    assert not offenders, offenders


FIRST = ["megatron_darl.config.load", "megatron_darl.config.run", "megatron_darl.learner.checks",
         "megatron_darl.learner.memory_plan", "megatron_darl.launch.warmstart", "megatron_darl.launch.slurm_job",
         "megatron_darl.launch.slurm", "megatron_darl.launch.local", "megatron_darl.rollout.manager_process",
         "megatron_darl.rollout.manager", "megatron_darl.trainer.loop", "megatron_darl.trainer.rank",
         "megatron_darl.algo.config"]
# One interpreter imports the heavy libraries once (none of the package), then forks a child per
# module that imports that module first: the order of first imports inside the package is what
# a cycle makes matter, and each child starts with none of it (the parent checks so).
_FORK_EACH = """
import importlib, json, os, sys, traceback
import torch, transformers, megatron.core  # noqa: F401  shared by every child
assert not [m for m in sys.modules if m.startswith("megatron_darl")], "the parent imported the package"
out = {}
for name in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc()[-2000:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        err = fh.read().decode()
    _, status = os.waitpid(pid, 0)
    out[name] = "" if os.waitstatus_to_exitcode(status) == 0 else (err or f"exit status {status}")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def first_imports() -> dict[str, str]:
    import json

    out = subprocess.run([sys.executable, "-c", _FORK_EACH, json.dumps(FIRST)], capture_output=True, text=True,
                         timeout=300, cwd=str(PACKAGE.parent))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", FIRST)
def test_each_module_of_the_old_circles_imports_first(first_imports, first):
    assert first_imports[first] == ""


def test_reading_a_config_imports_no_torch_and_algo_loads_on_first_use():
    # every process reads the config; a reward worker or the launcher must not pay for torch
    # to do it. `algo` loads its functions on first use; its `diagnostics` is the function
    # whichever of its modules was imported first.
    code = ("import sys; import megatron_darl.config.run, megatron_darl.config.load, megatron_darl.rewards.worker; "
            "from megatron_darl.config import load_config, RunConfig; assert 'torch' not in sys.modules, 'torch'; "
            "import megatron_darl.algo.diagnostics; from megatron_darl import algo; "
            "assert callable(algo.grpo_advantages) and 'torch' in sys.modules; "
            "assert callable(algo.diagnostics) and algo.diagnostics.__module__.endswith('diagnostics'); "
            "ns = {}; exec('from megatron_darl.algo import *', ns); assert 'darl_policy_loss' in ns; "
            "assert 'ppo_loss' in dir(algo)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(PACKAGE.parent))
    assert out.returncode == 0, out.stderr[-2000:]
