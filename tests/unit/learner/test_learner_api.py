"""Learner config validation: bad combinations are refused with the offending keys named."""

from megatron_darl.learner.api import AlgorithmConfig, LearnerConfig, ModelConfig, OptimConfig, ParallelConfig


def fields(errors):
    return [f for f, _ in errors]


def test_defaults_are_valid():
    assert ModelConfig(hf_dir="x").check() == []
    assert ParallelConfig().check() == []
    assert OptimConfig().check() == []
    assert LearnerConfig().check() == []
    assert AlgorithmConfig().check() == []


def test_darl_without_proximal_recompute_names_both_keys():
    errors = AlgorithmConfig(policy_loss="darl", old_logprob="proximal", recompute_proximal=False).check()
    assert "recompute_proximal" in fields(errors)
    msg = dict(errors)["recompute_proximal"]
    assert "policy_loss=darl" in msg and "old_logprob=proximal" in msg


def test_decoupled_needs_proximal_old_logprob():
    assert "old_logprob" in fields(AlgorithmConfig(policy_loss="decoupled", old_logprob="behavior").check())


def test_naive_async_needs_no_recompute():
    cfg = AlgorithmConfig(policy_loss="ppo", old_logprob="behavior", recompute_proximal=False)
    assert cfg.check() == [] and not cfg.uses_proximal
    assert AlgorithmConfig(policy_loss="ppo", old_logprob="behavior", rollout_is="token").uses_proximal
    assert not AlgorithmConfig(policy_loss="sg_weight", old_logprob="behavior").uses_proximal


def test_invalid_values_are_reported():
    assert "hf_dir" in fields(ModelConfig().check())
    assert "fp8" in fields(ModelConfig(hf_dir="x", spec="local", fp8="delayed").check())
    assert "vpp" in fields(ParallelConfig(pp=1, vpp=2).check())
    assert "lr_decay_steps" in fields(OptimConfig(lr_decay_style="cosine").check())
    assert "min_lr" in fields(OptimConfig(lr=1e-6, min_lr=1e-5).check())
    assert "ppo_n_minibatches" in fields(AlgorithmConfig(ppo_n_minibatches=0).check())
    assert "behav_clip" in fields(AlgorithmConfig(behav_clip=0.5).check())
    assert "micro_batch_tokens" in fields(LearnerConfig(micro_batch_tokens=0).check())
    assert "sequence_parallel" in fields(ParallelConfig(tp=1, sequence_parallel=True).check())
    assert ParallelConfig(tp=2, sequence_parallel=True).check() == []
    assert "recompute_modules" in fields(ModelConfig(hf_dir="x", recompute="selective", recompute_modules=["moe"]).check())
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
    assert set(AlgorithmConfig._choices["policy_loss"]) == {"ppo", "decoupled", "darl", "sg_weight"}
    assert ModelConfig._choices["fp8"] == ("delayed", "tensorwise", "blockwise", "mxfp8")
    assert LearnerConfig(micro_batch_tokens=100).recompute_tokens == 100
    assert LearnerConfig(micro_batch_tokens=100, logprob_chunk_tokens=7).recompute_tokens == 7
