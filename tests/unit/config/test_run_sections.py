"""The run's own sections (`train`, `demo`, `ring`): bad values refused by name, derived values."""

from megatron_darl.config.run import DemoConfig, RingConfig, TrainConfig


def fields(errors):
    return [f for f, _ in errors]


def test_ring_checksum_is_derived_unless_set():
    assert RingConfig(checksum=True).effective_checksum and not RingConfig(checksum=False).effective_checksum
    assert RingConfig().check() == []
    assert fields(RingConfig(size_bytes=10, name="a/b").check()) == ["size_bytes", "name"]


def test_demo_and_train_values_are_refused_by_name():
    assert DemoConfig().check() == [] and TrainConfig().check() == []
    assert fields(DemoConfig(sft_steps=-1, sft_target=1.0, min_step_s=-1).check()) == ["sft_steps", "sft_target",
                                                                                       "min_step_s"]
    assert fields(TrainConfig(steps=-1, batch_prompts=0, run_dir="").check()) == ["steps", "batch_prompts", "run_dir"]
