"""The rollout manager's process: adapters to the real pieces and the entry point.

What it is: `RingSink` (the node's shared-memory ring buffer as the manager's trajectory sink),
the two engine restarters, and `main()`, the process the launcher starts beside the ring:
`python -m megatron_darl.rollout --run-info <run_dir>/run_info.json`. With a run-info
record it takes everything from it (config, ring, notice and status paths, the state to resume)
and finds its engines through their hosts' announcements: `AnnouncedEngineRestarter` waits for
every engine, and replaces one that stopped answering by asking its host (on whatever node) and
waiting for the new announcement. Standalone (no record: `--config --ring --weight-notice
[--engine-url ...]`), `EmbeddedEngineRestarter` starts and replaces `darl-engine` processes
itself. Both start engines only through `engine/command.py`, so a replacement keeps
every flag of the original. SIGINT stops at once; SIGTERM (Slurm's preemption, sent to every
process of a job) keeps the manager answering the learners' checkpoint request until their
stop notice, at most `launch.stop_timeout_s`.
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
import subprocess
import sys
import time
from typing import Any, Callable

from megatron_darl.channel.announcements import read_announcement, request_restart
from megatron_darl.channel.ports import free_port
from megatron_darl.engine.command import EngineSpec
from megatron_darl.rollout.api import RolloutEngine
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.types import Trajectory

log = logging.getLogger("megatron_darl.rollout.manager")


class RingSink:
    """`TrajectorySink` over a `channel.shm_ring.ShmRing` producer handle. The G records of a
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



class EmbeddedEngineRestarter:
    """Starts `darl-engine` processes on this node (`astart_engine`) and replaces dead ones
    (`arestart`: kill what is left of the old process, start a new one on a fresh port with the
    same flags, wait for /health_generate). The replacement serves the initial weights; the
    manager pushes the current version before it takes requests."""

    def __init__(self, model_dir: str, *, api_key: str | None = None, threads: int = 1, host: str = "127.0.0.1",
                 startup_timeout_s: float = 300.0, request_timeout_s: float = 600.0,
                 pids: dict[int, int] | None = None, log_dir: str | None = None, max_batch: int = 64,
                 seed: int = 0) -> None:
        """A restarter that has started nothing yet.

        Args:
            model_dir: the HF model folder every engine loads.
            api_key: the bearer token the engines require and the clients send; None: no key.
            threads: torch threads per engine process.
            host: the address the engines bind and the clients connect to.
            startup_timeout_s: seconds a new engine gets to answer its health check before the start fails.
            request_timeout_s: the clients' per-request timeout in seconds.
            pids: `{index: pid}` of engines started by someone else, killed when that index is restarted;
                None: none.
            log_dir: engine i's output goes to `<log_dir>/engine<i>.log`; None discards it.
            max_batch: the most sequences each engine decodes together.
            seed: the sampler seed base; engine i gets `seed + i` for requests without a seed.
        """
        self.model_dir, self.api_key, self.threads, self.host = model_dir, api_key, threads, host
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.max_batch, self.seed = max_batch, seed
        self.pids = dict(pids or {})
        self.log_dir = log_dir
        self.procs: dict[int, asyncio.subprocess.Process] = {}

    def spec(self, index: int) -> EngineSpec:
        return EngineSpec(index=index, backend="torch", model_dir=self.model_dir, seed=self.seed + index,
                          max_batch=self.max_batch, threads=self.threads, api_key=self.api_key)

    async def astart_engine(self, index: int) -> RolloutEngine:
        from megatron_darl.rollout.sglang_client import SGLangClient  # aiohttp only when used

        port = free_port(self.host)
        spec = self.spec(index)
        log_path = os.path.join(self.log_dir, f"engine{index}.log") if self.log_dir else None
        if log_path:
            os.makedirs(self.log_dir, exist_ok=True)
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        # the child imports this package from wherever this process did, installed or not
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = spec.environment((self.host,))
        if spec.backend != "sglang":  # darl-engine imports this package; SGLang's environment has its own path
            env["PYTHONPATH"] = path
        proc = await asyncio.create_subprocess_exec(*spec.command(self.host, port), stdout=out,
                                                    stderr=subprocess.STDOUT, env=env)
        if log_path:
            out.close()  # the child holds its own descriptor
        self.procs[index] = proc
        client = SGLangClient(f"http://{self.host}:{port}", api_key=self.api_key, timeout_s=self.request_timeout_s)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while not await client.ahealth():
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"darl-engine {index} on port {port} did not become healthy "
                                       f"(exit code {proc.returncode}, model {self.model_dir}, log {log_path})")
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


class AnnouncedEngineRestarter:
    """Engines run by engine hosts (`launch/engine_host.py`), found and replaced through their
    announcements in `engines_dir`: `aconnect(n)` waits until engines 0..n-1 are announced;
    `arestart(i)` asks engine i's host to replace the generation in use and waits for the next
    one's announcement. The host keeps its engines: closing this restarter stops none of them."""

    def __init__(self, engines_dir: str, attempt: str, make_client: Callable[[str], RolloutEngine], *,
                 startup_timeout_s: float = 300.0) -> None:
        self.engines_dir, self.attempt, self.make_client = engines_dir, attempt, make_client
        self.startup_timeout_s = startup_timeout_s
        self.generations: dict[int, int] = {}

    async def _aannounced(self, index: int, after: int) -> RolloutEngine:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            ann = read_announcement(self.engines_dir, index, self.attempt)
            if ann is not None and ann.generation > after:
                self.generations[index] = ann.generation
                return self.make_client(ann.url)
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {index}: no announcement after generation {after} in {self.engines_dir} "
                                   f"within {self.startup_timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    async def aconnect(self, count: int) -> list[RolloutEngine]:
        return [await self._aannounced(i, -1) for i in range(count)]

    async def arestart(self, index: int, engine: RolloutEngine) -> RolloutEngine:
        generation = self.generations.get(index, 0)
        log.warning("engine %d (%s, generation %d) asked to restart", index, getattr(engine, "url", "?"), generation)
        request_restart(self.engines_dir, index, self.attempt, generation)
        aclose = getattr(engine, "aclose", None)
        if aclose is not None:
            await aclose()
        return await self._aannounced(index, generation)

    async def aclose(self) -> None:
        return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_darl.rollout",
                                description="The rollout manager beside the ring buffer (started by the launcher).")
    p.add_argument("--run-info", default=None, help="<run_dir>/run_info.json: everything below comes from it")
    p.add_argument("--config", default=None, help="standalone: the run's resolved YAML config")
    p.add_argument("--ring", default=None, help="standalone: the shared-memory ring buffer (the learner creates it)")
    p.add_argument("--weight-notice", default=None, help="standalone: WeightNotice JSON the learner publishes")
    p.add_argument("--status", default=None, help="standalone: RolloutStatus JSON this process writes "
                   "(default: notice + .status)")
    p.add_argument("--engine-url", action="append", default=[], help="standalone: engine URL (repeat); "
                   "default rollout.engine_urls")
    p.add_argument("--engine-pid", action="append", type=int, default=[],
                   help="standalone: pid of the embedded engine at the same position, killed when it is restarted")
    p.add_argument("--resume", default=None, help="standalone: state JSON written earlier on a state_request")
    p.add_argument("--initial-version", type=int, default=0, help="weight version the engines start with")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p


def _settings(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The config and the paths: from the run-info record, or from the standalone flags."""
    from megatron_darl.channel.run_info import RunInfo
    from megatron_darl.config import load_config

    if args.run_info:
        info = RunInfo.load(args.run_info)
        cfg = load_config(info.config, args.overrides)
        return cfg, {"ring": info.ring, "notice": info.notice, "status": info.status, "resume": info.rollout_state,
                     "urls": list(info.engine_urls), "announced": None if info.engine_urls else info,
                     "log_dir": info.log_dir, "run_id": info.run_id}
    missing = [f"--{k}" for k in ("config", "ring", "weight_notice") if getattr(args, k) is None]
    if missing:
        raise SystemExit(f"rollout manager: pass --run-info, or {' '.join(missing)}")
    cfg = load_config(args.config, args.overrides)
    urls = args.engine_url or list(cfg.rollout.engine_urls)
    if not urls:
        raise SystemExit("rollout manager: no engines: pass --engine-url (repeat) or set rollout.engine_urls")
    status = args.status or args.weight_notice + ".status"
    return cfg, {"ring": args.ring, "notice": args.weight_notice, "status": status, "resume": args.resume,
                 "urls": urls, "announced": None, "log_dir": os.path.join(cfg.train.run_dir, "logs"), "run_id": None}


async def _aengines(cfg: Any, where: dict[str, Any], args: argparse.Namespace) -> tuple[list, Any]:
    """The engine clients and the restarter that replaces a dead one."""
    from megatron_darl.rollout.sglang_client import SGLangClient

    rc = cfg.rollout

    def make_client(url: str) -> RolloutEngine:
        return SGLangClient.from_config(url, rc, initial_version=args.initial_version)  # pool sized to the cap

    info = where["announced"]
    if info is not None:  # engine hosts run them, on this node or on rollout nodes
        restarter = AnnouncedEngineRestarter(info.engines_dir, info.attempt, make_client,
                                             startup_timeout_s=cfg.launch.engine_startup_s(cfg.rollout.backend))
        return await restarter.aconnect(info.num_engines), restarter
    restarter = None
    if rc.backend == "torch":
        restarter = EmbeddedEngineRestarter(cfg.model.hf_dir, api_key=rc.api_key, threads=rc.engine_threads,
                                            startup_timeout_s=cfg.launch.engine_startup_s(cfg.rollout.backend),
                                            request_timeout_s=rc.request_timeout_s,
                                            pids=dict(enumerate(args.engine_pid)), log_dir=where["log_dir"],
                                            max_batch=rc.max_concurrent_per_engine, seed=cfg.train.seed)
    return [make_client(u) for u in where["urls"]], restarter


def _handle_signals(mgr: RolloutManager, stop_timeout_s: float) -> None:
    """SIGINT: stop now. SIGTERM: keep serving the learners' checkpoint request until their stop
    notice, at most `stop_timeout_s`."""
    loop = asyncio.get_running_loop()

    def on_term() -> None:
        log.warning("SIGTERM: serving the learners until their stop notice (at most %.0f s)", stop_timeout_s)
        loop.call_later(stop_timeout_s, mgr.request_stop)

    loop.add_signal_handler(signal.SIGINT, mgr.request_stop)
    loop.add_signal_handler(signal.SIGTERM, on_term)


async def _amain(args: argparse.Namespace) -> None:
    from megatron_darl.channel.shm_ring import ShmRing
    from megatron_darl.data.sources import build_loader
    from megatron_darl.data.tokenizers import load_tokenizer
    from megatron_darl.model_facts import context_limit
    from megatron_darl.rewards.pool import RewardPool
    from megatron_darl.rollout.staleness import StalenessGate
    from megatron_darl.rollout.tools import ToolFormat, ToolRunner
    from megatron_darl.rollout.workflow import GroupWorkflow, RewardPoolScorer

    cfg, where = _settings(args)
    rc = cfg.rollout
    tokenizer = load_tokenizer(cfg.model.tokenizer_dir)
    loader = build_loader(cfg.data, tokenizer, context=context_limit(cfg, "train"))  # prompts the engines take
    engines, restarter = await _aengines(cfg, where, args)
    ring = ShmRing.attach(where["ring"], timeout=cfg.launch.engine_startup_s(cfg.rollout.backend))
    sink = RingSink(ring)
    pool = RewardPool(cfg.reward)
    scorer = RewardPoolScorer(pool, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    gate = StalenessGate(cfg.algo.max_head_offpolicyness, cfg.train.batch_prompts, args.initial_version)
    tools = ToolRunner(rc, ToolFormat(rc, tokenizer)) if rc.tool != "none" else None
    workflow = GroupWorkflow(rc, scorer, seed=cfg.train.seed, tools=tools)
    mgr = RolloutManager(rc, engines, loader, workflow, sink, gate,
                         restarter=restarter, notice_path=where["notice"], status_path=where["status"],
                         initial_version=args.initial_version, run_id=where["run_id"])
    if where["resume"]:
        with open(where["resume"], encoding="utf-8") as fh:
            mgr.load_state_dict(json.load(fh))
    _handle_signals(mgr, cfg.launch.stop_timeout_s)
    try:
        await mgr.arun()
    finally:
        for close in (sink.close, ring.close, pool.close, *([tools.close] if tools else [])):
            close()
        await asyncio.gather(*(e.aclose() for e in mgr.pool.engines))  # restarted ones included
        if restarter is not None:
            await restarter.aclose()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # ignored here and in the reward workers (inherited)
        signal.signal(sig, signal.SIG_IGN)
    asyncio.run(_amain(_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
