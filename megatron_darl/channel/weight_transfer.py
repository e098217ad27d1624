"""The rollout manager's side of `rollout.weight_sync=distributed`: asking the learner to push a
version to some engines, while they are paused, and finishing what the push could not do.

What it is: two small atomic JSON files beside the weight notice. The manager writes a
*transfer request* (`transfer_request.json`: an id, the version it wants, and per engine its
index, URL and process-group name) after pausing the engines; the learner's main rank
(`trainer/weight_sender.py`) broadcasts its newest staged version to them through SGLang's
`/init_weights_update_group` + `/update_weights_from_distributed` and answers with a *transfer
result* (`transfer_result.json`: the same id, the version it sent, the engines that have it,
the ones that failed and why, and an HF folder of that version when any failed).
`apush_distributed` drives one exchange for the manager: engines that failed load the folder
through `/update_weights_from_disk` (logged, counted as `rollout/weight_sync_fallbacks`).
A group name carries the run id, a random token of the manager's start and the engine's
incarnation: an engine marked down (dead, restarted or just late) joins a new group when it
comes back, never the old one, and a restarted manager never asks for a name an engine holds.
What it is not: the broadcast itself, or the pause/resume around it (`manager.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from megatron_darl.channel.json_files import read_json, write_json_atomic

log = logging.getLogger(__name__)


def transfer_paths(notice_path: str) -> tuple[str, str]:
    """(request, result) files of a run: beside its weight notice."""
    folder = os.path.dirname(os.path.abspath(notice_path))
    return os.path.join(folder, "transfer_request.json"), os.path.join(folder, "transfer_result.json")


def group_tag(run_id: str | None = None) -> str:
    """What every group name of one manager start begins with: the run id and a random token, so
    neither another run nor a restarted manager of this run (whose incarnations start again at 0
    while the engines still hold the old groups: "group name has already been created") reuses
    a name."""
    return f"darl-{run_id}-{uuid.uuid4().hex[:8]}" if run_id else f"darl-{uuid.uuid4().hex[:8]}"


def group_name(tag: str, index: int, incarnation: int) -> str:
    """The process group of engine `index` in its `incarnation`-th life (new after every down)
    under the manager start `tag` (`group_tag`)."""
    return f"{tag}-w{index}-{incarnation}"


@dataclass
class TransferResult:
    id: str
    version: int  # the version sent (the learner's newest: it may be newer than asked)
    ok: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)  # engine index -> why
    fallback: str | None = None  # an HF folder of `version`, written when any engine failed

    @classmethod
    def from_json(cls, d: Any, where: str) -> "TransferResult":
        try:
            return cls(id=str(d["id"]), version=int(d["version"]), ok=[int(i) for i in d.get("ok", [])],
                       failed={int(k): str(v) for k, v in (d.get("failed") or {}).items()},
                       fallback=d.get("fallback"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad transfer result {str(d)[:200]}: {exc}") from None


class TransferClient:
    """Manager side of the exchange: one request at a time (the manager's update lock)."""

    def __init__(self, notice_path: str, timeout_s: float, poll_s: float = 0.02):
        self.request_path, self.result_path = transfer_paths(notice_path)
        self.timeout_s, self.poll_s = timeout_s, poll_s

    async def arequest(self, version: int, engines: list[dict[str, Any]]) -> TransferResult:
        rid = uuid.uuid4().hex  # unique across manager restarts: the learner serves any new id
        write_json_atomic(self.request_path, {"id": rid, "version": version, "engines": engines})
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            raw = read_json(self.result_path)
            if isinstance(raw, dict) and raw.get("id") == rid:
                return TransferResult.from_json(raw, self.result_path)
            await asyncio.sleep(self.poll_s)
        raise TimeoutError(f"the learner did not answer the weight transfer request for version {version} "
                           f"({self.request_path}) within {self.timeout_s:.0f}s")


