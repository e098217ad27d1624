"""Engine host: the process that runs one node's rollout engines for a run.

What it is: `EngineHost` and its entry, `python -m megatron_darl.launch.engine_host --run-info
<run_dir>/run_info.json` (one per rollout node on Slurm, one beside the learners on a local
run). It waits for the run-info record of its attempt, checks that it can read the run's
weights folder (a rollout node that cannot read it says so and stops the run), starts the
node's engines through the one engine command builder (`engine/command.py`; darl-engine
on CPU, `python -m sglang.launch_server` per `launch.engine_gpus` GPUs), each in its own
process group with its log in `<run_dir>/logs/engine<i>.log`, and announces each engine once it
answers /health_generate. Then it keeps them: an engine that exits, or that the rollout manager
asks to restart (it stopped answering), is replaced on a new port and announced again with the
next generation, with the same flags. It stops every engine on the attempt's stop marker,
SIGTERM or SIGINT.
What it is not: the rollout manager (which decides that an engine is down) or the engines.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from megatron_darl.channel.announcements import EngineAnnouncement, announce, read_restart_request, stop_path
from megatron_darl.channel.json_files import write_json_atomic
from megatron_darl.channel.ports import free_port
from megatron_darl.channel.run_info import RunInfo, read_marker, wait_for_run_info, write_marker
from megatron_darl.engine.command import EngineSpec, engine_specs
from megatron_darl.launch.engine_env import check_sglang_python, engine_python
from megatron_darl.launch.supervisor import Child, Supervisor, _signal_group

PROBE = ".probe"  # in the weights folder: the session writes the attempt id, every host reads it back
QUICK_DEATH_S = 30.0  # an engine that dies this soon after its start, RESTART_LIMIT times in a row, is broken
RESTART_LIMIT = 3
# engines are on this node or another node of the job, never behind the proxy a site exports
# (urllib's default opener honours http_proxy even for 127.0.0.1 when no_proxy is unset)
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def probe_path(weights_root: str) -> str:
    return os.path.join(weights_root, PROBE)


def host_error_path(engines_dir: str, node: int) -> str:
    return os.path.join(engines_dir, f"host{node}.error")


def host_starting_path(engines_dir: str, node: int) -> str:
    """Holds the attempt once host `node` begins starting its engines (their budgets start then)."""
    return os.path.join(engines_dir, f"host{node}.starting")


def slurm_attempt() -> str | None:
    """The attempt id of this Slurm job execution (None outside Slurm)."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT', '0') or '0'}" if job else None


def node_name() -> str:
    """This node's name: Slurm's (virtual nodes share a host name), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def node_address(node: str | None = None) -> str:
    """The address other nodes reach this node at: Slurm's NodeAddr of the node, else its name."""
    node = node or os.environ.get("SLURMD_NODENAME")
    if node:
        try:
            out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                                 timeout=30).stdout
            for field in out.split():
                if field.startswith("NodeAddr="):
                    return field.split("=", 1)[1]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return node or socket.gethostname()


def bind_address(address: str) -> str:
    """Bind loopback addresses as they are (nothing leaves the machine); others on every interface."""
    try:
        return address if ipaddress.ip_address(address).is_loopback else "0.0.0.0"
    except ValueError:
        return "0.0.0.0"



def healthy(url: str, api_key: str | None = None) -> bool:
    """Whether the engine at `url` answers /health_generate with 200."""
    req = urllib.request.Request(url + "/health_generate")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with DIRECT.open(req, timeout=10) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(url: str, child: Child, timeout_s: float, api_key: str | None, name: str,
                 started: float | None = None) -> None:
    """Until `url` is healthy; raises when `child` exits first or `timeout_s` passes since
    `started` (the engine's own start, time.monotonic(); default now)."""
    deadline = (time.monotonic() if started is None else started) + timeout_s
    while not healthy(url, api_key):
        code = child.poll()
        if code is not None:
            raise RuntimeError(f"{name} exited with code {code} before answering /health_generate; "
                               f"see {child.log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not answer /health_generate within {timeout_s:.0f} s "
                               f"(launch.startup_timeout_s); see {child.log_path}")
        time.sleep(0.2)


@dataclass
class _Engine:
    spec: EngineSpec
    child: Child
    url: str
    generation: int
    started: float
    quick_deaths: int = 0


class EngineHost:
    """Starts, announces, watches and replaces the engines `specs` of one node."""

    def __init__(self, info: RunInfo, specs: list[EngineSpec], sup: Supervisor, node: int, address: str,
                 startup_timeout_s: float, api_key: str | None = None):
        self.info, self.specs, self.sup, self.node = info, specs, sup, node
        self.address, self.bind = address, bind_address(address)
        self.startup_timeout_s, self.api_key = startup_timeout_s, api_key
        self.engines: dict[int, _Engine] = {}
        self.probe = ""

    def log(self, msg: str) -> None:
        print(f"[engine-host {self.node}] {msg}", flush=True)

    def check_weights_readable(self) -> None:
        """The rollout side must read what the learner publishes: read the session's probe back."""
        path = probe_path(self.info.weights_root)
        try:
            with open(path, encoding="utf-8") as fh:
                self.probe = fh.read().strip()
        except OSError as exc:
            raise RuntimeError(f"node {node_name()} cannot read the run's weights folder "
                               f"{self.info.weights_root} ({exc}); engines load every published version from "
                               f"there: train.run_dir must be on a file system all nodes share") from None

    def start_all(self) -> None:
        write_marker(host_starting_path(self.info.engines_dir, self.node), self.info.attempt)
        for spec in self.specs:
            self._start(spec, 0)
        for index in sorted(self.engines):
            self._await_and_announce(index)

    def _start(self, spec: EngineSpec, generation: int) -> None:
        port = free_port(self.bind)
        child = self.sup.start(f"engine{spec.index}", spec.command(self.bind, port),
                               env=spec.environment((self.bind, self.address)), inherit=False,
                               essential=False, critical=False)
        url = f"http://{self.address}:{port}"
        old = self.engines.get(spec.index)
        self.engines[spec.index] = _Engine(spec, child, url, generation, time.monotonic(),
                                           old.quick_deaths if old else 0)
        self.log(f"engine {spec.index} (generation {generation}) starting at {url}, pid {child.pid}, "
                 f"log {child.log_path}")

    def _await_and_announce(self, index: int) -> None:
        e = self.engines[index]
        wait_healthy(e.url, e.child, self.startup_timeout_s, self.api_key, f"engine {index}", started=e.started)
        announce(self.info.engines_dir, EngineAnnouncement(
            attempt=self.info.attempt, index=index, url=e.url, pid=e.child.pid, node=node_name(),
            generation=e.generation, log=e.child.log_path, probe=self.probe))
        self.log(f"engine {index} (generation {e.generation}) up at {e.url}")

    def restart(self, index: int, why: str) -> None:
        e = self.engines[index]
        quick = time.monotonic() - e.started < QUICK_DEATH_S and e.child.poll() is not None
        e.quick_deaths = e.quick_deaths + 1 if quick else 0
        if e.quick_deaths >= RESTART_LIMIT:
            raise RuntimeError(f"engine {index} failed {e.quick_deaths} times within {QUICK_DEATH_S:.0f} s of "
                               f"its start; see {e.child.log_path}")
        self.log(f"engine {index}: {why}; restarting it")
        _signal_group(e.child.pid, signal.SIGKILL)
        e.child.proc.wait()
        self._start(e.spec, e.generation + 1)
        self._await_and_announce(index)

    def step(self) -> None:
        """One round of watching: replace engines that exited or that the manager gave up on."""
        for index, e in sorted(self.engines.items()):
            code = e.child.poll()
            if code is not None:
                self.restart(index, f"exited with code {code}")
            elif read_restart_request(self.info.engines_dir, index, self.info.attempt) == e.generation:
                self.restart(index, "the rollout manager asked for a restart (it stopped answering)")

    def stop_requested(self) -> bool:
        return read_marker(stop_path(self.info.engines_dir)) == self.info.attempt


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_darl.launch.engine_host",
                                description="Run one node's rollout engines for a run (started by the launcher).")
    p.add_argument("--run-info", required=True, help="<run_dir>/run_info.json (waited for)")
    p.add_argument("--attempt", default=None, help="the attempt to serve (default: from the Slurm job)")
    p.add_argument("--node", type=int, default=None, help="this node's index among the engine nodes "
                   "(default $SLURM_NODEID, else 0)")
    p.add_argument("--nodes", type=int, default=None,
                   help="engine nodes in all (default $SLURM_STEP_NUM_NODES, else 1)")
    p.add_argument("--address", default=None, help="address engines are reached at (default: Slurm's NodeAddr)")
    p.add_argument("--gpus", default=None, help="comma-separated GPUs for engines (default $CUDA_VISIBLE_DEVICES)")
    return p


class _Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    attempt = args.attempt or slurm_attempt()
    node = args.node if args.node is not None else int(os.environ.get("SLURM_NODEID", "0"))
    nodes = args.nodes or int(os.environ.get("SLURM_STEP_NUM_NODES", "1"))

    def on_signal(signum, _frame):
        raise _Stop(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # Slurm's warning before the time limit is for the learners
        signal.signal(sig, signal.SIG_IGN)
    try:
        return _serve(args, attempt, node, nodes)
    except _Stop as why:
        print(f"[engine-host {node}] {why}: stopping the engines", flush=True)
        return 0


def _serve(args: argparse.Namespace, attempt: str | None, node: int, nodes: int) -> int:
    from megatron_darl.config import load_config

    run_dir = os.path.dirname(os.path.abspath(args.run_info))
    engines_dir = os.path.join(run_dir, "engines")
    print(f"[engine-host {node}] waiting for {args.run_info} (attempt {attempt or 'any'})", flush=True)
    info = wait_for_run_info(args.run_info, attempt, timeout_s=float("inf"),
                             alive=lambda: _stop_if_marked(engines_dir, attempt))
    cfg = load_config(info.config)
    per = info.num_engines // nodes
    indices = list(range(node * per, (node + 1) * per))
    gpus = (args.gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "")).split(",")
    gpus = [g for g in gpus if g]
    python = engine_python(cfg)
    with Supervisor(info.log_dir, echo=None) as sup:
        host = EngineHost(info, engine_specs(cfg, indices, gpus, python), sup, node,
                          args.address or node_address(), cfg.launch.engine_startup_s(cfg.rollout.backend),
                          cfg.rollout.api_key)
        try:
            host.check_weights_readable()
            if cfg.rollout.backend == "sglang" and not gpus:
                raise RuntimeError("rollout.backend=sglang needs GPUs on the engine nodes (none visible: "
                                   "set launch.rollout.gpus_per_node)")
            if cfg.rollout.backend == "sglang":
                check_sglang_python(python)
            host.start_all()
            while not host.stop_requested():
                host.step()
                time.sleep(0.2)
        except (RuntimeError, TimeoutError, ValueError) as exc:
            write_json_atomic(host_error_path(info.engines_dir, node), {"attempt": info.attempt, "message": str(exc)})
            print(f"[engine-host {node}] error: {exc}", file=sys.stderr, flush=True)
            return 1
        host.log("stop marker: stopping the engines")
    return 0


def _stop_if_marked(engines_dir: str, attempt: str | None) -> None:
    if attempt is not None and read_marker(stop_path(engines_dir)) == attempt:
        raise _Stop("stop marker before the run started")


if __name__ == "__main__":
    sys.exit(main())
