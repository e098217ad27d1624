"""No request of ours to an engine or a node goes through a proxy: HPC sites export `http_proxy`
on compute nodes. Each test exports a dead proxy (`http://127.0.0.1:9`, nothing listens there)
with no `no_proxy`, and talks to a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.server
import subprocess
import sys
import threading

import pytest

from megatron_darl.engine.command import EngineSpec, no_proxy_env
from megatron_darl.launch.engine_host import healthy
from tests.helpers.network import DEAD_PROXY, PROXY_KEYS


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # http.server's name
        body = b"ok" if self.path in ("/health_generate", "/model_info") else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet: http.server logs every request to stderr
        return None


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def dead_proxy(monkeypatch):
    for key in PROXY_KEYS:
        monkeypatch.setenv(key, DEAD_PROXY)
    for key in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(key, raising=False)


def test_the_health_probe_goes_direct(server, dead_proxy):
    # before: urllib's default opener sent this to the proxy, and engines were "not announced"
    assert healthy(server)


def test_the_client_goes_direct(server, dead_proxy):
    from megatron_darl.rollout.sglang_client import SGLangClient

    async def probe():
        async with SGLangClient(server, timeout_s=5) as client:
            return await client.ahealth()

    assert asyncio.run(probe())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lib", ["urllib", "requests"])
def test_an_engine_reaches_its_own_address_direct(server, dead_proxy, lib):
    """An SGLang server warms itself up with `requests` at its own address (127.0.0.1 when bound
    on every interface): the environment an engine gets keeps that off the proxy."""
    import os

    spec = EngineSpec(index=0, backend="sglang", model_dir="/m", seed=0, max_batch=1)
    env = {**os.environ, **spec.env(("0.0.0.0", "node7"))}
    code = {"urllib": "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=5)",
            "requests": "import requests, sys; requests.get(sys.argv[1], timeout=5).raise_for_status()"}[lib]
    out = subprocess.run([sys.executable, "-c", code, server + "/model_info"], env=env, capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "node7" in env["no_proxy"].split(",") and env["NO_PROXY"] == env["no_proxy"]


def test_no_proxy_keeps_the_sites_entries():
    env = no_proxy_env(("10.0.0.5",), {"no_proxy": ".site.org, 10.1.0.0/16", "NO_PROXY": "gpfs"})
    assert env["no_proxy"].split(",") == [".site.org", "10.1.0.0/16", "gpfs", "127.0.0.1", "localhost", "::1",
                                          "10.0.0.5"]
