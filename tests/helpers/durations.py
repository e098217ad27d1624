"""Test durations as measured, and the marks and the fast tier that follow from them.

What it is: a pytest plugin over `tests/durations.json` (node id -> seconds, setup + call +
teardown, as a full run of the README's test command measured them on the 2-core build machine):
- every test measured at `SLOW_S` (10 s) or more is marked `slow`, so `-m "not slow"` leaves
  out what the measurement says is slow, not what someone once guessed;
- `--fast` also leaves out every test measured at `FAST_S` (2 s) or more (end-to-end runs, Slurm
  jobs, multi-process learners, sandboxed programs, subprocess imports) and says how many it left
  out and how long they took when measured: the README's fast command;
- `--record-durations` rewrites the file (`--durations-file FILE`: another one) from this run (tests that did not run keep their entry,
  tests that no longer exist are dropped), printing how many entries changed.
A test without an entry (new since the last recording) runs in every tier, and `--fast` says how
many such tests there are.
What it is not: a timer that fails slow tests (speed targets live in bench/) or a place for marks
other than `slow` (gpu and slurm say what a test needs, not how long it takes).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "durations.json")
SLOW_S = 10.0
FAST_S = 2.0


def read_durations(path: str = FILE) -> dict[str, float]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    return {str(k): float(v) for k, v in doc.get("seconds", {}).items()}


def write_durations(seconds: dict[str, float], path: str = FILE) -> None:
    doc = {"about": "seconds per test (setup + call + teardown) of a full run of the README's test command on the "
                    "2-core build machine; rewritten by `python -m pytest --record-durations`; tests/helpers/"
                    "durations.py marks tests at >= %g s slow and `--fast` leaves out tests at >= %g s"
                    % (SLOW_S, FAST_S),
           "seconds": {k: round(v, 2) for k, v in sorted(seconds.items())}}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=0)
        fh.write("\n")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("measured durations")
    group.addoption("--durations-file", metavar="FILE", default=FILE, dest="durations_file",
                    help="the measured durations (default: tests/durations.json)")
    group.addoption("--fast", action="store_true",
                    help=f"leave out the tests measured at >= {FAST_S:g} s (tests/durations.json) and those marked slow")
    group.addoption("--record-durations", action="store_true", dest="record_durations",
                    help="rewrite tests/durations.json from this run's measured durations")


class Durations:
    """Marks from the recorded durations at collection; records this run's at the end."""

    def __init__(self, config) -> None:
        self.config, self.path = config, config.getoption("durations_file")
        self.known = read_durations(self.path)
        self.measured: dict[str, float] = defaultdict(float)
        self.collected: list[str] = []

    @pytest.hookimpl(tryfirst=True)  # before `-m` reads the marks
    def pytest_collection_modifyitems(self, config, items) -> None:
        self.collected = [item.nodeid for item in items]
        for item in items:
            if self.known.get(item.nodeid, 0.0) >= SLOW_S:
                item.add_marker(pytest.mark.slow)
        if not config.getoption("fast"):
            return
        keep, out = [], []
        for item in items:
            slow = self.known.get(item.nodeid, 0.0) >= FAST_S or item.get_closest_marker("slow") is not None
            (out if slow else keep).append(item)
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = keep
        self.left_out = (len(out), sum(self.known.get(i.nodeid, 0.0) for i in out),
                         sum(1 for i in keep if i.nodeid not in self.known))

    def pytest_report_collectionfinish(self, config, start_path, items) -> str | None:
        if not config.getoption("fast") or not hasattr(self, "left_out"):
            return None
        n, secs, unknown = self.left_out
        return (f"--fast: left out {n} tests measured at >= {FAST_S:g} s or marked slow ({secs / 60:.0f} min when "
                f"measured: end-to-end runs, Slurm jobs, multi-process learners, sandboxed programs, subprocess "
                f"imports); {unknown} tests have no measured duration yet (--record-durations)")

    def pytest_runtest_logreport(self, report) -> None:
        self.measured[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if not self.config.getoption("record_durations") or not self.measured:
            return
        collected = set(self.collected)
        merged = {k: v for k, v in self.known.items() if k in collected or not self.collected}
        merged.update(self.measured)
        changed = sum(1 for k, v in merged.items() if round(self.known.get(k, -1.0), 2) != round(v, 2))
        write_durations(merged, self.path)
        writer = self.config.pluginmanager.get_plugin("terminalreporter")
        if writer:
            writer.write_line(f"durations: wrote {len(merged)} tests ({changed} changed) to {self.path}")


def pytest_configure(config) -> None:
    config.pluginmanager.register(Durations(config), "darl-durations")
