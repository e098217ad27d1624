"""The learner's config sections (`model`, `parallel`, `optim`, `learner`): bad values and
combinations are refused with the offending keys named; derived values are computed."""

from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig


def fields(errors):
    return [f for f, _ in errors]


def test_defaults_are_valid():
    assert ModelConfig(hf_dir="x").check() == []
    assert ParallelConfig().check() == []
    assert OptimConfig().check() == []
    assert LearnerConfig().check() == []


def test_invalid_values_are_reported():
    assert "hf_dir" in fields(ModelConfig().check())
    assert "fp8" in fields(ModelConfig(hf_dir="x", spec="local", fp8="delayed").check())
    assert "vpp" in fields(ParallelConfig(pp=1, vpp=2).check())
    assert "lr_decay_steps" in fields(OptimConfig(lr_decay_style="cosine").check())
    assert "min_lr" in fields(OptimConfig(lr=1e-6, min_lr=1e-5).check())
    assert "micro_batch_tokens" in fields(LearnerConfig(micro_batch_tokens=0).check())
    assert "sequence_parallel" in fields(ParallelConfig(tp=1, sequence_parallel=True).check())
    assert ParallelConfig(tp=2, sequence_parallel=True).check() == []
    assert "recompute_modules" in fields(ModelConfig(hf_dir="x", recompute="selective",
                                                     recompute_modules=["moe"]).check())
    assert "recompute_modules" in fields(ModelConfig(hf_dir="x", recompute="selective", recompute_modules=[]).check())
    assert "engine_memory_fraction" in fields(LearnerConfig(engine_memory_fraction=1.0).check())
    assert "gpu_memory_gib" in fields(LearnerConfig(gpu_memory_gib=0).check())


def test_data_parallel_size_is_derived():
    par = ParallelConfig(tp=2, pp=2)
    assert par.dp(8) == 2
    try:
        par.dp(6)
    except ValueError as e:
        assert "parallel.tp*parallel.pp=4" in str(e)
    else:
        raise AssertionError("world 6 with tp*pp=4 must fail")


def test_choices_cover_the_string_fields():
    assert ModelConfig._choices["fp8"] == ("delayed", "tensorwise", "blockwise", "mxfp8")
    assert LearnerConfig(micro_batch_tokens=100).recompute_tokens == 100
    assert LearnerConfig(micro_batch_tokens=100, logprob_chunk_tokens=7).recompute_tokens == 7
