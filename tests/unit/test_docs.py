"""The user-facing docs hold together: the README stays short, its commands are CI's, and its links land.

What it is: checks over README.md and the docs it sends newcomers to first (development, clusters,
design, ARCHITECTURE, CHANGELOG), read as text:
- the README has at most `README_MAX_LINES` lines (it is for users; detail goes to docs/);
- the README's first command is the demo command `scripts/fresh_clone_demo.sh` times, and the prose
  just before it gives a CPU-only machine its torch command (PyPI's default torch is the CUDA build);
- every relative markdown link, and every backticked path (or path word in a code block) that
  starts at a folder of the repository, resolves to a file or folder that exists inside the repo;
- the README holds, as one line and only once, the test command `.ci/run` runs (the line after its
  comment "The README's test command, verbatim:");
- every `#anchor` of those links names a heading of its target (GitHub's slugs).
The checker's own functions are tried on small broken inputs too, so that a pattern that stopped
matching cannot pass silently.
What it is not: a check of external (http) links, of prose, or of docs beyond those six files.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *(ROOT / "docs" / f for f in ("development.md", "clusters.md", "design.md", "ARCHITECTURE.md")),
        ROOT / "CHANGELOG.md"]
README_MAX_LINES = 260
CI_MARKER = "The README's test command, verbatim:"
DEMO_COMMAND = "pip install -e . && darl-train --config configs/cpu_demo_darl.yaml"
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

# a path word counts when it starts at one of these repository folders ...
REPO_FOLDERS = {"docs", "configs", "scripts", "tests", "slurm", "bench", "megatron_darl", "checkpoint_tools",
                "experiment", ".ci"}
# ... or at a folder of the package (`trainer/feed.py`), when it names a file or ends in "/"; a metric
# such as `rollout/groups_dropped` shares a folder's name but is no path
PACKAGE_FOLDERS = {p.name for p in (ROOT / "megatron_darl").iterdir() if (p / "__init__.py").is_file()}
FILE_SUFFIX = re.compile(r"\.(py|md|yaml|yml|txt|json|sh|sbatch|toml|ini|png|jsonl)$")
NOT_A_PATH = re.compile(r"[<>*{}~=|\[\]$]")  # placeholders, globs, assignments

LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _split_fenced(text: str) -> tuple[str, str]:
    """(prose, code): the lines outside and inside ``` fences."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return "\n".join(prose), "\n".join(code)


def _path_words(text: str) -> list[str]:
    """The words of `text` that name a repository path, `::test` parts and wrapping punctuation removed."""
    out = []
    for raw in text.split():
        word = raw.strip("\"'(),;$").rstrip(".").split("::")[0]
        if "/" not in word or word.startswith("/") or NOT_A_PATH.search(word) or ":" in word:
            continue
        first = word.split("/")[0]
        if first in REPO_FOLDERS:
            out.append(word)
        elif first in PACKAGE_FOLDERS and (FILE_SUFFIX.search(word) or word.endswith("/")):
            out.append("megatron_darl/" + word)
    return out


def repo_paths(text: str) -> list[str]:
    """Repository paths named in backticks in the prose, or as words of the code blocks."""
    prose, code = _split_fenced(text)
    words = [w for span in CODE_SPAN.findall(prose) for w in _path_words(span)]
    return words + _path_words(code)


def first_command(text: str) -> tuple[str, str]:
    """(the prose paragraph just before the first ``` fence, the fence's first line), or ("", "")."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            before: list[str] = []
            for prev in reversed(lines[:i]):
                if not prev.strip():
                    if before:
                        break
                    continue
                before.insert(0, prev)
            return " ".join(before), lines[i + 1].strip() if i + 1 < len(lines) else ""
    return "", ""


def relative_links(text: str) -> list[str]:
    """Link targets in the prose that are neither absolute URLs nor mail addresses."""
    prose, _ = _split_fenced(text)
    return [t for _, t in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercase, punctuation but '-' and '_' dropped."""
    text = LINK.sub(r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 for repeated headings."""
    prose, _ = _split_fenced(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    """What is wrong with `doc`'s relative links: a missing target, one outside the repo, a bad anchor."""
    problems = []
    for target in relative_links(doc.read_text()):
        where, _, anchor = target.partition("#")
        dest = (doc.parent / where).resolve() if where else doc
        if not dest.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file or folder")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_their_anchors_resolve(doc):
    assert relative_links(doc.read_text()), f"{doc.name}: no relative link found (has the pattern broken?)"
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_in_code_exist(doc):
    paths = repo_paths(doc.read_text())
    assert paths, f"{doc.name}: no repository path found (has the pattern broken?)"
    missing = sorted({p for p in paths if not (ROOT / p).exists()})
    assert missing == [], f"{doc.name} names paths that do not exist: {missing}"


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_holds_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    marks = [i for i, line in enumerate(ci) if CI_MARKER in line]
    assert len(marks) == 1, f".ci/run should have one comment {CI_MARKER!r}"
    command = ci[marks[0] + 1].strip()
    assert command.startswith("pip install"), f".ci/run: the line after the marker is {command!r}"
    assert [line.strip() for line in README.read_text().splitlines()].count(command) == 1, (
        f"README.md should hold {command!r} as a line exactly once")


def test_the_first_command_is_the_demo_and_a_cpu_machine_is_told_first():
    assert DEMO_COMMAND in (ROOT / "scripts" / "fresh_clone_demo.sh").read_text()
    prose, command = first_command(README.read_text())
    assert command == DEMO_COMMAND, f"README.md's first command is {command!r}"
    assert "CUDA" in prose and f"`{CPU_TORCH}`" in prose, f"before the first command: {prose!r}"


def test_the_checker_finds_what_is_broken(tmp_path, monkeypatch):
    doc = tmp_path / "x.md"
    doc.write_text("# Top `A` and b_c!\n## Twice\n## Twice\n[ok](#twice-1) [bad](#nowhere) [gone](nothing.md)\n"
                   "[web](https://example.org/a.md) `docs/missing.md` `rollout/groups_dropped` `trainer/loop.py`\n"
                   "```\nsbatch slurm/absent.sbatch runs/out\n```\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert anchors(doc) == {"top-a-and-b_c", "twice", "twice-1"}
    assert relative_links(doc.read_text()) == ["#twice-1", "#nowhere", "nothing.md"]
    assert broken_links(doc) == ["#nowhere: no heading with anchor #nowhere in x.md",
                                 "nothing.md: no such file or folder"]
    assert repo_paths(doc.read_text()) == ["docs/missing.md", "megatron_darl/trainer/loop.py", "slurm/absent.sbatch"]
    outside = tmp_path / "docs" / "y.md"
    outside.parent.mkdir()
    outside.write_text("[up](../../elsewhere.md)\n")
    assert broken_links(outside) == ["../../elsewhere.md: outside the repository"]
    two_fences = "# T\n\nfirst\nsecond\n\n```bash\nrun me\n```\n```\nlater\n```\n"
    assert first_command(two_fences) == ("first second", "run me")
    assert first_command("no fence at all\n") == ("", "")
