"""Trajectory flat-array round trip and TrainBatch padding."""

import numpy as np
import pytest

from megatron_darl.types import TRAJECTORY_FIELDS, Trajectory, make_train_batch


def _traj(rng, prompt_id=7, group_id=3, n_resp=5, meta=None):
    return Trajectory(
        prompt_ids=rng.integers(0, 1000, size=4),
        response_ids=rng.integers(0, 1000, size=n_resp),
        behav_logprobs=rng.normal(size=n_resp).astype(np.float32),
        behav_versions=np.sort(rng.integers(0, 3, size=n_resp)),
        reward=0.5,
        prompt_id=prompt_id,
        group_id=group_id,
        finish_reason="length",
        metadata=meta if meta is not None else {"task": "chain_sum", "answer": "-56", "ü": [1, 2]},
    )


def test_round_trip_is_exact_and_pickle_free():
    rng = np.random.default_rng(0)
    t = _traj(rng)
    arrays = t.to_arrays()
    assert list(arrays) == [name for name, _ in TRAJECTORY_FIELDS]
    for name, dt in TRAJECTORY_FIELDS:
        assert arrays[name].dtype == dt and arrays[name].ndim == 1
    # through raw bytes, as the ring buffer stores them
    raw = {k: np.frombuffer(v.tobytes(), dtype=v.dtype) for k, v in arrays.items()}
    back = Trajectory.from_arrays(raw)
    for name in ("prompt_ids", "response_ids", "behav_logprobs", "behav_versions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(t, name))
    assert (back.reward, back.prompt_id, back.group_id, back.finish_reason, back.metadata) == (
        t.reward, t.prompt_id, t.group_id, t.finish_reason, t.metadata)


def test_empty_response_and_metadata():
    t = _traj(np.random.default_rng(1), n_resp=0, meta={})
    back = Trajectory.from_arrays(t.to_arrays())
    assert back.version == -1 and len(back.response_ids) == 0 and back.metadata == {}


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="behav_logprobs"):
        Trajectory([1], [1, 2], [0.0], [0, 0], 0.0, 1, 1)
    with pytest.raises(ValueError, match="finish_reason"):
        Trajectory([1], [1], [0.0], [0], 0.0, 1, 1, finish_reason="eos")


def test_version_is_the_oldest_token_version():
    t = Trajectory([1], [5, 6, 7], [0.0] * 3, [3, 3, 4], 1.0, 1, 1)
    assert t.version == 3


def test_make_train_batch_aligns_tokens_and_logprobs():
    rng = np.random.default_rng(2)
    trajs = [_traj(rng, prompt_id=i, group_id=10 + i // 2, n_resp=2 + i) for i in range(4)]
    b = make_train_batch(trajs, np.arange(4, dtype=np.float32))
    assert b.tokens.shape == (4, 4 + 5)
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        np.testing.assert_array_equal(b.tokens[i, p:p + r], t.response_ids)
        np.testing.assert_array_equal(b.behav_logprobs[i, p:p + r], t.behav_logprobs)
        assert b.loss_mask[i].sum() == r and b.loss_mask[i, :p].sum() == 0
        assert b.versions[i] == t.version
    assert b.group_index.tolist() == [0, 0, 1, 1]
    assert b.num_response_tokens == sum(2 + i for i in range(4))
