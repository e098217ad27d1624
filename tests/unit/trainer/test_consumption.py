"""What a step consumes: the store's counters, the feed's plan of new groups, the gate's credit,
and, together, that generation is not spent on groups that age out untrained."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from experiment.api import REPLAY_DEPTH, darl_window
from megatron_darl import algo
from megatron_darl.algo.config import AlgoConfig
from megatron_darl.rollout.staleness import StalenessGate
from megatron_darl.trainer.batching import choose_groups
from megatron_darl.trainer.feed import ReplayFeed
from megatron_darl.trainer.loop import batch_composition
from megatron_darl.trainer.replay_store import ReplayStore
from megatron_darl.types import Trajectory

G = 2


def _traj(gid: int, member: int, version: int) -> Trajectory:
    return Trajectory(prompt_ids=[1, 2], response_ids=np.arange(3) + member, behav_logprobs=-np.ones(3),
                      behav_versions=np.full(3, version), reward=float(member), prompt_id=gid, group_id=gid)


class FakeRing:
    """The feed's view of the ring: records in arrival order."""

    def __init__(self):
        self.records = collections.deque()

    def put_group(self, gid: int, version: int) -> None:
        self.records.extend(_traj(gid, m, version) for m in range(G))

    def get_trajectory(self, timeout: float = 0.0):
        return self.records.popleft() if self.records else None


def _store(**kw) -> ReplayStore:
    kw.setdefault("warmup", 0)
    return ReplayStore(AlgoConfig(**kw), group_size=G)


def _add(store: ReplayStore, gid: int, version: int) -> None:
    for m in range(G):
        store.add(_traj(gid, m, version))


def test_candidates_offer_the_oldest_new_groups_and_older_reused_ones():
    store = _store(k=3)
    for gid, v in enumerate([1, 1, 2, 2]):
        _add(store, gid, v)
    store.commit(2, [1, 3])  # groups 1 (version 1) and 3 (version 2) are reused from now on
    for gid, v in [(10, 3), (11, 2), (12, 3)]:
        _add(store, gid, v)
    cands = store.candidates(3, new_limit=2)
    assert cands.group_ids.tolist() == [0, 1, 2, 3]  # reused 1, 3 + oldest new 0, 2; not 11, 10, 12
    assert cands.versions.tolist() == [1, 1, 2, 2] and cands.reuse.tolist() == [0, 1, 0, 1]
    assert store.candidates(3).group_ids.tolist() == [0, 1, 2, 3, 11, 10, 12]  # no limit: the whole window
    m = store.metrics()
    assert (m["replay/candidates"], m["replay/candidates_new"]) == (7.0, 5.0)
    assert store.candidates(3, reused_before=2).group_ids.tolist() == [0, 1, 2, 11, 10, 12]  # not 3: version 2
    assert store.candidates(3, reused_limit=1).group_ids.tolist() == [0, 2, 3, 11, 10, 12]  # the freshest reused
    assert store.last_reused_offered == 1
    assert store.reused_eligible(3) == 2 and store.reused_eligible(3, before=2) == 1
    assert store.reused_eligible(6) == 0  # versions 1 and 2 aged out at step 6 (K = 3)


def test_counters_consumed_and_trained_fraction():
    store = _store(k=1, max_reuse=2)
    for gid in range(4):
        _add(store, gid, 0)
    assert store.metrics()["replay/trained_frac"] == 1.0 and store.consumed == 0
    store.commit(0, [0, 1])
    store.commit(1, [0])  # a second training is not a new consumption
    assert store.consumed == 2 and store.metrics()["replay/trained"] == 2.0
    store.candidates(2)  # version 0 ages out: groups 2, 3 never trained, group 1 trained once
    m = store.metrics()
    assert (m["replay/evicted_age"], m["replay/evicted_untrained"], m["replay/evicted_reuse"]) == (3.0, 2.0, 1.0)
    assert store.consumed == 4 and m["replay/consumed"] == 4.0 and m["replay/trained_frac"] == 0.5
    restored = _store(k=1, max_reuse=2)
    restored.load_state_dict(store.state_dict())
    assert restored.consumed == 4 and restored.metrics()["replay/trained_frac"] == 0.5


def test_feed_plans_the_next_steps_new_groups_from_what_selection_admits():
    ring, store = FakeRing(), _store(k=2)
    feed = ReplayFeed(ring, store, batch_groups=4, max_head_offpolicyness=0)
    assert feed.step_new_groups(0) == 4  # nothing to reuse: a full batch of new groups
    for gid in range(6):
        ring.put_group(gid, 0)
    cands = feed.wait_candidates(0, alive=lambda: None, timeout_s=5)
    assert cands.group_ids.tolist() == [0, 1, 2, 3]  # the oldest 4 new groups; 4, 5 wait
    # no reused group was offered: assume the next step's all pass; new: 4 - 4, at least 4 / K = 2
    assert feed.commit(0, cands.group_ids, reused_admitted=0) == 2
    ring.put_group(6, 1)
    ring.put_group(7, 1)
    cands = feed.wait_candidates(1, alive=lambda: None, timeout_s=5)
    # 2 new (the oldest: 4, 5) and room for 2 reused plus a quarter batch: 3 of the 4 reused
    assert cands.group_ids.tolist() == [0, 1, 2, 4, 5] and cands.reuse.tolist() == [1, 1, 1, 0, 0]
    assert feed.commit(1, cands.group_ids[[0, 1, 3, 4]], reused_admitted=1, filtered=1) == 3
    assert store.metrics()["replay/filtered_groups"] == 1  # the reused group selection's gate left out
    # 1 of 3 offered reused groups passed; 4 can be offered at step 2 (2, 3, 4, 5): expect 1, take 3 new
    assert feed.new_groups == 3
    again = ReplayFeed(FakeRing(), _store(k=2), batch_groups=4)
    again.load_state_dict(feed.state_dict())
    assert again.new_groups == 3 and again.received == feed.received == 16
    assert again.store.metrics()["replay/filtered_groups"] == 1  # checkpointed with the pool
    with pytest.raises(TimeoutError, match="3 never trained"):
        feed.wait_candidates(2, alive=lambda: None, timeout_s=0.3)  # only 6 and 7 are new
    # reused groups too old to be offered (version >= step - eta) do not count toward the batch
    late = ReplayFeed(FakeRing(), store, batch_groups=4, max_head_offpolicyness=2)
    assert late.step_new_groups(2) == 4


def test_gate_credits_what_the_learner_used_up_and_plans_its_batch():
    gate = StalenessGate(1, 4)
    assert gate.capacity() == 8  # AReaL: (eta + 0 + 1) * 4 before any report
    for _ in range(8):
        assert gate.try_acquire()
        gate.release(True)
    gate.on_version(1)  # not reported: one batch per version
    assert gate.consumed == 4 and gate.capacity() == 4
    gate.on_version(2, consumed=6, batch_size=3)  # trained 2 new groups at step 1; next steps take 3
    assert gate.capacity() == (1 + 1) * 3 + 6 - 8 == 4
    gate.on_version(2, consumed=5)  # an out-of-order count for the same version cannot shrink it
    assert gate.consumed == 6
    gate.on_version(3)  # once reported, only reports count
    assert gate.consumed == 6 and gate.version == 3
    gate.on_version(1, consumed=100)  # older versions are ignored
    assert gate.consumed == 6
    restored = StalenessGate(1, 4)
    restored.load_state_dict(gate.state_dict())
    assert (restored.consumed, restored.reported, restored.batch_size, restored.capacity()) == (6, True, 3, 4)
    with pytest.raises(ValueError, match="batch_size"):
        gate.on_version(4, batch_size=0)


class _Engines:
    """Engines in ticks: each tick they generate up to `per_tick` groups, as the staleness gate
    admits, at the version they serve (`version`, set by the caller after each step)."""

    def __init__(self, ring: FakeRing, gate: StalenessGate, per_tick: int):
        self.ring, self.gate, self.per_tick, self.gid, self.version = ring, gate, per_tick, 0, 0

    def tick(self, ticks: int = 1) -> None:
        for _ in range(ticks):
            for _ in range(self.per_tick):
                if not self.gate.try_acquire():
                    break
                self.gate.release(True)
                self.ring.put_group(self.gid, self.version)
                self.gid += 1


def _simulate(new_protocol: bool, steps: int = 60, batch: int = 8, eta: int = 1, k: int = 2,
              per_tick: int = 2, train_ticks: int = 3, mismatch: float = 0.0, drift: float = 0.01, seed: int = 0,
              new_first: bool = False, out: dict | None = None):
    """A run in ticks: engines generate up to `per_tick` groups a tick, as the gate admits, with
    the version they serve; a step trains for `train_ticks` ticks, so the learner waits for data
    now and then (as the CPU demo does) and groups of the current version are then in the pool.
    Selection: `algo.select_groups` on scores `mismatch * u + drift * age * (1 + u)`, u uniform
    (with no mismatch the current version scores 0: the learner recomputes exactly what the
    engine sampled, as on the CPU demo); `new_first`: never-trained candidates first
    (`algo.sg_new_first`). Old protocol: every candidate, a batch of new groups per step, AReaL's
    gate counting one batch per version. `out` receives the store's final metrics."""
    rng = np.random.default_rng(seed)
    ring, store = FakeRing(), _store(k=k)
    feed = ReplayFeed(ring, store, batch, eta)
    gate = StalenessGate(eta, batch)
    engines = _Engines(ring, gate, per_tick)

    for step in range(steps):
        need = feed.step_new_groups(step) if new_protocol else batch
        feed.drain(step)
        while not store.ready(step, batch, min_new=need):
            engines.tick()
            feed.drain(step)
        cands = feed.wait_candidates(step, lambda: None, 1) if new_protocol else store.candidates(step)
        age = step - cands.versions
        u = rng.random(len(cands))
        scores = torch.as_tensor(mismatch * u + drift * age * (1 + u))
        versions = torch.as_tensor(cands.versions)
        fresh = torch.as_tensor(cands.reuse == 0) if new_first else None
        chosen = algo.select_groups(scores, versions, quantile=0.9, batch_groups=batch, never_trained=fresh).numpy()
        assert len(chosen) == batch
        tau = algo.selection_threshold(scores, versions, quantile=0.9)
        gated = scores.numpy() > tau
        admitted = int((~gated & (cands.reuse > 0)).sum())
        filtered = int((gated & ~np.isin(np.arange(len(cands)), chosen)).sum())
        engines.tick(train_ticks)
        version = engines.version = step + 1
        if new_protocol:
            planned = feed.commit(step, cands.group_ids[chosen], admitted, filtered=filtered)
            gate.on_version(version, consumed=store.consumed, batch_size=planned)
        else:
            store.commit(step, cands.group_ids[chosen])
            gate.on_version(version)
    untrained_before_end = store.metrics()["replay/evicted_untrained"]
    feed.drain(steps)
    store.candidates(steps + k + 1)  # the run ends: what is left ages out
    m = store.metrics()
    if out is not None:
        out.update(m, untrained_before_end=untrained_before_end)
    return m["replay/trained_frac"], m["replay/added"] / steps


def test_generation_is_not_spent_on_groups_that_age_out_untrained():
    old_frac, old_rate = _simulate(new_protocol=False)
    new_frac, new_rate = _simulate(new_protocol=True)
    assert old_frac < 0.9 and new_frac >= 0.95
    # stale groups that still match (small drift against the engine mismatch) are reused: the
    # learner takes fewer new groups per step and generation follows, still without waste
    old_frac, old_rate = _simulate(new_protocol=False, mismatch=0.01, drift=0.001)
    new_frac, new_rate = _simulate(new_protocol=True, mismatch=0.01, drift=0.001)
    assert old_frac < 0.9 and new_frac >= 0.95 and new_rate < 7.5


def test_with_new_first_selection_no_never_trained_group_ages_out_displaced():
    """Stale groups that match better than new ones (engine mismatch above the drift): ranked
    together by score, reused groups displace never-trained ones, which then age out untrained
    during the run; with never-trained data first none does, and the gate's rejections are
    counted (`replay/filtered_groups`)."""
    for kw in (dict(mismatch=0.01, drift=0.001), dict(mismatch=0.02, drift=0.002, eta=2, k=5)):
        ranked, first = {}, {}
        _simulate(new_protocol=True, out=ranked, **kw)
        _simulate(new_protocol=True, new_first=True, out=first, **kw)
        assert ranked["untrained_before_end"] > 0, kw
        assert first["untrained_before_end"] == 0, kw
        assert first["replay/filtered_groups"] > 0 and first["replay/trained_frac"] > ranked["replay/trained_frac"]


def test_k1_replay_ages_out_a_straggler_that_decoupled_trains():
    """K = 1, selection off, and decoupled PPO (replay off) take the same groups in the same
    order, except a straggler older than the window when it arrives: K = 1 ages it out and the
    gate is credited for it (generation replaces it); decoupled PPO, without a window, trains it."""
    batch, straggler = 3, 99
    orders, stores = {}, {}
    for name, cfg in (("darl_k1", AlgoConfig(k=1, sg=False, pmis=False, warmup=5)),
                      ("decoupled", AlgoConfig(replay=False, sg=False, pmis=False, warmup=5))):
        ring, store = FakeRing(), ReplayStore(cfg, group_size=G)
        feed, order = ReplayFeed(ring, store, batch, max_head_offpolicyness=1), []
        for step in range(6):
            for j in range(batch + (step == 5)):  # one more at the end, so both can fill step 5
                ring.put_group(10 * step + j, step)
            if step == 2:
                ring.put_group(straggler, 0)  # begun at version 0, arrives at step 2: 2 - 0 > K
            cands = feed.wait_candidates(step, alive=lambda: None, timeout_s=5)
            chosen, metrics = choose_groups(None, cands, batch, cfg, step)
            order += cands.group_ids[chosen].tolist()
            feed.commit(step, cands.group_ids[chosen], metrics["algo/select/reused_admitted"])
        orders[name], stores[name] = order, store
    assert straggler in orders["decoupled"] and straggler not in orders["darl_k1"]
    assert [g for g in orders["decoupled"] if g != straggler] == orders["darl_k1"][:-1]
    m_k1, m_dec = stores["darl_k1"].metrics(), stores["decoupled"].metrics()
    assert (m_k1["replay/evicted_untrained"], m_dec["replay/evicted_untrained"]) == (1.0, 0.0)
    assert stores["darl_k1"].consumed == 6 * batch + 1 and stores["decoupled"].consumed == 6 * batch


# Replay depth: with D-ARL's window (`experiment.api.darl_window`) groups are really replayed at
# every staleness bound eta, and a step trains a full batch at every step. A group trained at step
# t' is offered again only while it is older than the new data (version < t - eta) and inside the
# window (t - version <= K): from K - eta versions. A simulated run (engines generating as the gate
# admits, a slower learner, the real feed, store and FIFO `choose_groups`) counts what was replayed.


def _run(eta: int, k: int, steps: int = 30, batch: int = 8, per_tick: int = 4, train_ticks: int = 4,
         warmup: int = 0) -> list[dict]:
    """Per step: `batch_composition` of what FIFO (the replay baselines' rule) trained."""
    cfg = AlgoConfig(k=k, sg=False, pmis=False, warmup=warmup)
    ring, store = FakeRing(), ReplayStore(cfg, group_size=G)
    feed, gate = ReplayFeed(ring, store, batch, eta), StalenessGate(eta, batch)
    engines, rows = _Engines(ring, gate, per_tick), []

    for step in range(steps):
        need = feed.step_new_groups(step)
        feed.drain(step)
        while not store.ready(step, batch, min_new=need):
            engines.tick()
            feed.drain(step)
        cands = feed.wait_candidates(step, lambda: None, 1)
        chosen, metrics = choose_groups(None, cands, batch, cfg, step)
        rows.append({**batch_composition(cands, chosen),
                     "staleness_max": int(step - cands.versions[chosen].min())})
        engines.tick(train_ticks)
        version = engines.version = step + 1
        planned = feed.commit(step, cands.group_ids[chosen], metrics["algo/select/reused_admitted"])
        gate.on_version(version, consumed=store.consumed, batch_size=planned)
    return rows


@pytest.mark.parametrize("eta", [1, 2, 4, 8])
def test_darl_window_replays_at_every_eta(eta):
    k = darl_window(eta)
    assert k - eta == REPLAY_DEPTH >= 1  # the versions a group can be replayed from
    rows = _run(eta, k)
    assert all(r["train/batch_groups"] == 8 for r in rows)
    assert max(r["staleness_max"] for r in rows) == k  # replayed up to the window's edge
    assert np.mean([r["replay/reused_frac"] for r in rows[k + 2:]]) > 0.2


def test_a_window_no_wider_than_eta_never_replays():
    rows = _run(eta=2, k=2)
    assert all(r["replay/reused_frac"] == 0.0 and r["train/batch_groups"] == 8 for r in rows)
