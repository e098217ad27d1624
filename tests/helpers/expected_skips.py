"""Skips are results: a pytest plugin that compares the tests a run skipped with the list it is
expected to skip, and fails the run on any difference.

What it is: `--expected-skips FILE` (or DARL_EXPECTED_SKIPS=FILE, so that a command given
verbatim, such as the README's, can carry it) records every skipped test, node id and reason,
and at the end of the session compares them with FILE: a test that skipped and is not listed, a
listed test that did not skip, or a listed test that skipped for another reason each fail the run
(exit status 1), printed with the lines to add and remove and the command that rewrites FILE
(`--expected-skips-update`). FILE has one skip a line, `NODE_ID | REASON`; `#` starts a comment;
REASON may hold `*` (any text) for the parts of a reason that vary by machine (a uid, an error
text); nothing else in it is special. tests/conftest.py registers it; .ci/run and .ci/restricted_pass name one file per
pass (tests/expected_skips/<pass>.txt).
What it is not: a way to skip tests (the tests say when and why they skip), nor a check of runs
restricted with -k, -m or node ids other than the pass's own (their skips differ by design).
"""

from __future__ import annotations

import os
import re

import pytest

ENV = "DARL_EXPECTED_SKIPS"
SEP = " | "


def pytest_addoption(parser) -> None:
    group = parser.getgroup("expected skips")
    group.addoption("--expected-skips", metavar="FILE", default=os.environ.get(ENV) or None,
                    help=f"fail unless the skipped tests (node id and reason) are those listed in FILE (env {ENV})")
    group.addoption("--expected-skips-update", action="store_true",
                    help="rewrite the --expected-skips FILE with this run's skips instead of comparing")


def skip_reason(report) -> str:
    """The reason a skipped report gives, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def read_expected(path: str) -> dict[str, str]:
    """node id -> reason pattern, from FILE's `NODE_ID | REASON` lines."""
    expected: dict[str, str] = {}
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if SEP not in line:
                raise pytest.UsageError(f"{path}:{number}: expected `NODE_ID{SEP}REASON`, got {line!r}")
            node, reason = line.split(SEP, 1)
            expected[node.strip()] = reason.strip()
    return expected


def matches(reason: str, pattern: str) -> bool:
    """`reason` is `pattern`, each `*` of which stands for any text."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), reason, re.DOTALL) is not None


def compare(skipped: dict[str, str], expected: dict[str, str]) -> tuple[list[str], list[str]]:
    """(lines to add, lines to remove) so that FILE lists exactly `skipped`; a listed test that
    skipped for a reason its pattern does not match is in both."""
    add, remove = [], []
    for node in sorted(set(skipped) | set(expected)):
        got, want = skipped.get(node), expected.get(node)
        if want is not None and got is not None and matches(got, want):
            continue
        if got is not None:
            add.append(f"{node}{SEP}{got}")
        if want is not None:
            remove.append(f"{node}{SEP}{want}")
    return add, remove


class ExpectedSkips:
    """Records the skips of one session and checks (or rewrites) FILE at its end."""

    def __init__(self, config, path: str) -> None:
        self.config, self.path = config, path
        self.update = config.getoption("expected_skips_update")
        self.skipped: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped[report.nodeid] = " ".join(skip_reason(report).split())

    def pytest_collectreport(self, report) -> None:
        """A whole module skipped at import (`pytest.importorskip`, a module-level skip)."""
        if report.skipped:
            self.skipped[report.nodeid] = " ".join(skip_reason(report).split())

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        stopped = (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR)
        if exitstatus in stopped or self.config.option.collectonly:  # nothing ran: nothing to compare
            return
        writer = self.config.pluginmanager.get_plugin("terminalreporter")
        if self.update:
            self._write()
            if writer:
                writer.write_line(f"expected skips: wrote {len(self.skipped)} skip(s) to {self.path}")
            return
        add, remove = compare(self.skipped, read_expected(self.path))
        if not (add or remove):
            return
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if writer:
            writer.write_sep("=", "expected skips", red=True)
            for line in self.message(add, remove):
                writer.write_line(line, red=True)

    def message(self, add: list[str], remove: list[str]) -> list[str]:
        lines = [f"expected skips: this run's skips differ from {self.path} (a skip is a result: this run FAILS)"]
        lines += [f"  skipped, not listed:       + {line}" for line in add]
        lines += [f"  listed, did not skip so:   - {line}" for line in remove]
        lines += ["If the difference is intended (a test that now runs, a new skip with its reason), update the list:",
                  f"  edit {self.path} (add the + lines, delete the - lines), or rerun this same command with",
                  f"  --expected-skips-update, which rewrites {self.path} from this run's skips; commit it",
                  "  (a run on a temporary copy of the checkout, as .ci/restricted_pass nonroot: edit it by hand)."]
        return lines

    def _write(self) -> None:
        """FILE := this run's skips; a listed pattern that still matches is kept (its `*` with it),
        and so are the comment lines at the top."""
        header, expected = [], {}
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as fh:
                for line in fh.read().splitlines():
                    if not line.startswith("#"):
                        break
                    header.append(line)
            expected = read_expected(self.path)
        rows = []
        for node, reason in sorted(self.skipped.items()):
            want = expected.get(node)
            rows.append(f"{node}{SEP}{want if want is not None and matches(reason, want) else reason}")
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as fh:
            fh.write("".join(f"{line}\n" for line in header + rows))


def pytest_configure(config) -> None:
    os.environ.pop(ENV, None)  # read once (the option's default): pytest runs that tests start do not inherit it
    path = config.getoption("expected_skips", None)
    if path and not config.getoption("expected_skips_update") and not os.path.isfile(path):
        raise pytest.UsageError(f"--expected-skips {path}: no such file (--expected-skips-update writes it)")
    if path:
        config.pluginmanager.register(ExpectedSkips(config, path), "darl-expected-skips")
