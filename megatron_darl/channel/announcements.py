"""How engines say where they are: one announcement file per engine, and the files that ask for a
restart or a stop.

What it is: `EngineAnnouncement` (attempt, index, URL, pid, node, generation, log, probe) written by
an engine host to `<engines_dir>/engine<i>.json` once its engine answers, read by the run session
and the rollout manager (on whatever node they run); `request_restart` / `read_restart_request`
(manager -> host) and `stop_path` (session -> hosts). A reader acts only on files of its own
attempt (a requeued Slurm job is a new attempt of the same run folder).
What it is not: how an engine is started (`engine/command.py`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from megatron_darl.channel.json_files import read_json, write_json_atomic


@dataclass
class EngineAnnouncement:
    attempt: str  # the run attempt this engine serves
    index: int
    url: str
    pid: int
    node: str  # host name of the node it runs on
    generation: int  # 0 at the first start, +1 per restart
    log: str  # its log file
    probe: str = ""  # the token the host read from the run's probe file (the weights folder is readable)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "EngineAnnouncement":
        try:
            return cls(attempt=str(d["attempt"]), index=int(d["index"]), url=str(d["url"]), pid=int(d["pid"]),
                       node=str(d["node"]), generation=int(d["generation"]), log=str(d["log"]),
                       probe=str(d.get("probe", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad engine announcement {d!r}: {exc}") from None


def announcement_path(engines_dir: str, index: int) -> str:
    return os.path.join(engines_dir, f"engine{index}.json")


def restart_path(engines_dir: str, index: int) -> str:
    return os.path.join(engines_dir, f"engine{index}.restart")


def stop_path(engines_dir: str) -> str:
    return os.path.join(engines_dir, "stop")


def announce(engines_dir: str, ann: EngineAnnouncement) -> None:
    write_json_atomic(announcement_path(engines_dir, ann.index), asdict(ann))


def read_announcement(engines_dir: str, index: int, attempt: str) -> EngineAnnouncement | None:
    """Engine `index`'s announcement of `attempt`, or None (absent, or left by another attempt)."""
    path = announcement_path(engines_dir, index)
    d = read_json(path)
    if d is None:
        return None
    ann = EngineAnnouncement.from_json(d, path)
    return ann if ann.attempt == attempt else None


def read_announcements(engines_dir: str, attempt: str, count: int) -> dict[int, EngineAnnouncement]:
    out = {}
    for i in range(count):
        ann = read_announcement(engines_dir, i, attempt)
        if ann is not None:
            out[i] = ann
    return out


def request_restart(engines_dir: str, index: int, attempt: str, generation: int) -> None:
    """Ask engine `index`'s host to replace generation `generation` (a no-op if it already did)."""
    write_json_atomic(restart_path(engines_dir, index), {"attempt": attempt, "generation": generation})


def read_restart_request(engines_dir: str, index: int, attempt: str) -> int | None:
    """The generation a restart was requested for, or None."""
    path = restart_path(engines_dir, index)
    try:
        d = read_json(path)
    except ValueError:
        return None
    if not isinstance(d, dict) or d.get("attempt") != attempt:
        return None
    try:
        return int(d["generation"])
    except (KeyError, TypeError, ValueError):
        return None
