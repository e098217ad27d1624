"""Naive per-element Python references for the algo tests (loops over lists, `math` only).

What it is: the formulas of docs/ALGORITHM.md written the slow, obvious way, so that the
vectorised library can be checked against them. What it is not: test cases (see test_algo_*).
"""

from __future__ import annotations

import math
import random

import torch

BOUND = 20.0  # the library's LOG_RATIO_BOUND, restated here on purpose


def rand_inputs(b, t, *, seed=0, scale=0.5, empty_rows=(), dtype=torch.float64):
    """Random log-probs q, p, b, advantages [B], mask with the given rows empty, versions."""
    g = torch.Generator().manual_seed(seed)
    base = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    prox = base + scale * torch.randn(b, t, generator=g, dtype=dtype)
    behav = base + scale * torch.randn(b, t, generator=g, dtype=dtype)
    logp = prox + 0.3 * scale * torch.randn(b, t, generator=g, dtype=dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    for r in empty_rows:
        mask[r] = False
    adv = torch.randn(b, generator=g, dtype=dtype)
    versions = torch.randint(0, 3, (b,), generator=g)
    return logp, prox, behav, adv, mask, versions


def clamp(x, lo, hi):
    return max(lo, min(hi, x))


def is_weights(p, b, m, *, level="token", mode="truncate", threshold=2.0, lower=None, veto=1e-4):
    """rollout IS weights as nested lists."""
    out = []
    for i in range(len(m)):
        toks = [j for j in range(len(m[i])) if m[i][j]]
        ls = {j: p[i][j] - b[i][j] for j in toks}
        seq = sum(ls.values())
        row = []
        for j in range(len(m[i])):
            if not m[i][j]:
                row.append(0.0)
                continue
            lw = ls[j] if level == "token" else (seq if level == "sequence" else seq / len(toks))
            if mode == "truncate":
                w = math.exp(clamp(lw, -BOUND, min(math.log(threshold), BOUND)))
            else:
                lo = 1.0 / threshold if lower is None else lower
                llo = math.log(lo) if lo > 0 else -math.inf
                keep = llo <= lw <= math.log(threshold)
                w = math.exp(clamp(lw, -BOUND, BOUND)) if keep else 0.0
            row.append(w)
        if veto is not None and any(ls[j] < math.log(veto) for j in toks):
            row = [0.0] * len(row)
        out.append(row)
    return out


def token_obj(q, o, a, lo, hi):
    r = math.exp(clamp(q - o, -BOUND, BOUND))
    return min(r * a, clamp(r, 1 - lo, 1 + hi) * a)


def ppo(q, o, adv, m, lo=0.2, hi=0.2, w=None, den=None):
    num, n = 0.0, 0
    for i in range(len(m)):
        for j in range(len(m[i])):
            if m[i][j]:
                n += 1
                num += (1.0 if w is None else w[i][j]) * token_obj(q[i][j], o[i][j], adv[i], lo, hi)
    return -num / (den if den is not None else max(n, 1))


def decoupled(q, p, b, adv, m, lo=0.2, hi=0.2, cap=None):
    num, n = 0.0, 0
    for i in range(len(m)):
        for j in range(len(m[i])):
            if not m[i][j]:
                continue
            n += 1
            w = math.exp(clamp(p[i][j] - b[i][j], -BOUND, BOUND))
            if cap is not None and w > cap:
                continue
            num += w * token_obj(q[i][j], p[i][j], adv[i], lo, hi)
    return -num / max(n, 1)


def seq_ppo(q, o, adv, m, lo=0.2, hi=0.2):
    """GSPO-style: one ratio exp(mean_j (q - o)) per row, token-mean aggregation."""
    num, n = 0.0, 0
    for i in range(len(m)):
        toks = [j for j in range(len(m[i])) if m[i][j]]
        if not toks:
            continue
        s = sum(q[i][j] - o[i][j] for j in toks) / len(toks)
        r = math.exp(s)
        num += len(toks) * min(r * adv[i], clamp(r, 1 - lo, 1 + hi) * adv[i])
        n += len(toks)
    return -num / max(n, 1)


def ess(ws):
    s, s2 = sum(ws), sum(w * w for w in ws)
    return s * s / s2 if s2 > 0 else 0.0


def pmis_beta(versions, w, m, mode="ess"):
    ks = sorted(set(versions))
    toks = {k: [w[i][j] for i in range(len(m)) for j in range(len(m[i])) if m[i][j] and versions[i] == k] for k in ks}
    n = {k: len(toks[k]) for k in ks}
    e = {k: ess(toks[k]) for k in ks}
    if mode == "ess" and sum(e.values()) > 0:
        return {k: e[k] / sum(e.values()) for k in ks}
    tot = sum(n.values())
    return {k: n[k] / tot if tot else 0.0 for k in ks}


def darl(q, p, b, adv, m, versions, beta, lo=0.2, hi=0.2, **is_kw):
    w = is_weights(p, b, m, **is_kw)
    loss = 0.0
    for k in sorted(set(versions)):
        num, n = 0.0, 0
        for i in range(len(m)):
            if versions[i] != k:
                continue
            for j in range(len(m[i])):
                if m[i][j]:
                    n += 1
                    num += w[i][j] * token_obj(q[i][j], p[i][j], adv[i], lo, hi)
        loss -= beta[k] * (num / n if n else 0.0)
    return loss


def variance_scores(p, b, m):
    out = []
    for i in range(len(m)):
        ls = [(p[i][j] - b[i][j]) ** 2 for j in range(len(m[i])) if m[i][j]]
        out.append(sum(ls) / len(ls) if ls else 0.0)
    return out


def quantile(xs, q):
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def select(scores, versions, q, tau_abs, batch, fill="fresh"):
    """Selection the slow way: pick one group at a time."""
    newest = max(versions)
    tau = quantile([s for s, v in zip(scores, versions) if v == newest], q)
    ok = []
    for i, (s, v) in enumerate(zip(scores, versions)):
        limit = tau if v == newest or tau_abs is None else min(tau, tau_abs)
        if s <= limit:
            ok.append(i)
    chosen = []
    while ok and len(chosen) < batch:
        best = ok[0]
        for i in ok[1:]:
            if scores[i] < scores[best] or (scores[i] == scores[best] and versions[i] > versions[best]):
                best = i
        chosen.append(best)
        ok.remove(best)
    while fill == "fresh" and len(chosen) < batch and len(chosen) < len(scores):
        rest = [i for i in range(len(scores)) if i not in chosen]
        best = rest[0]
        for i in rest[1:]:
            if versions[i] > versions[best] or (versions[i] == versions[best] and scores[i] < scores[best]):
                best = i
        chosen.append(best)
    return chosen


def grpo(rewards, groups, norm=True, eps=1e-6):
    out = []
    for i, g in enumerate(groups):
        rs = [r for r, h in zip(rewards, groups) if h == g]
        mu = sum(rs) / len(rs)
        sd = math.sqrt(sum((r - mu) ** 2 for r in rs) / len(rs))
        out.append((rewards[i] - mu) / (sd + eps) if norm else rewards[i] - mu)
    return out


def rloo(rewards, groups):
    out = []
    for i, g in enumerate(groups):
        others = [r for k, (r, h) in enumerate(zip(rewards, groups)) if h == g and k != i]
        out.append(rewards[i] - sum(others) / len(others) if others else 0.0)
    return out


def shuffle_groups(n, size, seed):
    ids = [k for k in range(n) for _ in range(size)]
    random.Random(seed).shuffle(ids)
    return ids
