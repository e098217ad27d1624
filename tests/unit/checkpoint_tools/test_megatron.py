"""The converted checkpoint against real Megatron-Core 0.16.1: every (tp, pp) rank file loads into
its stage's GPTModel (local spec, CPU, gloo) with strict=True, and the logits equal transformers'
on the original model within 1e-5 (fp32). Runs `ckpt_megatron_check.py` as `tp` subprocesses."""

import re
import subprocess
import sys

import megatron.core  # noqa: F401  (a hard dependency: imported, never skipped)
import torch

from checkpoint_tools.convert import hf_to_mcore
from megatron_darl.channel.ports import free_port
from tests.helpers import repo_env


def _run_ranks(pairs: list[tuple[str, str]], tp: int) -> str:
    env = repo_env(OMP_NUM_THREADS="1")
    args = [str(tp), str(free_port())] + [x for pair in pairs for x in pair]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.ckpt_megatron_check", str(r)] + args, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(tp)]
    outs = []
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs[0]


def test_megatron_loads_strict_and_matches_transformers_logits(hf_factory, tmp_path):
    # One pair of TP=2 processes checks every case (imports dominate the cost): Qwen3 untied and tied
    # (vocab padding 300 -> 512, GQA, head_dim 24 != 64/4), Qwen2 (qkv bias), at PP=1 and at PP=2
    # (stages built in one process and chained by hand; the tied last stage holds output_layer).
    cases = [("qwen3", False, 1), ("qwen3", True, 2), ("qwen2", False, 2), ("qwen3", False, 2)]
    pairs = []
    for arch, tied, pp in cases:
        src = hf_factory(arch, tied, torch.float32)
        mc = str(tmp_path / f"mc_{arch}_{tied}_pp{pp}")
        hf_to_mcore(src, mc, tp=2, pp=pp, progress=False)
        pairs.append((src, mc))
    out = _run_ranks(pairs, tp=2)
    diffs = dict(re.findall(r"MAXDIFF (\S+) (\S+)", out))
    assert set(diffs) == {mc for _, mc in pairs}, out[-2000:]
    for mc, d in diffs.items():
        assert float(d) < 1e-5, (mc, d)
