"""Learner <-> rollout-manager signalling through two small atomic JSON files on the node.

What it is: the *notice* (learner -> manager): the latest published `WeightVersion`, a stop flag
and an optional request to save the manager's state to a path; and the *status* (manager ->
learner): the version every live engine serves, the groups written so far and the path of the
last state saved on request. Each file is written whole to a temporary file in the same folder
and renamed over the old one (`os.replace` is atomic on POSIX), so a reader sees either the old
or the new content, never a torn write. Readers poll; both sides tolerate a missing file.
What it is not: the weights themselves (they travel by disk, shared memory or NCCL as the
`WeightVersion` says) nor the trajectories (they go through the shared-memory ring buffer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_darl.channel.json_files import read_json, write_json_atomic
from megatron_darl.channel.weight_probe import WeightProbe
from megatron_darl.types import WeightVersion


def weight_version_from_json(d: dict[str, Any], where: str) -> WeightVersion:
    """A `WeightVersion` from its JSON object. Notices and rollout states written before the
    field was renamed call `weight_sync` `kind`: read too, so a run resumes across the change."""
    try:
        sync = d["kind"] if "kind" in d and "weight_sync" not in d else d["weight_sync"]
        return WeightVersion(
            version=int(d["version"]), weight_sync=str(sync), location=str(d["location"]),
            num_bytes=int(d.get("num_bytes", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: bad weight version {d!r} (needs version, weight_sync, location): {exc}") from None


@dataclass(frozen=True)
class WeightNotice:
    """What the learner tells the manager. `state_request`: a path where the manager should
    write its `state_dict()` (for a checkpoint); a new path means a new request. For the
    staleness gate (None: not reported): `consumed`, the groups the learner has used up with
    these weights (trained once, or aged out untrained; `ReplayStore.consumed`), and
    `new_groups`, the never-trained groups its next step takes (the gate's batch). `probe`: the
    learner's log-probs of the weight probe under `weights` (None: not checked; notices written
    before the field have none)."""

    weights: WeightVersion | None = None
    stop: bool = False
    state_request: str | None = None
    consumed: int | None = None
    new_groups: int | None = None
    probe: WeightProbe | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "weights": asdict(self.weights) if self.weights is not None else None,
            "stop": self.stop,
            "state_request": self.state_request,
            "consumed": self.consumed,
            "new_groups": self.new_groups,
            "probe": self.probe.to_json() if self.probe is not None else None,
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> "WeightNotice":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: a weight notice must be a JSON object, got {type(d).__name__}")
        w = d.get("weights")
        return cls(
            weights=weight_version_from_json(w, where) if w is not None else None,
            stop=bool(d.get("stop", False)),
            state_request=d.get("state_request"),
            consumed=None if d.get("consumed") is None else int(d["consumed"]),
            new_groups=None if d.get("new_groups") is None else int(d["new_groups"]),
            probe=None if d.get("probe") is None else WeightProbe.from_json(d["probe"], where),
        )


def publish_notice(path: str, notice: WeightNotice) -> None:
    """Learner side: replace the notice at `path` (atomic)."""
    write_json_atomic(path, notice.to_json())


def read_notice(path: str) -> WeightNotice | None:
    d = read_json(path)
    return None if d is None else WeightNotice.from_json(d, path)


class NoticePoller:
    """Manager side: `poll()` returns the notice when its content changed since the last poll."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._last: WeightNotice | None = None

    def poll(self) -> WeightNotice | None:
        notice = read_notice(self.path)
        if notice is None or notice == self._last:
            return None
        self._last = notice
        return notice


@dataclass(frozen=True)
class RolloutStatus:
    """What the manager tells the learner. `version`: the weight version every live engine has
    loaded (the learner may delete older published weights once it moved past them). `error`:
    set when the manager stopped on a failure (e.g. it could not write its state): the learner
    must fail with it rather than wait for an answer that will not come."""

    version: int
    groups_written: int = 0
    groups_filtered: int = 0
    state_path: str | None = None  # the last state_request the manager answered
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the manager stopped (None while it runs)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "RolloutStatus":
        if not isinstance(d, dict) or "version" not in d:
            raise ValueError(f"{where}: a rollout status must be a JSON object with 'version'")
        return cls(
            version=int(d["version"]),
            groups_written=int(d.get("groups_written", 0)),
            groups_filtered=int(d.get("groups_filtered", 0)),
            state_path=d.get("state_path"),
            metrics={str(k): float(v) for k, v in (d.get("metrics") or {}).items()},
            error=None if d.get("error") is None else str(d["error"]),
        )


def write_status(path: str, status: RolloutStatus) -> None:
    write_json_atomic(path, status.to_json())


def read_status(path: str) -> RolloutStatus | None:
    d = read_json(path)
    return None if d is None else RolloutStatus.from_json(d, path)
