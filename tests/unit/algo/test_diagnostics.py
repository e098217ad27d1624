"""Diagnostics (ESS, weight stats, KL k1/k2/k3, staleness) and the import boundary."""

import math
import subprocess
import sys

import pytest
import torch

from megatron_darl.algo import diagnostics, effective_sample_size, masked_quantile, staleness_histogram
from tests.helpers import algo_reference as ref


def test_diagnostics_match_reference():
    _, prox, behav, _, mask, versions = ref.rand_inputs(7, 9, seed=21, scale=0.6, empty_rows=[2])
    out = diagnostics(prox, behav, mask, versions, current_version=4)
    p, b, m, v = prox.tolist(), behav.tolist(), mask.tolist(), versions.tolist()
    w = ref.is_weights(p, b, m)
    for k in sorted(set(v)) + [None]:
        cells = [(i, j) for i in range(7) for j in range(9) if m[i][j] and (k is None or v[i] == k)]
        ls = [p[i][j] - b[i][j] for i, j in cells]
        ws = [w[i][j] for i, j in cells]
        suffix = "" if k is None else f"/v{k}"
        n = max(len(ls), 1)
        assert math.isclose(float(out[f"algo/kl_k1{suffix}"]), sum(-x for x in ls) / n, rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(float(out[f"algo/kl_k2{suffix}"]), sum(x * x / 2 for x in ls) / n,
                            rel_tol=1e-9, abs_tol=1e-12)
        k3 = sum(math.exp(x) - 1 - x for x in ls) / n
        assert math.isclose(float(out[f"algo/kl_k3{suffix}"]), k3, rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(float(out[f"algo/ess_frac{suffix}"]), ref.ess(ws) / n, rel_tol=1e-9, abs_tol=1e-12)
    all_w = sorted(w[i][j] for i in range(7) for j in range(9) if m[i][j])
    assert math.isclose(float(out["algo/is/p99"]), all_w[math.ceil(0.99 * len(all_w)) - 1])
    assert math.isclose(float(out["algo/is/max"]), max(all_w))
    hist = {s: sum(1 for x in v if 4 - x == s) / 7 for s in set(4 - x for x in v)}
    for s, share in hist.items():
        assert math.isclose(out[f"algo/staleness/batch/{s}"], share)
    assert "algo/is/frac_truncated" in out and "algo/is/frac_vetoed" in out


def test_given_weights_are_used_for_ess():
    prox = behav = torch.zeros(1, 4)
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = diagnostics(prox, behav, mask, torch.tensor([0]), weights=torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert math.isclose(float(out["algo/ess_frac"]), 0.5) and math.isclose(float(out["algo/is/max"]), 1.0)


def test_ess_quantile_and_histogram_edges():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert float(effective_sample_size(torch.ones(2, 3), mask)) == 0.0
    assert float(masked_quantile(torch.ones(2, 3), mask, 0.99)) == 0.0
    x = torch.arange(100.0).reshape(1, 100)
    assert float(masked_quantile(x, torch.ones(1, 100, dtype=torch.bool), 0.99)) == 98.0
    h = staleness_histogram(torch.tensor([5, 5, 3, 1]), 5, prefix="algo/staleness/pool")
    assert h == {"algo/staleness/pool/0": 0.5, "algo/staleness/pool/2": 0.25, "algo/staleness/pool/4": 0.25,
                 "algo/staleness/pool/mean": 1.5, "algo/staleness/pool/max": 4.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_diagnostics_extreme_inputs_are_finite(dtype):
    prox = torch.tensor([[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]], dtype=dtype)
    behav = torch.tensor([[-1e4, 1e4, float("nan")], [0.0, 0.0, 0.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    out = diagnostics(prox, behav, mask, torch.tensor([0, 1]), current_version=1)
    assert all(math.isfinite(float(v)) for v in out.values())


def test_algo_imports_alone():
    code = (
        "import sys, megatron_darl.algo as a; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'omegaconf', 'transformer_engine')]; "
        "assert not bad, bad; assert callable(a.darl_policy_loss); print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                         cwd=str(__import__("pathlib").Path(__file__).parents[3]))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
