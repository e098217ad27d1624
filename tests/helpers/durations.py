"""Test durations as measured, and the marks and the fast tier that follow from them.

What it is: a pytest plugin over `tests/durations.json` (node id -> seconds, setup + call +
teardown, as a full run of the README's test command measured them):
- every test measured at `SLOW_S` (10 s) or more is marked `slow`, so `-m "not slow"` leaves
  out what the measurement says is slow, not what someone once guessed;
- `--fast` also leaves out every test measured at `FAST_S` (2 s) or more (end-to-end runs, Slurm
  jobs, multi-process learners, sandboxed programs, subprocess imports), and every test that uses
  a shared fixture (module or session scope) measured at `FIXTURE_S` (5 s) or more to set up --
  the first test of a module pays for it, so leaving only that test out would move the cost to
  the next -- and says how many it left out and how long they took when measured: the README's
  fast command;
- `--record-durations` rewrites the file (`--durations-file FILE`: another one) from this run,
  printing how many entries changed. Tests that did not run keep their entry (a run over a few
  files re-measures only theirs); an entry goes when its file ran without it, or its file is gone.
A test without an entry (new since the last recording) runs in every tier, and `--fast` says how
many such tests there are.
What it is not: a timer that fails slow tests (speed targets live in bench/) or a place for marks
other than `slow` (gpu and slurm say what a test needs, not how long it takes).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "durations.json")
SLOW_S = 10.0
FAST_S = 2.0
FIXTURE_S = 5.0  # a module- or session-wide fixture this slow to set up leaves its users out of --fast


def read(path: str = FILE) -> tuple[dict[str, float], dict[str, float]]:
    """(node id -> seconds, shared fixture -> seconds to set up) from one reading of `path`."""
    if not os.path.isfile(path):
        return {}, {}
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    return ({str(k): float(v) for k, v in doc.get("seconds", {}).items()},
            {str(k): float(v) for k, v in doc.get("fixtures", {}).items()})


def fixture_key(fixturedef) -> str:
    """A shared fixture's entry: where it is defined and its name (modules may reuse a name)."""
    return f"{fixturedef.baseid}::{fixturedef.argname}" if fixturedef.baseid else fixturedef.argname


def fixture_keys(item) -> set[str]:
    """The entries of the fixtures in effect for `item` (the innermost definition of each name)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return {fixture_key(d[-1]) for name in getattr(item, "fixturenames", ()) if (d := defs.get(name))}


def write_durations(seconds: dict[str, float], path: str = FILE, fixtures: dict[str, float] | None = None) -> None:
    doc = {"about": "seconds per test (setup + call + teardown) of a full run of the README's test command on the "
                    "2-core build machine; rewritten by `python -m pytest --record-durations`; tests/helpers/"
                    "durations.py marks tests at >= %g s slow and `--fast` leaves out tests at >= %g s"
                    % (SLOW_S, FAST_S),
           "fixtures": {k: round(v, 2) for k, v in sorted((fixtures or {}).items())},
           "seconds": {k: round(v, 2) for k, v in sorted(seconds.items())}}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=0)
        fh.write("\n")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("measured durations")
    group.addoption("--durations-file", metavar="FILE", default=FILE, dest="durations_file",
                    help="the measured durations (default: tests/durations.json)")
    group.addoption("--fast", action="store_true",
                    help=f"leave out the tests measured at >= {FAST_S:g} s (tests/durations.json) "
                         "and those marked slow")
    group.addoption("--record-durations", action="store_true", dest="record_durations",
                    help="rewrite tests/durations.json from this run's measured durations")


class Durations:
    """Marks from the recorded durations at collection; records this run's at the end."""

    def __init__(self, config) -> None:
        self.config, self.path = config, config.getoption("durations_file")
        self.known, self.fixtures = read(self.path)
        self.measured: dict[str, float] = defaultdict(float)
        self.measured_fixtures: dict[str, float] = {}
        self.collected: list[str] = []
        self.left_out: tuple[int, float, int] | None = None  # --fast: (tests, their measured s, unmeasured kept)

    @pytest.hookimpl(tryfirst=True)  # before `-m` reads the marks
    def pytest_collection_modifyitems(self, config, items) -> None:
        self.collected = [item.nodeid for item in items]
        for item in items:
            if self.known.get(item.nodeid, 0.0) >= SLOW_S:
                item.add_marker(pytest.mark.slow)
        if not config.getoption("fast"):
            return
        keep, out = [], []
        heavy = {key for key, secs in self.fixtures.items() if secs >= FIXTURE_S}
        for item in items:
            slow = (self.known.get(item.nodeid, 0.0) >= FAST_S or item.get_closest_marker("slow") is not None
                    or bool(heavy & fixture_keys(item)))
            (out if slow else keep).append(item)
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = keep
        self.left_out = (len(out), sum(self.known.get(i.nodeid, 0.0) for i in out),
                         sum(1 for i in keep if i.nodeid not in self.known))

    def pytest_report_collectionfinish(self, config, start_path, items) -> str | None:
        if self.left_out is None:
            return None
        n, secs, unknown = self.left_out
        return (f"--fast: left out {n} tests measured at >= {FAST_S:g} s, marked slow or using a shared fixture "
                f"measured at >= {FIXTURE_S:g} s ({secs / 60:.0f} min when "
                f"measured: end-to-end runs, Slurm jobs, multi-process learners, sandboxed programs, subprocess "
                f"imports); {unknown} tests have no measured duration yet (--record-durations)")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        t0 = time.perf_counter()
        yield
        if fixturedef.scope != "function":  # paid once by the first test that uses it (per parameter)
            key = fixture_key(fixturedef)
            self.measured_fixtures[key] = max(self.measured_fixtures.get(key, 0.0), time.perf_counter() - t0)

    def pytest_runtest_logreport(self, report) -> None:
        self.measured[report.nodeid] += report.duration

    def _kept(self) -> dict[str, float]:
        """The recorded entries that stay: all but those of a file this run collected that no
        longer holds them, and those of a file that is gone (a file not run keeps its entries)."""
        if not self.collected:
            return dict(self.known)
        ids = set(self.collected)
        files = {n.split("::")[0] for n in ids}
        root = str(self.config.rootpath)

        def stays(nodeid: str) -> bool:
            path = nodeid.split("::")[0]
            return nodeid in ids if path in files else os.path.exists(os.path.join(root, path))

        return {k: v for k, v in self.known.items() if stays(k)}

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if not self.config.getoption("record_durations") or not self.measured:
            return
        merged = self._kept()
        merged.update(self.measured)
        changed = sum(1 for k, v in merged.items() if round(self.known.get(k, -1.0), 2) != round(v, 2))
        write_durations(merged, self.path, {**self.fixtures, **self.measured_fixtures})
        writer = self.config.pluginmanager.get_plugin("terminalreporter")
        if writer:
            writer.write_line(f"durations: wrote {len(merged)} tests ({changed} changed) to {self.path}")


def pytest_configure(config) -> None:
    config.pluginmanager.register(Durations(config), "darl-durations")
