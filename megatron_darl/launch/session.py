"""One local run from start to summary, as the `darl-train` process sees it.

What it is: `LocalSession.run()`: (1) warm start (`builtin:tiny-qwen3` becomes a real model
folder, SFT cached), (2) resolved config + run info written to the run folder, (3) embedded
engines started and health-checked (or the SGLang URLs checked), (4) held-out accuracy of the
starting policy, (5) rollout manager and learner ranks started, (6) wait for the learners while
watching every child, (7) accuracy of the final policy on the same problems and a summary
(paired gain with a 95% interval, where TensorBoard logs are). Preemption (SIGTERM/SIGUSR1)
is forwarded to the learner ranks, which checkpoint and stop.
What it is not: process supervision (`local.py`) or any role's own work.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import time
from contextlib import closing
from typing import Any

from megatron_darl.config import RunConfig
from megatron_darl.launch.local import Supervisor
from megatron_darl.launch.runner import PY, learner_env, new_run_id, run_paths, write_run_info
from megatron_darl.resume import load_rollout_state, resolve_resume, rollout_sidecar


STALE_RUN = re.compile(r"^darl-([0-9a-f]{10})-(ring|weights)$")


def sweep_stale_runs(directory: str = "/dev/shm", min_age_s: float = 60.0) -> list[str]:
    """Remove the shared memory of runs whose processes are all gone (a SIGKILLed launcher
    cannot clean up after itself): a ring whose creator died, and weight folders of a run
    whose ring is gone. Entries younger than `min_age_s` are left alone (a run starting now)."""
    from megatron_darl.replay.shm_ring import remove_if_stale

    if not os.path.isdir(directory):
        return []
    removed, now = [], time.time()
    entries = sorted(os.listdir(directory), key=lambda n: not n.endswith("-ring"))  # rings first
    for name in entries:
        m = STALE_RUN.match(name)
        path = os.path.join(directory, name)
        if m is None or now - os.path.getmtime(path) < min_age_s:
            continue
        if m.group(2) == "ring" and remove_if_stale(path):
            removed.append(path)
        elif m.group(2) == "weights" and not os.path.exists(os.path.join(directory, f"darl-{m.group(1)}-ring")):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSession:
    def __init__(self, cfg: RunConfig, sup: Supervisor):
        self.cfg, self.sup = cfg, sup
        self.engine_urls: list[str] = list(cfg.rollout.engine_urls)
        self.engine_pids: list[int] = []

    def log(self, msg: str) -> None:
        print(f"[launcher] {msg}", flush=True)

    def run(self) -> int:
        from megatron_darl import warmstart

        for path in sweep_stale_runs():
            self.log(f"removed shared memory of a dead run: {path}")
        self.cfg = warmstart.prepare_model(self.cfg)
        info = run_paths(self.cfg, new_run_id())
        resume = resolve_resume(self.cfg.checkpoint.resume, self.cfg.checkpoint_dir)
        info["resume"] = resume
        info["rollout_state"] = rollout_sidecar(resume) if resume else None
        load_rollout_state(resume)  # fails now, not in the manager, if the sidecar is missing
        cfg_path, info_path = write_run_info(self.cfg, info)
        self._cleanup_on_exit(info)
        self.start_engines()
        before = self._evaluate("before RL") if self._eval_enabled(resume) else None
        self._start_manager(cfg_path, info)
        learners = self._start_learners(cfg_path, info_path)
        self._forward_preemption(learners)
        for child in learners:
            self.sup.wait(child)
        completed = self._completed(info)
        after = self._evaluate("after RL", final=info["final_model"]) if before is not None and completed else None
        self._summary(info, before, after)
        return 0

    # ---- steps ----
    def _cleanup_on_exit(self, info: dict[str, Any]) -> None:
        from megatron_darl.replay.shm_ring import segment_path

        def cleanup() -> None:
            path = segment_path(info["ring"])
            if os.path.exists(path):
                os.unlink(path)
            if info["weights_kind"] == "shm":
                shutil.rmtree(info["weights_root"], ignore_errors=True)

        self.sup.on_shutdown(cleanup)

    def start_engines(self) -> None:
        rc = self.cfg.rollout
        if rc.backend == "sglang":
            if not self.engine_urls:
                raise ValueError("rollout.backend=sglang on a local run needs rollout.engine_urls")
        else:
            for i in range(rc.num_engines):
                port = free_port()
                argv = [PY, "-m", "megatron_darl.rollout.engine_server", "--model", self.cfg.model.hf_dir,
                        "--host", "127.0.0.1", "--port", str(port), "--threads", str(rc.engine_threads),
                        "--max-batch", str(rc.max_concurrent_per_engine), "--seed", str(self.cfg.train.seed + i)]
                if rc.api_key:
                    argv += ["--api-key", rc.api_key]
                # not critical: the rollout manager detects a dead engine, requeues its work and restarts it
                child = self.sup.start(f"engine{i}", argv, env={"OMP_NUM_THREADS": str(rc.engine_threads)},
                                       essential=False, critical=False)
                self.engine_urls.append(f"http://127.0.0.1:{port}")
                self.engine_pids.append(child.pid)
        asyncio.run(self._await_healthy(self.cfg.launch.startup_timeout_s))
        self.log(f"engines healthy: {', '.join(self.engine_urls)}")

    async def _await_healthy(self, timeout_s: float) -> None:
        from megatron_darl.rollout.sglang_client import SGLangClient

        deadline = time.monotonic() + timeout_s
        for url in self.engine_urls:
            async with SGLangClient(url, api_key=self.cfg.rollout.api_key, timeout_s=5.0, max_retries=0) as c:
                while not await c.ahealth():
                    self.sup.check()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"engine {url} not healthy within {timeout_s} s")
                    await asyncio.sleep(0.2)

    def _start_manager(self, cfg_path: str, info: dict[str, Any]) -> None:
        argv = [PY, "-m", "megatron_darl.rollout.manager", "--config", cfg_path, "--ring", info["ring"],
                "--weight-notice", info["notice"], "--status", info["status"]]
        for url in self.engine_urls:
            argv += ["--engine-url", url]
        for pid in self.engine_pids:
            argv += ["--engine-pid", str(pid)]
        if info["rollout_state"]:
            argv += ["--resume", info["rollout_state"]]
        # not essential: it exits 0 by itself when the learner says stop; a crash still stops the run
        self.sup.start("rollout", argv, env={"OMP_NUM_THREADS": "1"}, essential=False)

    def _start_learners(self, cfg_path: str, info_path: str) -> list:
        world = self.cfg.launch.learner_procs_per_node
        port = free_port()
        return [self.sup.start(f"learner{r}", [PY, "-m", "megatron_darl.train", "--config", cfg_path,
                                               "--run-info", info_path], env=learner_env(r, world, port))
                for r in range(world)]

    def _forward_preemption(self, learners: list) -> None:
        def forward(signum, _frame):
            self.log(f"received {signal.Signals(signum).name}: learners checkpoint and stop")
            for c in learners:
                if c.poll() is None:
                    os.kill(c.pid, signum)

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, forward)

    def _completed(self, info: dict[str, Any]) -> bool:
        """Whether the learners reached train.steps (not stopped early by preemption)."""
        path = os.path.join(info["run_dir"], "learner_summary.json")
        if not os.path.isfile(path):
            return False
        with open(path, encoding="utf-8") as fh:
            done = json.load(fh)["final_version"] >= self.cfg.train.steps
        if not done:
            self.log("stopped before train.steps (preempted): resume with checkpoint.resume=auto")
        return done

    # ---- evaluation ----
    def _eval_enabled(self, resume: str | None) -> bool:
        """Before/after evaluation of a fresh run (a resumed one has no 'before')."""
        return self.cfg.eval.num_problems > 0 and resume is None

    def _evaluate(self, label: str, final: str | None = None):
        from megatron_darl.eval.session import evaluate_with_engines

        scores, line = evaluate_with_engines(self.cfg, self.engine_urls, label, final_model=final)
        self.log(line)
        return scores

    def _summary(self, info: dict[str, Any], before, after) -> None:
        summary: dict[str, Any] = {"run_dir": info["run_dir"], "tensorboard": os.path.join(info["run_dir"], "tb"),
                                   "metrics": os.path.join(info["run_dir"], "metrics.jsonl"),
                                   "final_model": info["final_model"]}
        if before is not None and after is not None:
            from megatron_darl.eval.runner import paired_difference

            gain, lo, hi = paired_difference(before, after)
            summary.update({"accuracy_before": float(before.scores.mean()), "accuracy_after": float(after.scores.mean()),
                            "gain": gain, "gain_ci95": [lo, hi], "eval_problems": len(before.uids)})
            self.log(f"held-out accuracy {100 * summary['accuracy_before']:.1f}% -> "
                     f"{100 * summary['accuracy_after']:.1f}%: gain {100 * gain:+.1f} points "
                     f"(95% CI {100 * lo:+.1f} to {100 * hi:+.1f}) on {len(before.uids)} problems")
        with open(os.path.join(info["run_dir"], "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1)
        self.log(f"TensorBoard: tensorboard --logdir {summary['tensorboard']}")
        self.log(f"summary: {os.path.join(info['run_dir'], 'summary.json')}")
