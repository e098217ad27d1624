"""The conventions of docs/development.md that a machine can check, checked.

What it is: every module of the package says what it is in a docstring; a function with more
than three keyword parameters lists each in an `Args:` section; no code comment or docstring
carries a tracker number; test files live in packages (`__init__.py`) and carry no folder prefix.
What it is not: the line length and import order (ruff, `tests/unit/test_packaging.py`), or the
layout of the package (`tests/unit/test_layout.py`).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = ["megatron_darl", "checkpoint_tools", "experiment"]
TRACKER = re.compile(r"\b(issue|stop)s? #?\d+\b", re.IGNORECASE)


def _files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py"))


def _keyword_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameters with a default or keyword-only: what a caller names."""
    a = fn.args
    positional = a.posonlyargs + a.args
    return [p.arg for p in positional[len(positional) - len(a.defaults):]] + [p.arg for p in a.kwonlyargs]


def _args_section(doc: str) -> set[str]:
    """Names listed as `name: ...` (or `name (type): ...`, or `a, b: ...` for names that share one
    description) in the docstring's `Args:` section."""
    names, inside = set(), False
    for line in doc.splitlines():
        if line.strip() == "Args:":
            inside = True
        elif inside and line.strip() and not line.startswith((" ", "\t")):
            break
        elif inside and (m := re.match(r"\s+(\*{0,2}\w+(?:, \*{0,2}\w+)*)(?: \([^)]*\))?:", line)):
            names.update(n.lstrip("*") for n in m.group(1).split(", "))  # `a, b: shared text` lists both
    return names


def test_every_module_says_what_it_is():
    missing = [str(p.relative_to(REPO)) for p in _files(*CODE)
               if p.stat().st_size and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without a docstring: {missing}"


def test_functions_with_more_than_three_keywords_list_them_under_args():
    offenders = []
    for path in _files(*CODE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                keywords = _keyword_params(node)
                if len(keywords) > 3:
                    listed = _args_section(ast.get_docstring(node) or "")
                    if absent := [k for k in keywords if k not in listed]:
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {absent}")
    assert not offenders, "keyword parameters missing from the docstring's Args: section:\n" + "\n".join(offenders)


def test_the_args_reader_finds_what_a_docstring_lists():
    doc = "Score it.\n\nArgs:\n    level: token or sequence.\n    eps (float): floor.\n\nReturns:\n    x: no."
    assert _args_section(doc) == {"level", "eps"}
    assert _args_section("No section.\n    level: here.") == set()
    grouped = "Run it.\n\nArgs:\n    is_level, is_mode: the options.\n    x: one.\n    a sentence, with: a colon."
    assert _args_section(grouped) == {"is_level", "is_mode", "x"}


def _comments_and_strings(path: Path) -> list[tuple[int, str]]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((tok.start[0], tok.string))
    return out


def test_no_tracker_numbers_in_code_comments_or_docstrings():
    found = [f"{p.relative_to(REPO)}:{line}: {TRACKER.search(text).group(0)}"
             for p in _files(*CODE, "tests", "scripts", "bench") for line, text in _comments_and_strings(p)
             if TRACKER.search(text)]
    assert not found, "tracker numbers belong in commit messages:\n" + "\n".join(found)
    assert TRACKER.search("# fixed in issue " + "31") and not TRACKER.search("# stop the 3 engines")


def test_test_folders_are_packages_and_files_carry_no_folder_prefix():
    folders = [d for d in (REPO / "tests").rglob("*") if d.is_dir() and d.name != "__pycache__"
               and any(d.glob("test_*.py"))]
    assert [d for d in folders if not (d / "__init__.py").is_file()] == []
    prefixed = [str(p.relative_to(REPO)) for d in folders for p in d.glob("test_*.py")
                if p.name.startswith(f"test_{d.name}_")]
    assert prefixed == []
