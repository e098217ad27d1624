"""The asynchronous, batched reward pool: worker processes with a per-item time limit.

What it is: `RewardPool(config)` keeps `num_workers` worker processes (worker.py), each grading
one item at a time. `await pool.ascore(items)` grades a batch concurrently and returns one
RewardResult per item, in order. A worker that overruns `timeout_s` is killed with its whole
process group and replaced; its item scores 0 with status "timeout", and the memory cgroups
of the program it was running are removed (a pool also removes, at start, those a crash left). A worker that dies or a
grader that raises scores 0 with status "error". Both are counted (`metrics()`) and logged.
What it is not: a general task queue, or usable from two event loops at once: one loop drives
it at a time (a later `asyncio.run` may take it over when the first is done).

Why processes we start ourselves rather than concurrent.futures: a ProcessPoolExecutor whose
worker is killed breaks for good; here a hung grader costs one item and one restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.api import RewardInput, RewardResult
from megatron_darl.rewards.sandbox import SandboxLimits, kill_uid, root_path
from megatron_darl.rewards.sandbox_cgroup import sweep as sweep_cgroups
from megatron_darl.rewards.worker import load_reward_fn

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 120.0  # importing sympy and reasoning-gym on a loaded machine
_BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from megatron_darl.rewards.worker import main; main()"
)


class WorkerDied(RuntimeError):
    """The worker's pipe closed: it crashed or was killed."""


class _Worker:
    """One worker process and the buffered reading of its reply lines."""

    def __init__(self, config: RewardConfig, tmp_root: str) -> None:
        # the worker's temporary files (sandbox folders) live here, so that killing it mid-run
        # leaves nothing behind: the folder goes with it; 0711 lets a sandbox uid reach its
        # own scratch folder inside without listing anything
        self.tmp = tempfile.mkdtemp(prefix="worker-", dir=tmp_root)
        os.chmod(self.tmp, 0o711)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TMPDIR=self.tmp)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, json.dumps(sys.path), json.dumps(asdict(config))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group, killed as one
        )
        self.ready = False
        self._buf = b""

    def send(self, message: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode("utf-8"))
        self.proc.stdin.flush()

    async def arecv(self, timeout: float) -> dict:
        """The next reply line; asyncio.TimeoutError past `timeout`, WorkerDied on EOF."""
        if b"\n" not in self._buf:
            await asyncio.wait_for(self._await_line(), timeout)
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    async def _await_line(self) -> None:
        loop = asyncio.get_running_loop()
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        done = loop.create_future()

        def on_readable() -> None:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                if not done.done():
                    done.set_exception(WorkerDied(f"reward worker {self.proc.pid} exited"))
                return
            self._buf += chunk
            if b"\n" in self._buf and not done.done():
                done.set_result(None)

        loop.add_reader(fd, on_readable)
        try:
            await done
        finally:
            loop.remove_reader(fd)

    async def await_ready(self) -> None:
        try:
            hello = await self.arecv(STARTUP_TIMEOUT_S)
        except (WorkerDied, asyncio.TimeoutError) as e:
            raise RuntimeError(f"reward worker {self.proc.pid} did not start: {e!r}") from e
        if not hello.get("ready"):
            raise RuntimeError(f"reward worker could not start: {hello.get('error')}")
        self.ready = True

    def kill(self, uid_base: int) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if root_path():
            # a sandboxed program this worker started runs as uid_base + the worker's pid (its
            # main thread id); without a PID namespace it would outlive the worker. As a user it
            # always has one, whose PID 1 dies with its launcher (sandbox_launcher.py)
            kill_uid(uid_base + self.proc.pid)
        # the memory cgroup of the program it was running (root path): its own `remove` never ran
        sweep_cgroups(owner=self.proc.pid)
        shutil.rmtree(self.tmp, ignore_errors=True)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class RewardPool:
    """Grades batches of RewardInput in worker processes with a per-item time limit."""

    def __init__(self, config: RewardConfig) -> None:
        config.validate()
        if config.fn:
            load_reward_fn(config.fn)  # a wrong import path fails here, not in every worker
        self.config = config
        sweep_cgroups()  # sandbox cgroups a crashed pool's workers left behind
        self.timeouts = 0
        self.errors = 0
        self.items = 0
        self._uid_base = SandboxLimits().uid_base
        self._workers: list[_Worker] = []
        self._tmp_root = tempfile.mkdtemp(prefix="darl-rewards-")
        os.chmod(self._tmp_root, 0o711)
        self._idle: asyncio.Queue[_Worker] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_id = 0
        self._closed = False

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since the pool started."""
        return {
            "rollout/reward_timeouts": float(self.timeouts),
            "rollout/reward_errors": float(self.errors),
            "rollout/reward_items": float(self.items),
        }

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a worker is replaced)."""
        return [w.proc.pid for w in self._workers]

    async def ascore(self, items: list[RewardInput]) -> list[RewardResult]:
        """One RewardResult per item, in order; never raises for what a grader does."""
        if self._closed:
            raise RuntimeError("RewardPool.ascore: the pool is closed")
        idle = self._idle_queue()
        return list(await asyncio.gather(*(self._ascore_one(item, idle) for item in items)))

    def score(self, items: list[RewardInput]) -> list[RewardResult]:
        """Blocking form of `ascore`, for scripts without an event loop."""
        return asyncio.run(self.ascore(items))

    def _idle_queue(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # first use, or a new loop (e.g. a second asyncio.run): queues bind to one loop
            self._loop = loop
            if not self._workers:
                self._workers = [
                    _Worker(self.config, self._tmp_root) for _ in range(self.config.num_workers)
                ]
            self._idle = asyncio.Queue()
            for w in self._workers:
                self._idle.put_nowait(w)
        assert self._idle is not None
        return self._idle

    async def _ascore_one(self, item: RewardInput, idle: asyncio.Queue) -> RewardResult:
        worker = await idle.get()
        keep = False  # whether the worker is still usable afterwards
        try:
            if not worker.ready:
                await worker.await_ready()
            self._next_id += 1
            request_id = self._next_id
            worker.send({"id": request_id, "item": asdict(item)})
            reply = await worker.arecv(self.config.timeout_s)
            if reply.get("id") != request_id:
                # cannot happen with one item per worker at a time; guard the protocol anyway
                raise WorkerDied(f"replied to request {reply.get('id')}, not {request_id}")
            keep = True
        except asyncio.TimeoutError:
            self.timeouts += 1
            log.warning("reward item timed out after %.1fs (kind=%s); worker restarted",
                        self.config.timeout_s, item.kind)
            return RewardResult(0.0, "timeout", f"exceeded {self.config.timeout_s}s")
        except (WorkerDied, BrokenPipeError) as e:
            self.errors += 1
            log.warning("reward worker died grading a %s item: %s; restarted", item.kind, e)
            return RewardResult(0.0, "error", f"worker died: {e}")
        finally:
            self.items += 1
            idle.put_nowait(worker if keep else self._replace(worker))
        if reply["status"] != "ok":
            self.errors += 1
            log.warning("reward grader error (kind=%s): %s", item.kind, reply["detail"])
        return RewardResult(float(reply["score"]), reply["status"], reply.get("detail", ""))

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill(self._uid_base)
        fresh = _Worker(self.config, self._tmp_root)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        """Stop every worker (and anything it sandboxed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            w.kill(self._uid_base)
        self._workers = []
        shutil.rmtree(self._tmp_root, ignore_errors=True)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
