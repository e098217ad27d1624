"""The `rollout` section's derived values: `weight_sync=auto` resolved where the setting is declared."""

import pytest

from megatron_darl.config.rollout import RolloutConfig

# (backend, weight_sync, engines on rollout nodes) -> (effective_weight_sync, weight_folder_kind)
CASES = [
    (("torch", "auto", False), ("shm", "shm")),  # embedded engines beside the learner: its /dev/shm
    (("torch", "auto", True), ("disk", "disk")),  # embedded engines on a Slurm job's rollout nodes
    (("sglang", "auto", False), ("disk", "disk")),  # SGLang servers, wherever they run
    (("sglang", "auto", True), ("disk", "disk")),
    (("torch", "shm", True), ("shm", "shm")),  # a set value is kept (the preflight refuses what cannot work)
    (("sglang", "disk", False), ("disk", "disk")),
    (("torch", "disk", False), ("disk", "disk")),
    (("torch", "distributed", False), ("distributed", "shm")),  # fallback folders where auto would put them
    (("torch", "distributed", True), ("distributed", "disk")),
    (("sglang", "distributed", False), ("distributed", "disk")),
]


@pytest.mark.parametrize(("given", "expected"), CASES, ids=["-".join(map(str, g)) for g, _ in CASES])
def test_weight_sync_auto_is_resolved_by_backend_and_placement(given, expected):
    backend, weight_sync, on_rollout_nodes = given
    rc = RolloutConfig(backend=backend, weight_sync=weight_sync)
    assert (rc.effective_weight_sync(on_rollout_nodes), rc.weight_folder_kind(on_rollout_nodes)) == expected


def test_every_setting_is_covered():
    assert {g[1] for g, _ in CASES} == set(RolloutConfig._choices["weight_sync"])
    assert {g[0] for g, _ in CASES} == set(RolloutConfig._choices["backend"])
