"""GRPO / Dr.GRPO / RLOO advantages against the naive references."""

import pytest
import torch

from megatron_darl.algo import grpo_advantages, rloo_advantages
from tests.helpers import algo_reference as ref


@pytest.mark.parametrize("n_groups,size,seed", [(1, 1, 0), (3, 4, 1), (8, 8, 2), (5, 2, 3)])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(n_groups, size, seed, norm):
    groups = ref.shuffle_groups(n_groups, size, seed)
    rewards = torch.randn(len(groups), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = grpo_advantages(rewards, torch.tensor(groups) * 7 + 3, norm_by_std=norm)
    want = ref.grpo(rewards.tolist(), groups, norm=norm)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))


def test_grpo_constant_group_is_zero_and_binary_rewards_are_unit_scale():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    adv = grpo_advantages(rewards, groups)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.allclose(adv[3:], torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-5)


@pytest.mark.parametrize("n_groups,size,seed", [(1, 1, 0), (4, 3, 1), (6, 8, 2)])
def test_rloo_matches_reference(n_groups, size, seed):
    groups = ref.shuffle_groups(n_groups, size, seed)
    rewards = torch.rand(len(groups), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = rloo_advantages(rewards, torch.tensor(groups))
    torch.testing.assert_close(got, torch.tensor(ref.rloo(rewards.tolist(), groups), dtype=torch.float64))


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="group_index"):
        grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="rewards"):
        rloo_advantages(torch.zeros(2, 2), torch.zeros(4, dtype=torch.long))
