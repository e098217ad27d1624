"""One run from start to summary, whatever the placement: the run session.

What it is: `RunSession(cfg, placement).run()`: (1) warm start (`builtin:tiny-qwen3` becomes a
real model folder, SFT cached), (2) the resolved config and the run-info record written to the
run folder (the checkpoint to resume, the attempt, the rendezvous), (3) engines started by the
placement and found through their announcements (or `rollout.engine_urls`), health-checked,
(4) held-out accuracy of the starting policy, (5) rollout manager and learner ranks started,
(6) wait for the learners while the placement watches every role; a preemption (SIGTERM,
SIGUSR1, SIGUSR2) is forwarded to the learners, which checkpoint and stop within
`launch.stop_timeout_s`, (7) accuracy of the final policy on the same problems, with the
engines' current addresses (a restarted engine has a new one), and a summary (paired gain
with a 95% interval, where TensorBoard logs are). A finished training run never ends as a
failure: an evaluation that fails after it is reported and left out of the summary. A
preemption signal before the learners start (warm start, engine start, the first evaluation)
stops the run at once and cleanly, exit 0 (no train step ran, nothing to checkpoint; the warm
start writes its model whole or not at all); during the evaluation after training it skips
that evaluation (the policy is exported). Each phase is one `[launcher]` line.
What it is not: where processes run (`Placement`: `local.LocalPlacement`,
`slurm_job.SlurmPlacement`) or any role's own work.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
import uuid
from typing import Any

from megatron_darl.channel.announcements import read_announcements, stop_path
from megatron_darl.channel.json_files import read_json
from megatron_darl.channel.run_info import RunInfo, read_marker, write_marker
from megatron_darl.config import RunConfig, save_resolved
from megatron_darl.launch import stopping
from megatron_darl.launch.api import Placement
from megatron_darl.launch.engine_host import host_error_path, host_starting_path, probe_path
from megatron_darl.trainer.checkpoints import load_rollout_state, resolve_resume, rollout_sidecar

STALE_RUN = re.compile(r"^darl-([0-9a-f]{10})-(ring|weights)$")
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def new_run_id() -> str:
    return uuid.uuid4().hex[:10]


def sweep_stale_runs(directory: str = "/dev/shm", min_age_s: float = 60.0) -> list[str]:
    """Remove the shared memory of runs whose processes are all gone (a SIGKILLed launcher
    cannot clean up after itself): a ring whose creator died, and weight folders of a run
    whose ring is gone. Entries younger than `min_age_s` are left alone (a run starting now)."""
    from megatron_darl.channel.shm_ring import remove_if_stale

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


def make_run_info(cfg: RunConfig, run_id: str, attempt: str, addr: str, port: int) -> RunInfo:
    """The record of this attempt (paths only; nothing is written)."""
    run_dir = os.path.abspath(cfg.train.run_dir)
    lc, rc = cfg.launch, cfg.rollout
    external = rc.backend == "sglang" and bool(rc.engine_urls)
    on_rollout_nodes = lc.mode == "slurm" and bool(lc.rollout_nodes)
    folder_kind = rc.weight_folder_kind(on_rollout_nodes)  # distributed: the folders of failed broadcasts
    return RunInfo(
        run_id=run_id, attempt=attempt, run_dir=run_dir, config=os.path.join(run_dir, "config.yaml"),
        ring=cfg.ring.name or f"darl-{run_id}-ring",
        notice=os.path.join(run_dir, "rollout", "notice.json"), status=os.path.join(run_dir, "rollout", "status.json"),
        weights_root=f"/dev/shm/darl-{run_id}-weights" if folder_kind == "shm" else os.path.join(run_dir, "weights"),
        weight_sync=rc.effective_weight_sync(on_rollout_nodes), final_model=os.path.join(run_dir, "final_model"),
        engines_dir=os.path.join(run_dir, "engines"), num_engines=0 if external else rc.num_engines,
        engine_urls=list(rc.engine_urls) if external else [], learner_world=lc.learner_world,
        master_addr=addr, master_port=port, learners_go=os.path.join(run_dir, "engines", "learners.go"))


class HostClock:
    """When each engine host of an attempt began starting its engines (its `host<i>.starting`
    marker, timed on this node's clock when first seen), and which hosts are late."""

    SLACK_S = 60.0  # after a host's own budget: its error report or the last announcement to arrive

    def __init__(self, info: RunInfo, hosts: int, budget_s: float):
        self.info, self.hosts, self.budget_s = info, hosts, budget_s
        self.t0 = time.monotonic()
        self.started: dict[int, float] = {}

    def since_start(self) -> float:
        return time.monotonic() - self.t0

    def late(self) -> str:
        """'' while every host is within its time; else which are late, and why."""
        now, out = time.monotonic(), []
        for node in range(self.hosts):
            if node not in self.started and read_marker(host_starting_path(self.info.engines_dir, node)) == \
                    self.info.attempt:
                self.started[node] = now
            if node in self.started and now - self.started[node] > self.budget_s + self.SLACK_S:
                out.append(f"engine host {node} started them {now - self.started[node]:.0f} s ago")
            elif node not in self.started and now - self.t0 > self.budget_s:
                out.append(f"engine host {node} never began starting its engines")
        return "; ".join(out)


class Stopped(Exception):
    """A preemption signal before any learner rank started (nothing to checkpoint: stop now), or
    during the evaluation after training (the policy is exported: skip the evaluation)."""

    def __init__(self, signum: int, when: str = "before training started"):
        super().__init__(f"{signal.Signals(signum).name} {when}")
        self.signum = signum


class RunSession:
    def __init__(self, cfg: RunConfig, placement: Placement):
        self.cfg, self.placement = cfg, placement
        self.info: RunInfo | None = None
        self.preempted_at: float | None = None
        self.learners_started = self.stopping = self.completed = self.evaluating_final = False

    def log(self, msg: str) -> None:
        print(f"[launcher] {msg}", flush=True)

    def run(self) -> int:
        stopping.quiet_when_dropped()  # a stop Python drops in a finalizer is deferred, not an error
        try:
            return self._run()
        except Stopped as why:  # a clean stop, as a preemption during training is: exit 0
            self.log(f"stopped: {why}; nothing to checkpoint (no train step ran): the same command starts "
                     f"the run again")
            return 0
        except Exception as exc:  # named here: a signal handler running during teardown may replace it
            self.log(f"the run failed: {exc}")
            raise
        finally:
            self.stopping = True  # a signal now must not interrupt the teardown
            self.placement.stop(self.info)

    def _run(self) -> int:
        from megatron_darl.launch import warmstart

        for path in sweep_stale_runs():
            self.log(f"removed shared memory of a dead run: {path}")
        if self.cfg.model.hf_dir == warmstart.BUILTIN_MODEL:
            self.log(f"warm start of the built-in model (demo.sft_steps={self.cfg.demo.sft_steps}; cached in "
                     f"{os.path.join(self.cfg.train.run_dir, 'model')})")
        self.cfg = warmstart.prepare_model(self.cfg)  # its steps call stopping.raise_pending()
        stopping.raise_pending()
        info = self.info = self.prepare()
        self.log("starting engines")
        self.placement.start_engines(info)
        self.log(f"engines healthy: {', '.join(self.engine_urls(info))}")
        before = self._evaluate("before RL") if self._eval_enabled(info.resume) else None
        stopping.raise_pending()  # the last point at which a stop needs no checkpoint
        self.log("training: starting the rollout manager and the learners")
        self.placement.start_rollout(info)
        write_marker(info.learners_go, info.attempt)
        self.learners_started = True
        self.placement.start_learners(info)
        self.wait_learners()
        self.completed = self._completed(info)
        after = None
        if before is not None and self.completed:
            self.evaluating_final = True  # a preemption signal now skips this evaluation
            after = self._evaluate("after RL", final=info.final_model)
            self.evaluating_final = False
        self._summary(info, before, after)
        return 0

    # ---- steps ----
    def prepare(self) -> RunInfo:
        """Resume point, resolved config and run-info record; stale files of earlier attempts go."""
        addr, port = self.placement.rendezvous()
        info = make_run_info(self.cfg, new_run_id(), "", addr, port)
        info.attempt = self.placement.attempt or info.run_id
        info.resume = resolve_resume(self.cfg.checkpoint.resume, self.cfg.checkpoint_dir)
        info.rollout_state = rollout_sidecar(info.resume) if info.resume else None
        load_rollout_state(info.resume)  # fails now, not in the manager, if the sidecar is missing
        # a notice or status of an earlier run holds weights, `stop` and `state_request` of processes
        # that are gone; announcements and markers belong to their attempt
        for stale in (info.notice, info.status):
            if os.path.exists(stale):
                os.unlink(stale)
        shutil.rmtree(info.engines_dir, ignore_errors=True)
        os.makedirs(info.engines_dir)
        save_resolved(self.cfg, info.run_dir)
        os.makedirs(info.weights_root, exist_ok=True)
        write_marker(probe_path(info.weights_root), info.attempt)
        info.save()
        if info.resume:
            self.log(f"resuming from {info.resume}")
        return info

    def engine_urls(self, info: RunInfo) -> list[str]:
        """Every engine's current address, once all are announced and answer /health_generate
        (a restarted engine announces a new address; it is read again until then). The startup
        budget counts from each engine's own start: its host enforces it and reports; this side
        gives a host the budget to begin starting its engines, and then the budget again."""
        budget = self.cfg.launch.engine_startup_s(self.cfg.rollout.backend)
        hosts = HostClock(info, max(1, self.cfg.launch.rollout_nodes), budget)
        while True:
            stopping.raise_pending()
            self._raise_host_errors(info)
            self.placement.check()
            if info.engine_urls:
                urls, missing = list(info.engine_urls), []
            else:
                anns = read_announcements(info.engines_dir, info.attempt, info.num_engines)
                bad = [a.index for a in anns.values() if a.probe != info.attempt]
                if bad:
                    raise RuntimeError(f"engines {bad} did not read this run's weights folder {info.weights_root}")
                urls = [anns[i].url for i in sorted(anns)]
                missing = sorted(set(range(info.num_engines)) - set(anns))
            sick = [] if missing else asyncio.run(self._unhealthy(urls))
            if not missing and not sick:
                return urls
            late = hosts.late() if not info.engine_urls else (
                "rollout.engine_urls" if hosts.since_start() > budget else "")
            if late:
                raise TimeoutError(
                    f"engines not ready within launch.startup_timeout_s={budget:.0f} s of their start ({late}): "
                    f"{'not announced in ' + info.engines_dir + ': ' + str(missing) if missing else ''}"
                    f"{'not healthy: ' + ', '.join(sick) if sick else ''}; see {info.log_dir}/engine*.log (on Slurm "
                    f"the run folder must be on a file system the rollout nodes share)")
            time.sleep(0.3)

    def _raise_host_errors(self, info: RunInfo) -> None:
        for node in range(max(1, self.cfg.launch.rollout_nodes)):
            err = read_json(host_error_path(info.engines_dir, node))
            if isinstance(err, dict) and err.get("attempt") == info.attempt:
                raise RuntimeError(f"engine host {node}: {err.get('message')}")

    async def _unhealthy(self, urls: list[str]) -> list[str]:
        from megatron_darl.rollout.sglang_client import SGLangClient

        sick = []
        for url in urls:
            async with SGLangClient(url, api_key=self.cfg.rollout.api_key, timeout_s=5.0, max_retries=0) as c:
                if not await c.ahealth():
                    sick.append(url)
        return sick

    # ---- learners ----
    def preempt(self, signum: int, _frame: Any = None) -> None:
        """Signal handler: the learners checkpoint and stop (at once if they wait for data)."""
        if self.stopping:
            return
        if not self.learners_started:  # recorded too: a raise that lands in a finalizer is lost
            raise stopping.record(Stopped(signum))
        if self.evaluating_final:  # the learners are done and the policy exported
            self.evaluating_final = False
            raise stopping.record(Stopped(signum, "during the evaluation after training"))
        if self.preempted_at is None:
            self.preempted_at = time.monotonic()
            self.log(f"received {signal.Signals(signum).name}: learners checkpoint and stop "
                     f"(within launch.stop_timeout_s={self.cfg.launch.stop_timeout_s:.0f} s)")
        self.placement.preempt(signum)

    def wait_learners(self) -> None:
        """Until every learner rank exited; after a preemption, at most `launch.stop_timeout_s`."""
        while not self.placement.wait_learners(timeout_s=0.5):
            if self.preempted_at is not None and time.monotonic() - self.preempted_at > self.cfg.launch.stop_timeout_s:
                raise TimeoutError(f"the learners did not checkpoint and stop within launch.stop_timeout_s="
                                   f"{self.cfg.launch.stop_timeout_s:.0f} s of the preemption signal; stopped them")

    def _completed(self, info: RunInfo) -> bool:
        """Whether the learners reached train.steps or spent the sample budget
        (train.max_generated_samples), not stopped early by preemption."""
        path = os.path.join(info.run_dir, "learner_summary.json")
        if not os.path.isfile(path):
            return False
        with open(path, encoding="utf-8") as fh:
            learner = json.load(fh)
        done = learner["final_version"] >= self.cfg.train.steps or learner.get("stopped_on") == "samples"
        if not done:
            self.log("stopped before train.steps (preempted): resume with checkpoint.resume=auto")
        return done

    # ---- evaluation and summary ----
    def _eval_enabled(self, resume: str | None) -> bool:
        """Before/after evaluation of a fresh run (a resumed one has no 'before')."""
        return self.cfg.eval.num_problems > 0 and resume is None

    def _evaluate(self, label: str, final: str | None = None):
        """Held-out accuracy on the engines' addresses now (a restarted engine moved)."""
        from megatron_darl.eval.heldout import evaluate_with_engines

        self.log(f"evaluating held-out accuracy {label}")
        try:
            scores, line = evaluate_with_engines(self.cfg, self.engine_urls(self.info), label, final_model=final)
        except Stopped as why:
            if final is None:
                raise
            stopping.clear()
            self.log(f"evaluation {label} skipped ({why}); training finished: the policy is in {final} "
                     f"(darl-eval --model {final} scores it)")
            return None
        except Exception as exc:
            if final is None:
                raise  # before training: nothing has been done yet, fail now
            self.log(f"evaluation {label} failed ({exc!r}); training finished: the policy is in {final} "
                     f"(darl-eval --model {final} scores it)")
            return None
        self.log(line)
        return scores

    def _summary(self, info: RunInfo, before, after) -> None:
        summary: dict[str, Any] = {"run_dir": info.run_dir, "tensorboard": os.path.join(info.run_dir, "tb"),
                                   "metrics": os.path.join(info.run_dir, "metrics.jsonl"),
                                   "final_model": info.final_model}
        if before is not None and after is not None:
            from megatron_darl.eval.scoring import paired_difference

            gain, lo, hi = paired_difference(before, after)
            summary.update({"accuracy_before": float(before.scores.mean()),
                            "accuracy_after": float(after.scores.mean()),
                            "gain": gain, "gain_ci95": [lo, hi], "eval_problems": len(before.uids)})
            self.log(f"held-out accuracy {100 * summary['accuracy_before']:.1f}% -> "
                     f"{100 * summary['accuracy_after']:.1f}%: gain {100 * gain:+.1f} points "
                     f"(95% CI {100 * lo:+.1f} to {100 * hi:+.1f}) on {len(before.uids)} problems")
            if before.tool_calls is not None and after.tool_calls is not None:
                self._tool_summary(summary, before, after)
        with open(os.path.join(info.run_dir, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1)
        self.log(f"TensorBoard: tensorboard --logdir {summary['tensorboard']}")
        self.log(f"summary: {os.path.join(info.run_dir, 'summary.json')}")


    def _tool_summary(self, summary: dict[str, Any], before, after) -> None:
        """With rollout.tool: the share of samples that called the tool, before and after, paired."""
        from megatron_darl.eval.scoring import ProblemScores, paired_difference

        def called(s):
            return ProblemScores(s.uids, (s.tool_calls > 0).astype(float))

        change, lo, hi = paired_difference(called(before), called(after))
        summary.update({"tool_call_rate_before": before.tool_call_rate(),
                        "tool_call_rate_after": after.tool_call_rate(),
                        "tool_call_rate_change": change, "tool_call_rate_change_ci95": [lo, hi]})
        self.log(f"samples calling the tool {100 * summary['tool_call_rate_before']:.1f}% -> "
                 f"{100 * summary['tool_call_rate_after']:.1f}% ({100 * change:+.1f} points, 95% CI "
                 f"{100 * lo:+.1f} to {100 * hi:+.1f})")


def stop_engines(info: RunInfo | None) -> None:
    """Tell every engine host of this attempt to stop (they also stop on SIGTERM)."""
    if info is not None and os.path.isdir(info.engines_dir):
        write_marker(stop_path(info.engines_dir), info.attempt)
