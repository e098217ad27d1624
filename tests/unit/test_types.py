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


def _tool_episode() -> Trajectory:
    """Policy tokens 0-2 (versions 4, 4, 5), tool output 3-5, policy tokens 6-7 (version 3)."""
    mask = [1, 1, 1, 0, 0, 0, 1, 1]
    return Trajectory([1, 2], [10, 11, 12, 90, 91, 92, 13, 14], [-0.5, -0.4, -0.3, 0.0, 0.0, 0.0, -0.2, -0.1],
                      [4, 4, 5, -1, -1, -1, 3, 3], 1.0, 9, 9, policy_mask=mask)


def test_tool_output_is_context_never_a_trained_token():
    t = _tool_episode()
    assert t.version == 3 and t.num_policy_tokens == 5  # tool tokens have no version
    back = Trajectory.from_arrays({k: np.frombuffer(v.tobytes(), dtype=v.dtype) for k, v in t.to_arrays().items()})
    np.testing.assert_array_equal(back.policy_mask, t.policy_mask)
    b = make_train_batch([t], np.ones(1, np.float32))
    assert b.loss_mask[0, :2].sum() == 0 and b.loss_mask[0, 2:].tolist() == [1, 1, 1, 0, 0, 0, 1, 1]
    assert b.token_versions[0, 5:8].tolist() == [-1, -1, -1] and b.num_response_tokens == 5
    np.testing.assert_array_equal(b.tokens[0, 2:], t.response_ids)  # the learner conditions on them
    assert b.versions[0] == 3


def test_tool_tokens_with_a_version_or_logprob_are_refused():
    good = _tool_episode()
    with pytest.raises(ValueError, match="token 4 is tool output .* version 5"):
        Trajectory([1], good.response_ids, good.behav_logprobs, [4, 4, 5, -1, 5, -1, 3, 3], 1.0, 9, 9,
                   policy_mask=good.policy_mask)
    logp = good.behav_logprobs.copy()
    logp[3] = -1.0
    with pytest.raises(ValueError, match="token 3 is tool output"):
        Trajectory([1], good.response_ids, logp, good.behav_versions, 1.0, 9, 9, policy_mask=good.policy_mask)
    with pytest.raises(ValueError, match="policy_mask 7"):
        Trajectory([1], good.response_ids, good.behav_logprobs, good.behav_versions, 1.0, 9, 9, policy_mask=[1] * 7)
    with pytest.raises(ValueError, match="policy_mask holds 2"):
        Trajectory([1], [5, 6], [0.0, 0.0], [1, -1], 1.0, 9, 9, policy_mask=[2, 0])
    with pytest.raises(ValueError, match="policy_mask holds 2"):  # no tool token: still checked
        Trajectory([1], [5, 6], [0.0, 0.0], [1, 1], 1.0, 9, 9, policy_mask=[2, 1])


def test_a_record_without_policy_mask_reads_as_all_policy_tokens():
    """A replay-store checkpoint written before the field existed."""
    t = _traj(np.random.default_rng(3))
    arrays = {k: v for k, v in t.to_arrays().items() if k != "policy_mask"}
    back = Trajectory.from_arrays(arrays)
    assert back.policy_mask.tolist() == [1] * len(t.response_ids)
