"""The run-info record: the one file every process of a run reads to find the others.

What it is: `RunInfo`, a typed record written by the run session (`launch/session.py`) to
`<run_dir>/run_info.json` before any role starts, and read by the learner ranks, the rollout
manager and the engine hosts (on whatever node they run): the ring buffer's name, the notice
and status files, where weights are published and how, where engines announce their addresses,
how learner ranks meet (rendezvous), the checkpoint to resume. `attempt` names one execution of
the run (a requeued Slurm job is a new attempt of the same run folder): a process only acts on
a record, an announcement or a marker of its own attempt, never on what an earlier one left.
What it is not: the run's config (`config.yaml`, which the record points at) or any behaviour.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunInfo:
    run_id: str  # names this attempt's shared memory: /dev/shm/darl-<run_id>-*
    attempt: str  # "<run_id>" locally, "<slurm job id>.<restart count>" on Slurm
    run_dir: str  # absolute; on a file system every node of the run sees
    config: str  # the resolved config (YAML) every role loads
    ring: str  # shared-memory ring buffer on the main learner rank's node
    notice: str  # learner -> manager: weight notice (JSON)
    status: str  # manager -> learner: rollout status (JSON)
    weights_root: str  # published weight versions: <root>/v<N>
    weight_sync: str  # rollout.weight_sync resolved (RolloutConfig.effective_weight_sync): shm | disk | distributed
    final_model: str  # the final policy, a Hugging Face folder
    engines_dir: str  # engine hosts announce engine<i>.json here; restart requests and the stop marker
    num_engines: int  # engines the rollout side runs (0 when engine_urls are given)
    engine_urls: list[str] = field(default_factory=list)  # external engines (rollout.engine_urls), not announced
    learner_world: int = 1  # learner ranks in total
    master_addr: str = "127.0.0.1"  # rendezvous of the learner ranks (global rank 0's node)
    master_port: int = 0  # 0: learner rank 0 binds a port when it starts and writes it to rendezvous_file
    learners_go: str = ""  # a file holding `attempt` once learner ranks may start (after evaluation before RL)
    resume: str | None = None  # checkpoint folder to resume from
    rollout_state: str | None = None  # the manager's saved state that belongs to `resume`
    created: float = field(default_factory=time.time)

    @property
    def rendezvous_file(self) -> str:
        """Where learner rank 0 publishes the port it bound (this attempt's own file)."""
        return os.path.join(self.engines_dir, f"rendezvous.{self.attempt}.json")

    # ---- JSON ----
    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str) -> "RunInfo":
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a run-info record must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown run-info keys {unknown} (written by another version?)")
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"{where}: run-info record lacks {missing}")
        return cls(**data)

    def save(self, path: str | None = None) -> str:
        """Write atomically (readers on other nodes never see half a record); returns the path."""
        path = path or self.path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_json(), fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str) -> "RunInfo":
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_json(data, path)

    @property
    def path(self) -> str:
        return run_info_path(self.run_dir)

    @property
    def log_dir(self) -> str:
        return os.path.join(self.run_dir, "logs")


def run_info_path(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "run_info.json")


def wait_for_run_info(path: str, attempt: str | None, timeout_s: float, alive=None) -> RunInfo:
    """The record at `path` once it belongs to `attempt` (any attempt when None); other nodes
    read it over a shared file system, so absence means "not written yet" until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error = "no file"
    while True:
        if os.path.isfile(path):
            try:
                info = RunInfo.load(path)
                if attempt is None or info.attempt == attempt:
                    return info
                last_error = f"it belongs to attempt {info.attempt!r}, not {attempt!r}"
            except (ValueError, OSError) as exc:
                last_error = str(exc)
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: no run-info record of attempt {attempt!r} within {timeout_s:.0f} s "
                               f"({last_error}); the run folder must be on a file system every node shares")
        time.sleep(0.5)


def read_marker(path: str) -> str | None:
    """The content of a small marker file (an attempt id), or None when absent."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except FileNotFoundError:
        return None


def write_marker(path: str, content: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(content + "\n")
    os.replace(tmp, path)
