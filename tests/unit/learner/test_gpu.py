"""GPU-only learner paths: Transformer Engine spec, FP8 recipes, distributed optimizer, NCCL.

Each test runs a one-rank learner on CUDA (NCCL backend) in a subprocess of `learner_worker`;
they skip without a GPU (and the TE ones without transformer_engine)."""

import pytest
import torch

from megatron_darl.channel.ports import free_port
from tests.helpers import learner_worker as W
from tests.helpers import repo_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _have_te() -> bool:
    from megatron_darl.learner.model import have_te

    return have_te()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return W.tiny_qwen3(str(tmp_path_factory.mktemp("gpu") / "hf"))


def test_local_spec_bf16_distributed_optimizer_trains(hf_dir, tmp_path):
    """The local spec without TE: it trains, resumes, and runs SDPA's flash kernel (GQA, bf16) with
    the log-probs of DotProductAttention to bf16 precision, every parameter in bf16 (norms
    included), and a 4096-token step that keeps less than the [s, s] scores did."""
    import numpy as np
    import torch.multiprocessing as mp

    out = W.launch("gpu", {"hf_dir": hf_dir, "spec": "local", "fp8": None, "dtype": "bf16",
                           "ckpt": str(tmp_path / "ckpt")}, 1, str(tmp_path))
    assert out["distributed_optimizer"] and out["losses"][-1] < out["losses"][0]
    assert out["resume_diff"] < 1e-5  # save/load of the sharded distributed-optimizer state
    assert 0 < out["mfu"] < 1
    assert out["max_logprob_diff_vs_fp32_reference"] < 0.1  # bf16 forward near the fp32 HF model
    path = str(tmp_path / "flash.pt")
    mp.start_processes(_flash_worker, args=(hf_dir, path), nprocs=1, start_method="spawn")
    got = torch.load(path)
    flash, ref = got["flash"], got["dot_product"]
    assert (flash["core"], ref["core"]) == ("FlashCoreAttention", "DotProductAttention")
    assert flash["dtypes"] == ["torch.bfloat16"]
    assert np.abs(np.asarray(flash["logprobs"]) - np.asarray(ref["logprobs"])).max() < 0.05
    assert flash["step_peak"] < 0.5 * ref["step_peak"], (flash["step_peak"], ref["step_peak"])


def test_a_fresh_process_resumes_the_distributed_optimizer(hf_dir, tmp_path):
    """What a Slurm requeue does: load in a process that has taken no step. Without apex/TE,
    megatron-core 0.16.1 asserted on torch Adam's empty per-parameter state. What resume
    promises: the step after the load is the step the saving process took next (the fused
    AdamW's step counts come back on the GPU)."""
    args = {"hf_dir": hf_dir, "ckpt": str(tmp_path / "ckpt")}
    first = W.launch("gpu_resume", {**args, "save": True}, 1, str(tmp_path))
    again = W.launch("gpu_resume", {**args, "save": False}, 1, str(tmp_path))
    assert again["extra"] == {"k": 1}
    assert again["next"]["train/step"] == first["next"]["train/step"] == 2.0  # saved at 1, then one step
    for m in ("train/loss", "train/grad_norm", "train/lr"):
        assert abs(first["next"][m] - again["next"][m]) < 1e-5, m
    assert first["next"]["train/grad_norm"] > 0  # not a comparison of zeros


def _long_batch(tokens: int):
    """One row of `tokens` random tokens, all but a 4-token prompt scored."""
    import numpy as np

    from megatron_darl.types import TrainBatch

    rng = np.random.RandomState(0)
    mask = np.ones((1, tokens), np.float32)
    mask[:, :4] = 0
    return TrainBatch(tokens=rng.randint(0, 256, (1, tokens)).astype(np.int64), lengths=np.array([tokens]),
                      loss_mask=mask, advantages=np.ones(1, np.float32),
                      behav_logprobs=np.full((1, tokens), -5.0, np.float32),
                      token_versions=np.zeros((1, tokens), np.int64), versions=np.zeros(1, np.int64),
                      group_index=np.zeros(1, np.int64), rewards=np.zeros(1, np.float32),
                      prompt_ids=np.zeros(1, np.int64))


def _flash_worker(rank: int, hf_dir: str, out: str) -> None:
    """One CUDA rank, local spec, bf16: the flash core attention against DotProductAttention."""
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    results, long = {}, _long_batch(4096)
    for attention in ("flash", "dot_product"):
        learner = MegatronLearner(
            ModelConfig(hf_dir=hf_dir, spec="local", dtype="bf16", attention=attention), ParallelConfig(),
            OptimConfig(lr=1e-4), LearnerConfig(micro_batch_tokens=4096),
            W.learner_algo("ppo", old_logprob="behavior", ppo_n_minibatches=1))
        batch = W.make_batch()
        lp = learner.compute_logprobs(batch)
        learner.train_step(long)  # optimizer state allocated before the measured step
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        learner.train_step(long)
        torch.cuda.synchronize()
        results[attention] = {
            "core": type(learner.chunks[0].decoder.layers[0].self_attention.core_attention).__name__,
            "dtypes": sorted({str(p.dtype) for c in learner.chunks for p in c.parameters()}),
            "logprobs": lp.tolist(), "step_peak": torch.cuda.max_memory_allocated() - base}
        learner.close(keep_world=attention == "flash")
    torch.save(results, out)


@pytest.mark.skipif(not _have_te(), reason="needs transformer_engine")
def test_te_spec_matches_hf_and_trains(hf_dir, tmp_path):
    out = W.launch("gpu", {"hf_dir": hf_dir, "spec": "te", "fp8": None, "dtype": "fp32",
                           "ckpt": str(tmp_path / "ckpt")}, 1, str(tmp_path))
    assert out["max_logprob_diff_vs_fp32_reference"] < 1e-3
    assert out["losses"][-1] < out["losses"][0]


@pytest.mark.skipif(not _have_te(), reason="needs transformer_engine")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_recipes_run(hf_dir, tmp_path, recipe):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    out = W.launch("gpu", {"hf_dir": hf_dir, "spec": "te", "fp8": recipe, "dtype": "bf16",
                           "ckpt": str(tmp_path / "ckpt")}, 1, str(tmp_path))
    assert all(abs(x) < 1e3 for x in out["losses"]) and out["fp8_recipe"] == recipe
    assert out["seq_multiple"] == 16  # token widths padded to Megatron's FP8 GEMM alignment


@pytest.mark.skipif(not _have_te(), reason="needs transformer_engine")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one rank per GPU)")
def test_sequence_parallel_tp2_matches_hf_and_trains(hf_dir, tmp_path):
    import numpy as np

    out = W.launch("sequence_parallel", {"hf_dir": hf_dir}, 2, str(tmp_path))
    batch = W.make_batch()
    ref = np.asarray(W.transformers_logprobs(hf_dir, batch.tokens, batch.lengths, 0.9))
    assert np.abs(np.asarray(out["logprobs"]) - ref).max() < 1e-3  # TE kernels in fp32 (TF32 off by default)
    assert out["seq_multiple"] == 2 and out["losses"][-1] < out["losses"][0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL forbids two ranks on one GPU)")
def test_nccl_weight_broadcast_reaches_a_receiver(tmp_path):
    import subprocess
    import sys

    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", f"""
import torch, torch.distributed as dist
from megatron_darl.channel.process_group import init_custom_group
torch.cuda.set_device(1)
g = init_custom_group("127.0.0.1", {port}, 2, "darl_weights", rank=1, backend="nccl", timeout_s=120)
t = torch.empty(3, 5, device="cuda")
dist.broadcast(t, group=g, group_src=0)
assert torch.equal(t.cpu(), torch.arange(15.0).reshape(3, 5)), t
"""], env=repo_env())
    import torch.distributed as dist

    from megatron_darl.channel.process_group import init_custom_group
    from megatron_darl.learner.weights import describe
    from megatron_darl.trainer.weight_sender import _broadcast

    torch.cuda.set_device(0)
    group = init_custom_group("127.0.0.1", port, 2, "darl_weights", rank=0, backend="nccl", timeout_s=120)
    bucket = [("model.norm.weight", torch.arange(15.0).reshape(3, 5))]  # staged on CPU, sent from the GPU
    assert describe(bucket) == {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[3, 5]]}
    _broadcast(group, [(n, t.cuda()) for n, t in bucket], "cuda")  # as the sender: on the device once
    dist.destroy_process_group(group)
    assert receiver.wait(timeout=120) == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL forbids two ranks on one GPU)")
def test_an_nccl_receiver_killed_mid_broadcast_leaves_the_sender_alive(tmp_path):
    """The receiver joins, takes the first tensor, then dies (SIGKILL) before the second: the
    sender's deadline aborts the group and raises, and this process (the learner) lives on,
    where torch's default NCCL error handling would tear it down."""
    import subprocess
    import sys
    import time

    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", f"""
import os, signal, torch, torch.distributed as dist
from megatron_darl.channel.process_group import init_custom_group
torch.cuda.set_device(1)
g = init_custom_group("127.0.0.1", {port}, 2, "darl_weights_lost", rank=1, backend="nccl", timeout_s=30)
t = torch.empty(1 << 20, device="cuda")
dist.broadcast(t, group=g, group_src=0)
torch.cuda.synchronize()
os.kill(os.getpid(), signal.SIGKILL)
"""], env=repo_env())
    from megatron_darl.channel.process_group import init_custom_group
    from megatron_darl.trainer.weight_sender import _broadcast

    torch.cuda.set_device(0)
    group = init_custom_group("127.0.0.1", port, 2, "darl_weights_lost", rank=0, backend="nccl", timeout_s=30)
    _broadcast(group, [("a", torch.ones(1 << 20, device="cuda"))], "cuda", 20.0)
    assert receiver.wait(timeout=60) == -9
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError)):
        _broadcast(group, [("b", torch.ones(64 << 20, device="cuda"))], "cuda", 5.0)
    assert time.monotonic() - t0 < 30.0
    torch.cuda.synchronize()  # the aborted communicator left no kernel behind
    assert torch.ones(1, device="cuda").item() == 1.0  # and this process still computes
