"""Tests that download from the package index say so, and skip with the reason where it is out of reach.

What it is: `needs_network(why)`, called by a test (or its fixture) just before it downloads:
it probes the index pip is configured with (PIP_INDEX_URL, else `pip config get
global.index-url`, else PyPI), through the proxy the environment names if any, with one TCP
connection bounded in time, once per session. Unreachable: the test is skipped, naming what it
downloads and why it could not; with DARL_REQUIRE_NETWORK=1 (set by .ci/run) it fails instead,
so CI never passes by skipping them.
`dead_proxy_env(env)`: `env` with every proxy variable pointing at a port nothing listens on and
no `no_proxy`, as HPC sites export them on compute nodes (the demo and the Slurm job run so).
What it is not: a download helper (the tests call `pip download` themselves) or a check that
the package exists (a missing release is the test's error, not a skip).
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

DEFAULT_INDEX = "https://pypi.org/simple"
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens there
PROXY_KEYS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


def dead_proxy_env(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` that sends any proxied request to a dead proxy (and exempts nothing)."""
    out = {k: v for k, v in env.items() if k not in ("no_proxy", "NO_PROXY")}
    out.update({k: DEAD_PROXY for k in PROXY_KEYS})
    return out
PROBE_TIMEOUT_S = 5.0


def index_url() -> str:
    """The index pip downloads from here."""
    url = os.environ.get("PIP_INDEX_URL", "")
    if not url:
        run = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True, timeout=60)
        url = run.stdout.strip() if run.returncode == 0 else ""
    return url or DEFAULT_INDEX


@functools.lru_cache(maxsize=None)
def unreachable() -> str | None:
    """Why the package index cannot be reached from here, or None when it can."""
    url = urlsplit(index_url())
    if url.scheme == "file":
        return None  # a local index: no network involved
    proxy = os.environ.get(f"{url.scheme}_proxy") or os.environ.get(f"{url.scheme.upper()}_PROXY")
    if proxy and "://" not in proxy:
        proxy = f"http://{proxy}"
    target = urlsplit(proxy) if proxy else url
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    what = f"{'proxy' if proxy else 'package index'} {host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"cannot reach the {what} ({exc})"


def needs_network(why: str) -> None:
    """Skip (or, with DARL_REQUIRE_NETWORK=1, fail) the calling test when the index is out of reach."""
    reason = unreachable()
    if reason is None:
        return
    message = f"needs the network: {why}; {reason}"
    if os.environ.get("DARL_REQUIRE_NETWORK") == "1":
        pytest.fail(f"{message} (DARL_REQUIRE_NETWORK=1: required here)", pytrace=False)
    pytest.skip(message)
