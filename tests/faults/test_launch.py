"""Faults of the launcher, as a user's bad day brings them.

1. An engine killed mid-run: its host restarts it (new port, same flags, its log still in
   `logs/`), training finishes, the evaluation after training finds the engine at its new
   address, and `darl-train` exits 0 with a `summary.json`.
2. A run whose learners wait for data that never comes (every /generate rejected by the
   engine) gets SIGTERM: it checkpoints what it has and stops, exit 0, within a bounded time,
   and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.e2e import (
    assert_nothing_left,
    new_run,
    role_pid,
    run_groups,
)


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().decode().split("\0")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _replacement(run, announcement: Path, timeout_s: float) -> list[str] | None:
    """The argv of the engine that replaced generation 0, once announced; None if the run ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.proc.poll() is None:
        try:
            ann = json.loads(announcement.read_text())
            if ann["generation"] >= 1:
                return _argv(ann["pid"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.2)
    return None


@pytest.mark.timeout(600)
def test_engine_killed_mid_run_the_run_still_ends_with_its_evaluation(tmp_path, warm_model):
    """Fails on the launcher before the engine hosts: exit 1, no summary.json (the evaluation
    after training asked the dead engine's address)."""
    run = new_run(tmp_path, warm_model, "restart", algo={"max_head_offpolicyness": 1}, train={"steps": 10},
                  eval={"num_problems": 16}, data={"eval_size": 32},
                  rollout={"max_concurrent_per_engine": 48})
    engines = Path(run.run_dir) / "engines"
    try:
        run.start()
        run.wait_for(lambda: len(run.ledger()) >= 2, 300, "two trained steps")
        run_id = run.run_info()["run_id"]
        groups = run_groups(run)
        victim = role_pid(run.run_dir, "megatron_darl.engine")
        before = _argv(victim)
        os.kill(victim, signal.SIGKILL)
        after = _replacement(run, engines / "engine0.json", 300)  # its argv, read while it runs
        code = run.wait(400)
        out = run.output()
        assert code == 0, out[-4000:]  # the evaluation after training found the engine
        summary = json.loads((Path(run.run_dir) / "summary.json").read_text())
        assert "accuracy_after" in summary and summary["eval_problems"] == 16, summary
        assert after is not None, "no replacement engine was announced"
        for flag in ("--model", "--max-batch", "--seed", "--threads"):  # the replacement is the same engine
            assert _flag(after, flag) == _flag(before, flag), (flag, before, after)
        assert _flag(after, "--max-batch") == "48"
        assert _flag(after, "--port") != _flag(before, "--port")
        steps = [r["step"] for r in run.ledger()]
        assert steps == list(range(10))
        ids = [u for r in run.ledger() for u in r["prompt_ids"]]
        assert len(ids) == len(set(ids)), "a prompt was trained twice"
        log = (Path(run.run_dir) / "logs" / "engine0.log").read_text()
        assert log.count("darl-engine: ") == 2, log[-2000:]  # both generations log in logs/
        assert not list(Path(run.run_dir).glob("engine*.log"))
        assert_nothing_left(run, run_id, groups)
    finally:
        run.kill()


class RejectingEngine:
    """An SGLang-protocol server on 127.0.0.1 that is healthy, loads any weights, and rejects
    every /generate: the learners wait for data that never comes."""

    def __init__(self):
        self.url, self.generate_calls = "", 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self):
        from aiohttp import web

        async def ok(_req):
            return web.json_response({"success": True, "message": "ok", "status": "ok", "num_paused_requests": 0})

        async def generate(_req):
            self.generate_calls += 1
            return web.json_response({"error": "rejected by the test"}, status=400)

        async def main():
            app = web.Application()
            app.router.add_get("/health", ok)
            app.router.add_get("/health_generate", ok)
            for route in ("/update_weights_from_disk", "/pause_generation", "/continue_generation",
                          "/abort_request", "/flush_cache"):
                app.router.add_post(route, ok)
            app.router.add_post("/generate", generate)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self._started.set()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(main())
        self._loop.run_forever()

    def __enter__(self):
        self._thread.start()
        assert self._started.wait(30)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("ranks", [1, 2], ids=["one_rank", "tp2"])
def test_sigterm_while_learners_wait_for_data_checkpoints_and_stops(tmp_path, warm_model, ranks):
    """With two ranks the second waits for the first's word (outside any collective) while the
    first waits for data: it must learn of the preemption there and take part in the checkpoint."""
    with RejectingEngine() as engine:
        run = new_run(tmp_path, warm_model, "starved", rollout={"backend": "sglang", "engine_urls": [engine.url]},
                      train={"steps": 20}, checkpoint={"every_steps": 0}, parallel={"tp": ranks},
                      launch={"learner_procs_per_node": ranks})
        notice = Path(run.run_dir) / "rollout" / "notice.json"
        try:
            run.start()
            run.wait_for(lambda: notice.exists() and engine.generate_calls >= 3, 300,
                         "the learner's first published version and rejected generations")
            run_id = run.run_info()["run_id"]
            groups = run_groups(run)
            time.sleep(2)  # the learner is in its wait for rollouts
            assert run.ledger() == [] and run.proc.poll() is None
            os.kill(run.proc.pid, signal.SIGTERM)  # what Slurm sends to preempt a job
            t0 = time.monotonic()
            code = run.wait(180)  # far below launch.stop_timeout_s: the wait itself must end
            out = run.output()
            assert code == 0, out[-4000:]
            assert "preempted while waiting for rollouts at step 0" in out, out[-4000:]
            ckpt = Path(run.run_dir) / "checkpoints"
            assert (ckpt / "step_00000000").is_dir() and (ckpt / "step_00000000.rollout.json").is_file()
            summary = json.loads((Path(run.run_dir) / "learner_summary.json").read_text())
            assert summary["final_version"] == 0 and summary["steps_done"] == 0
            assert_nothing_left(run, run_id, groups)
            print(f"stopped {time.monotonic() - t0:.1f} s after SIGTERM")
        finally:
            run.kill()
