"""The rollout manager's process: adapters to the real pieces and the entry point.

What it is: `RingSink` (the node's shared-memory ring buffer as the manager's trajectory sink),
`EmbeddedEngineRestarter` (starts and replaces `darl-engine` processes) and `main()`, the
process the launcher starts on each trainer node: `python -m megatron_darl.rollout.manager
--config RESOLVED.yaml --ring NAME --weight-notice PATH [--engine-url URL ...]`.
What it is not: the manager's logic (`manager.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from megatron_darl.rollout.api import RolloutEngine
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.types import Trajectory

class RingSink:
    """`TrajectorySink` over a `replay.shm_ring.ShmRing` producer handle. The G records of a
    group are written back to back by one writer thread (the ring's flock does not order
    threads of one process, so there is exactly one); `put` blocks while the ring is full
    (backpressure from the learner), up to `put_timeout_s` (None: as long as the learner lives)."""

    def __init__(self, ring: Any, put_timeout_s: float | None = None) -> None:
        self.ring = ring
        self.put_timeout_s = put_timeout_s
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ring-writer")

    async def aput_group(self, trajectories: list[Trajectory]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._writer, self._put_all, trajectories)

    def _put_all(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            self.ring.put_trajectory(t, timeout=self.put_timeout_s)

    def close(self) -> None:
        self._writer.shutdown(wait=True)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedEngineRestarter:
    """Starts `darl-engine` processes on this node (`astart_engine`) and replaces dead ones
    (`arestart`: kill what is left of the old process, start a new one on a fresh port, wait
    for /health_generate). The replacement serves the initial weights; the manager pushes the
    current version before it takes requests. `pids` are processes started by someone else
    (the launcher), killed on restart of their index."""

    def __init__(self, model_dir: str, *, api_key: str | None = None, threads: int = 1, host: str = "127.0.0.1",
                 startup_timeout_s: float = 300.0, request_timeout_s: float = 600.0,
                 pids: dict[int, int] | None = None, log_dir: str | None = None) -> None:
        self.model_dir, self.api_key, self.threads, self.host = model_dir, api_key, threads, host
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.pids = dict(pids or {})
        self.log_dir = log_dir
        self.procs: dict[int, asyncio.subprocess.Process] = {}

    async def astart_engine(self, index: int) -> RolloutEngine:
        from megatron_darl.rollout.sglang_client import SGLangClient  # aiohttp only when used

        port = _free_port(self.host)
        cmd = [sys.executable, "-m", "megatron_darl.rollout.engine_server", "--model", self.model_dir,
               "--host", self.host, "--port", str(port), "--threads", str(self.threads)]
        cmd += ["--api-key", self.api_key] if self.api_key else []
        log_path = os.path.join(self.log_dir, f"engine{index}.{port}.log") if self.log_dir else None
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        # the child imports this package from wherever this process did, installed or not
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PYTHONPATH": path}
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        if log_path:
            out.close()  # the child holds its own descriptor
        self.procs[index] = proc
        client = SGLangClient(f"http://{self.host}:{port}", api_key=self.api_key, timeout_s=self.request_timeout_s)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while not await client.ahealth():
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"darl-engine {index} on port {port} did not become healthy "
                                       f"(exit code {proc.returncode}, model {self.model_dir})")
                await asyncio.sleep(0.2)
        except BaseException:  # failed or cancelled (manager stopping): leave nothing behind
            await client.aclose()
            await self._akill(index)
            raise
        return client

    async def arestart(self, index: int, engine: RolloutEngine) -> RolloutEngine:
        await self._akill(index)
        aclose = getattr(engine, "aclose", None)
        if aclose is not None:
            await aclose()
        return await self.astart_engine(index)

    async def _akill(self, index: int) -> None:
        proc = self.procs.pop(index, None)
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        pid = self.pids.pop(index, None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    async def aclose(self) -> None:
        for index in list(self.procs):
            await self._akill(index)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_darl.rollout.manager",
                                description="The rollout manager of one trainer node (started by the launcher).")
    p.add_argument("--config", required=True, help="the run's resolved YAML config")
    p.add_argument("--ring", required=True, help="name of the node's shared-memory ring buffer (learner creates it)")
    p.add_argument("--weight-notice", required=True, help="WeightNotice JSON the learner publishes (polled)")
    p.add_argument("--status", default=None, help="RolloutStatus JSON this process writes (default: notice + .status)")
    p.add_argument("--engine-url", action="append", default=[], help="engine URL (repeat); default rollout.engine_urls")
    p.add_argument("--engine-pid", action="append", type=int, default=[],
                   help="pid of the embedded engine at the same position, killed when it is restarted")
    p.add_argument("--resume", default=None, help="state JSON written earlier on a state_request")
    p.add_argument("--initial-version", type=int, default=0, help="weight version the engines start with")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p


async def _amain(args: argparse.Namespace) -> None:
    from megatron_darl.config import load_config
    from megatron_darl.data.sources import build_loader
    from megatron_darl.data.tokenizers import load_tokenizer
    from megatron_darl.replay.shm_ring import ShmRing
    from megatron_darl.replay.staleness import StalenessGate
    from megatron_darl.rollout.rewards.pool import RewardPool
    from megatron_darl.rollout.sglang_client import SGLangClient
    from megatron_darl.rollout.workflow import GroupWorkflow, RewardPoolScorer

    cfg = load_config(args.config, args.overrides)
    rc = cfg.rollout
    urls = args.engine_url or list(rc.engine_urls)
    if not urls:
        raise SystemExit("rollout manager: no engines: pass --engine-url (repeat) or set rollout.engine_urls")
    tokenizer = load_tokenizer(cfg.model.tokenizer_dir)
    loader = build_loader(cfg.data, tokenizer)
    engines = [SGLangClient(u, api_key=rc.api_key, timeout_s=rc.request_timeout_s, max_retries=rc.max_retries,
                            initial_version=args.initial_version) for u in urls]
    restarter = None
    if rc.backend == "torch":
        restarter = EmbeddedEngineRestarter(cfg.model.hf_dir, api_key=rc.api_key, threads=rc.engine_threads,
                                            startup_timeout_s=cfg.launch.startup_timeout_s,
                                            request_timeout_s=rc.request_timeout_s,
                                            pids=dict(enumerate(args.engine_pid)), log_dir=cfg.train.run_dir)
    ring = ShmRing.attach(args.ring, timeout=cfg.launch.startup_timeout_s)
    sink = RingSink(ring)
    pool = RewardPool(cfg.reward)
    scorer = RewardPoolScorer(pool, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    gate = StalenessGate(cfg.staleness.max_head_offpolicyness, cfg.train.batch_prompts, args.initial_version)
    mgr = RolloutManager(rc, engines, loader, GroupWorkflow(rc, scorer, seed=cfg.train.seed), sink, gate,
                         restarter=restarter, notice_path=args.weight_notice,
                         status_path=args.status or args.weight_notice + ".status",
                         initial_version=args.initial_version)
    if args.resume:
        with open(args.resume, encoding="utf-8") as fh:
            mgr.load_state_dict(json.load(fh))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, mgr.request_stop)
    try:
        await mgr.arun()
    finally:
        for close in (sink.close, ring.close, pool.close):
            close()
        await asyncio.gather(*(s.engine.aclose() for s in mgr._slots))  # restarted ones included
        if restarter is not None:
            await restarter.aclose()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_amain(_parser().parse_args(argv)))
    return 0

