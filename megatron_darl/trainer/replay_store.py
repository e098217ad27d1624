"""Replay store: complete groups of the K newest behavior versions, with reuse counts.

What it is: the learner-side pool that D-ARL samples from. Trajectories arrive one by one
(`add`, typically from `ShmRing.get_trajectory`); a group enters the pool once its G responses
are in. Each training step is two phases, because a group's score needs proximal log-probs
that only the learner can compute:

    cands = store.candidates(t, ...)         # evicts by age, applies warmup; offers a subset
    scores = learner_scores(cands.groups)    # recompute log pi_prox, score s_g per group
    idx = select_fn(scores, cands.versions, batch_groups)
    batch = store.commit(t, cands.group_ids[idx])   # reuse += 1, drop groups at max_reuse

`sample(t, batch_groups, select_fn, score_fn)` runs both phases for callers whose scores need
no learner pass (baselines). Rules (ALGORITHM.md): a group of behavior version v leaves when
t - v > K (replay on) or after `effective_max_reuse` trainings; with variance-guided selection
(`sg`), for the first `warmup` steps only never-trained groups are offered, no reused ones
(never without it: baselines take the oldest groups from the first step). With replay off
(`algo.replay=false`) every group is trained exactly once and never aged out, as the baselines do:
the staleness gate bounds their age instead. Which groups of the window a step is offered
(the oldest never-trained ones it takes, older reused ones) is the feed's decision
(`feed.py`). Counters: `consumed` (groups trained for the first time, aged out
untrained or dropped incomplete: what the staleness gate credits), `replay/trained_frac` and
`replay/filtered_groups` (the candidates selection's gate left out, as `commit` is told).
`state_dict` / `load_state_dict` round-trip the pool exactly (JSON-able metadata plus numpy
arrays, no pickle).
What it is not: the selection rule (`algo.select_groups`), the scoring maths, or transport.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.types import DEFAULTED_FIELDS, TRAJECTORY_FIELDS, Trajectory

STATE_FORMAT = 1


@dataclass
class ReplayGroup:
    """One prompt's G responses as the store keeps them.

    `version` is the oldest behavior version among the group's tokens (staleness is measured
    from the oldest policy that contributed); `reuse` counts the steps that trained on it.
    """

    group_id: int
    version: int
    trajectories: list[Trajectory]
    reuse: int = 0
    added_step: int = 0  # learner step at which the group became complete

    @property
    def num_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.trajectories)


@dataclass
class Candidates:
    """The groups a step may train on, in pool order (oldest version first, then group id).

    The learner recomputes proximal log-probs for them, scores each group, calls its
    selection function with (`scores`, `versions`, batch_groups) and passes the chosen indices
    (positions in this list) to `ReplayStore.commit`.
    """

    step: int
    groups: list[ReplayGroup]

    @property
    def versions(self) -> np.ndarray:
        return np.array([g.version for g in self.groups], dtype=np.int64)

    @property
    def reuse(self) -> np.ndarray:
        return np.array([g.reuse for g in self.groups], dtype=np.int64)

    @property
    def group_ids(self) -> np.ndarray:
        return np.array([g.group_id for g in self.groups], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.groups)


def _group_version(trajs: list[Trajectory], step: int) -> int:
    """The oldest version among the group's tokens; a group of empty responses counts as fresh."""
    versions = [t.version for t in trajs if t.version >= 0]
    return min(versions) if versions else step


class ReplayStore:
    """Pool of complete groups over the K newest behavior versions (see the module docstring)."""

    def __init__(self, cfg: AlgoConfig, group_size: int):
        errs = cfg.check()
        if errs:
            raise ValueError("ReplayStore: invalid config: " + "; ".join(f"algo.{k}: {m}" for k, m in errs))
        if group_size < 1:
            raise ValueError(f"ReplayStore: group_size={group_size} must be >= 1")
        self.cfg = cfg
        self.group_size = group_size
        self._pool: dict[int, ReplayGroup] = {}  # insertion order = arrival order
        self._pending: dict[int, list[Trajectory]] = {}  # groups still missing responses
        self._step = 0  # latest step seen (candidates/commit/add)
        # cumulative: added, trained (first time), evicted_age (of which evicted_untrained),
        # evicted_reuse, dropped_incomplete, filtered (candidates selection's gate left out, per step)
        self._counters = Counter()
        self._last_candidates = (0, 0)  # (groups offered, of them never trained) at the latest step

    # ---------------------------------------------------------------- intake
    def add(self, traj: Trajectory, step: int | None = None) -> ReplayGroup | None:
        """Add one response; returns the group if this response completed it."""
        step = self._step if step is None else step
        if traj.group_id in self._pool:
            raise ValueError(f"ReplayStore.add: group {traj.group_id} is already complete (G={self.group_size})")
        members = self._pending.setdefault(traj.group_id, [])
        members.append(traj)
        if len(members) < self.group_size:
            return None
        del self._pending[traj.group_id]
        group = ReplayGroup(traj.group_id, _group_version(members, step), members, reuse=0, added_step=step)
        self._pool[group.group_id] = group
        self._counters["added"] += 1
        return group

    def add_many(self, trajs: Iterable[Trajectory], step: int | None = None) -> int:
        """Add responses; returns how many groups they completed."""
        return sum(self.add(t, step) is not None for t in trajs)

    # ---------------------------------------------------------------- sampling
    def candidates(self, step: int, new_limit: int | None = None, reused_before: int | None = None,
                   reused_limit: int | None = None) -> Candidates:
        """Evict what aged out at `step`, then the groups this step may train on, in pool order
        (oldest version first, then group id). Without arguments: the whole window. With
        `new_limit`, only the `new_limit` OLDEST never-trained groups: groups generated for a
        later step are not offered yet (scored against a policy that barely moved they would
        beat older never-trained groups, which would then age out untrained; and the learner
        would recompute log-probs for groups it does not train). With `reused_before`, only
        reused groups of versions below it: older than the new data, so a reused group never
        crowds out a never-trained one (selection ranks it after newer groups of similar drift).
        With `reused_limit`, at most that many reused groups, the freshest (most likely to pass
        selection's threshold) first: the learner recomputes log-probs for every candidate."""
        self._step = max(self._step, step)
        self._evict_age(step)
        groups = self._eligible(step)
        fresh = [g for g in groups if g.reuse == 0]
        reused = [g for g in groups if g.reuse > 0 and (reused_before is None or g.version < reused_before)]
        reused.sort(key=lambda g: (-g.version, g.reuse, g.group_id))
        keep = {id(g) for g in (fresh if new_limit is None else fresh[:new_limit])}
        keep |= {id(g) for g in (reused if reused_limit is None else reused[:reused_limit])}
        groups = [g for g in groups if id(g) in keep]
        self._last_candidates = (len(groups), sum(g.reuse == 0 for g in groups))
        return Candidates(step, groups)

    def commit(self, step: int, group_ids: Iterable[int], filtered: int = 0) -> list[ReplayGroup]:
        """Mark the chosen groups trained at `step` (in the given order); returns them. `filtered`:
        the candidates selection's gate kept out of this step's batch (`replay/filtered_groups`)."""
        ids = [int(g) for g in np.asarray(list(group_ids), dtype=np.int64).reshape(-1)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"ReplayStore.commit(step={step}): repeated group ids in {ids}")
        missing = [g for g in ids if g not in self._pool]
        if missing:
            raise KeyError(f"ReplayStore.commit(step={step}): groups {missing} are not in the pool")
        if filtered < 0:
            raise ValueError(f"ReplayStore.commit(step={step}): filtered={filtered} must be >= 0")
        self._step = max(self._step, step)
        self._counters["filtered"] += int(filtered)
        batch = [self._pool[g] for g in ids]
        limit = self.cfg.effective_max_reuse
        for g in batch:
            self._counters["trained"] += g.reuse == 0
            g.reuse += 1
            if g.reuse >= limit:
                del self._pool[g.group_id]
                self._counters["evicted_reuse"] += 1
        return batch

    def ready(self, step: int, batch_groups: int, min_new: int = 0) -> bool:
        """Whether `step` can fill `batch_groups` and has at least `min_new` never-trained groups."""
        groups = self._eligible(step)
        return len(groups) >= batch_groups and sum(g.reuse == 0 for g in groups) >= min_new

    def reused_eligible(self, step: int, before: int | None = None) -> int:
        """Groups trained before that `step` may train again (in the window, under max_reuse),
        of versions below `before` when given."""
        return sum(g.reuse > 0 and (before is None or g.version < before) for g in self._eligible(step))

    def _aged_out(self, g: ReplayGroup, step: int) -> bool:
        return self.cfg.replay and step - g.version > self.cfg.k

    def _evict_age(self, step: int) -> None:
        for gid in [gid for gid, g in self._pool.items() if self._aged_out(g, step)]:
            self._counters["evicted_untrained"] += self._pool.pop(gid).reuse == 0
            self._counters["evicted_age"] += 1
        # an incomplete group this old would be evicted as soon as it completed; it may also have
        # lost a response (a producer died mid-write) and never complete. With replay off nothing
        # ages out: a slow group may still complete (the leak is one group per producer death)
        if not self.cfg.replay:
            return
        stale = [gid for gid, m in self._pending.items() if step - _group_version(m, step) > self.cfg.k]
        for gid in stale:
            del self._pending[gid]
            self._counters["dropped_incomplete"] += 1

    def _eligible(self, step: int) -> list[ReplayGroup]:
        groups = [g for g in self._pool.values() if not self._aged_out(g, step)]
        # (version, group id), not arrival order: arrival depends on engine timing, and the same
        # data must give the same batch on a rerun
        groups.sort(key=lambda g: (g.version, g.group_id))
        if step < self.cfg.effective_warmup:
            # warmup: only never-trained groups, the freshest data the staleness gate lets exist.
            # Not "the newest version only": the gate generates what the learner reported it
            # would take, so waiting for a batch of the newest version alone could wait forever
            # (while the older never-trained groups aged out untrained)
            groups = [g for g in groups if g.reuse == 0]
        return groups

    # ---------------------------------------------------------------- introspection
    def __len__(self) -> int:
        return len(self._pool)

    @property
    def groups(self) -> list[ReplayGroup]:
        return list(self._pool.values())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def last_reused_offered(self) -> int:
        """Reused groups among the latest step's candidates."""
        return self._last_candidates[0] - self._last_candidates[1]

    @property
    def consumed(self) -> int:
        """Complete groups that left the never-trained state: trained once, aged out untrained,
        or dropped incomplete. What the staleness gate credits generation with (the learner
        reports it in the weight notice), so generation replaces exactly what was used up."""
        c = self._counters
        return int(c["trained"] + c["evicted_untrained"] + c["dropped_incomplete"])

    def metrics(self) -> dict[str, float | np.ndarray]:
        """Scalars and histograms (numpy arrays) under `replay/`: the pool (its staleness
        histogram has one bin per age d = t - v, the last for d > K) and cumulative counters.
        What a step selected is the selection's to report (`algo/select/filtered_frac/v{k}`,
        by behavior version k, and the batch's `algo/staleness/batch/*`)."""
        t, k = self._step, self.cfg.k
        ages = [min(max(t - g.version, 0), k + 1) for g in self._pool.values()]  # bin k+1: older than K
        reuse_bins = max(self.cfg.effective_max_reuse, 1)
        out: dict[str, float | np.ndarray] = {
            "replay/pool_groups": float(len(self._pool)),
            "replay/pool_trajectories": float(sum(len(g.trajectories) for g in self._pool.values())),
            "replay/pending_groups": float(len(self._pending)),
            "replay/staleness_hist": np.bincount(np.array(ages, dtype=np.int64), minlength=k + 2),
            "replay/reuse_hist": np.bincount(
                np.array([g.reuse for g in self._pool.values()], dtype=np.int64), minlength=reuse_bins
            ),
        }
        for name in ("added", "trained", "evicted_age", "evicted_untrained", "evicted_reuse", "dropped_incomplete"):
            out[f"replay/{name}"] = float(self._counters[name])
        out["replay/filtered_groups"] = float(self._counters["filtered"])  # counted at each step that gates it out
        out["replay/consumed"] = float(self.consumed)
        # of the groups whose fate is decided, the share trained at least once (1 before any)
        out["replay/trained_frac"] = self._counters["trained"] / self.consumed if self.consumed else 1.0
        out["replay/candidates"], out["replay/candidates_new"] = (float(n) for n in self._last_candidates)
        return out

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """{"meta": JSON-able dict, "arrays": {name: 1-D numpy array}}; exact round trip."""
        trajs = [t for g in self._pool.values() for t in g.trajectories]
        trajs += [t for m in self._pending.values() for t in m]
        meta = {
            "format": STATE_FORMAT,
            "group_size": self.group_size,
            "step": self._step,
            "counters": dict(self._counters),
            "groups": [
                [g.group_id, g.version, g.reuse, g.added_step, len(g.trajectories)] for g in self._pool.values()
            ],
            "pending": [[gid, len(m)] for gid, m in self._pending.items()],
        }
        arrays: dict[str, np.ndarray] = {}
        flat = [t.to_arrays() for t in trajs]
        for name, dtype in TRAJECTORY_FIELDS:
            parts = [f[name] for f in flat]
            arrays[f"traj/{name}"] = np.concatenate(parts) if parts else np.zeros(0, dtype)
            arrays[f"traj/{name}/len"] = np.array([len(p) for p in parts], dtype=np.int64)
        arrays["traj/reward64"] = np.array([t.reward for t in trajs], dtype=np.float64)  # float32 field is lossy
        return {"meta": meta, "arrays": arrays}

    def load_state_dict(self, state: dict) -> None:
        """Restore the pool saved by `state_dict` (replaces everything in this store)."""
        meta, arrays = state["meta"], state["arrays"]
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"ReplayStore.load_state_dict: format {meta.get('format')}, expected {STATE_FORMAT}")
        if meta["group_size"] != self.group_size:
            raise ValueError(
                f"ReplayStore.load_state_dict: saved group_size {meta['group_size']} != this store's {self.group_size}"
            )
        trajs = iter(_unflatten(arrays))
        self._pool = {}
        for gid, version, reuse, added_step, n in meta["groups"]:
            members = [next(trajs) for _ in range(n)]
            self._pool[int(gid)] = ReplayGroup(int(gid), int(version), members, int(reuse), int(added_step))
        self._pending = {int(gid): [next(trajs) for _ in range(n)] for gid, n in meta["pending"]}
        self._step = int(meta["step"])
        self._counters = Counter({k: int(v) for k, v in meta["counters"].items()})

    def save(self, path: str) -> None:
        """Write `state_dict()` to one .npz file (meta as UTF-8 JSON bytes)."""
        state = self.state_dict()
        meta = np.frombuffer(json.dumps(state["meta"]).encode("utf-8"), dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez(f, __meta__=meta, **state["arrays"])

    def load(self, path: str) -> None:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(bytes(z["__meta__"]).decode("utf-8"))
        self.load_state_dict({"meta": meta, "arrays": arrays})


def _unflatten(arrays: dict[str, np.ndarray]) -> list[Trajectory]:
    # a checkpoint of an earlier release lacks the fields added since (Trajectory defaults them)
    present = [(name, dtype) for name, dtype in TRAJECTORY_FIELDS
               if name not in DEFAULTED_FIELDS or f"traj/{name}/len" in arrays]
    lens = {name: arrays[f"traj/{name}/len"] for name, _ in present}
    n = len(arrays["traj/reward64"])
    if any(len(v) != n for v in lens.values()):
        raise ValueError("ReplayStore.load_state_dict: trajectory field counts disagree")
    ends = {name: np.cumsum(v) for name, v in lens.items()}
    out = []
    for i in range(n):
        fields = {}
        for name, dtype in present:
            end = int(ends[name][i])
            fields[name] = np.asarray(arrays[f"traj/{name}"][end - int(lens[name][i]) : end], dtype=dtype).copy()
        traj = Trajectory.from_arrays(fields)
        traj.reward = float(arrays["traj/reward64"][i])
        out.append(traj)
    return out
