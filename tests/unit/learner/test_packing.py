"""Token-budget packing, DP shares and minibatch splits: every row exactly once, budgets kept."""

import numpy as np
import torch

from megatron_darl.learner.packing import dp_share, micro_batch, pack_rows, rank_micro_batches, split_minibatches
from megatron_darl.types import TrainBatch


def test_pack_rows_respects_budget_and_covers_rows():
    rng = np.random.RandomState(0)
    lengths = rng.randint(1, 50, size=40)
    rows = np.arange(40)
    for budget in (1, 30, 64, 200, 10_000):
        mbs = pack_rows(rows, lengths, budget)
        assert sorted(np.concatenate(mbs).tolist()) == list(range(40))
        for mb in mbs:
            padded = len(mb) * lengths[mb].max()
            assert padded <= budget or len(mb) == 1  # an over-long row travels alone
    assert len(pack_rows(rows, lengths, 10_000)) == 1
    assert len(pack_rows(rows, lengths, 1)) == 40


def test_dp_share_partitions_and_balances():
    lengths = np.array([50, 40, 30, 20, 10, 10, 5, 5])
    rows = np.arange(8)
    shares = [dp_share(rows, lengths, 3, r) for r in range(3)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(8))
    loads = [lengths[s].sum() for s in shares]
    assert max(loads) - min(loads) <= 50


def test_split_minibatches_keeps_groups_whole():
    gi = np.array([0, 0, 1, 1, 1, 2, 3, 3, 4])
    parts = split_minibatches(gi, 2)
    assert sorted(np.concatenate(parts).tolist()) == list(range(9))
    for p in parts:
        for g in set(gi[p].tolist()):
            assert set(np.where(gi == g)[0]) <= set(p.tolist())
    assert len(split_minibatches(gi, 10)) == 5  # never more minibatches than groups


def _batch(b=3, width=6, lengths=(6, 3, 4)):
    lengths = np.array(lengths)
    tokens = np.arange(b * width).reshape(b, width)
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
    z = np.zeros((b, width), np.float32)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=np.ones(b, np.float32),
                      behav_logprobs=z, token_versions=z.astype(np.int64), versions=np.zeros(b, np.int64),
                      group_index=np.arange(b), rewards=np.zeros(b, np.float32), prompt_ids=np.arange(b))


def test_micro_batch_trims_to_longest_row_and_placeholders_are_masked():
    batch = _batch()
    mb = micro_batch(batch, np.array([1, 2]), torch.device("cpu"))
    assert mb["tokens"].shape == (2, 4) and mb["tokens"][0, 0] == 6
    assert mb["loss_mask"].sum() == 7
    dead = micro_batch(batch, np.array([1]), torch.device("cpu"), live=False)
    assert dead["loss_mask"].sum() == 0 and not dead["live"]
    # a DP rank without rows still gets one (masked) micro-batch so collectives line up
    got = rank_micro_batches(batch, np.array([0]), 100, 2, 1, torch.device("cpu"))
    assert len(got) == 1 and not got[0]["live"]


def test_sequence_multiple_follows_megatron_fp8_alignment():
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    from megatron_darl.learner.packing import sequence_multiple

    assert sequence_multiple(None, 4, False) == 1
    assert sequence_multiple(None, 4, True) == 4  # sequence parallel splits the sequence over TP
    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        align = get_fp8_align_size(Fp8Recipe(recipe))
        assert sequence_multiple(recipe, 1, False) == align and sequence_multiple(recipe, 2, True) == 2 * align
    assert sequence_multiple("mxfp8", 1, False) == 32 and sequence_multiple("delayed", 1, False) == 16


def test_pad_batch_rounds_lengths_and_pads_with_masked_zeros():
    from megatron_darl.learner.packing import pad_batch

    rng = np.random.RandomState(0)
    b = _batch(3, 17, lengths=[5, 17, 16])
    b.behav_logprobs = rng.randn(3, 17).astype(np.float32) * b.loss_mask
    b.prox_logprobs = np.ones_like(b.behav_logprobs)
    p = pad_batch(b, 16)
    assert p.lengths.tolist() == [16, 32, 16] and p.tokens.shape == (3, 32)
    assert b.tokens.shape[1] == 17 and b.lengths.tolist() == [5, 17, 16]  # the input is untouched
    for name in ("tokens", "loss_mask", "behav_logprobs", "prox_logprobs"):
        got, orig = getattr(p, name), getattr(b, name)
        assert np.array_equal(got[:, :17], orig) and not got[:, 17:].any(), name
    assert p.loss_mask.sum() == b.loss_mask.sum()  # padding never counts in the loss
    assert (p.token_versions[:, 17:] == -1).all()
    assert pad_batch(b, 1) is b
    for mb in rank_micro_batches(p, np.arange(3), 40, 1, 0, torch.device("cpu")):
        assert mb["tokens"].shape[1] % 16 == 0  # every micro-batch width is aligned


def _lockstep_batch():
    """Rows whose balanced DP shares pack into different micro-batch counts: rank 0 gets the
    one long row (one micro-batch), rank 1 the three short ones (three at a budget of 4 tokens)."""
    lengths = (8, 3, 3, 2)
    return _batch(b=len(lengths), width=8, lengths=lengths)


def test_fp8_delayed_with_dp_gives_every_rank_the_same_micro_batch_count():
    batch, rows, cpu = _lockstep_batch(), np.arange(4), torch.device("cpu")
    free = [rank_micro_batches(batch, rows, 4, 2, r, cpu) for r in range(2)]
    assert [len(m) for m in free] == [1, 3]  # the shares differ: what FP8 delayed cannot run
    locked = [rank_micro_batches(batch, rows, 4, 2, r, cpu, lockstep=True) for r in range(2)]
    assert [len(m) for m in locked] == [3, 3]
    # the padding is masked and only repeats a row of that rank's own share; the real rows are unchanged
    pad = locked[0][-1]
    assert not pad["live"] and pad["loss_mask"].sum() == 0 and pad["rows"].tolist() == [0]
    for a, b in zip(free, locked):
        assert [m["rows"].tolist() for m in a] == [m["rows"].tolist() for m in b[:len(a)]]
    # a rank without rows gets placeholders up to the others' count too
    short = [rank_micro_batches(batch, np.array([0]), 4, 2, r, cpu, lockstep=True) for r in range(2)]
    assert [len(m) for m in short] == [1, 1] and not short[1][0]["live"]
    assert len(rank_micro_batches(batch, rows, 4, 1, 0, cpu, lockstep=True)) == 4  # dp=1: nothing to match


def test_dp_lockstep_follows_the_fp8_recipe_and_tp_only_amax_red():
    from types import SimpleNamespace as C

    from megatron_darl.learner.packing import dp_lockstep

    assert dp_lockstep(C(fp8="hybrid", fp8_recipe="delayed", tp_only_amax_red=False))
    assert not dp_lockstep(C(fp8="hybrid", fp8_recipe="delayed", tp_only_amax_red=True))
    assert not dp_lockstep(C(fp8="e4m3", fp8_recipe="tensorwise", tp_only_amax_red=False))
    assert not dp_lockstep(C(fp8=None, fp8_recipe="delayed", tp_only_amax_red=False))
