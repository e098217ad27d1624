"""Weight publication: after each step the learner makes version v available to the engines.

What it is: `Publisher`. Every learner rank calls `publish(v)` (the export gathers TP/PP shards
collectively); the main rank then has a Hugging Face folder `<root>/v{v}` (safetensors +
config.json) and announces it in the weight notice that the rollout manager polls; the manager
pauses the engines, has them load it through `/update_weights_from_disk`, and resumes. With
`weight_sync="distributed"` nothing is written: the main rank stages the version's tensors on CPU and
`weight_sender.py` broadcasts them to the paused engines (a folder under `root` only
for an engine whose broadcast failed). `root`
is in /dev/shm for embedded engines on this node (the shared-memory path: no disk write) and on
a shared filesystem for SGLang servers. Old versions are deleted once every engine serves a
newer one (the manager reports that in its status), keeping at most `keep` folders.
Every exported tensor is checked finite before the notice names the folder (or the staged version): a NaN or Inf stops
the run with `NonFiniteWeights` naming the tensors and the version, instead of engines serving
garbage (an engine accepts such a file and then answers with NaN log-probs).
With `probe_tokens` > 0 every rank also scores the weight probe (`channel/weight_probe.py`) under
the new version, one forward of one short sequence, and the notice carries it: the manager checks
each engine's answer for it against these log-probs.
What it is not: the export itself (`learner.export_hf`) or the engines' loading code.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from megatron_darl.channel.weight_notice import WeightNotice, publish_notice, read_notice, read_status
from megatron_darl.channel.weight_probe import WeightProbe, probe_ids
from megatron_darl.types import TrainBatch, WeightVersion


class NonFiniteWeights(RuntimeError):
    """The learner's new weights hold NaN or Inf: the run stops instead of poisoning the engines."""

    def __init__(self, version: int, bad: list[tuple[str, int, int, int]]):
        shown = "; ".join(f"{name}: {nan} NaN, {inf} Inf of {numel} values" for name, nan, inf, numel in bad[:5])
        more = f" (and {len(bad) - 5} more tensors)" if len(bad) > 5 else ""
        super().__init__(
            f"weight version {version} (the policy after {version} train steps) has non-finite values in "
            f"{len(bad)} tensor(s): {shown}{more}. It was not published: no engine loads it. Training diverged "
            f"at or before this step (see train/loss and train/grad_norm in metrics.jsonl); resume from the last "
            f"checkpoint with a lower optim.lr or a tighter optim.grad_clip")
        self.version, self.bad = version, bad


def nonfinite_tensors(folder: str) -> list[tuple[str, int, int, int]]:
    """(name, NaN count, Inf count, size) of every floating-point tensor of the safetensors
    files in `folder` that is not entirely finite, in file and name order."""
    from safetensors import safe_open

    named = []
    for fname in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, fname), framework="pt") as fh:
            named += [(name, fh.get_tensor(name)) for name in sorted(fh.keys())]
    return nonfinite_named(named)


def nonfinite_named(named) -> list[tuple[str, int, int, int]]:
    """(name, NaN count, Inf count, size) of every floating-point tensor of `named` (pairs of
    name and tensor) that is not entirely finite, in order."""
    import torch

    bad = []
    for name, t in named:
        if not t.is_floating_point():
            continue
        t = t.float() if t.element_size() == 1 else t  # fp8: isnan/isinf need a wider type
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            nan = int(torch.isnan(t).sum())
            bad.append((name, nan, int((~finite).sum()) - nan, t.numel()))
    return bad


# what `Publisher.rollout_report` names of the manager's status, in this order
_REPORTED = (("engines up", "rollout/engines_up"), ("groups in flight", "rollout/inflight_groups"),
             ("groups written", "rollout/groups_written"), ("filtered (equal rewards)", "rollout/filtered_groups"),
             ("dropped", "rollout/groups_dropped"), ("engine failures", "rollout/engine_failures"),
             ("admission capacity", "rollout/gate_capacity"), ("prompts drawn", "rollout/prompts_drawn"))


class Publisher:
    def __init__(self, learner: Any, root: str, notice_path: str, status_path: str, weight_sync: str, keep: int = 3,
                 sender: Any = None, probe_tokens: int = 0):
        self.learner, self.root, self.weight_sync, self.keep = learner, root, weight_sync, keep
        self.probe_tokens = probe_tokens  # 0: no weight probe in the notice (rollout.probe_tokens)
        self.last_probe_s = 0.0
        self.sender = sender  # weight_sync "distributed", main rank: trainer/weight_sender.WeightSender
        self.notice_path, self.status_path = notice_path, status_path
        self.last_publish_s = 0.0
        if learner.is_main:
            os.makedirs(root, exist_ok=True)

    def folder(self, version: int) -> str:
        return os.path.join(self.root, f"v{version}")

    def publish(self, version: int, consumed: int | None = None, new_groups: int | None = None) -> None:
        """Export version `version` and announce it; `NonFiniteWeights` (nothing announced, the
        folder removed) when any exported tensor holds NaN or Inf. `consumed`, `new_groups` (main
        rank): what the learner used up and what its next step takes, for the staleness gate."""
        t0 = time.perf_counter()
        if self.weight_sync == "distributed":
            self._publish_distributed(version, consumed, new_groups)
            self.last_publish_s = time.perf_counter() - t0
            return
        out = self.folder(version)
        self.learner.export_hf(out)  # collective: every rank takes part, the main rank writes
        probe = self.score_probe(version)  # collective too
        if self.learner.is_main:
            bad = nonfinite_tensors(out)
            if bad:  # checked on the files engines would load, before any engine is told of them
                shutil.rmtree(out, ignore_errors=True)
                raise NonFiniteWeights(version, bad)
            size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
            self.notify(WeightVersion(version=version, weight_sync=self.weight_sync, location=out, num_bytes=size),
                        consumed=consumed, new_groups=new_groups, probe=probe)
            self._collect_garbage(version)
        self.last_publish_s = time.perf_counter() - t0

    def _publish_distributed(self, version: int, consumed: int | None, new_groups: int | None) -> None:
        """Gather the version (collective), copy it to CPU on the main rank, check it finite
        there (nothing non-finite is ever sent), stage it for the sender and announce it. No
        file is written; the manager pauses the engines and asks the sender for it."""
        staged, bad = [], []
        for bucket in self.learner.iter_hf_buckets():
            if self.learner.is_main:  # checked where it is (on the GPU: fast), then a CPU copy
                bad += nonfinite_named(bucket)
                staged.append([(n, t.detach().to("cpu", copy=True)) for n, t in bucket])
        probe = self.score_probe(version)  # collective: every rank
        if not self.learner.is_main:
            return
        if bad:
            raise NonFiniteWeights(version, bad)
        self.sender.stage(version, staged)
        size = sum(t.numel() * t.element_size() for bucket in staged for _, t in bucket)
        where = f"{self.sender.master_address}#v{version}"
        self.notify(WeightVersion(version=version, weight_sync="distributed", location=where, num_bytes=size),
                    consumed=consumed, new_groups=new_groups, probe=probe)
        self._collect_garbage(version)  # fallback folders, when any engine needed one

    def score_probe(self, version: int) -> WeightProbe | None:
        """The learner's log-probs of the weight probe under its current weights (`version`),
        untempered as the engines answer them; None with `probe_tokens` 0. Every rank calls it
        (the forward is collective). One sequence of a few hundred tokens: its time is
        `last_probe_s`."""
        if self.probe_tokens <= 0:
            return None
        import numpy as np

        t0 = time.perf_counter()
        context = (getattr(self.learner, "hf_config", None) or {}).get("max_position_embeddings")
        # the engine also generates one token: probe + 1 must fit the context (else a 400)
        n = min(self.probe_tokens, int(context) - 1) if context else self.probe_tokens
        ids = probe_ids(n, int(self.learner.vocab_size))
        n = len(ids)
        batch = TrainBatch(tokens=np.asarray([ids], dtype=np.int64), lengths=np.asarray([n], dtype=np.int64),
                           loss_mask=np.zeros((1, n), np.float32), advantages=np.zeros(1, np.float32),
                           behav_logprobs=np.zeros((1, n), np.float32), token_versions=np.full((1, n), -1, np.int64),
                           versions=np.asarray([version], np.int64), group_index=np.zeros(1, np.int64),
                           rewards=np.zeros(1, np.float32), prompt_ids=np.zeros(1, np.int64))
        temperature = getattr(self.learner, "temperature", None)
        try:  # engines answer prompt log-probs untempered (SGLang 0.5.23): so does the probe
            if temperature is not None:
                self.learner.temperature = 1.0
            lp = self.learner.compute_logprobs(batch)
        finally:
            if temperature is not None:
                self.learner.temperature = temperature
        self.last_probe_s = time.perf_counter() - t0
        return WeightProbe(version=version, ids=ids, logprobs=[float(x) for x in lp[0, 1:n]])

    def eval_folder(self, version: int) -> str:
        """An HF folder of `version` for the in-loop evaluation (main rank): the published one,
        or with `distributed` (no folder) one written once from the staged tensors."""
        staged = self.sender.staged_folder(version) if self.sender is not None else None
        return staged or self.folder(version)

    def drain(self) -> None:
        """Main rank, at the end of a run: the last version reaches the engines before the
        sender stops (distributed only; a folder needs nobody)."""
        if self.sender is not None and not self.sender.drain():
            print(f"darl-train: the rollout side did not ask for the last weight version within "
                  f"{self.sender.timeout_s:.0f}s; stopping anyway", flush=True)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    def notify(self, weights: WeightVersion | None = None, **changes: Any) -> None:
        """Rewrite the notice with new weights and/or other fields (stop, state_request)."""
        old = read_notice(self.notice_path) or WeightNotice()
        fields = {"weights": weights or old.weights, "stop": old.stop, "state_request": old.state_request,
                  "consumed": old.consumed, "new_groups": old.new_groups, "probe": old.probe}
        if weights is not None and "probe" not in changes:
            fields["probe"] = None  # a probe belongs to its version: never carried to another
        fields.update(changes)
        publish_notice(self.notice_path, WeightNotice(**fields))

    def rollout_metrics(self) -> dict[str, float]:
        """The rollout manager's latest counters and rates (`rollout/...`, `perf/...`) from its
        status file, for the learner's TensorBoard; empty before its first status."""
        status = read_status(self.status_path)
        return dict(status.metrics) if status is not None else {}

    def rollout_report(self) -> str:
        """The rollout manager's last status in one line: what a learner that waited too long
        for data says about the side that should have produced it."""
        status = read_status(self.status_path)
        if status is None:
            return "the rollout manager never reported (no status file: its engines may not have started)"
        try:
            age = f"{time.time() - os.path.getmtime(self.status_path):.0f} s ago"
        except OSError:
            age = "time unknown"
        m = status.metrics
        parts = [f"{label} {m[key]:g}" for label, key in _REPORTED if key in m]
        error = f", error: {status.error}" if status.error else ""
        return f"the rollout manager's last report ({age}): version {status.version}, {', '.join(parts)}{error}"

    def _collect_garbage(self, newest: int) -> None:
        status = read_status(self.status_path)
        served = status.version if status is not None else 0
        versions = sorted(int(d[1:]) for d in os.listdir(self.root) if d.startswith("v") and d[1:].isdigit())
        for v in list(versions):
            if v < served and v < newest and len(versions) > self.keep:  # never the one engines load now
                shutil.rmtree(self.folder(v), ignore_errors=True)
                versions.remove(v)
