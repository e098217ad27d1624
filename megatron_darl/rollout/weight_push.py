"""The rollout manager's half of `rollout.weight_sync=distributed`: one version pushed to engines.

What it is: `apush_distributed`, which asks the learner (through `channel/weight_transfer.py`)
to broadcast a version to the paused engines that do not serve it yet, and finishes what the
broadcast could not do: an engine that failed loads the learner's fallback folder from disk, an
engine that gets neither is marked down. An engine whose transfer failed may hold part of the
version (SGLang loads each bucket as it arrives): it is marked `partial` until it loads a whole
version, and the engine pool neither resumes it nor sends it requests until then (`engine_pool.py`).
What it is not: the broadcast itself (the trainer's `weight_sender.py`, and each engine), nor the
pool it works on (it needs only `EngineControl`, which `engine_pool.EnginePool` has).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from megatron_darl.channel.weight_transfer import TransferClient, group_name
from megatron_darl.types import WeightVersion

log = logging.getLogger(__name__)


class EngineControl(Protocol):
    """What a push needs of the engines' owner (`engine_pool.EnginePool`); the slots it is given
    are that owner's `EngineSlot`s (index, engine, version, incarnation, partial)."""

    async def acontrol(self, slot: Any, what: str, make: Callable[[], Any]) -> bool: ...

    def mark_down(self, slot: Any, reason: str) -> None: ...

    def count(self, name: str, n: float = 1) -> None: ...


async def apush_distributed(client: TransferClient, weights: WeightVersion, slots: list, tag: str,
                            pool: EngineControl) -> None:
    """Have the learner push `weights` (or newer) to `slots`; set each slot's version to what it
    now serves. Engines that failed load the learner's fallback folder; an engine that gets
    neither is marked down. `tag` begins the group names (`weight_transfer.group_tag`);
    `pool.acontrol(slot, what, make)` is the pool's bounded control call."""
    todo = [s for s in slots if s.version != weights.version]
    if not todo:
        return
    engines = [{"index": s.index, "url": s.engine.url, "group": group_name(tag, s.index, s.incarnation)} for s in todo]
    try:
        result = await client.arequest(weights.version, engines)
    except (TimeoutError, ValueError, OSError) as exc:
        for s in todo:
            s.partial = True  # the learner may have sent it part of the version
            pool.mark_down(s, f"distributed weight update failed: {exc}")
        return
    for s in todo:
        if s.index in result.ok:
            s.version, s.partial = result.version, False
            continue
        s.partial = True  # SGLang loaded the buckets it got: a mix of versions until a whole one loads
        why = result.failed.get(s.index, "not in the learner's answer")
        if result.fallback is None:
            pool.mark_down(s, f"distributed weight update failed and no fallback folder: {why}")
            continue
        log.warning("engine %d (%s): broadcast of version %d failed (%s); loading %s from disk instead",
                    s.index, s.engine.url, result.version, why, result.fallback)
        pool.count("weight_sync_fallbacks")
        folder = WeightVersion(version=result.version, weight_sync="disk", location=result.fallback)
        if await pool.acontrol(s, "update_weights (disk fallback)",
                               lambda s=s, folder=folder: s.engine.aupdate_weights(folder)):
            s.version, s.partial = result.version, False
