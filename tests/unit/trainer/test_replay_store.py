"""Replay store: ageing past K, reuse limits, warmup, two-phase commit, exact state round trip."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.trainer.replay_store import ReplayGroup, ReplayStore
from megatron_darl.types import Trajectory

G = 2


def _traj(gid: int, member: int, version: int, n: int = 4, older_token: bool = False) -> Trajectory:
    versions = np.full(n, version)
    if older_token:
        versions[0] = version - 1  # a partial rollout that began under the previous version
    return Trajectory(
        prompt_ids=[gid, gid + 1],
        response_ids=np.arange(n) + member,
        behav_logprobs=-(np.arange(n) + 1.0) / (gid + 3),
        behav_versions=versions,
        reward=0.1 * gid + member,  # not exactly representable in float32
        prompt_id=gid,
        group_id=gid,
        finish_reason="length" if member else "stop",
        metadata={"gid": gid, "m": member},
    )


def _add_group(store: ReplayStore, gid: int, version: int, step: int | None = None) -> None:
    for m in range(G):
        store.add(_traj(gid, m, version), step)


def _train(store: ReplayStore, step: int, n: int, newest_first: bool = False) -> list[ReplayGroup]:
    """One step of the two phases with no learner pass: the first `n` candidates in pool order
    (oldest version first, then group id: FIFO), or newest version first."""
    cands = store.candidates(step)
    order = np.argsort(-cands.versions, kind="stable") if newest_first else np.arange(len(cands))
    return store.commit(step, cands.group_ids[order[:n]])


def _cfg(**kw) -> AlgoConfig:
    kw.setdefault("warmup", 0)
    return AlgoConfig(**kw)


def test_group_enters_the_pool_complete_with_its_oldest_version():
    store = ReplayStore(_cfg(), group_size=3)
    assert store.add(_traj(7, 0, 5)) is None
    assert store.add(_traj(7, 1, 5, older_token=True)) is None
    assert len(store) == 0 and store.num_pending == 1
    group = store.add(_traj(7, 2, 6))
    assert group is not None and group.version == 4 and len(group.trajectories) == 3
    assert len(store) == 1 and store.num_pending == 0
    with pytest.raises(ValueError, match="already complete"):
        store.add(_traj(7, 3, 6))


def test_groups_age_out_past_k_and_incomplete_groups_are_dropped():
    store = ReplayStore(_cfg(k=2), group_size=G)
    for v in range(6):
        _add_group(store, gid=v, version=v)
    store.add(_traj(100, 0, 1))  # a group that lost a response never completes
    cands = store.candidates(step=5)
    assert sorted(cands.versions.tolist()) == [3, 4, 5]  # t - v <= K kept
    m = store.metrics()
    assert m["replay/evicted_age"] == 3 and m["replay/dropped_incomplete"] == 1
    assert m["replay/staleness_hist"].tolist() == [1, 1, 1, 0]
    assert store.num_pending == 0


def test_reuse_limit_and_eviction_against_a_naive_reference():
    """Random arrivals and steps; the store must match a direct simulation of the rules."""
    rng = np.random.default_rng(3)
    k, max_reuse, batch = 3, 2, 3
    store = ReplayStore(_cfg(k=k, max_reuse=max_reuse), group_size=G)
    ref: list[list[int]] = []  # [gid, version, reuse] in arrival order
    gid = 0
    trained: dict[int, int] = {}
    for step in range(40):
        for _ in range(int(rng.integers(0, 4))):
            v = step - int(rng.integers(0, 3))
            _add_group(store, gid, v, step)
            ref.append([gid, v, 0])
            gid += 1
        ref = [r for r in ref if step - r[1] <= k]
        want = [r for r in sorted(ref, key=lambda r: r[1])][:batch]
        batch_groups = _train(store, step, batch)
        assert [g.group_id for g in batch_groups] == [r[0] for r in want], step
        for r in want:
            r[2] += 1
            trained[r[0]] = trained.get(r[0], 0) + 1
        ref = [r for r in ref if r[2] < max_reuse]
        assert sorted((g.group_id, g.reuse) for g in store.groups) == sorted((r[0], r[2]) for r in ref)
    assert max(trained.values()) == max_reuse
    hist = store.metrics()["replay/reuse_hist"]
    assert hist.tolist() == np.bincount([r[2] for r in ref], minlength=max_reuse).tolist()


def test_replay_off_trains_every_group_exactly_once_and_never_ages_out():
    cfg = _cfg(replay=False, sg=False, k=1)
    assert cfg.effective_max_reuse == 1
    store = ReplayStore(cfg, group_size=G)
    for g in range(10):
        _add_group(store, g, version=0)
    store.add(_traj(50, 0, 0))  # a slow group: still incomplete far past K
    seen = []
    for step in range(10, 15):  # far past K: baselines bound staleness with the gate, not here
        seen += [g.group_id for g in _train(store, step, 2)]
    assert seen == list(range(10)) and len(store) == 0
    assert store.add(_traj(50, 1, 0)) is not None  # it completes and is trained
    assert [g.group_id for g in _train(store, 15, 2)] == [50]


def test_warmup_offers_only_never_trained_groups():
    store = ReplayStore(_cfg(k=4, warmup=2), group_size=G)
    for g, v in enumerate([0, 1, 1, 0]):
        _add_group(store, g, v)
    store.commit(0, [0])  # group 0 trained once: reused from now on
    assert store.candidates(1).group_ids.tolist() == [3, 1, 2]  # every version, oldest first, no replay
    assert sorted(store.candidates(2).group_ids.tolist()) == [0, 1, 2, 3]  # after warmup: replay too


def test_warmup_never_waits_for_a_batch_of_the_newest_version():
    """The deadlock the comparison experiment hit (D-ARL, eta 1, step 2): the gate had generated
    the groups the learner reported it would take, a few of them already of the newest version;
    a warmup that offered only the newest version waited for a full batch of it, which the gate
    would never generate."""
    store = ReplayStore(_cfg(k=2, warmup=5), group_size=G)
    for g in range(6):
        _add_group(store, g, 1)
    _add_group(store, 6, 2)
    assert store.ready(2, batch_groups=6, min_new=6)
    assert store.candidates(2, new_limit=6).versions.tolist() == [1] * 6


def test_warmup_is_part_of_selection_only():
    """Baselines (replay and selection off) and the no-selection ablation take the oldest groups
    from the first step: a warmup would train only the newest version and the skipped groups
    late, staler than eta allows."""
    for cfg in (_cfg(replay=False, sg=False, warmup=5), _cfg(k=4, sg=False, warmup=5)):
        assert cfg.effective_warmup == 0
        store = ReplayStore(cfg, group_size=G)
        for g, v in enumerate([0, 1, 1, 0]):
            _add_group(store, g, v)
        assert store.candidates(1).versions.tolist() == [0, 0, 1, 1]
        assert [g.group_id for g in _train(store, 1, 2)] == [0, 3]
    assert _cfg(k=4, warmup=5).effective_warmup == 5


def test_two_phase_commit_by_group_id():
    store = ReplayStore(_cfg(k=4, max_reuse=1), group_size=G)
    for g in range(4):
        _add_group(store, g, version=g)
    cands = store.candidates(3)
    _add_group(store, 9, version=3)  # arrivals between the phases do not disturb the choice
    chosen = cands.group_ids[[2, 0]]
    batch = store.commit(3, chosen)
    assert [g.group_id for g in batch] == [2, 0] and 2 not in [g.group_id for g in store.groups]
    with pytest.raises(KeyError, match=r"\[2\]"):
        store.commit(3, [2])  # already used up
    with pytest.raises(ValueError, match="repeated"):
        store.commit(3, [1, 1])
    assert store.ready(3, batch_groups=3, min_new=3) and not store.ready(3, batch_groups=3, min_new=4)
    # the groups selection's gate left out: cumulative, as the commits report them
    assert store.metrics()["replay/filtered_groups"] == 0
    store.commit(4, [1], filtered=2)
    store.commit(4, [3], filtered=1)
    assert store.metrics()["replay/filtered_groups"] == 3
    with pytest.raises(ValueError, match="filtered=-1"):
        store.commit(4, [9], filtered=-1)


def _assert_same(a: ReplayStore, b: ReplayStore) -> None:
    assert [(g.group_id, g.version, g.reuse, g.added_step) for g in a.groups] == [
        (g.group_id, g.version, g.reuse, g.added_step) for g in b.groups
    ]
    pairs = [(x, y) for ga, gb in zip(a.groups, b.groups) for x, y in zip(ga.trajectories, gb.trajectories)]
    pairs += [(x, y) for ka in a._pending for x, y in zip(a._pending[ka], b._pending[ka])]
    assert list(a._pending) == list(b._pending)
    for x, y in pairs:
        for name in ("prompt_ids", "response_ids", "behav_logprobs", "behav_versions", "policy_mask"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
        assert (x.reward, x.prompt_id, x.group_id, x.finish_reason, x.metadata) == (
            y.reward, y.prompt_id, y.group_id, y.finish_reason, y.metadata)


@pytest.mark.parametrize("via_file", [False, True])
def test_state_round_trip_is_exact_and_resumes_identically(tmp_path, via_file):
    cfg = _cfg(k=3, max_reuse=2)
    store = ReplayStore(cfg, group_size=G)
    for step in range(6):
        for j in range(3):
            _add_group(store, 10 * step + j, version=step - j % 2, step=step)
        _train(store, step, 2, newest_first=not step % 2)
    store.add(_traj(999, 0, 5))  # pending
    if via_file:
        path = str(tmp_path / "replay.npz")
        store.save(path)
        restored = ReplayStore(cfg, group_size=G)
        restored.load(path)
    else:
        restored = ReplayStore(cfg, group_size=G)
        restored.load_state_dict(store.state_dict())
    _assert_same(store, restored)
    assert restored.metrics()["replay/evicted_reuse"] == store.metrics()["replay/evicted_reuse"] > 0
    for step in range(6, 10):  # the same future on both
        for s in (store, restored):
            _add_group(s, 10 * step, version=step, step=step)
        ids = [[g.group_id for g in _train(s, step, 3)] for s in (store, restored)]
        assert ids[0] == ids[1]
    _assert_same(store, restored)
    with pytest.raises(ValueError, match="group_size"):
        ReplayStore(cfg, group_size=G + 1).load_state_dict(store.state_dict())


def test_tool_output_masks_survive_a_round_trip_and_older_checkpoints_load():
    """A multi-turn group's policy_mask is saved; a checkpoint written before the field existed
    (no traj/policy_mask arrays) loads with every token a policy token."""
    cfg = _cfg(k=3)
    store = ReplayStore(cfg, group_size=G)
    for m in range(G):
        t = _traj(5, m, 2, n=6)
        t.behav_logprobs[2:4], t.behav_versions[2:4] = 0.0, -1
        store.add(Trajectory(t.prompt_ids, t.response_ids, t.behav_logprobs, t.behav_versions, t.reward, 5, 5,
                             policy_mask=[1, 1, 0, 0, 1, 1]), 2)
    _add_group(store, 6, version=2, step=2)
    restored = ReplayStore(cfg, group_size=G)
    restored.load_state_dict(store.state_dict())
    _assert_same(store, restored)
    assert [t.policy_mask.tolist() for t in restored.groups[0].trajectories] == [[1, 1, 0, 0, 1, 1]] * G
    old = store.state_dict()
    old["arrays"] = {k: v for k, v in old["arrays"].items() if not k.startswith("traj/policy_mask")}
    plain = ReplayStore(cfg, group_size=G)
    plain.load_state_dict(old)
    assert [g.group_id for g in plain.groups] == [5, 6]
    assert all(t.policy_mask.all() for g in plain.groups for t in g.trajectories)


def test_bad_config_is_rejected_with_field_names():
    with pytest.raises(ValueError, match="algo.k"):
        ReplayStore(AlgoConfig(k=0), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        ReplayStore(AlgoConfig(), group_size=0)


def test_candidate_order_does_not_depend_on_arrival_order():
    store = ReplayStore(_cfg(k=4), group_size=G)
    for gid, v in [(5, 1), (3, 1), (4, 0), (1, 1)]:
        _add_group(store, gid, v)
    assert store.candidates(1).group_ids.tolist() == [4, 1, 3, 5]
